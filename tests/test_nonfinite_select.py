"""Non-finite scores (NaN, +inf, -inf) in every selection implementation that runs here: the
selection equals that of the same scores with those tokens removed, and nothing crashes or
hangs.

Implementations: the Numba kernel (tiered.cpu), the MLX-ops reference, and the Metal kernels on
the CPU executor (tests/metal_exec) with passes 1 and 1b in one launch or two, with MLX's block
maxima (a NaN or +inf among them makes the kernels re-read the row) or finite ones. The
persistent CUDA kernel shares its passes' bodies (select_*.h) and cannot run here. The
threshold alone (tau_threshold: the sorting reference, and its own kernel tau_threshold.h on the
executor) gives the statistics and threshold of each row's finite scores.

The reference is the same implementation on the row without the absent tokens, per kv head:
query heads without a finite score are dropped (m = -inf, s = 0, mass 0), then tokens without
a finite score in the remaining heads; a non-finite score of a token that another head of the
group scores finitely stands as the head's max - 1000, whose weight is 0 exactly (the token
stays through the other head; for tau < 1 the threshold lies within 32 logits of the max, and
for tau = 1 the other head keeps the token anyway). Each case runs in a child process
(tests/isolated.py): first the reference and a warm-up on finite scores of the same shapes
(compiling what the case needs), then the case itself under a short timeout.
"""

from __future__ import annotations

import numpy as np
import pytest

from isolated import WARM_S, Child

CASE_S = 60.0  # one case, kernels compiled (the executor at 4099 tokens, rep 4: a few s)
SIZES = [31, 33, 4099]
REPS = [1, 4]
H = 2
# (tau, cap, floor): the cap cutting through the kept set, a floor filling up, tau = 1.
PARAMS = [(0.9, 16, 4), (0.5, 4096, 40), (1.0, 64, 0)]
IMPLS = ["numba", "mlx-ops", "metal-one", "metal-two", "metal-zmax"]
ZMAX_BLOCK = 64  # block of the finite block maxima handed to "metal-zmax"


@pytest.fixture(scope="module")
def child():
    c = Child()
    yield c
    c.stop()


# ---- scores ------------------------------------------------------------------------------------
def make_scores(n, rep, pattern, seed=0):
    """(z (H rep, n) float32, exclude (H, n) bool) with non-finite scores placed by pattern:
    'scattered': whole columns of group 0 (the first token, the max of its first head, the
    last token) and single scores of group 1's heads (at their maxima among others), plus 2%
    random scores everywhere; 'rows': a query head's row all NaN (for rep 1: its group's only
    head keeps a single finite score), and group 1 without any finite score; 'all'."""
    rng = np.random.default_rng(seed + 7 * n + rep)
    z = (rng.standard_normal((H * rep, n)) * 3).astype(np.float32)
    exclude = rng.random((H, n)) < 0.1
    bad = np.array([np.nan, np.inf, -np.inf], np.float32)
    if pattern == "scattered":
        top = int(np.argmax(z[0, 1 : n - 1])) + 1
        z[:rep, 0], z[:rep, top], z[:rep, n - 1] = bad
        for r in range(rep):
            h = rep + r
            z[h, int(np.argmax(z[h]))] = bad[r % 3]
            z[h, (5 * r + 3) % n] = bad[(r + 1) % 3]
        hit = rng.random(z.shape) < 0.02
        z[hit] = bad[rng.integers(0, 3, int(hit.sum()))]
    elif pattern == "rows":
        if rep > 1:
            z[1] = np.nan
        else:
            keep = z[0, 7]
            z[0] = -np.inf
            z[0, 7] = keep
        z[rep:] = bad[rng.integers(0, 3, (rep, n))]
    elif pattern == "all":
        z[:] = bad[rng.integers(0, 3, z.shape)]
    else:
        raise ValueError(pattern)
    return z, exclude


def finite_block_max(z, block=ZMAX_BLOCK):
    """(rows, ceil(n / block)) maxima of the finite scores of each block (-inf for none)."""
    rows, n = z.shape
    nb = -(-n // block)
    pad = np.full((rows, nb * block), -np.inf, np.float32)
    pad[:, :n] = np.where(np.isfinite(z), z, -np.inf)
    return pad.reshape(rows, nb, block).max(axis=2)


# ---- the implementations (run in the child) ----------------------------------------------------
def run_select(impl, z, exclude, tau_, cap, floor):
    """The selection of impl as numpy arrays: idx, count, m, s, mass (and theta, Metal)."""
    if impl == "numba":
        from tiered.cpu import kernels as K

        sel = K.tau_select(z, z.shape[1], exclude, tau_, cap, floor, with_stats=True)
        return {k: v for k, v in sel._asdict().items() if v is not None}
    import mlx.core as mx
    from test_metal_exec_kernels import metal_on_cpu

    from tiered.metal import tau

    n = z.shape[1]
    args = (mx.array(z), n, mx.array(exclude), tau_, cap, floor)
    if impl == "mlx-ops":
        sel = tau.tau_select(*args, with_stats=True, use_kernel=False)
    else:
        zmax = mx.array(finite_block_max(z)) if impl == "metal-zmax" else None
        with metal_on_cpu(0 if impl == "metal-two" else None):
            sel = tau.tau_select(*args, with_stats=True, use_kernel=True, zmax=zmax)
            mx.eval(*(f for f in sel if f is not None))
    return {k: np.array(v) for k, v in sel._asdict().items() if v is not None}


def reference_select(impl, z, exclude, tau_, cap, floor, rep):
    """impl's selection of z with the non-finite scores removed (module docstring), after a
    warm-up on finite scores of z's shape."""
    run_select(impl, np.where(np.isfinite(z), z, 0.0).astype(np.float32), exclude, tau_, cap,
               floor)
    hq, n = z.shape
    h = hq // rep
    want = dict(idx=np.full((h, max(cap, floor)), -1, np.int32), count=np.zeros(h, np.int32),
                m=np.full(hq, -np.inf, np.float32), s=np.zeros(hq, np.float32),
                mass=np.zeros(hq, np.float32), theta=np.full(hq, np.inf, np.float32))
    for k in range(h):
        zk = z[k * rep:(k + 1) * rep]
        finite = np.isfinite(zk)
        rows = np.flatnonzero(finite.any(axis=1))
        cols = np.flatnonzero(finite[rows].any(axis=0))
        if cols.size == 0:
            continue
        zc = zk[rows][:, cols]
        top = np.where(np.isfinite(zc), zc, -np.inf).max(axis=1)
        zc = np.where(np.isfinite(zc), zc, (top - 1000.0)[:, None]).astype(np.float32)
        got = run_select(impl, np.ascontiguousarray(zc),
                         np.ascontiguousarray(exclude[k:k + 1, cols]), tau_, cap, floor)
        c = int(got["count"][0])
        want["count"][k] = c
        want["idx"][k, :c] = cols[got["idx"][0, :c]]
        for field in ("m", "s", "mass", "theta"):
            if field in got:
                want[field][k * rep + rows] = got[field]
    return want


def case_select(impl, z, exclude, tau_, cap, floor):
    return run_select(impl, z, exclude, tau_, cap, floor)


def run_threshold(impl, z, tau_):
    """(m, s, theta) of tau_threshold: the sorting reference ("mlx-ops") or tau_threshold.h
    ("metal", on the executor), as numpy arrays."""
    import mlx.core as mx
    from test_metal_exec_kernels import metal_on_cpu

    from tiered.metal import threshold

    if impl == "mlx-ops":
        out = threshold.tau_threshold(mx.array(z), z.shape[1], tau_, use_kernel=False)
    else:
        with metal_on_cpu():
            out = threshold.tau_threshold(mx.array(z), z.shape[1], tau_, use_kernel=True)
            mx.eval(*out)
    return tuple(np.array(a) for a in out)


def reference_threshold(impl, z, tau_):
    """The sorting reference on each row's finite scores alone (m = -inf, s = 0, theta = +inf
    for a row without one), after a warm-up of impl on finite scores of z's shape."""
    run_threshold(impl, np.where(np.isfinite(z), z, 0.0).astype(np.float32), tau_)
    want = (np.full(len(z), -np.inf, np.float32), np.zeros(len(z), np.float32),
            np.full(len(z), np.inf, np.float32))
    for h, row in enumerate(z):
        if np.isfinite(row).any():
            got = run_threshold("mlx-ops", row[np.isfinite(row)][None], tau_)
            for field, value in zip(want, got):
                field[h] = value[0]
    return want


# ---- the tests ---------------------------------------------------------------------------------
def metal_available():
    import metal_exec

    return metal_exec.compiler() is not None


def check(child, impl, n, rep, pattern):
    if impl.startswith("metal") and not metal_available():
        pytest.skip("the Metal executor needs a C++ compiler")
    z, exclude = make_scores(n, rep, pattern)
    tau_, cap, floor = PARAMS[(SIZES.index(n) + rep) % len(PARAMS)]
    want = child.call(WARM_S, reference_select, impl, z, exclude, tau_, cap, floor, rep)
    got = child.call(CASE_S, case_select, impl, z, exclude, tau_, cap, floor)
    np.testing.assert_array_equal(got["count"], want["count"], err_msg="count")
    np.testing.assert_array_equal(got["idx"], want["idx"], err_msg="idx")
    np.testing.assert_array_equal(got["m"], want["m"], err_msg="m")
    np.testing.assert_allclose(got["s"], want["s"], rtol=1e-6, err_msg="s")
    np.testing.assert_allclose(got["mass"], want["mass"], rtol=1e-5, atol=1e-7, err_msg="mass")
    if "theta" in got:
        np.testing.assert_array_equal(got["theta"], want["theta"], err_msg="theta")
    empty = ~np.isfinite(z).any(axis=1)  # query heads without a finite score: empty partials
    assert np.all(got["m"][empty] == -np.inf) and np.all(got["s"][empty] == 0.0)
    assert np.all(got["mass"][empty] == 0.0)
    return got


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rep", REPS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("pattern", ["scattered", "rows"])
def test_selection_without_nonfinite_tokens(child, impl, n, rep, pattern):
    check(child, impl, n, rep, pattern)


@pytest.mark.parametrize("impl", IMPLS)
def test_selection_of_nothing_finite_is_empty(child, impl):
    got = check(child, impl, 33, 4, "all")
    assert np.all(got["count"] == 0) and np.all(got["idx"] == -1)


@pytest.mark.parametrize("impl", ["mlx-ops", "metal"])
@pytest.mark.parametrize("n", [33, 4099])
@pytest.mark.parametrize("pattern", ["scattered", "rows", "all"])
@pytest.mark.parametrize("tau_", [0.5, 0.9, 1.0])
def test_threshold_without_nonfinite_scores(child, impl, n, pattern, tau_):
    """tau_threshold (its own kernel, tau_threshold.h): the statistics and threshold of the
    finite scores alone; the kernel's theta within its slack below the exact one."""
    from test_accel_kernels import THETA_SLACK

    if impl == "metal" and not metal_available():
        pytest.skip("the Metal executor needs a C++ compiler")
    z, _ = make_scores(n, 4, pattern)
    m_ref, s_ref, theta_ref = child.call(WARM_S, reference_threshold, impl, z, tau_)
    m, s, theta = child.call(CASE_S, run_threshold, impl, z, tau_)
    np.testing.assert_array_equal(m, m_ref)
    np.testing.assert_allclose(s, s_ref, rtol=1e-5)
    slack = 0.0 if impl == "mlx-ops" else THETA_SLACK
    assert np.all(theta <= theta_ref) and np.all(theta >= theta_ref - slack), (theta, theta_ref)
    assert np.all(theta[m == -np.inf] == np.inf)


def test_reference_drops_what_it_should():
    """The reference's inputs: the patterns put non-finite scores where the docstring says."""
    z, _ = make_scores(33, 4, "scattered")
    assert not np.isfinite(z[:4, [0, 32]]).any() and np.isfinite(z[4:]).mean() > 0.9
    z, _ = make_scores(33, 4, "rows")
    assert np.isnan(z[1]).all() and not np.isfinite(z[4:]).any()
    assert np.isfinite(z[[0, 2, 3]]).mean() == 1.0
    z, _ = make_scores(33, 1, "rows")
    assert np.isfinite(z[0]).sum() == 1 and not np.isfinite(z[1]).any()
