"""The tau threshold and the capped selection of tiered.metal: the MLX-op references against
float64 numpy and the documented rule, the kernels (histogram passes, one or two launches, the
hand-over to MLX ops, ties) against the references (kernels only where the default device is
a Metal or CUDA GPU). The kernel checks are shared with tests/test_metal_exec_kernels.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_accel_kernels import (
    KERNEL_TOL,
    THETA_SLACK,
    TOL,
    assert_valid_threshold,
    make_codebook_case,
    make_scores,
    needs_accel,
    np_softmax_stats,
    np_tau_threshold,
)

from tiered.metal import accelerator, tau_select, tau_threshold, tau_threshold_ops
from tiered.metal.codebook import codebook_scores_and_max
from tiered.metal.select_passes import select_bin_widths


@pytest.mark.parametrize("n", [31, 33, 4099, 131072])
@pytest.mark.parametrize("tau", [0.5, 0.9, 0.99, 1.0])
def test_tau_threshold_ops_matches_numpy(n, tau):
    z = make_scores(8, n, n + 5, seed=n)
    m, s, theta = tau_threshold_ops(z, n, tau)
    m64, s64, theta64 = np_tau_threshold(z, n, tau)
    np.testing.assert_allclose(np.asarray(m), m64, rtol=TOL[mx.float32])
    np.testing.assert_allclose(np.asarray(s), s64, rtol=10 * TOL[mx.float32])
    assert_valid_threshold(z, n, tau, theta, slack=0.0)
    if tau < 1.0:  # the boundary token itself, unless float32 and float64 sums disagree
        assert np.mean(np.asarray(theta) == theta64.astype(np.float32)) >= 0.75


def np_tau_select(z, n, exclude, theta, m, s, cap, floor, rep):
    """Sets of token indices per kv head, by the documented rule, in float64."""
    zv = np.asarray(z, np.float64)[:, :n]
    hq = zv.shape[0]
    h = hq // rep
    logp = zv - (np.asarray(m, np.float64) + np.log(np.asarray(s, np.float64)))[:, None]
    keep_q = np.asarray(z)[:, :n] >= np.asarray(theta)[:, None]
    allowed = ~np.asarray(exclude)[:, :n]
    keep = keep_q.reshape(h, rep, n).any(1) & allowed
    lmax = logp.reshape(h, rep, n).max(1)
    out = []
    for i in range(h):
        kept = np.flatnonzero(keep[i])
        others = np.flatnonzero(allowed[i] & ~keep[i])
        kept = kept[np.argsort(-lmax[i, kept], kind="stable")]
        others = others[np.argsort(-lmax[i, others], kind="stable")]
        count = min(max(len(kept), floor), max(cap, floor), len(kept) + len(others))
        out.append(set(np.concatenate([kept, others])[:count].tolist()))
    return out


def check_select_output(idx, count, exclude, cap, floor, n):
    idx, count, exclude = np.asarray(idx), np.asarray(count), np.asarray(exclude)
    assert idx.shape == (exclude.shape[0], cap) and idx.dtype == np.int32
    for i, cnt in enumerate(count):
        sel = idx[i, :cnt]
        assert np.all(idx[i, cnt:] == -1)
        assert np.all(np.diff(sel) > 0) and np.all((sel >= 0) & (sel < n))
        assert not exclude[i, sel].any()
        assert cnt <= cap and cnt >= min(floor, (~exclude[i, :n]).sum())
    return [set(idx[i, :c].tolist()) for i, c in enumerate(count)]


@pytest.mark.parametrize(
    "n,rep,cap,floor,excluded",
    [(4099, 4, 64, 8, 0.0), (4099, 4, 4096, 8, 0.3), (31, 8, 64, 40, 0.2), (33, 1, 5, 5, 0.5),
     (4099, 3, 1024, 900, 0.1)],
)  # fmt: skip
def test_tau_select_ops_follows_rule(n, rep, cap, floor, excluded):
    h = 2
    z = make_scores(h * rep, n, n + 3, seed=7)
    rng = np.random.default_rng(1)
    exclude = mx.array(rng.random((h, n)) < excluded)
    idx, count = tau_select(z, n, exclude, 0.9, cap, floor, use_kernel=False)
    got = check_select_output(idx, count, exclude, cap, floor, n)
    m, s, theta = tau_threshold_ops(z, n, 0.9)
    assert got == np_tau_select(z, n, exclude, theta, m, s, cap, floor, rep)


def test_tau_rejects_bad_arguments():
    z = make_scores(4, 10, 12)
    with pytest.raises(ValueError, match="tau"):
        tau_threshold(z, 10, 0.0)
    with pytest.raises(ValueError, match="n"):
        tau_threshold(z, 13, 0.9)
    with pytest.raises(ValueError, match="floor"):
        tau_select(z, 10, mx.zeros((2, 10), dtype=mx.bool_), 0.9, 4, -1)
    with pytest.raises(ValueError, match="exclude"):
        tau_select(z, 10, mx.zeros((3, 10), dtype=mx.bool_), 0.9, 4, 1)


def test_tau_select_stats_floor_above_cap_and_empty():
    h, rep, n = 2, 4, 300
    z = make_scores(h * rep, n, n, seed=5)
    exclude = mx.array(np.random.default_rng(3).random((h, n)) < 0.2)
    sel = tau_select(z, n, exclude, 0.5, 4, 40, cap_alloc=64, with_stats=True, use_kernel=False)
    got = check_select_output(sel.idx[:, :40], sel.count, exclude, 40, 40, n)
    assert np.all(np.asarray(sel.idx)[:, 40:] == -1)  # a floor above cap raised the cap
    assert all(len(g) == 40 for g in got)
    zv, m, s = np_softmax_stats(z, n)
    np.testing.assert_allclose(np.asarray(sel.m), m, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(sel.s), s, rtol=1e-5)
    p = np.exp(zv - m[:, None]) / s[:, None]
    mass = [p[qh, sorted(got[qh // rep])].sum() for qh in range(h * rep)]
    np.testing.assert_allclose(np.asarray(sel.mass), mass, rtol=1e-5)
    idx, count = tau_select(z, 0, exclude, 0.9, 8, 2)
    assert np.all(np.asarray(idx) == -1) and idx.shape == (h, 8) and np.all(np.asarray(count) == 0)


@pytest.mark.accelerator
@needs_accel
@pytest.mark.parametrize("n", [1, 31, 33, 4099, 131072])
@pytest.mark.parametrize("tau", [0.5, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("scale", [0.5, 3.0, 20.0])
def test_tau_threshold_kernel_matches_ops(n, tau, scale):
    z = make_scores(8, n, n + 5, scale=scale, seed=n)
    assert_kernel_threshold(z, n, tau, *tau_threshold(z, n, tau, use_kernel=True))


def assert_kernel_threshold(z, n, tau, m, s, theta):
    """The histogram kernel's (m, s, theta) against the sorting reference: m exact, s to
    KERNEL_TOL, theta at most THETA_SLACK logits below the exact threshold."""
    m_ref, s_ref, theta_ref = tau_threshold_ops(z, n, tau)
    np.testing.assert_array_equal(np.asarray(m), np.asarray(m_ref))
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), rtol=KERNEL_TOL)
    assert_valid_threshold(z, n, tau, theta, slack=THETA_SLACK)
    assert np.all(np.asarray(theta) <= np.asarray(theta_ref) + 1e-6)
    assert np.all(np.asarray(theta) >= np.asarray(theta_ref) - THETA_SLACK)


def np_lmax(z, n, m, s, rep):
    """float32 max-over-heads log-probability (H, n), as the kernel computes it."""
    zv = np.asarray(z, np.float32)[:, :n]
    lp = zv - np.asarray(m, np.float32)[:, None] - np.log(np.asarray(s, np.float32))[:, None]
    return lp.reshape(-1, rep, n).max(1)


@pytest.mark.accelerator
@needs_accel
@pytest.mark.parametrize(
    "n,rep,cap,floor,tau",
    [(4099, 4, 64, 8, 0.9), (131072, 8, 2048, 64, 0.9), (33, 3, 40, 10, 0.9),
     (31, 1, 64, 0, 1.0), (4099, 4, 4096, 8, 0.5), (131072, 4, 2048, 2100, 0.99)],
)  # fmt: skip
@pytest.mark.parametrize("exclude_dtype", [mx.bool_, mx.uint8])
def test_tau_select_kernel_follows_rule(n, rep, cap, floor, tau, exclude_dtype):
    """The fused selection against the documented rule, with its own thresholds: thresholds
    within their slack of the exact ones, the kept set and count they imply, the cap ranking
    exact to one bin, and m, s and the selected mass against float64."""
    h = 2
    z = make_scores(h * rep, n, n + 5, seed=n + rep)
    exclude = mx.array(np.random.default_rng(2).random((h, n + 3)) < 0.1).astype(exclude_dtype)
    sel = tau_select(z, n, exclude, tau, cap, floor, with_stats=True, use_kernel=True)
    assert_kernel_selection(z, n, exclude, sel, tau, cap, floor, rep, accelerator())


def assert_kernel_selection(z, n, exclude, sel, tau, cap, floor, rep, backend):
    """A kernel Selection (with its thresholds) of (H, n) scores z against the documented rule
    (see test_tau_select_kernel_follows_rule); backend names the bin widths used."""
    h = z.shape[0] // rep
    ex = np.asarray(exclude).astype(bool)[:, :n]
    got = check_select_output(sel.idx, sel.count, ex, max(cap, floor), floor, n)
    w_t, w_l = select_bin_widths(backend)
    theta = np.asarray(sel.theta)
    zv, m, s = np_softmax_stats(z, n)
    np.testing.assert_array_equal(np.asarray(sel.m), m.astype(np.float32))
    np.testing.assert_allclose(np.asarray(sel.s), s, rtol=KERNEL_TOL)
    if tau < 1.0:
        _, _, theta_exact = np_tau_threshold(z, n, tau)
        assert np.all(theta <= theta_exact + 1e-6) and np.all(theta >= theta_exact - 2 * w_t)
        assert_valid_threshold(z, n, tau, theta, slack=2 * w_t)
    else:
        assert np.all(np.isneginf(theta))
    keep = (np.asarray(z)[:, :n] >= theta[:, None]).reshape(h, rep, n).any(1) & ~ex
    lmax = np_lmax(z, n, sel.m, sel.s, rep)
    p = np.exp(zv - m[:, None]) / s[:, None]
    for i in range(h):
        chosen = np.array(sorted(got[i]), dtype=np.int64)
        n_keep, n_allowed = int(keep[i].sum()), int((~ex[i]).sum())
        k = min(max(n_keep, floor), max(cap, floor), n_allowed)
        assert int(np.asarray(sel.count)[i]) == k
        mask = np.zeros(n, bool)
        mask[chosen] = True
        if k <= n_keep:  # only kept tokens, the most probable ones (to one bin)
            assert np.all(keep[i][mask])
            pool = keep[i]
        else:  # every kept token plus the most probable others
            assert np.all(mask[keep[i]])
            pool = ~ex[i] & ~keep[i]
        left = pool & ~mask
        if left.any() and (mask & pool).any():
            assert lmax[i][mask & pool].min() >= lmax[i][left].max() - 1.01 * w_l
        for r in range(rep):
            qh = i * rep + r
            np.testing.assert_allclose(np.asarray(sel.mass)[qh], p[qh, chosen].sum(),
                                       rtol=KERNEL_TOL, atol=1e-6)


@pytest.mark.accelerator
@needs_accel
@pytest.mark.parametrize("n,rep", [(33, 3), (4099, 4), (131072, 8)])
def test_tau_select_kernel_one_launch_thresholds_equal_two(monkeypatch, n, rep):
    """Passes 1 and 1b in one launch (rows of up to SELECT_FUSED_TOKENS tokens) and in two
    (pass 1 split across threadgroups) sum the same fixed-point masses: the selections and
    their statistics are identical, bit for bit."""
    import tiered.metal.select_passes as tm

    h = 2
    z = make_scores(h * rep, n, n + 5, seed=n + 1)
    exclude = mx.array(np.random.default_rng(4).random((h, n + 3)) < 0.1)
    real_launch, names = tm.launch, []

    def recording_launch(spec, backend, plan):
        names.append(spec.name)
        return real_launch(spec, backend, plan)

    monkeypatch.setattr(tm, "launch", recording_launch)
    monkeypatch.setenv("TIERED_PERSISTENT", "0")  # the passes as separate launches
    sels = []
    for fused_tokens in (2**24, 0):
        monkeypatch.setattr(tm, "SELECT_FUSED_TOKENS", fused_tokens)
        names.clear()
        sels.append(tau_select(z, n, exclude, 0.9, 256, 8, with_stats=True, use_kernel=True))
        mx.eval(*sels[-1])
        fused = tm.HIST_THETA_SPEC.name in names
        assert fused == (fused_tokens > 0) and (tm.HIST_SPEC.name in names) != fused
    for field in ("idx", "count", "m", "s", "theta", "mass"):
        np.testing.assert_array_equal(np.asarray(getattr(sels[0], field)),
                                      np.asarray(getattr(sels[1], field)), err_msg=field)


@pytest.mark.accelerator
@needs_accel
def test_tau_select_kernel_hands_over_to_mlx_ops_beyond_float_counts(monkeypatch):
    """From SELECT_MAX_TOKENS tokens (2^24: the passes count in float32) the selection runs
    as MLX ops: the same result as use_kernel=False, and no kernel threshold."""
    import tiered.metal.tau as tm

    monkeypatch.setattr(tm, "SELECT_MAX_TOKENS", 4000)
    z = make_scores(8, 4099, 4100, seed=3)
    exclude = mx.zeros((2, 4099), dtype=mx.bool_)
    a = tau_select(z, 4099, exclude, 0.9, 64, 8, with_stats=True, use_kernel=True)
    b = tau_select(z, 4099, exclude, 0.9, 64, 8, with_stats=True, use_kernel=False)
    assert a.theta is None
    for x, y in [(a.idx, b.idx), (a.count, b.count), (a.m, b.m), (a.s, b.s)]:
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    c = tau_select(z, 3999, exclude, 0.9, 64, 8, with_stats=True, use_kernel=True)
    assert c.theta is not None  # below the limit: the kernels


@pytest.mark.accelerator
@needs_accel
def test_tau_select_kernel_takes_codebook_block_maxima():
    """Passing the codebook kernel's block maxima gives the same selection as without."""
    q, cb, codes = make_codebook_case(h=2, rep=4, d=128, ds=4, c=256, n=20000, n_cap=20010,
                                      per_group=False, code_dtype=np.uint8)
    z, zmax, notes = codebook_scores_and_max(q, cb, codes, 20000, rep=4, backend=accelerator())
    assert zmax.shape == (8, notes["n_blocks"])
    np.testing.assert_array_equal(np.asarray(zmax).max(1), np.asarray(z).max(1))
    exclude = mx.zeros((2, 20000), dtype=mx.bool_)
    a = tau_select(z, 20000, exclude, 0.9, 512, 8, with_stats=True, zmax=zmax)
    b = tau_select(z, 20000, exclude, 0.9, 512, 8, with_stats=True)
    # The same maxima give the same fixed-point histograms: everything matches exactly.
    for x, y in [(a.m, b.m), (a.s, b.s), (a.theta, b.theta), (a.idx, b.idx), (a.count, b.count)]:
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.accelerator
@needs_accel
@pytest.mark.parametrize("rep", [1, 4])
def test_tau_select_kernel_is_deterministic_and_breaks_ties_by_index(rep):
    """Scores from a few distinct values (0.5 logits apart, far more than a rank bin; the
    heads of a group share them, so their log-probabilities tie exactly), so the cap cuts
    through thousands of exact ties: every run selects the same tokens, and among tied
    tokens the lower indices."""
    h, n, cap = 2, 50000, 1000
    rng = np.random.default_rng(5)
    base = (rng.integers(0, 4, (h, n + 7)) * 0.5).astype(np.float32)
    z = mx.array(np.repeat(base, rep, axis=0))
    exclude = mx.array(rng.random((h, n)) < 0.05)
    runs = [tau_select(z, n, exclude, 0.99, cap, 0, with_stats=True, use_kernel=True)
            for _ in range(3)]
    for other in runs[1:]:
        for f in ("idx", "count", "m", "s", "theta", "mass"):
            np.testing.assert_array_equal(np.asarray(getattr(runs[0], f)),
                                          np.asarray(getattr(other, f)), err_msg=f)
    sel = runs[0]
    ex = np.asarray(exclude)
    lmax = np_lmax(z, n, sel.m, sel.s, rep)
    for i in range(h):
        k = int(np.asarray(sel.count)[i])
        assert k == cap
        chosen = np.asarray(sel.idx)[i, :k]
        mask = np.zeros(n, bool)
        mask[chosen] = True
        cut = lmax[i][mask].min()  # the boundary: tied tokens at it split by index
        tied = np.flatnonzero((lmax[i] == cut) & ~ex[i])
        picked = mask[tied]
        assert picked.any() and not picked.all()
        assert np.all(picked[: picked.sum()]), "ties must go to the lowest token indices"
        assert np.all(mask[(lmax[i] > cut) & ~ex[i]])
