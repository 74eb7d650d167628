"""Numba kernels of tiered.cpu against plain numpy float64 references (defined first): the fast
exponentials and the codebook (lookup tables, scores, encoding). The selection, the gather with
partial attention and the lookahead buffer are in tests/test_cpu_select_kernels.py,
test_cpu_gather_kernels.py and test_cpu_spill_kernels.py."""

import numpy as np
import pytest

from tiered.cpu import kernels as K

SIZES = (1, 31, 33, 257, 4099)


# ---- references ---------------------------------------------------------------------------------
def lut_reference(q, C, rep):
    """T[qh, i, :] = q[qh, i*ds:(i+1)*ds] . C[qh // rep, i or 0].T, float64."""
    H, Gc, c, ds = C.shape
    g = q.shape[1] // ds
    T = np.empty((q.shape[0], g, c))
    for qh in range(q.shape[0]):
        for i in range(g):
            codebook = C[qh // rep, i if Gc == g else 0].astype(np.float64)
            T[qh, i] = codebook @ q[qh, i * ds:(i + 1) * ds]
    return T


def scores_reference(P, n, T, rep):
    g = P.shape[2]
    z = np.empty((T.shape[0], n))
    for qh in range(T.shape[0]):
        codes = P[qh // rep, :n].astype(np.int64)
        z[qh] = T[qh][np.arange(g)[None, :], codes].astype(np.float64).sum(1)
    return z


def encode_distances(x, C):
    """(H, L, g, c) float64 squared distance of every group of every key to every centroid."""
    H, Gc, c, ds = C.shape
    g = x.shape[2] // ds
    xg = x.astype(np.float64).reshape(H, x.shape[1], g, 1, ds)
    Cg = np.broadcast_to(C.astype(np.float64), (H, g, c, ds))[:, None]
    return ((xg - Cg) ** 2).sum(-1)


# ---- fast exp -----------------------------------------------------------------------------------
def test_fast_exp_matches_exp():
    x = np.concatenate([-np.geomspace(1e-8, 87, 2000), [0.0, -1e-30]]).astype(np.float32)
    got = np.array([K.fast_exp(v) for v in x], np.float64)
    np.testing.assert_allclose(got, np.exp(x.astype(np.float64)), rtol=3e-7)
    assert K.fast_exp(np.float32(-1000.0)) < 2e-38


def test_fast_exp64_matches_exp():
    for x, rtol in ((np.linspace(-40, 40, 2001), 3e-15), (-np.geomspace(1e-12, 708, 3000), 5e-14)):
        got = np.array([K.fast_exp64(v) for v in x])
        np.testing.assert_allclose(got, np.exp(x), rtol=rtol)
    assert K.fast_exp64(-709.0) == 0.0 and K.fast_exp64(-np.inf) == 0.0


# ---- (a) codebook -------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("rep", [1, 3, 4])
@pytest.mark.parametrize("shared", [True, False])
def test_codebook_lut(d, rep, shared):
    rng = np.random.default_rng(d + rep)
    H, ds, c = 2, 4, 256
    g = d // ds
    C = rng.standard_normal((H, 1 if shared else g, c, ds)).astype(np.float32)
    q = rng.standard_normal((H * rep, d)).astype(np.float32)
    T = K.codebook_lut(q, C, rep)
    np.testing.assert_allclose(T, lut_reference(q, C, rep), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("rep", [1, 3, 4])
@pytest.mark.parametrize("c,dtype", [(256, np.uint8), (300, np.uint16)])
def test_codebook_scores(n, rep, c, dtype):
    rng = np.random.default_rng(n * 7 + rep)
    H, g, n_cap = 3, 16, n + 37
    P = rng.integers(0, c, (H, n_cap, g)).astype(dtype)
    P[:, n:] = rng.integers(0, np.iinfo(dtype).max, (H, n_cap - n, g))  # junk past n
    T = rng.standard_normal((H * rep, g, c)).astype(np.float32)
    out = np.full((H * rep, n_cap), np.nan, np.float32)
    K.codebook_scores(P, n, T, rep, out)
    np.testing.assert_allclose(out[:, :n], scores_reference(P, n, T, rep), rtol=1e-5, atol=1e-5)
    assert np.isnan(out[:, n:]).all()  # nothing written past n


def test_codebook_scores_from_lut_end_to_end():
    """Scores of the codes equal q . (decoded keys): the LUT and scores compose as the paper's."""
    rng = np.random.default_rng(5)
    H, rep, d, ds, c, n = 2, 3, 64, 4, 16, 257
    g = d // ds
    C = rng.standard_normal((H, g, c, ds)).astype(np.float32)
    P = rng.integers(0, c, (H, n, g)).astype(np.uint8)
    keys = np.stack([C[k, np.arange(g)[None, :], P[k]].reshape(n, d) for k in range(H)])
    q = rng.standard_normal((H * rep, d)).astype(np.float32)
    z = K.codebook_scores(P, n, K.codebook_lut(q, C, rep), rep)
    want = np.stack([keys[qh // rep].astype(np.float64) @ q[qh] for qh in range(H * rep)])
    np.testing.assert_allclose(z, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("L", [1, 33, 257])
@pytest.mark.parametrize("d,shared,c", [(64, False, 256), (128, True, 256), (64, True, 300)])
def test_codebook_encode(L, d, shared, c):
    rng = np.random.default_rng(L + d + c)
    H, ds = 3, 8
    g = d // ds
    C = rng.standard_normal((H, 1 if shared else g, c, ds)).astype(np.float32)
    x = rng.standard_normal((H, L, d)).astype(np.float32)
    codes = K.codebook_encode(x, C)
    assert codes.dtype == (np.uint8 if c <= 256 else np.uint16) and codes.shape == (H, L, g)
    dist = encode_distances(x, C)
    chosen = np.take_along_axis(dist, codes.astype(np.int64)[..., None], -1)[..., 0]
    # float32 may pick a near-tie: the chosen centroid must be as close as the best up to rounding
    np.testing.assert_allclose(chosen, dist.min(-1), rtol=1e-5, atol=1e-4)
    assert (codes == dist.argmin(-1)).mean() > 0.99
