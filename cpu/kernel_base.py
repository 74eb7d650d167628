"""What the CPU tier's Numba kernels share: storage dtype codes, argument checks, the fast
exp, and the row reductions (see :mod:`tiered.cpu.kernels` for the notation)."""

from __future__ import annotations

import math

import numpy as np

from ._numba import NATIVE_HALF, int32_bits_as_float32, int64_bits_as_float64, kernel

DTYPE_CODES = {"float16": 0, "float32": 1, "int8": 2}
# Internal: float16 decoded by the hardware instead of F16_TO_F32 (2x faster gathers where
# NATIVE_HALF; gather_partial switches to it by itself).
FLOAT16_NATIVE = 3
# float16 bits -> float32 value; Numba has no float16, so fp16 pages are read as uint16.
F16_TO_F32 = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)

SCORE_BLOCK = 1024  # tokens per parallel task of the score kernel (16 KB of codes at g = 16)
ENCODE_BLOCK = 64  # keys per parallel task of the encoder
NBINS = 2048  # histogram bins per refinement pass of the threshold search
SMALL = 32  # candidates below which the threshold search sorts instead of binning
EXP_CHUNK = 256  # scores per vectorized exp batch of the selection
MASS_SPAN = 100.0  # logits further below the max than this carry < e^-100 of the mass
# Token flags of the selection (per kv head); NO_FLAG matches no token.
EXCLUDED, IN_UNION, AVAILABLE, NO_FLAG = 0, 1, 2, 3


def check_array(name, x, shape, dtypes=None):
    """Raise ValueError unless x is an ndarray of ``shape`` (None = any) and one of ``dtypes``."""
    if not isinstance(x, np.ndarray) or x.ndim != len(shape) or any(
        e is not None and e != s for e, s in zip(shape, x.shape)
    ):
        got = tuple(x.shape) if hasattr(x, "shape") else type(x).__name__
        want = "(" + ", ".join("?" if e is None else str(e) for e in shape) + ")"
        raise ValueError(f"Invalid shape of {name}: expected {want}, got {got}")
    if dtypes is not None and x.dtype not in dtypes:
        raise ValueError(f"Invalid dtype of {name}: expected one of {dtypes}, got {x.dtype}")


def check_out(name, x, shape, dtype):
    check_array(name, x, shape, (np.dtype(dtype),))
    if not x.flags.c_contiguous or not x.flags.writeable:
        raise ValueError(f"Invalid {name}: must be a writable C-contiguous array")


def c32(x):
    return np.ascontiguousarray(x, dtype=np.float32)


# ---- fast exp -------------------------------------------------------------------------------
@kernel("float32(float32)", inf_safe=True)
def fast_exp(x):
    """exp(x) in float32 for x <= 0 (rel. error ~1e-7); LLVM vectorizes it, unlike libm's expf.

    Cody-Waite range reduction to r in [-ln2/2, ln2/2], degree-7 polynomial, scale by 2^k
    built from its bits. Inputs below -87 (also -inf) return exp(-87) ~ 1.6e-38, negligible
    next to the max's 1 in a softmax.
    """
    x = max(x, np.float32(-87.0))
    k = math.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    r = x - k * np.float32(0.693145751953125) - k * np.float32(1.428606765330187e-06)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * int32_bits_as_float32((np.int32(k) + 127) << 23)


@kernel("float64(float64)", inf_safe=True)
def fast_exp64(x):
    """exp(x) in float64 (rel. error < 3e-15 for |x| < 40, < 5e-14 down to -708, where it
    becomes 0, as for -inf), inlined
    and vectorizable: the softmax masses of the selection must match a float64 reference to
    the last digits, and libm's exp is an opaque call at ~5 ns."""
    xc = min(max(x, -708.0), 709.0)
    k = math.floor(xc * 1.4426950408889634 + 0.5)
    r = xc - k * 6.93147180369123816490e-01 - k * 1.90821492927058770002e-10
    # Taylor to r^12 on |r| <= ln2/2: truncation ~2e-16
    p = 1.0 / 479001600.0
    p = p * r + 1.0 / 39916800.0
    p = p * r + 1.0 / 3628800.0
    p = p * r + 1.0 / 362880.0
    p = p * r + 1.0 / 40320.0
    p = p * r + 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    e = p * int64_bits_as_float64((np.int64(k) + 1023) << 52)
    return e if x >= -708.0 else 0.0




# ---- row reductions -------------------------------------------------------------------------
# Non-finite scores (NaN, +-inf: an fp16 overflow, a damaged page) are absent from the
# selection: never selected, no softmax mass. NaN costs nothing: max(a, b) is
# select(b > a, b, a), which skips a NaN b, fast_exp64(NaN) is 0, and NaN >= theta is false. A
# row holding +-inf (the reductions below return it) is read from a copy where they are NaN
# (nan_for_inf): per-element guards in the hot loops measured 15-20% slower.
INF32 = np.float32(np.inf)


@kernel("float32(float32[::1], int64)", inf_safe=True)
def row_max(row, n):
    """max of the non-NaN values of row[:n] (-inf if none; +inf if the row holds it). Eight
    independent maxima: LLVM does not vectorize a float max reduction (it would need no-NaN),
    and the dependency chain alone costs 2x."""
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = -INF32
    j = 0
    while j + 8 <= n:
        m0 = max(m0, row[j])
        m1 = max(m1, row[j + 1])
        m2 = max(m2, row[j + 2])
        m3 = max(m3, row[j + 3])
        m4 = max(m4, row[j + 4])
        m5 = max(m5, row[j + 5])
        m6 = max(m6, row[j + 6])
        m7 = max(m7, row[j + 7])
        j += 8
    while j < n:
        m0 = max(m0, row[j])
        j += 1
    return max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))


@kernel("float32(float32[::1], int64)", inf_safe=True)
def row_min(row, n):
    """min of the non-NaN values of row[:n] (+inf if none; -inf if the row holds it), as
    row_max."""
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = INF32
    j = 0
    while j + 8 <= n:
        m0 = min(m0, row[j])
        m1 = min(m1, row[j + 1])
        m2 = min(m2, row[j + 2])
        m3 = min(m3, row[j + 3])
        m4 = min(m4, row[j + 4])
        m5 = min(m5, row[j + 5])
        m6 = min(m6, row[j + 6])
        m7 = min(m7, row[j + 7])
        j += 8
    while j < n:
        m0 = min(m0, row[j])
        j += 1
    return min(min(min(m0, m1), min(m2, m3)), min(min(m4, m5), min(m6, m7)))


@kernel(inf_safe=True)
def nan_for_inf(z, n):
    """A copy of z[:, :n] with +-inf as NaN (the selection's view of a row holding them)."""
    out = np.empty((z.shape[0], n), np.float32)
    for h in range(z.shape[0]):
        for j in range(n):
            v = z[h, j]
            out[h, j] = v if abs(v) < INF32 else np.nan
    return out
