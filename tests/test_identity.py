"""tiered.persistence.identity.model_identity: the same digest from MLX integer ops (the GPU's path)
and the host's Numba kernel, for every dtype and for lengths around the chunking; any one changed
element (one bit) changes it; names, shapes and dtypes count."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_small_model

from tiered.persistence import identity
from tiered.persistence.identity import model_identity, parameter_lanes

DTYPES = [mx.float32, mx.float16, mx.bfloat16, mx.uint8, mx.int8, mx.uint32, mx.int32,
          mx.bool_, mx.int64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 31, 4099])
def test_device_and_host_lanes_agree(dtype, n):
    a = (mx.random.normal((n,), key=mx.random.key(n)) * 1000).astype(dtype)
    assert parameter_lanes(a, device=True) == parameter_lanes(a, device=False)


def test_lanes_agree_across_chunks(monkeypatch):
    monkeypatch.setattr(identity, "CHUNK", 1000)  # several device chunks, uneven last one
    a = mx.random.normal((4099,), key=mx.random.key(1)).astype(mx.float16)
    assert parameter_lanes(a, device=True) == parameter_lanes(a, device=False)


def test_one_flipped_bit_anywhere_changes_the_identity():
    model = make_small_model("llama-gqa-d64", layers=2, seed=3)
    base = model_identity(model)
    assert model_identity(model, device=True) == base == model_identity(model, device=False)
    w = model.layers[1].self_attn.v_proj.weight
    bits = np.array(w.view(mx.uint32))
    rng = np.random.default_rng(0)
    for _ in range(5):
        i = tuple(int(rng.integers(s)) for s in bits.shape)
        flipped = bits.copy()
        flipped[i] ^= np.uint32(1 << int(rng.integers(32)))
        model.layers[1].self_attn.v_proj.weight = mx.array(flipped).view(mx.float32)
        assert model_identity(model) != base
    model.layers[1].self_attn.v_proj.weight = w
    assert model_identity(model) == base


def test_a_reshaped_or_retyped_parameter_changes_the_identity():
    model = make_small_model("llama-gqa-d64", layers=2, seed=3)
    base = model_identity(model)
    w = model.layers[0].mlp.up_proj.weight
    model.layers[0].mlp.up_proj.weight = w.reshape(w.shape[1], w.shape[0])  # same bits
    assert model_identity(model) != base
    model.layers[0].mlp.up_proj.weight = w.view(mx.int32)  # same bits, another dtype
    assert model_identity(model) != base
