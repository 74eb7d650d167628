"""A layer profile serves the checkpoint it was measured on in every dtype and layout it loads
in (tiered.planning.layer_profile.find_profile): the embedded model's, shipped measured in float32
on the CPU, is found for the model as GPUs load it (quantized, float16 or bfloat16), so
planner="auto" plans by layers there without measuring; other weights do not take it."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_small_model

import mlx.core as mx

import tiered
from tiered.options.config import TieredConfig
from tiered.planning.layer_profile import LayerProfile, find_profile, profile_path, save_profile
from tiered.planning.planner import BudgetError


def _profile_for(model, layers):
    from tiered.codecs import checkpoint_signature, model_fingerprint

    cid, sample = checkpoint_signature(model)
    return LayerProfile(model_id=model_fingerprint(model), layers=layers, head_dim=64,
                        groups=[4, 8], output_error=[[0.2, 0.1]] * layers,
                        entropy=[0.5] * layers, dtype="float32",
                        checkpoints=[{"id": cid, "sample": sample, "dtype": "float32"}])


def test_a_profile_serves_its_weights_in_other_dtypes_only(tmp_path):
    model = make_small_model("llama-gqa-d64", layers=2, seed=3)
    cfg = TieredConfig(cache_dir=str(tmp_path))
    prof = _profile_for(model, 2)
    save_profile(prof, profile_path(str(tmp_path), prof.model_id))
    assert find_profile(model, cfg).model_id == prof.model_id  # its own id first
    for dtype in (mx.float16, mx.bfloat16):
        other = make_small_model("llama-gqa-d64", layers=2, seed=3)
        other.set_dtype(dtype)
        got = find_profile(other, cfg)
        assert got is not None and got.model_id == prof.model_id, dtype
    different = make_small_model("llama-gqa-d64", layers=2, seed=4)  # other weights
    different.set_dtype(mx.float16)
    assert find_profile(different, cfg) is None
    deeper = make_small_model("llama-gqa-d64", layers=3, seed=3)  # another architecture
    assert find_profile(deeper, cfg) is None


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_embedded_models_shipped_profile_in_16_bit(embedded, tmp_path, dtype):
    """As GPUs load it (Q4_1 weights kept quantized) and dequantized, in both 16-bit dtypes:
    the shipped profile is found and "auto" plans by layers at 1/32."""
    from tiered.model import load_default

    for dequantize in (False, True):
        model, _ = load_default(dequantize=dequantize, dtype=getattr(mx, dtype))
        prof = find_profile(model, TieredConfig(cache_dir=str(tmp_path)))
        assert prof is not None and prof.dtype == "float32", (dequantize, dtype)
    cache = tiered.TieredCache.for_model(model, 1 / 32, cache_dir=str(tmp_path))
    assert cache.context.planner == "layers"
    with pytest.raises(BudgetError):  # what "auto" fell back to without the profile
        tiered.TieredCache.for_model(model, 1 / 32, planner="uniform", cache_dir=str(tmp_path))
    np.testing.assert_equal(len(prof.output_error), len(model.layers))


def test_auto_plans_by_layers_where_uniform_refuses_and_no_profile_exists(tmp_path):
    """No profile at hand and a budget one layout for every layer cannot meet: "auto" plans
    by layers with every layer weighed alike (LayerProfile.flat) instead of refusing; the
    cache compresses and keeps its accelerator tier within the budget. A budget no layered
    plan meets is still refused."""
    model = make_small_model("llama-gqa-d64", layers=4, seed=9)
    with pytest.raises(BudgetError):
        tiered.TieredCache.for_model(model, 1 / 48, planner="uniform", cache_dir=str(tmp_path))
    cache = tiered.TieredCache.for_model(model, 1 / 48, cache_dir=str(tmp_path), page_size=16)
    assert cache.context.planner == "layers"
    assert cache.context.layer_profile.source.startswith("flat")
    ids = np.random.default_rng(2).integers(0, 1000, 6000).tolist()  # compresses from 4945
    for i in range(0, len(ids), 1000):
        model(mx.array(ids[i : i + 1000])[None], cache=cache)
    mx.eval(model(mx.array([[7]]), cache=cache))
    assert all(c.phase == "compressed" for c in cache)
    rep = tiered.report_dict(cache)
    assert rep["bytes"]["accelerator"] <= rep["budget_bytes"]
    cache.close()
    with pytest.raises(BudgetError):
        tiered.TieredCache.for_model(model, 1 / 4096, cache_dir=str(tmp_path))
