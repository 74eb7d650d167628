"""The Numba tau-cumulative selection of tiered.cpu against a full-sort float64 reference:
score distributions with ties and spikes, the cap and the floor, edge cases, validation, and
the parallel kernels entered from several threads at once."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from test_cpu_kernels import SIZES, scores_reference

from tiered.cpu import kernels as K


# ---- reference ----------------------------------------------------------------------------------
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
