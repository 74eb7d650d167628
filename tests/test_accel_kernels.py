"""Accelerator kernels of tiered.metal: references against float64 numpy, kernels against
references (kernels only where the default device is a Metal or CUDA GPU).

Rows of codes / keys / scores past n are filled with values that poison any result that reads
them (NaN centroids, NaN scales, NaN scores), so a read past the end cannot pass silently.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tiered.metal import (
    acc_update,
    acc_update_ops,
    accelerator,
    affine_scores,
    affine_scores_ops,
    codebook_scores,
    codebook_scores_ops,
    tau_select,
    tau_threshold,
    tau_threshold_ops,
)
from tiered.metal.codebook import codebook_scores_and_max
from tiered.metal.select_passes import select_bin_widths
from tiered.metal.threshold import BINS, PASSES, SPAN

# Relative tolerance by the dtype the arithmetic runs in (all outputs here are float32).
TOL = {mx.float32: 1e-5, mx.float16: 1e-3, mx.bfloat16: 1e-2}
KERNEL_TOL = 1e-4  # kernel vs reference, fp32 (different summation order)
# The kernel's threshold may sit this far (logits) below the exact one (see threshold.py).
THETA_SLACK = 2.0 * SPAN / BINS**PASSES

needs_accel = pytest.mark.skipif(
    accelerator() == "cpu",
    reason="kernel test needs the Metal or CUDA backend: default device is "
    f"{mx.default_device()}, mx.metal.is_available()={mx.metal.is_available()}, "
    f"mx.cuda.is_available()={mx.cuda.is_available()}",
)


# ----------------------------------------------------------------------------- references
def np_codebook_scores(q, codebook, codes, n, rep):
    """float64 z (Hq, n) and the magnitude sum_i |q_i . c_i| that bounds rounding error."""
    q = np.asarray(q, np.float64)
    cb = np.asarray(codebook, np.float64)
    codes = np.asarray(codes)[:, :n].astype(np.int64)
    hq, d = q.shape
    h, gc, c, ds = cb.shape
    g = d // ds
    qg = q.reshape(h, rep, g, ds)
    z = np.zeros((h, rep, n))
    mag = np.zeros((h, rep, n))
    for i in range(g):
        lut = np.einsum("hrs,hcs->hrc", qg[:, :, i], cb[:, i if gc == g else 0])  # (H, rep, c)
        t = np.take_along_axis(lut, np.broadcast_to(codes[:, None, :, i], (h, rep, n)), axis=2)
        z += t
        mag += np.abs(t)
    return z.reshape(hq, n), mag.reshape(hq, n)


def np_dequantize(wq, scales, biases, n, group_size, bits):
    """float64 keys (H, n, d) from mx.quantize's packing (a little-endian bit stream)."""
    w = np.ascontiguousarray(np.asarray(wq)[:, :n]).view(np.uint8)
    h = w.shape[0]
    bitsarr = np.unpackbits(w, axis=-1, bitorder="little")
    d = bitsarr.shape[-1] // bits
    vals = (bitsarr.reshape(h, n, d, bits) * (1 << np.arange(bits))).sum(-1).astype(np.float64)
    sc = np.asarray(scales[:, :n].astype(mx.float32), np.float64)
    bi = np.asarray(biases[:, :n].astype(mx.float32), np.float64)
    ng = d // group_size
    vals = vals.reshape(h, n, ng, group_size) * sc[..., None] + bi[..., None]
    return vals.reshape(h, n, d)


def np_affine_scores(q, wq, scales, biases, n, rep, group_size, bits):
    keys = np_dequantize(wq, scales, biases, n, group_size, bits)
    h, _, d = keys.shape
    qh = np.asarray(q, np.float64).reshape(h, rep, d)
    z = np.einsum("hrd,hnd->hrn", qh, keys).reshape(h * rep, n)
    mag = np.einsum("hrd,hnd->hrn", np.abs(qh), np.abs(keys)).reshape(h * rep, n)
    return z, mag


def np_softmax_stats(z, n):
    zv = np.asarray(z, np.float64)[:, :n]
    m = zv.max(1)
    s = np.exp(zv - m[:, None]).sum(1)
    return zv, m, s


def np_tau_threshold(z, n, tau):
    """Exact float64 threshold by sorting."""
    zv, m, s = np_softmax_stats(z, n)
    zs = -np.sort(-zv, axis=1)
    cum = np.cumsum(np.exp(zs - m[:, None]), axis=1) / s[:, None]
    k = np.minimum((cum < tau).sum(1), n - 1)
    return m, s, zs[np.arange(len(zs)), k]


def assert_valid_threshold(z, n, tau, theta, slack):
    """theta keeps mass >= tau, and no token above theta + slack is superfluous."""
    zv, m, s = np_softmax_stats(z, n)
    p = np.exp(zv - m[:, None]) / s[:, None]
    theta = np.asarray(theta, np.float64)[:, None]
    kept = (p * (zv >= theta)).sum(1)
    assert np.all(kept >= tau - 1e-5), (kept, tau)
    strict = (p * (zv > theta + slack)).sum(1)
    assert np.all(strict < tau + 1e-5), (strict, tau)


def assert_scores_close(actual, expected, magnitude, rtol):
    actual = np.asarray(actual, np.float64)
    assert actual.shape == expected.shape
    assert np.all(np.isfinite(actual)), "non-finite score: a read past n?"
    err = np.abs(actual - expected)
    bound = rtol * (np.abs(expected) + magnitude + 1e-30)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert np.all(err <= bound), f"max err {err[worst]} at {worst}, bound {bound[worst]}"


# ----------------------------------------------------------------------------- inputs
def make_codebook_case(*, h, rep, d, ds, c, n, n_cap, per_group, code_dtype, seed=0):
    """Codes use centroids 0..c-2 for tokens < n; rows >= n point at centroid c-1, which is NaN."""
    rng = np.random.default_rng(seed)
    g = d // ds
    gc = g if per_group else 1
    cb = rng.standard_normal((h, gc, c, ds)).astype(np.float32)
    cb[:, :, c - 1] = np.nan
    codes = rng.integers(0, c - 1, (h, n_cap, g)).astype(code_dtype)
    codes[:, n:] = c - 1
    q = (rng.standard_normal((h * rep, d)) / math.sqrt(d)).astype(np.float32)
    return mx.array(q), mx.array(cb), mx.array(codes)


def make_affine_case(*, h, rep, d, n, n_cap, group_size, bits, dtype, seed=0):
    rng = np.random.default_rng(seed)
    keys = mx.array(rng.standard_normal((h, n_cap, d)).astype(np.float32)).astype(dtype)
    wq, scales, biases = mx.quantize(keys, group_size=group_size, bits=bits)
    junk = mx.array(rng.integers(0, 2**32, (h, n_cap - n, wq.shape[2]), dtype=np.uint32))
    wq = mx.concatenate([wq[:, :n], junk], axis=1)
    nan = mx.full((h, n_cap - n, scales.shape[2]), math.nan, dtype=scales.dtype)
    scales = mx.concatenate([scales[:, :n], nan], axis=1)
    biases = mx.concatenate([biases[:, :n], nan], axis=1)
    q = mx.array((rng.standard_normal((h * rep, d)) / math.sqrt(d)).astype(np.float32))
    return q, wq, scales, biases


def make_scores(hq, n, n_cap, *, scale=3.0, seed=0):
    """Scores with a few heavy hitters; columns >= n are NaN."""
    rng = np.random.default_rng(seed)
    z = (rng.standard_normal((hq, n_cap)) * scale).astype(np.float32)
    hot = rng.integers(0, n, (hq, 4))
    np.put_along_axis(z, hot, z.max() + 4.0, axis=1)
    z[:, n:] = np.nan
    return mx.array(z)


# ----------------------------------------------------------------------------- codebook
CODEBOOK_SIZES = [(31, 1), (33, 3), (4099, 4), (4099, 8), (33, 8), (31, 4)]


@pytest.mark.parametrize("n,rep", CODEBOOK_SIZES)
def test_codebook_ops_matches_numpy_sizes(n, rep):
    q, cb, codes = make_codebook_case(
        h=2, rep=rep, d=128, ds=4, c=64, n=n, n_cap=n + 9, per_group=True, code_dtype=np.uint8
    )
    z = codebook_scores_ops(q, cb, codes, n, rep=rep)
    expected, mag = np_codebook_scores(q, cb, codes, n, rep)
    assert_scores_close(z, expected, mag, TOL[mx.float32])


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("per_group", [True, False])
@pytest.mark.parametrize("code_dtype,c", [(np.uint8, 256), (np.uint16, 1024)])
def test_codebook_ops_matches_numpy_layouts(d, per_group, code_dtype, c):
    q, cb, codes = make_codebook_case(
        h=2, rep=4, d=d, ds=d // 32, c=c, n=33, n_cap=50, per_group=per_group, code_dtype=code_dtype
    )
    z = codebook_scores_ops(q, cb, codes, 33, rep=4)
    expected, mag = np_codebook_scores(q, cb, codes, 33, 4)
    assert_scores_close(z, expected, mag, TOL[mx.float32])


def test_codebook_ops_long_context():
    n = 131072
    q, cb, codes = make_codebook_case(
        h=2, rep=4, d=64, ds=4, c=16, n=n, n_cap=n + 64, per_group=False, code_dtype=np.uint8
    )
    z = codebook_scores_ops(q, cb, codes, n, rep=4)
    expected, mag = np_codebook_scores(q, cb, codes, n, 4)
    assert_scores_close(z, expected, mag, TOL[mx.float32])


def _check_top_order(z, dense, k=32):
    """The top-k tokens of z come in the order of the exact dense scores."""
    z = np.asarray(z)
    for row in range(dense.shape[0]):
        order = np.argsort(-dense[row])[: k + 1]
        gaps = -np.diff(dense[row, order])
        assert gaps.min() > 2e-5, "test data has near-ties; pick another seed"
        np.testing.assert_array_equal(np.argsort(-z[row])[:k], order[:k])


@pytest.mark.parametrize("per_group", [True, False])
def test_codebook_top_order_matches_dense_keys(per_group):
    """Keys that the codebook reconstructs exactly: codebook scores rank like q . k."""
    h, rep, d, ds, c, n = 2, 4, 128, 4, 32, 4099
    q, cb, codes = make_codebook_case(
        h=h, rep=rep, d=d, ds=ds, c=c, n=n, n_cap=n, per_group=per_group, code_dtype=np.uint8
    )
    cb_np, codes_np = np.asarray(cb, np.float64), np.asarray(codes).astype(np.int64)
    g = d // ds
    keys = np.stack(
        [cb_np[np.arange(h)[:, None], i if per_group else 0, codes_np[:, :, i]] for i in range(g)],
        axis=2,
    ).reshape(h, n, d)
    dense = np.einsum("hrd,hnd->hrn", np.asarray(q, np.float64).reshape(h, rep, d), keys)
    dense = dense.reshape(h * rep, n)
    _check_top_order(codebook_scores_ops(q, cb, codes, n, rep=rep), dense)
    dense32 = (q.reshape(h, rep, d) @ mx.array(keys.astype(np.float32)).swapaxes(1, 2))
    _check_top_order(dense32.reshape(h * rep, n), dense)  # the float32 dense reference agrees


def test_codebook_rejects_bad_shapes():
    q, cb, codes = make_codebook_case(
        h=2, rep=4, d=64, ds=4, c=16, n=10, n_cap=12, per_group=True, code_dtype=np.uint8
    )
    with pytest.raises(ValueError, match="rep"):
        codebook_scores(q, cb, codes, 10, rep=3)
    with pytest.raises(ValueError, match="n"):
        codebook_scores(q, cb, codes, 13, rep=4)
    with pytest.raises(ValueError, match="codes"):
        codebook_scores(q, cb, codes.astype(mx.int32), 10, rep=4)


# ----------------------------------------------------------------------------- affine
AFFINE_CASES = [
    # d, bits, group_size, dtype, rep, n
    (128, 4, 32, mx.float16, 4, 4099),
    (128, 8, 64, mx.float32, 1, 33),
    (64, 2, 32, mx.bfloat16, 3, 31),
    (256, 3, 32, mx.float16, 8, 33),
    (256, 4, 128, mx.bfloat16, 4, 31),
    (64, 6, 64, mx.float32, 8, 4099),
]


@pytest.mark.parametrize("d,bits,group_size,dtype,rep,n", AFFINE_CASES)
def test_affine_ops_matches_numpy(d, bits, group_size, dtype, rep, n):
    q, wq, scales, biases = make_affine_case(
        h=2, rep=rep, d=d, n=n, n_cap=n + 7, group_size=group_size, bits=bits, dtype=dtype
    )
    z = affine_scores_ops(q, wq, scales, biases, n, rep=rep, group_size=group_size, bits=bits)
    expected, mag = np_affine_scores(q, wq, scales, biases, n, rep, group_size, bits)
    assert_scores_close(z, expected, mag, TOL[mx.float32])


def test_affine_bench_hook_reports_a_choice(monkeypatch):
    """bench/probes/affine_choice.py (benchmark code, outside the package) times both paths."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench" / "probes"))
    from affine_choice import bench_affine_scores

    q, wq, scales, biases = make_affine_case(
        h=2, rep=4, d=128, n=256, n_cap=300, group_size=64, bits=4, dtype=mx.float16
    )
    res = bench_affine_scores(
        q, wq, scales, biases, 256, rep=4, group_size=64, bits=4, iters=3, warmup=1
    )
    assert res.ops_s > 0
    if accelerator() == "cpu":
        assert res.kernel_s is None and res.use_kernel is False
    else:
        assert res.kernel_s > 0 and res.use_kernel == (res.kernel_s < res.ops_s)


# ----------------------------------------------------------------------------- tau
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


# ----------------------------------------------------------------------------- kernels
@pytest.mark.accelerator
@needs_accel
@pytest.mark.parametrize("n,rep", CODEBOOK_SIZES + [(131072, 4)])
@pytest.mark.parametrize("per_group", [True, False])
@pytest.mark.parametrize(
    "code_dtype,c,ds", [(np.uint8, 256, 4), (np.uint8, 16, 8), (np.uint16, 1024, 4)]
)
@pytest.mark.parametrize("rep_tile", [None, 1])
@pytest.mark.parametrize("d", [64, 128])
def test_codebook_kernel_matches_ops(n, rep, per_group, code_dtype, c, ds, rep_tile, d):
    q, cb, codes = make_codebook_case(
        h=2, rep=rep, d=d, ds=ds, c=c, n=n, n_cap=n + 40, per_group=per_group, code_dtype=code_dtype
    )
    z = codebook_scores(q, cb, codes, n, rep=rep, use_kernel=True, rep_tile=rep_tile,
                        lut_half=False)
    ref = codebook_scores_ops(q, cb, codes, n, rep=rep)
    expected, mag = np_codebook_scores(q, cb, codes, n, rep)
    assert_scores_close(z, expected, mag, KERNEL_TOL)
    np.testing.assert_allclose(np.asarray(z), np.asarray(ref), rtol=KERNEL_TOL, atol=KERNEL_TOL)


# A float16 table rounds each entry to 11 significant bits (relative error <= 2^-11), after
# a per-head power-of-two scale; sums stay float32.
HALF_TOL = 2.0**-11 + KERNEL_TOL


@pytest.mark.accelerator
@needs_accel
@pytest.mark.parametrize("n,rep", CODEBOOK_SIZES + [(131072, 4)])
@pytest.mark.parametrize("qscale", [1e-6, 1.0, 1e5])  # float16 alone: underflow / overflow
@pytest.mark.parametrize("d,ds,c,per_group", [(128, 4, 256, False), (64, 4, 256, True),
                                              (256, 8, 16, False)])
def test_codebook_kernel_half_table_matches_numpy(n, rep, qscale, d, ds, c, per_group):
    q, cb, codes = make_codebook_case(
        h=2, rep=rep, d=d, ds=ds, c=c, n=n, n_cap=n + 40, per_group=per_group,
        code_dtype=np.uint8,
    )
    q = q * qscale
    z, zmax, notes = codebook_scores_and_max(q, cb, codes, n, rep=rep, backend=accelerator(),
                                             lut_half=True)
    assert notes["lut_half"] == notes["lut_shared"]
    expected, mag = np_codebook_scores(q, cb, codes, n, rep)
    assert_scores_close(z, expected, mag, HALF_TOL if notes["lut_half"] else KERNEL_TOL)
    # The block maxima are those of the exported (scaled back) scores, exactly.
    zn = np.asarray(z)
    block = notes["block"]
    for b in range(notes["n_blocks"]):
        np.testing.assert_array_equal(np.asarray(zmax)[:, b],
                                      zn[:, b * block:(b + 1) * block].max(axis=1))


@pytest.mark.accelerator
@needs_accel
@pytest.mark.parametrize(
    "d,bits,group_size,dtype,rep,n", AFFINE_CASES + [(128, 4, 64, mx.float16, 4, 131072)]
)
def test_affine_kernel_matches_ops(d, bits, group_size, dtype, rep, n):
    q, wq, scales, biases = make_affine_case(
        h=2, rep=rep, d=d, n=n, n_cap=n + 7, group_size=group_size, bits=bits, dtype=dtype
    )
    kw = dict(rep=rep, group_size=group_size, bits=bits)
    z = affine_scores(q, wq, scales, biases, n, use_kernel=True, **kw)
    ref = affine_scores_ops(q, wq, scales, biases, n, **kw)
    expected, mag = np_affine_scores(q, wq, scales, biases, n, rep, group_size, bits)
    assert_scores_close(z, expected, mag, KERNEL_TOL)
    assert_scores_close(ref, expected, mag, KERNEL_TOL)


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


# ----------------------------------------------------------------------------- H2O accumulators
def _acc_inputs(n, rep, h=3, slack=7, seed=0):
    """acc (H, n + slack) with live columns past n; z (H rep, n + 5) NaN past n; m, s from z."""
    rng = np.random.default_rng(seed + n + rep)
    acc = rng.random((h, n + slack)).astype(np.float32)
    z = (rng.standard_normal((h * rep, n + 5)) * 4).astype(np.float32)
    z[:, n:] = np.nan
    m = z[:, :n].max(axis=1) if n else np.zeros(h * rep, np.float32)
    s = np.exp(z[:, :n].astype(np.float64) - m[:, None]).sum(axis=1) if n else np.ones(h * rep)
    return acc, z, m.astype(np.float32), s.astype(np.float32)


def np_acc_update(acc, z, m, s, n, rep, alpha):
    h = acc.shape[0]
    p = np.exp(z[:, :n].astype(np.float64) - m[:, None]) / s[:, None]
    out = acc.astype(np.float64).copy()
    out[:, :n] = alpha * out[:, :n] + (1 - alpha) * p.reshape(h, rep, n).mean(axis=1)
    return out


@pytest.mark.parametrize("n", [0, 1, 31, 33, 4099])
@pytest.mark.parametrize("rep", [1, 3, 4, 8])
def test_acc_update_ops_matches_numpy(n, rep):
    acc, z, m, s = _acc_inputs(n, rep)
    out = acc_update_ops(mx.array(acc), mx.array(z), mx.array(m), mx.array(s), n, rep, 0.95)
    np.testing.assert_allclose(np.array(out), np_acc_update(acc, z, m, s, n, rep, 0.95),
                               rtol=1e-5, atol=1e-7)


def test_acc_update_rejects_bad_arguments():
    acc, z, m, s = (mx.array(a) for a in _acc_inputs(33, 4))
    with pytest.raises(ValueError, match="Invalid shapes for rep"):
        acc_update(acc, z, m, s, 33, 3, 0.9)
    with pytest.raises(ValueError, match="Invalid n"):
        acc_update(acc, z, m, s, 39, 4, 0.9)
    with pytest.raises(ValueError, match="Invalid alpha"):
        acc_update(acc, z, m, s, 33, 4, 1.5)


@pytest.mark.accelerator
@needs_accel
@pytest.mark.parametrize("n", [1, 31, 33, 4099, 131072])
@pytest.mark.parametrize("rep", [1, 3, 4, 8])
def test_acc_update_kernel_matches_ops(n, rep):
    """One pass, NaN scores past n: any read there would poison the row."""
    acc, z, m, s = (mx.array(a) for a in _acc_inputs(n, rep))
    out = acc_update(acc, z, m, s, n, rep, 0.95, use_kernel=True)
    ref = acc_update_ops(acc, z, m, s, n, rep, 0.95)
    assert out.shape == acc.shape
    np.testing.assert_allclose(np.array(out), np.array(ref), rtol=KERNEL_TOL, atol=1e-7)
    np.testing.assert_array_equal(np.array(out)[:, n:], np.array(acc)[:, n:])
