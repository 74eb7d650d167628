"""tiered.cpu.attention.causal_attention and softmax_pv against float64 numpy references."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tiered.cpu.attention import causal_attention, softmax_pv


def causal_attention_reference(q, k, v, scale):
    """float64 softmax(q k^T scale, causal: row i sees keys 0 .. n - L + i) v, per query head."""
    Hq, L, _ = q.shape
    H, n, _ = k.shape
    rep = Hq // H
    visible = np.arange(n)[None, :] <= (n - L + np.arange(L))[:, None]
    out = np.empty((Hq, L, v.shape[2]))
    for qh in range(Hq):
        s = q[qh].astype(np.float64) @ k[qh // rep].astype(np.float64).T * scale
        s = np.where(visible, s, -np.inf)
        p = np.exp(s - s.max(1, keepdims=True))
        out[qh] = (p / p.sum(1, keepdims=True)) @ v[qh // rep].astype(np.float64)
    return out


def _inputs(Hq, H, L, n, d, dv, seed, spread=1.0):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((Hq, L, d)) * spread).astype(np.float32)
    k = rng.standard_normal((H, n, d)).astype(np.float32)
    v = rng.standard_normal((H, n, dv)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("L,n", [(1, 33), (1, 600), (33, 33), (33, 600), (33, 4099), (300, 600),
                                 (300, 4099)])
@pytest.mark.parametrize("rep", [1, 3, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_causal_attention_matches_reference(L, n, rep, d):
    H = 2
    q, k, v = _inputs(H * rep, H, L, n, d, d, seed=L + n + rep + d)
    scale = d ** -0.5
    out = causal_attention(q, k, v, scale, block=128)  # 300 rows: 3 blocks, the last partial
    assert out.shape == (H * rep, L, d) and out.dtype == np.float32
    np.testing.assert_allclose(out, causal_attention_reference(q, k, v, scale), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("block", [1, 7, 512])
def test_causal_attention_blocks_and_value_dim(block):
    """Block size changes only the schedule; dv != d; peaky scores (large logits)."""
    q, k, v = _inputs(6, 2, 45, 100, 64, 40, seed=block, spread=4.0)
    out = causal_attention(q, k, v, 0.125, block=block)
    np.testing.assert_allclose(out, causal_attention_reference(q, k, v, 0.125), rtol=1e-4,
                               atol=1e-4)


def test_causal_attention_first_row_sees_only_the_past():
    """With n == L, row 0 sees only key 0: its output is exactly v[0]."""
    q, k, v = _inputs(3, 1, 16, 16, 64, 64, seed=1)
    out = causal_attention(q, k, v, 0.125)
    np.testing.assert_allclose(out[:, 0], np.broadcast_to(v[0, 0], (3, 64)), rtol=1e-6)


def test_causal_attention_from_threads():
    q, k, v = _inputs(8, 2, 64, 300, 64, 64, seed=4)
    want = causal_attention(q, k, v, 0.125, block=16)
    with ThreadPoolExecutor(3) as pool:
        for got in pool.map(lambda _: causal_attention(q, k, v, 0.125, block=16), range(6)):
            np.testing.assert_array_equal(got, want)


def test_causal_attention_validation():
    q, k, v = _inputs(4, 2, 8, 16, 64, 64, seed=0)
    with pytest.raises(ValueError, match="Invalid shape of q"):
        causal_attention(q[0], k, v, 0.1)
    with pytest.raises(ValueError, match="need n >= L"):
        causal_attention(q, k[:, :4], v[:, :4], 0.1)
    with pytest.raises(ValueError, match="multiple"):
        causal_attention(q[:3], k, v, 0.1)
    with pytest.raises(ValueError, match="Invalid shape of v"):
        causal_attention(q, k, v[:, :10], 0.1)
    with pytest.raises(ValueError, match="Invalid block"):
        causal_attention(q, k, v, 0.1, block=0)


def test_causal_attention_exports_the_log_sum_exp_of_each_row():
    """lse= fills each query row's log-sum-exp over the keys it sees (float64 reference), and the
    output is the one without it (a shard's partial over its own chunk takes both)."""
    q, k, v = _inputs(6, 2, 33, 600, 64, 64, seed=5)
    lse = np.empty((6, 33), np.float32)
    out = causal_attention(q, k, v, 0.125, lse=lse)
    np.testing.assert_array_equal(out, causal_attention(q, k, v, 0.125))
    visible = np.arange(600)[None, :] <= (600 - 33 + np.arange(33))[:, None]
    for qh in range(6):
        s = q[qh].astype(np.float64) @ k[qh // 3].astype(np.float64).T * 0.125
        s = np.where(visible, s, -np.inf)
        top = s.max(1)
        want = top + np.log(np.exp(s - top[:, None]).sum(1))
        np.testing.assert_allclose(lse[qh], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("R", [1, 7, 4099])
@pytest.mark.parametrize("rep", [1, 3])
def test_softmax_pv_is_the_partial_over_the_finite_scores(R, rep):
    """A decode query's partial over a set (the CPU step's resident set): o the softmax-weighted
    values over the finite scores only, lse their log-sum-exp; a row of none: 0 and -inf."""
    H, dv = 3, 40
    rng = np.random.default_rng(R + rep)
    s = (rng.standard_normal((H, rep, R)) * 4).astype(np.float32)
    s[rng.random(s.shape) < 0.3] = -np.inf  # slots not in the set
    s[0, :, 0] = 60.0  # a large score: the max subtracted before exp
    s[1, rep - 1] = -np.inf  # an empty set for one query
    v = rng.standard_normal((H, R, dv)).astype(np.float32)
    o, lse = softmax_pv(s, v)
    assert o.shape == (H, rep, dv) and lse.shape == (H, rep) and o.dtype == np.float32
    s64 = s.astype(np.float64)
    for h in range(H):
        for r in range(rep):
            fin = np.isfinite(s64[h, r])
            if not fin.any():
                assert lse[h, r] == -np.inf and not o[h, r].any()
                continue
            m = s64[h, r, fin].max()
            p = np.exp(s64[h, r, fin] - m)
            np.testing.assert_allclose(lse[h, r], m + np.log(p.sum()), rtol=1e-6, atol=1e-5)
            np.testing.assert_allclose(o[h, r], p @ v[h, fin] / p.sum(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="shape of v"):
        softmax_pv(s, v[:, :-1] if R > 1 else v[:2])
