"""The streaming-offload baseline (bench/streaming_cache.py) is exact attention: a model
decoding with it gives what mlx-lm's KVCache gives, across prefill chunks, host growth and trim."""

from __future__ import annotations

import os
import sys

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_small_model
from mlx_lm.models.cache import KVCache

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

from streaming_cache import StreamingCache  # noqa: E402


def _run(model, caches, prompt, toks, trim_at=None):
    outs = [model(mx.array([prompt[:40]]), cache=caches),
            model(mx.array([prompt[40:]]), cache=caches)]
    for i, t in enumerate(toks):
        if trim_at is not None and i == trim_at:
            for c in caches:
                assert c.trim(3) == 3
        outs.append(model(mx.array([[t]]), cache=caches))
    return [np.array(o) for o in outs]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_streaming_cache_decodes_as_kvcache(dtype):
    model = make_small_model("llama-gqa-d64", layers=2, seed=3)
    if dtype != mx.float32:
        model.set_dtype(dtype)
    rng = np.random.default_rng(0)
    prompt, toks = rng.integers(10, 49000, 90).tolist(), rng.integers(10, 49000, 12).tolist()
    StreamingCache.step = 64  # grows twice over this run
    try:
        ref = _run(model, [KVCache() for _ in model.layers], prompt, toks, trim_at=6)
        caches = [StreamingCache() for _ in model.layers]
        got = _run(model, caches, prompt, toks, trim_at=6)
    finally:
        StreamingCache.step = 4096
    tol = 1e-4 if dtype == mx.float32 else 2e-2  # the same math; SDPA over a transposed view
    for a, b in zip(ref, got):
        np.testing.assert_allclose(a, b, atol=tol, rtol=0)
    c = caches[0]
    assert c.offset == 90 + 12 - 3 and c.nbytes == 0
    assert c._k.shape[1] == 128 and c.host_bytes == c._k[:, : c.offset].nbytes * 2
    k, v = c.state
    assert k.shape[2] == c.offset and v.shape[2] == c.offset


def test_streaming_cache_refuses_bfloat16():
    c = StreamingCache()
    x = mx.zeros((1, 2, 3, 8), mx.bfloat16)
    with pytest.raises(ValueError, match="float16 or float32"):
        c.update_and_fetch(x, x)
