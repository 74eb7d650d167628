"""Numba kernels of tiered.cpu against plain numpy float64 references (defined first)."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tiered.cpu import HostStore
from tiered.cpu import kernels as K
from tiered.primitives import merge_partials

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


def softmax64(z):
    z = z.astype(np.float64)
    m = z.max(-1, keepdims=True)
    e = np.exp(z - m)
    return e / e.sum(-1, keepdims=True), m[..., 0], e.sum(-1)


def tau_select_reference(z, exclude, tau, cap, floor):
    """Full-sort tau-cumulative selection: (list of sorted token arrays per kv head, m, s, mass)."""
    Hq, n = z.shape
    H = exclude.shape[0]
    rep = Hq // H
    p, m, s = softmax64(z)
    member = np.zeros((Hq, n), bool)
    for h in range(Hq):
        if tau >= 1.0:
            member[h] = True
            continue
        order = np.argsort(-p[h], kind="stable")
        cum = np.cumsum(p[h][order])
        first = min(int(np.searchsorted(cum, tau)), n - 1)  # first prefix with mass >= tau
        member[h] = p[h] >= p[h][order[first]]
    limit = max(cap, floor)
    selected = []
    for k in range(H):
        key = p[k * rep:(k + 1) * rep].max(0)
        avail = ~exclude[k]
        union = np.flatnonzero(member[k * rep:(k + 1) * rep].any(0) & avail)
        if union.size > limit:
            chosen = union[np.lexsort((union, -key[union]))[:limit]]
        elif union.size < floor:
            rest = np.flatnonzero(avail & ~np.isin(np.arange(n), union))
            extra = rest[np.lexsort((rest, -key[rest]))[: floor - union.size]]
            chosen = np.concatenate([union, extra])
        else:
            chosen = union
        selected.append(np.sort(chosen))
    mass = np.array([p[h, selected[h // rep]].sum() for h in range(Hq)])
    return selected, m, s, mass


def partial_reference(store, b, q, z, tokens, qh, k, rescore):
    """(o, lse) of softmax attention of query head qh over tokens, read with HostStore.gather."""
    if len(tokens) == 0:
        return np.zeros(store.value_dim), -np.inf
    V = store.gather("values", b, k, tokens).astype(np.float64)
    if rescore:
        w = store.gather("keys", b, k, tokens).astype(np.float64) @ q[qh].astype(np.float64)
    else:
        w = z[qh, tokens].astype(np.float64)
    mx = w.max()
    e = np.exp(w - mx)
    return e @ V / e.sum(), mx + np.log(e.sum())


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


# ---- (b) tau-cumulative selection ---------------------------------------------------------------
def _scores(kind, Hq, n, rng):
    if kind == "normal":
        return (rng.standard_normal((Hq, n)) * 3).astype(np.float32)
    if kind == "ties":  # few distinct values: the threshold lands inside a large tie group
        return rng.integers(0, 4, (Hq, n)).astype(np.float32)
    if kind == "spike":
        z = rng.standard_normal((Hq, n)).astype(np.float32)
        z[:, rng.integers(0, n)] = 40.0
        return z
    if kind == "uniform":
        return np.zeros((Hq, n), np.float32)
    if kind == "dense":  # many distinct values in a tiny range: several refinement passes
        return (5.0 + rng.integers(0, 5000, (Hq, n)) * 2.0**-20).astype(np.float32)
    if kind == "heavy":  # a long tail far below the max
        return np.where(rng.random((Hq, n)) < 0.01, 20.0, -200.0 * rng.random((Hq, n))).astype(
            np.float32)
    raise ValueError(kind)


def _check_selection(sel, z, exclude, tau, cap, floor):
    want, m, s, mass = tau_select_reference(z, exclude, tau, cap, floor)
    for k, tokens in enumerate(want):
        cnt = sel.count[k]
        assert cnt == tokens.size, (k, cnt, tokens.size)
        np.testing.assert_array_equal(sel.idx[k, :cnt], tokens)
        assert (sel.idx[k, cnt:] == -1).all()
    np.testing.assert_allclose(sel.m, m, rtol=1e-6)
    np.testing.assert_allclose(sel.s, s, rtol=1e-5)
    np.testing.assert_allclose(sel.mass, mass, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("rep", [1, 3, 4])
@pytest.mark.parametrize("kind", ["normal", "ties", "spike", "dense"])
def test_tau_select_distributions(n, rep, kind):
    rng = np.random.default_rng(n + 10 * rep + len(kind))
    H = 2
    z = _scores(kind, H * rep, n, rng)
    exclude = rng.random((H, n)) < 0.2
    for tau in (0.5, 0.9):
        sel = K.tau_select(z, n, exclude, tau, cap=n, floor=0, with_stats=True)
        _check_selection(sel, z, exclude, tau, n, 0)


@pytest.mark.parametrize("kind", ["normal", "ties", "uniform", "heavy", "spike"])
@pytest.mark.parametrize(
    "tau,cap,floor",
    [(1.0, 10**6, 0), (0.9, 7, 0), (0.99, 100, 0), (0.3, 1000, 200), (0.05, 5, 40), (0.9, 1, 0)],
)
def test_tau_select_cap_floor(kind, tau, cap, floor):
    rng = np.random.default_rng(cap + floor)
    H, rep, n = 3, 3, 4099
    z = _scores(kind, H * rep, n, rng)
    exclude = np.zeros((H, n), bool)
    exclude[1, rng.integers(0, n, 500)] = True
    sel = K.tau_select(z, n, exclude, tau, cap, floor, with_stats=True)
    _check_selection(sel, z, exclude, tau, cap, floor)
    if tau == 1.0:
        assert (sel.count == n - exclude.sum(1)).all()


def test_tau_select_edge_cases():
    rng = np.random.default_rng(3)
    H, rep, n = 2, 4, 257
    z = _scores("normal", H * rep, n, rng)
    # everything resident on the accelerator: nothing offloaded, statistics still over all n
    sel = K.tau_select(z, n, np.ones((H, n), bool), 0.9, 64, 16, with_stats=True)
    assert (sel.count == 0).all() and (sel.idx == -1).all() and (sel.mass == 0).all()
    _check_selection(sel, z, np.ones((H, n), bool), 0.9, 64, 16)
    # nothing excluded; buffers reused through out=
    none = np.zeros((H, n), bool)
    sel2 = K.tau_select(z, n, none, 0.9, 64, 16, out=sel, with_stats=True)
    assert sel2.idx is sel.idx
    _check_selection(sel2, z, np.zeros((H, n), bool), 0.9, 64, 16)
    # one token; only the first n of wider buffers are read
    wide = np.concatenate([z, np.full((H * rep, 9), 1e4, np.float32)], 1)
    ex = (rng.random((H, n + 9)) < 0.3).astype(np.uint8) * 255  # any nonzero byte excludes
    sel3 = K.tau_select(wide, n, ex, 0.8, 32, cap_alloc=40, with_stats=True)
    assert sel3.idx.shape == (H, 40)
    _check_selection(sel3, z, ex[:, :n] != 0, 0.8, 32, 0)
    sel4 = K.tau_select(z[:, :1], 1, none, 0.5, 1, with_stats=True)
    assert (sel4.count == 1).all() and np.allclose(sel4.mass, 1.0)
    sel5 = K.tau_select(z, 0, none, 0.5, 4, with_stats=True)  # nothing live yet
    assert (sel5.count == 0).all() and (sel5.idx == -1).all() and np.isneginf(sel5.m).all()


def test_tau_select_large_n():
    rng = np.random.default_rng(11)
    H, rep, n = 3, 3, 65536
    z = (rng.standard_normal((H * rep, n)) * 2).astype(np.float32)
    exclude = rng.random((H, n)) < 0.05
    sel = K.tau_select(z, n, exclude, 0.9, 8192, 32, with_stats=True)
    _check_selection(sel, z, exclude, 0.9, 8192, 32)


def test_parallel_kernels_from_threads():
    """Parallel kernels entered from several Python threads at once (the scheduler's workers):
    the threading layer must not abort, and results must not mix."""
    rng = np.random.default_rng(8)
    H, rep, g, c, n = 3, 3, 16, 256, 4099
    P = rng.integers(0, c, (H, n, g)).astype(np.uint8)
    Ts = [rng.standard_normal((H * rep, g, c)).astype(np.float32) for _ in range(6)]
    exclude = rng.random((H, n)) < 0.1

    def job(T):
        z = K.codebook_scores(P, n, T, rep)
        return z, K.tau_select(z, n, exclude, 0.9, 512, 16, with_stats=True)

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(job, Ts * 2))
    for T, (z, sel) in zip(Ts * 2, results):
        np.testing.assert_allclose(z, scores_reference(P, n, T, rep), rtol=1e-5, atol=1e-5)
        _check_selection(sel, z, exclude, 0.9, 512, 16)


def test_tau_select_validation():
    z = np.zeros((6, 10), np.float32)
    with pytest.raises(ValueError, match="Invalid tau"):
        K.tau_select(z, 10, np.zeros((2, 10), bool), 0.0, 4)
    with pytest.raises(ValueError, match="multiple"):
        K.tau_select(z, 10, np.zeros((4, 10), bool), 0.5, 4)
    with pytest.raises(ValueError, match="Invalid shape of exclude"):
        K.tau_select(z, 10, np.zeros((2, 5), bool), 0.5, 4)
    with pytest.raises(ValueError, match="Invalid dtype of z"):
        K.tau_select(z.astype(np.float64), 10, np.zeros((2, 10), bool), 0.5, 4)
    with pytest.raises(ValueError, match="Invalid exclude"):
        K.tau_select(z, 10, None, 0.5, 4)
    with pytest.raises(ValueError, match="Invalid n"):
        K.tau_select(z, 11, np.zeros((2, 11), bool), 0.5, 4)


# ---- (c) gather + partial attention -------------------------------------------------------------
def _store(dtype, H, d, dv, n, rng, page_size=16, pages_per_block=4):
    """A 2-sequence store whose sequence 1 has non-contiguous pages across several blocks; part
    of it truncated and re-appended so freed pages come back in reverse order."""
    store = HostStore(H, d, value_dim=dv, page_size=page_size, dtype=dtype, keys=True, batch=2,
                      pages_per_block=pages_per_block)

    def append(L):
        store.append(rng.standard_normal((2, H, L, dv)).astype(np.float32),
                     rng.standard_normal((2, H, L, d)).astype(np.float32))

    append(n // 2 + 3)
    store.truncate(max(0, n // 2 - 2 * page_size))
    append(n - store.length)
    assert store.length == n
    return store


def _selection(H, n, cap_alloc, rng, empty_head=True):
    idx = np.full((H, cap_alloc), -1, np.int32)
    count = np.zeros(H, np.int32)
    for k in range(H):
        cnt = 0 if (empty_head and k == H - 1) else int(rng.integers(1, min(n, cap_alloc) + 1))
        idx[k, :cnt] = np.sort(rng.choice(n, cnt, replace=False))
        count[k] = cnt
    return idx, count


def _run_partial(store, b, q, z, idx, count, rep, rescore, kv_heads=None, o=None, lse=None,
                 native_half=True):
    Hq = idx.shape[0] * rep
    o = np.full((Hq, store.value_dim), np.nan, np.float32) if o is None else o
    lse = np.full(Hq, np.nan, np.float32) if lse is None else lse
    return K.gather_partial(q, z, idx, count, rep, *K.host_store_args(store, b), rescore, o, lse,
                            kv_heads=kv_heads, native_half=native_half)


@pytest.mark.parametrize("dtype", ["float16", "float16-table", "float32", "int8"])
@pytest.mark.parametrize("rep,d", [(1, 64), (3, 128), (4, 64)])
@pytest.mark.parametrize("rescore", [False, True])
@pytest.mark.parametrize("n", [1, 33, 4099])
def test_gather_partial(dtype, rep, d, rescore, n):
    """float16-table: decoded through F16_TO_F32 even where the hardware converts."""
    dtype, native_half = dtype.split("-")[0], not dtype.endswith("-table")
    rng = np.random.default_rng(n + rep + d)
    H, dv = 3, d if rep != 4 else 96
    store = _store(dtype, H, d, dv, n, rng, page_size=16 if n < 4099 else 128)
    q = (rng.standard_normal((H * rep, d)) / np.sqrt(d)).astype(np.float32)
    z = (rng.standard_normal((H * rep, n + 5)) * 2).astype(np.float32)
    idx, count = _selection(H, n, 300, rng)
    for b in (0, 1):
        o, lse = _run_partial(store, b, q, z, idx, count, rep, rescore, native_half=native_half)
        for qh in range(H * rep):
            k = qh // rep
            o_ref, lse_ref = partial_reference(store, b, q, z, idx[k, :count[k]], qh, k, rescore)
            np.testing.assert_allclose(o[qh], o_ref, rtol=1e-4, atol=2e-5)
            np.testing.assert_allclose(lse[qh], lse_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size,pages_per_block", [(16, 4), (24, 4), (16, 3), (24, 5)])
def test_gather_partial_any_page_geometry(page_size, pages_per_block):
    """Token rows are located by shifts when page size and pages per block are powers of two,
    by division otherwise: both agree with the reference."""
    rng = np.random.default_rng(page_size * pages_per_block)
    H, rep, d, n = 2, 3, 64, 700
    store = _store("float16", H, d, d, n, rng, page_size=page_size,
                   pages_per_block=pages_per_block)
    q = (rng.standard_normal((H * rep, d)) / np.sqrt(d)).astype(np.float32)
    idx, count = _selection(H, n, 200, rng, empty_head=False)
    for b in (0, 1):
        o, lse = _run_partial(store, b, q, None, idx, count, rep, True)
        for qh in range(H * rep):
            k = qh // rep
            o_ref, lse_ref = partial_reference(store, b, q, None, idx[k, :count[k]], qh, k, True)
            np.testing.assert_allclose(o[qh], o_ref, rtol=1e-4, atol=2e-5)
            np.testing.assert_allclose(lse[qh], lse_ref, rtol=1e-5, atol=1e-5)


def test_gather_partial_kv_subsets_from_threads():
    """Workers each take some kv heads; together they equal one call; other rows untouched."""
    rng = np.random.default_rng(2)
    H, rep, d, n = 4, 3, 64, 2048
    store = _store("float16", H, d, d, n, rng, page_size=64)
    q = rng.standard_normal((H * rep, d)).astype(np.float32)
    z = rng.standard_normal((H * rep, n)).astype(np.float32)
    idx, count = _selection(H, n, 512, rng, empty_head=False)
    o_all, lse_all = _run_partial(store, 0, q, z, idx, count, rep, True)
    o_noz, _ = _run_partial(store, 0, q, None, idx, count, rep, True)  # rescoring needs no z
    np.testing.assert_array_equal(o_noz, o_all)
    o_one, lse_one = _run_partial(store, 0, q, z, idx, count, rep, True, kv_heads=(1, 3))
    assert np.isnan(o_one[:rep]).all() and np.isnan(lse_one[3 * rep:]).all()
    np.testing.assert_array_equal(o_one[rep:3 * rep], o_all[rep:3 * rep])
    o = np.full_like(o_all, np.nan)
    lse = np.full_like(lse_all, np.nan)
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            list(pool.map(lambda k: _run_partial(store, 0, q, z, idx, count, rep, True,
                                                 kv_heads=(k, k + 1), o=o, lse=lse), range(H)))
            np.testing.assert_array_equal(o, o_all)
            np.testing.assert_array_equal(lse, lse_all)


def test_gather_partial_scores_by_slot_equal_scores_by_token():
    """An accelerator ships only the selected tokens' scores (z_by_slot): same result as the
    full score row indexed by token id."""
    rng = np.random.default_rng(5)
    H, rep, d, n = 3, 3, 64, 1500
    store = _store("float16", H, d, d, n, rng, page_size=64)
    z = rng.standard_normal((H * rep, n)).astype(np.float32)
    idx, count = _selection(H, n, 400, rng)
    zslot = np.full((H * rep, 400), np.nan, np.float32)
    for qh in range(H * rep):
        k = qh // rep
        zslot[qh, : count[k]] = z[qh, idx[k, : count[k]]]
    o_id, lse_id = _run_partial(store, 0, None, z, idx, count, rep, False)
    o = np.full_like(o_id, np.nan)
    lse = np.full_like(lse_id, np.nan)
    K.gather_partial(None, zslot, idx, count, rep, *K.host_store_args(store, 0), False, o, lse,
                     z_by_slot=True)
    np.testing.assert_array_equal(o, o_id)
    np.testing.assert_array_equal(lse, lse_id)


def test_gather_partial_rejects_bad_inputs():
    rng = np.random.default_rng(0)
    store = _store("float32", 2, 64, 64, 40, rng)
    idx, count = _selection(2, 40, 8, rng)
    q, z = np.zeros((2, 64), np.float32), np.zeros((2, 40), np.float32)
    bad = idx.copy()
    bad[0, 0] = 10**6
    with pytest.raises(IndexError):
        _run_partial(store, 0, q, z, bad, count, 1, False)
    args = list(K.host_store_args(store, 0))
    args[0] = args[0].copy()
    args[0][-1] = 10**6  # a page id past the allocated blocks
    with pytest.raises(IndexError):
        K.gather_partial(q, z, idx, count, 1, *args, False, np.zeros((2, 64), np.float32),
                         np.zeros(2, np.float32))
    with pytest.raises(IndexError):  # a token past the scores' width
        _run_partial(store, 0, q, z[:, :idx.max()], idx, count, 1, False)
    with pytest.raises(ValueError, match="Invalid shape of o_out"):
        _run_partial(store, 0, q, z, idx, count, 1, False, o=np.zeros((2, 32), np.float32))
    with pytest.raises(ValueError, match="Invalid count"):
        _run_partial(store, 0, q, z, idx, np.array([9, 1], np.int32), 1, False)


@pytest.mark.parametrize("split", ["random", "empty_a", "empty_b", "both_empty"])
@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_merge_partials_equals_union(split, dtype):
    rng = np.random.default_rng(len(split))
    H, rep, d, n = 2, 3, 64, 600
    store = _store(dtype, H, d, d, n, rng)
    q = (rng.standard_normal((H * rep, d)) / 8).astype(np.float32)
    z = rng.standard_normal((H * rep, n)).astype(np.float32)
    union, counts = _selection(H, n, 256, rng, empty_head=False)
    if split == "both_empty":
        counts[:] = 0
    in_a = [{"random": rng.random(c) < 0.5, "empty_a": np.zeros(c, bool),
             "empty_b": np.ones(c, bool), "both_empty": np.zeros(c, bool)}[split]
            for c in counts]
    parts = []
    for side in (True, False):
        idx = np.full_like(union, -1)
        count = np.zeros(H, np.int32)
        for k in range(H):
            mine = union[k, :counts[k]][in_a[k] == side]
            idx[k, :mine.size] = mine
            count[k] = mine.size
        parts.append(_run_partial(store, 0, q, z, idx, count, rep, True))
    o, lse = merge_partials(*parts[0], *parts[1])
    for qh in range(H * rep):
        k = qh // rep
        tok = union[k, :counts[k]]
        o_ref, lse_ref = partial_reference(store, 0, q, z, tok, qh, k, True)
        np.testing.assert_allclose(o[qh], o_ref, rtol=1e-4, atol=2e-5)
        np.testing.assert_allclose(lse[qh], lse_ref, rtol=1e-5, atol=1e-5)
    assert np.isfinite(o).all()


# ---- lookahead buffer ---------------------------------------------------------------------------
def spill_wanted_reference(idx, count, res_tok, n, shift, C):
    """Per head: the selection, then its successors, minus resident tokens and tokens outside
    [0, n), in that order, first C kept (as spill_changes defines the wanted set)."""
    out = []
    for h in range(idx.shape[0]):
        res = set(res_tok[h][(res_tok[h] >= 0) & (res_tok[h] < n)].tolist())
        want = []
        for off in (0, 1) if shift else (0,):
            for j in idx[h, : count[h]].tolist():
                j += off
                if 0 <= j < n and j not in res and j not in want and len(want) < C:
                    want.append(j)
        out.append(set(want))
    return out


@pytest.mark.parametrize("shift", [True, False])
def test_spill_changes_tracks_selections_and_keeps_slots(shift):
    """Rounds of random selections (overlapping the previous one, as decode steps do): after
    each update the buffer holds exactly the wanted set, a token held before keeps its slot,
    and the returned changes replay the update on a copy of the old buffer."""
    rng = np.random.default_rng(7)
    H, cap, C, n = 3, 40, 70, 300  # C < 2 * cap: the cap on the wanted set is exercised
    spill = np.full((H, C), -1, np.int32)
    prev = [np.zeros(0, np.int64)] * H
    for step in range(25):
        n += 1
        idx = np.full((H, cap), -1, np.int32)
        count = rng.integers(0, cap + 1, H).astype(np.int32)
        for h in range(H):
            keep = rng.permutation(prev[h])[: count[h] // 2]
            fresh = rng.choice(n, count[h], replace=False)
            sel = np.unique(np.concatenate([keep, fresh]))[: count[h]]
            count[h] = len(sel)
            idx[h, : count[h]] = rng.permutation(sel)
            prev[h] = sel
        res_tok = np.full((H, 12), -1, np.int32)
        res_tok[:, :9] = rng.integers(0, n, (H, 9))
        old = spill.copy()
        slots, toks = K.spill_changes(idx, count, res_tok, n, spill, shift=shift)
        want = spill_wanted_reference(idx, count, res_tok, n, shift, C)
        replay = np.concatenate([old, np.full((H, 1), -1, np.int32)], axis=1)
        for h in range(H):
            held = spill[h][spill[h] >= 0]
            assert len(held) == len(set(held.tolist())) and set(held.tolist()) == want[h]
            for s in range(C):  # a wanted token held before stays where it was
                if old[h, s] in want[h]:
                    assert spill[h, s] == old[h, s]
            replay[h, slots[h]] = toks[h]
            assert np.all(slots[h][toks[h] >= 0] < C)
        assert np.array_equal(replay[:, :C], spill)
        assert np.all(replay[:, C] == -1)  # padding (slot C) only ever carries token -1


def test_spill_changes_rejects_bad_inputs():
    idx = np.zeros((2, 4), np.int32)
    spill = np.full((2, 8), -1, np.int32)
    res = np.zeros((2, 3), np.int32)
    with pytest.raises(ValueError, match="count"):
        K.spill_changes(idx, np.array([5, 0], np.int32), res, 10, spill)
    with pytest.raises(ValueError, match="res_tok"):
        K.spill_changes(idx, np.zeros(2, np.int32), np.zeros((3, 3), np.int32), 10, spill)
    with pytest.raises(ValueError, match="spill_tok"):
        K.spill_changes(idx, np.zeros(2, np.int32), res, 10, spill[:, ::2])
