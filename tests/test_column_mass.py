"""The attention mass per key that seeds the heavy hitters (tiered.runtime.ops.column_mass), against
a float64 reference, and its lazy sum over a prompt's chunks on the path that is not the CPU
backend's float32 one (there it stays on the device until compression reads it)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_small_model

from tiered import TieredCache
from tiered.runtime import ops
from tiered.prefill import prefill


def _reference(q, k, scale, causal):
    """(H, n) float64: softmax rows of (Hq, L, d) queries over (H, n, d) keys, summed."""
    Hq, L, _ = q.shape
    H, n, _ = k.shape
    rep = Hq // H
    out = np.zeros((H, n))
    for hq in range(Hq):
        s = q[hq].astype(np.float64) @ k[hq // rep].astype(np.float64).T * scale
        if causal:
            s = np.where(np.arange(n)[None] <= (n - L + np.arange(L))[:, None], s, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[hq // rep] += (p / p.sum(axis=1, keepdims=True)).sum(axis=0)
    return out


@pytest.mark.parametrize("dtype,tol", [(mx.float32, 1e-4), (mx.float16, 2e-2)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n,L", [(40, 40), (100, 24)])
def test_column_mass_matches_the_softmax_sum(dtype, tol, causal, n, L):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 6, L, 32)).astype(np.float32)
    k = rng.standard_normal((1, 2, n, 32)).astype(np.float32)
    got = ops.column_mass(mx.array(q).astype(dtype), mx.array(k).astype(dtype), 0.3, causal)
    assert got.dtype == mx.float32 and got.shape == (2, n)
    ref = _reference(q[0], k[0], 0.3, causal)
    np.testing.assert_allclose(np.array(got), ref, rtol=tol, atol=tol * 6 * L / n)
    assert np.isclose(float(got.sum()), 6 * L, rtol=1e-3)  # every query row sums to 1


def test_a_half_precision_prompt_s_mass_is_summed_lazily_over_its_chunks():
    """float16 on the CPU backend takes MLX's SDPA (not the float32 export): the mass of each
    chunk is added on the device and read once; what is read sums to one per query row and
    head of every chunk that kept the books."""
    model = make_small_model("llama-gqa-d64", layers=2, seed=4)
    model.set_dtype(mx.float16)
    ids = np.random.default_rng(5).integers(0, 4000, 640).tolist()
    cache = TieredCache.for_model(model, gpu_budget=0.25, page_size=64)
    booked = {i: 0 for i in range(len(cache))}
    chunk = 128
    for start in range(0, len(ids), chunk):
        prefill(model, cache, ids[start: start + chunk], chunk=chunk)
        before = {i: c._bookkeeping(c.offset) for i, c in enumerate(cache)}  # as it was asked
        for i, c in enumerate(cache):
            assert c.phase == "exact"
            booked[i] += chunk if before[i] else 0
            if before[i]:
                assert c.__dict__.get("_colmass_dev") is not None  # not read yet
    for i, c in enumerate(cache):
        assert booked[i] > chunk
        mass = c._colmass  # read: the device sum joins the host buffer
        assert c.__dict__.get("_colmass_dev") is None
        rep = model.args.num_attention_heads // model.args.num_key_value_heads
        np.testing.assert_allclose(mass[:, : c.offset].sum(axis=1), rep * booked[i], rtol=2e-3)
        assert np.all(mass[:, c.offset:] == 0)


def test_attention_sinks_still_keep_the_books_on_the_cpu_path():
    """With attention sinks (gpt-oss) the CPU backend's float32 export does not apply: the mass
    is summed through column_mass instead, never dropped."""
    model = make_small_model("llama-gqa-d64", layers=1, seed=6)
    cache = TieredCache.for_model(model, gpu_budget=0.25, page_size=64)
    c = cache[0]
    rng = np.random.default_rng(7)
    H, Hq, d, L = 3, 9, 64, 96
    booked = 0
    for _ in range(4):
        k, v = (mx.array(rng.standard_normal((1, H, L, d)).astype(np.float32)) for _ in "kv")
        keys, values = c.update_and_fetch(k, v)
        q = mx.array(rng.standard_normal((1, Hq, L, d)).astype(np.float32))
        on = c._bookkeeping(c.offset)
        c.attention(q, keys, values, scale=d ** -0.5, mask="causal", sinks=mx.zeros((Hq,)))
        booked += L if on else 0
    assert booked > 0 and c.phase == "exact"
    # the seed's mass is over the keys (the sink's share is not counted): one per query row
    total = c._colmass[:, : c.offset].sum(axis=1)
    np.testing.assert_allclose(total, (Hq // H) * booked, rtol=1e-3)
