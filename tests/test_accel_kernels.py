"""Accelerator kernels of tiered.metal, the codebook scores: references against float64 numpy,
kernels against references (kernels only where the default device is a Metal or CUDA GPU).
This file also holds the float64 references, inputs and checks that the other kernel tests
import (tests/test_accel_affine.py, test_accel_tau.py, test_accel_h2o.py and the executor's
tests/test_metal_exec_kernels.py).

Rows of codes / keys / scores past n are filled with values that poison any result that reads
them (NaN centroids, NaN scales, NaN scores), so a read past the end cannot pass silently.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from tiered.metal import accelerator, codebook_scores, codebook_scores_ops
from tiered.metal.codebook import codebook_scores_and_max
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


# ----------------------------------------------------------------------------- codebook kernels
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
