"""report() says the memory a user gets plainly: the prefill's transient peak against the
budget, and on the CPU backend that the accelerator and host tiers share one memory."""

import mlx.core as mx
import numpy as np

import tiered
from tiered.report import report_dict


def test_the_report_names_the_prefill_peak_and_the_shared_memory():
    from conftest import make_small_model

    model = make_small_model("llama-gqa-d64", layers=2, seed=2)
    cache = tiered.TieredCache.for_model(model, gpu_budget=0.125, page_size=64, recent=16)
    ids = mx.array(np.random.default_rng(0).integers(0, 1000, (1, 1500)))
    model(ids, cache=cache)
    model(mx.array([[5]]), cache=cache)  # compresses at the first decode step
    d = report_dict(cache)
    b = d["bytes"]
    assert d["accelerator_and_host_bytes"] == b["accelerator"] + b["host"]
    text = tiered.report(cache)
    if mx.default_device() == mx.cpu:
        assert d["shared_memory"] == "the CPU backend"
        assert "share one memory" in text
    assert "compressed" in d["phases"]
    # the prompt's exact K/V, held before it compressed: above 1/8 of the full cache
    assert d["peak_transient_accelerator_bytes"] > d["budget_bytes"]
    assert "transient peak" in text and "above it" in text
    cache.close()


def test_the_report_names_each_layers_decode_step():
    """report() says which decode step each compressed layer runs and, where it is not the
    device step, why; before a decode step it says there was none."""
    from conftest import make_small_model

    from tiered.runtime import uva

    model = make_small_model("llama-gqa-d64", layers=2, seed=3)
    ids = mx.array(np.random.default_rng(1).integers(0, 1000, (1, 700)))
    for kernels, want in (("auto", None), ("mlx", "one sync a layer")):
        cache = tiered.TieredCache.for_model(model, gpu_budget=0.25, compress_from=64,
                                             kernels=kernels)
        model(ids, cache=cache)
        assert "decode_steps" not in report_dict(cache)  # not compressed yet: KVCache's step
        model(mx.array([[5]]), cache=cache)
        model(mx.array([[6]]), cache=cache)
        steps = report_dict(cache)["decode_steps"]
        assert sorted(i for ids_ in steps.values() for i in ids_) == [0, 1]
        (note,) = steps
        if uva.available():
            assert note.startswith("device step (CUDA)")
        elif mx.default_device() == mx.cpu and kernels == "auto":
            assert note == "CPU backend: Numba kernels over the host pages"
        else:
            assert note.startswith(want) and "not the device step: " in note
            assert "CUDA" in note  # why: not on MLX's CUDA backend
        assert f"decode step, all tiered layers: {note}" in tiered.report(cache)
        cache.close()
