"""Numba kernels of the CPU tier: codebook scores, tau-cumulative selection, paged gather.

Notation: ``H`` kv heads, ``Hq`` query heads, ``rep = Hq // H`` (query head ``qh`` reads kv head
``qh // rep``), ``d`` key head_dim, ``dv`` value head_dim, ``n`` live tokens, ``g`` codebook
groups of ``ds = d // g`` dims, ``c`` centroids per group. Scores are pre-softmax logits that
already include the attention scale.

Each public function validates shapes and dtypes in Python (``ValueError`` naming the argument)
and calls one ``_``-prefixed Numba kernel, jitted with explicit signatures, ``cache=True`` and
``nogil=True`` (see ``_numba``). Parallel kernels give every thread its own preallocated slice.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import prange

from ._numba import (NATIVE_HALF, address_as_pointer, half_bits_as_float32,
                     int32_bits_as_float32, int64_bits_as_float64, kernel, prefetch_address)

# Host storage dtypes as the kernels see them (same order as ``tiered.cpu.HOST_DTYPES``).
DTYPE_CODES = {"float16": 0, "float32": 1, "int8": 2}
# Internal: float16 decoded by the hardware instead of F16_TO_F32 (2x faster gathers where
# NATIVE_HALF; gather_partial switches to it by itself).
_FLOAT16_NATIVE = 3
# float16 bits -> float32 value; Numba has no float16, so fp16 pages are read as uint16.
F16_TO_F32 = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)

_SCORE_BLOCK = 1024  # tokens per parallel task of the score kernel (16 KB of codes at g = 16)
_ENCODE_BLOCK = 64  # keys per parallel task of the encoder
_NBINS = 2048  # histogram bins per refinement pass of the threshold search
_SMALL = 32  # candidates below which the threshold search sorts instead of binning
_EXP_CHUNK = 256  # scores per vectorized exp batch of the selection
_MASS_SPAN = 100.0  # logits further below the max than this carry < e^-100 of the mass
# Token flags of the selection (per kv head); _NO_FLAG matches no token.
_EXCLUDED, _IN_UNION, _AVAILABLE, _NO_FLAG = 0, 1, 2, 3


def _check(name, x, shape, dtypes=None):
    """Raise ValueError unless x is an ndarray of ``shape`` (None = any) and one of ``dtypes``."""
    if not isinstance(x, np.ndarray) or x.ndim != len(shape) or any(
        e is not None and e != s for e, s in zip(shape, x.shape)
    ):
        got = tuple(x.shape) if hasattr(x, "shape") else type(x).__name__
        want = "(" + ", ".join("?" if e is None else str(e) for e in shape) + ")"
        raise ValueError(f"Invalid shape of {name}: expected {want}, got {got}")
    if dtypes is not None and x.dtype not in dtypes:
        raise ValueError(f"Invalid dtype of {name}: expected one of {dtypes}, got {x.dtype}")


def _check_out(name, x, shape, dtype):
    _check(name, x, shape, (np.dtype(dtype),))
    if not x.flags.c_contiguous or not x.flags.writeable:
        raise ValueError(f"Invalid {name}: must be a writable C-contiguous array")


def _c32(x):
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


# ---- (a) codebook scores --------------------------------------------------------------------
@kernel("void(float32[:, ::1], float32[:, :, :, ::1], int64, float32[:, :, ::1])")
def _codebook_lut(q, C, rep, out):
    g, c, ds, shared = out.shape[1], out.shape[2], C.shape[3], C.shape[1] == 1
    for h in range(out.shape[0]):
        k = h // rep
        for i in range(g):
            gi = 0 if shared else i
            for j in range(c):
                acc = np.float32(0.0)
                for e in range(ds):
                    acc += q[h, i * ds + e] * C[k, gi, j, e]
                out[h, i, j] = acc


@kernel(
    [
        "void(uint8[:, :, ::1], int64, float32[:, :, ::1], int64, float32[:, ::1])",
        "void(uint16[:, :, ::1], int64, float32[:, :, ::1], int64, float32[:, ::1])",
    ],
    parallel=True,
)
def _codebook_scores(P, n, T, rep, out):
    H, g = P.shape[0], P.shape[2]
    for b in prange((n + _SCORE_BLOCK - 1) // _SCORE_BLOCK):
        j1 = min(n, (b + 1) * _SCORE_BLOCK)
        # Tokens outer, heads inner: a row of codes is loaded once and reused from L1 by the
        # rep query heads of its kv head.
        for k in range(H):
            for j in range(b * _SCORE_BLOCK, j1):
                for r in range(rep):
                    h = k * rep + r
                    acc = np.float32(0.0)
                    for i in range(g):
                        acc += T[h, i, P[k, j, i]]
                    out[h, j] = acc


@kernel(
    [
        "void(float32[:, :, ::1], float32[:, :, :, ::1], uint8[:, :, ::1])",
        "void(float32[:, :, ::1], float32[:, :, :, ::1], uint16[:, :, ::1])",
    ],
    parallel=True,
)
def _codebook_encode(x, C, out):
    H, L, g = out.shape[0], out.shape[1], out.shape[2]
    Gc, c, ds = C.shape[1], C.shape[2], C.shape[3]
    # argmin_j |x - C_j|^2 = argmin_j (|C_j|^2 - 2 x.C_j); centroids innermost and contiguous
    # (Ct is (H, Gc, ds, c)) so the distance loop vectorizes.
    Ct = np.empty((H, Gc, ds, c), np.float32)
    norms = np.zeros((H, Gc, c), np.float32)
    for k in range(H):
        for gi in range(Gc):
            for j in range(c):
                for e in range(ds):
                    Ct[k, gi, e, j] = C[k, gi, j, e]
                    norms[k, gi, j] += C[k, gi, j, e] * C[k, gi, j, e]
    n_tasks = (H * L + _ENCODE_BLOCK - 1) // _ENCODE_BLOCK
    dist = np.empty((n_tasks, c), np.float32)
    for b in prange(n_tasks):
        for t in range(b * _ENCODE_BLOCK, min(H * L, (b + 1) * _ENCODE_BLOCK)):
            k, l = t // L, t % L
            for i in range(g):
                gi = 0 if Gc == 1 else i
                for j in range(c):
                    dist[b, j] = norms[k, gi, j]
                for e in range(ds):
                    xe = np.float32(-2.0) * x[k, l, i * ds + e]
                    for j in range(c):
                        dist[b, j] += xe * Ct[k, gi, e, j]
                best = 0
                for j in range(1, c):
                    if dist[b, j] < dist[b, best]:
                        best = j
                out[k, l, i] = best


def _codebook_geometry(C, d):
    _check("C", C, (None, None, None, None), (np.dtype(np.float32),))
    H, Gc, c, ds = C.shape
    if ds == 0 or d % ds:
        raise ValueError(f"Invalid shape of C: sub-dim {ds} does not divide head_dim {d}")
    g = d // ds
    if Gc not in (1, g):
        raise ValueError(f"Invalid shape of C: expected Gc = 1 or g = {g} codebooks, got {Gc}")
    return H, g, c


def codebook_lut(q, C, rep, out=None):
    """Per-query lookup tables T[qh, i, :] = q[qh, i*ds:(i+1)*ds] @ C[qh // rep, i or 0].T.

    q: (Hq, d) float32, already scaled; C: (H, Gc, c, ds) float32 codebook, Gc = 1 (shared) or
    g = d // ds (per group); out: optional (Hq, g, c) float32. Returns out.
    """
    _check("q", q, (None, None), (np.dtype(np.float32),))
    H, g, c = _codebook_geometry(C, q.shape[1])
    _check("q", q, (H * rep, g * C.shape[3]))
    if out is None:
        out = np.empty((H * rep, g, c), np.float32)
    _check_out("out", out, (H * rep, g, c), np.float32)
    _codebook_lut(np.ascontiguousarray(q), np.ascontiguousarray(C), int(rep), out)
    return out


def codebook_scores(P, n, T, rep, out=None):
    """Approximate scores z[qh, j] = sum_i T[qh, i, P[qh // rep, j, i]] for tokens j < n.

    P: (H, n_cap, g) uint8/uint16 codes (rows >= n ignored); T: (Hq, g, c) float32 from
    :func:`codebook_lut`; out: optional (Hq, >= n) float32, C-contiguous (only [:, :n] is
    written). Returns out. Codes must be < c (not checked: an index past c reads garbage).
    """
    _check("P", P, (None, None, None), (np.dtype(np.uint8), np.dtype(np.uint16)))
    H, n_cap, g = P.shape
    _check("T", T, (H * rep, g, None), (np.dtype(np.float32),))
    if not 0 <= n <= n_cap:
        raise ValueError(f"Invalid n: {n} (the codes hold {n_cap} tokens)")
    if out is None:
        out = np.empty((H * rep, n), np.float32)
    _check_out("out", out, (H * rep, None), np.float32)
    if out.shape[1] < n:
        raise ValueError(f"Invalid shape of out: expected (Hq, >= {n}), got {out.shape}")
    _codebook_scores(np.ascontiguousarray(P), int(n), np.ascontiguousarray(T), int(rep), out)
    return out


def codebook_encode(x, C, out=None):
    """Nearest centroid (squared L2) of every group of every key.

    x: (H, L, d) float32 keys; C: (H, Gc, c, ds) float32; out: optional (H, L, g) uint8
    (c <= 256) or uint16 codes. Returns out.
    """
    _check("x", x, (None, None, None), (np.dtype(np.float32),))
    H, g, c = _codebook_geometry(C, x.shape[2])
    _check("x", x, (H, None, g * C.shape[3]))
    if out is None:
        out = np.empty((H, x.shape[1], g), np.uint8 if c <= 256 else np.uint16)
    _check_out("out", out, (H, x.shape[1], g), out.dtype)
    if out.dtype not in (np.uint8, np.uint16) or (out.dtype == np.uint8 and c > 256):
        raise ValueError(f"Invalid dtype of out: {out.dtype} cannot hold {c} codes")
    _codebook_encode(np.ascontiguousarray(x), np.ascontiguousarray(C), out)
    return out


# ---- row reductions -------------------------------------------------------------------------
# Non-finite scores (NaN, +-inf: an fp16 overflow, a damaged page) are absent from the
# selection: never selected, no softmax mass. NaN costs nothing: max(a, b) is
# select(b > a, b, a), which skips a NaN b, fast_exp64(NaN) is 0, and NaN >= theta is false. A
# row holding +-inf (the reductions below return it) is read from a copy where they are NaN
# (_nan_for_inf): per-element guards in the hot loops measured 15-20% slower.
_INF32 = np.float32(np.inf)


@kernel("float32(float32[::1], int64)", inf_safe=True)
def _row_max(row, n):
    """max of the non-NaN values of row[:n] (-inf if none; +inf if the row holds it). Eight
    independent maxima: LLVM does not vectorize a float max reduction (it would need no-NaN),
    and the dependency chain alone costs 2x."""
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = -_INF32
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
def _row_min(row, n):
    """min of the non-NaN values of row[:n] (+inf if none; -inf if the row holds it), as
    _row_max."""
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = _INF32
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
def _nan_for_inf(z, n):
    """A copy of z[:, :n] with +-inf as NaN (the selection's view of a row holding them)."""
    out = np.empty((z.shape[0], n), np.float32)
    for h in range(z.shape[0]):
        for j in range(n):
            v = z[h, j]
            out[h, j] = v if abs(v) < _INF32 else np.nan
    return out


# ---- (b) tau-cumulative selection -----------------------------------------------------------
@kernel(inf_safe=True)
def _bin(x, lo, scale, nbins):
    """Histogram bin of x: bins of width 1/scale from lo; x <= lo goes to bin 0, and so does
    NaN (int() of NaN is undefined: a negative index wrote outside the histogram)."""
    return min(nbins - 1, int((x - lo) * scale)) if x > lo else 0


@kernel(inf_safe=True)
def _refine_threshold(vals, mref, cand, nc, above, target, weighted, hist):
    """Largest v among vals[cand[:nc]] with above + sum_{x >= v} w(x) >= target, where w(x)
    is exp(x - mref) (weighted) or 1; the minimum if none reaches target (rounding).

    Each pass bins the candidates, keeps the bin where the cumulative weight from the top
    crosses target and carries the weight above it. The smallest and largest candidate always
    land in different bins, so nc strictly shrinks; few candidates are sorted. Overwrites cand.
    """
    nbins = hist.shape[0]
    while True:
        lo = np.float64(vals[cand[0]])
        hi = lo
        for t in range(1, nc):
            x = np.float64(vals[cand[t]])
            lo = min(lo, x)
            hi = max(hi, x)
        if lo == hi:
            return hi
        lo_bin = max(lo, hi - _MASS_SPAN) if weighted else lo
        scale = nbins / (hi - lo_bin)
        if nc <= _SMALL or not scale < 1e300:
            break
        hist[:] = 0.0
        for t in range(nc):
            x = np.float64(vals[cand[t]])
            hist[_bin(x, lo_bin, scale, nbins)] += fast_exp64(x - mref) if weighted else 1.0
        b = nbins - 1
        while above + hist[b] < target:
            above += hist[b]
            b -= 1
            if b < 0:
                return lo  # the candidates' weight falls short of target by rounding: all in
        kept = 0
        for t in range(nc):
            if _bin(np.float64(vals[cand[t]]), lo_bin, scale, nbins) == b:
                cand[kept] = cand[t]
                kept += 1
        nc = kept
    # Few candidates (or a span too small to bin): sort descending and walk the tie groups.
    order = np.argsort(-vals[cand[:nc]].astype(np.float64), kind="mergesort")
    ranked = cand[:nc][order]
    t = 0
    while t < nc:
        v = np.float64(vals[ranked[t]])
        while t < nc and np.float64(vals[ranked[t]]) == v:
            above += fast_exp64(v - mref) if weighted else 1.0
            t += 1
        if above >= target:
            return v
    return lo


@kernel(inf_safe=True)
def _tau_threshold(row, n, mx, lo, tau, hist, cand, ebuf):
    """(theta, s) of one query head: s = sum_j exp(row[j] - mx), theta the largest score whose
    top set {row >= theta} holds tau * s (the minimum for tau >= 1). The non-NaN values of
    row[:n] span [lo, mx] (finite); NaN counts for nothing and is never a candidate."""
    chunk = ebuf.shape[0]
    nbins = hist.shape[0]
    lo_bin = max(lo, mx - _MASS_SPAN)  # the tail below holds < n e^-100 of the mass
    scale = nbins / (mx - lo_bin) if mx > lo_bin else 0.0
    hist[:] = 0.0
    s = 0.0
    for j0 in range(0, n, chunk):
        j1 = min(n, j0 + chunk)
        # exp and sum in their own loop so they vectorize; the histogram scatter cannot
        for j in range(j0, j1):
            e = fast_exp64(np.float64(row[j]) - mx)  # 0 for NaN
            ebuf[j - j0] = e
            s += e
        if tau < 1.0:
            for j in range(j0, j1):
                hist[_bin(np.float64(row[j]), lo_bin, scale, nbins)] += ebuf[j - j0]
    if tau >= 1.0 or mx == lo:
        return lo, s  # every token (also those whose weight underflows), or all tied
    target = tau * s
    above = 0.0
    b = nbins - 1
    while above + hist[b] < target:
        above += hist[b]
        b -= 1
        if b < 0:
            return lo, s
    nc = 0
    for j in range(n):
        if _bin(np.float64(row[j]), lo_bin, scale, nbins) == b:
            cand[nc] = j
            nc += 1
    if b == 0:  # bin 0 also holds NaN, never a candidate (a test in the loop: 10% slower)
        kept = 0
        for t in range(nc):
            if row[cand[t]] == row[cand[t]]:
                cand[kept] = cand[t]
                kept += 1
        nc = kept
    return _refine_threshold(row, mx, cand, nc, above, target, True, hist), s


@kernel(inf_safe=True)
def _head_threshold(row, n, tau, hist, cand, ebuf):
    """(ok, m, s, theta, lse) of one query head over its non-NaN scores (_tau_threshold).
    ok is False, and nothing computed, for a row holding +-inf (the caller reads it again with
    NaN for them). A row without a finite score: m = -inf, s = 0, theta = +inf, lse = -inf,
    it selects nothing (an empty partial)."""
    mx = np.float64(_row_max(row, n))
    lo = np.float64(_row_min(row, n))
    if mx == np.inf or lo == -np.inf:
        return False, mx, 0.0, np.inf, -np.inf
    if mx == -np.inf:
        return True, mx, 0.0, np.inf, -np.inf
    th, s = _tau_threshold(row, n, mx, lo, tau, hist, cand, ebuf)
    return True, mx, s, th, mx + math.log(s)


@kernel(inf_safe=True)
def _emit(k, n, flags, keys, take_flag, part_flag, v, n_part, idx):
    """Write idx[k] ascending: tokens with flags == take_flag, plus the n_part best (by key,
    ties to the lower index) of flags == part_flag, whose threshold key is v. Returns count."""
    strict = 0
    if n_part > 0:
        for j in range(n):
            if flags[k, j] == part_flag and keys[k, j] > v:
                strict += 1
    ties = n_part - strict
    cnt = 0
    for j in range(n):
        f = flags[k, j]
        if f == take_flag:
            idx[k, cnt] = j
            cnt += 1
        elif f == part_flag and n_part > 0:
            if keys[k, j] > v:
                idx[k, cnt] = j
                cnt += 1
            elif keys[k, j] == v and ties > 0:
                idx[k, cnt] = j
                cnt += 1
                ties -= 1
    return cnt


@kernel(inf_safe=True)
def _rank_candidates(z, lse, rep, k, n, flags, flag, keys, cand):
    """cand <- tokens with flags[k] == flag; keys[k, j] <- max_h log p_hj for them (over the
    heads where the score is not NaN; -inf for a token NaN in every head). Count."""
    m = 0
    for j in range(n):
        if flags[k, j] == flag:
            best = np.float64(z[k * rep, j]) - lse[k * rep]
            best = best if best == best else -np.inf  # max(NaN, x) would be NaN
            for r in range(1, rep):  # max(best, NaN) is best
                best = max(best, np.float64(z[k * rep + r, j]) - lse[k * rep + r])
            keys[k, j] = best
            cand[m] = j
            m += 1
    return m


@kernel(inf_safe=True)
def _select_kv_head(z, n, exclude, theta, lse, k, limit, floor, flags, keys, cand, hist, idx):
    """U_k (union of the group's top sets, minus excluded), trimmed to limit or filled up to
    floor by max_h log p_hj, written ascending to idx[k]. Returns the count."""
    rep = z.shape[0] // idx.shape[0]
    has_exclude = exclude.shape[1] > 0
    # Branch-free passes over contiguous rows, so they vectorize.
    member = flags[k]
    member[:n] = 0
    for r in range(rep):
        th = theta[k * rep + r]
        row = z[k * rep + r]
        for j in range(n):
            member[j] |= row[j] >= th  # false for NaN
    n_union = 0
    n_free = 0  # counts tokens NaN in every head too (the floor's ranking drops them)
    for j in range(n):
        keep = (0 if exclude[k, j] else 1) if has_exclude else 1
        n_union += keep * member[j]
        n_free += keep * (1 - member[j])
        # 1 -> _IN_UNION, 0 -> _AVAILABLE, excluded -> _EXCLUDED (branch-free)
        member[j] = keep * (2 - member[j])
    if n_union > limit:  # keep the limit best of U_k (each has a finite score: a finite key)
        m = _rank_candidates(z, lse, rep, k, n, flags, _IN_UNION, keys, cand)
        v = _refine_threshold(keys[k], 0.0, cand, m, 0.0, float(limit), False, hist)
        return _emit(k, n, flags, keys, _NO_FLAG, _IN_UNION, v, limit, idx)
    if n_union < floor and n_free > 0:  # all of U_k and the best available up to floor
        m = _rank_candidates(z, lse, rep, k, n, flags, _AVAILABLE, keys, cand)
        kept = 0
        for t in range(m):  # a token NaN in every head (key -inf) is absent; here, not in
            # _rank_candidates: a test per token there measured 5-10% slower
            if keys[k, cand[t]] > -np.inf:
                cand[kept] = cand[t]
                kept += 1
            else:
                flags[k, cand[t]] = _EXCLUDED
        m = kept
        need = min(floor - n_union, m)
        if need > 0:
            v = _refine_threshold(keys[k], 0.0, cand, m, 0.0, float(need), False, hist)
            return _emit(k, n, flags, keys, _IN_UNION, _AVAILABLE, v, need, idx)
    return _emit(k, n, flags, keys, _IN_UNION, _NO_FLAG, 0.0, 0, idx)


@kernel(
    "void(float32[:, ::1], int64, uint8[:, ::1], float64, int64, int64, "
    "int32[:, ::1], int32[::1], float32[::1], float32[::1], float32[::1])",
    parallel=True,
    inf_safe=True,
)
def _tau_select(z, n, exclude, tau, cap, floor, idx, count, m_out, s_out, mass_out):
    Hq, H = z.shape[0], idx.shape[0]
    rep = Hq // H
    rows = max(Hq, H)
    # per-task scratch, allocated before the parallel loops
    cand = np.empty((rows, n), np.int32)
    hist = np.empty((rows, _NBINS), np.float64)
    ebuf = np.empty((rows, _EXP_CHUNK), np.float64)
    theta = np.empty(Hq, np.float32)  # S_h = {j : z[h, j] >= theta[h]}
    lse = np.empty(Hq, np.float64)
    keys = np.empty((H, n), np.float64)  # max_h log p_hj, filled for ranked candidates only
    flags = np.empty((H, n), np.uint8)  # _EXCLUDED, _IN_UNION or _AVAILABLE per token

    redo = np.zeros(Hq, np.bool_)
    for h in prange(Hq):
        ok, mx, s, th, ls = _head_threshold(z[h], n, tau, hist[h], cand[h], ebuf[h])
        redo[h] = not ok
        m_out[h], s_out[h], theta[h], lse[h] = mx, s, th, ls
    if redo.any():  # rare: rows holding +-inf, read again from a copy where they are NaN
        z = _nan_for_inf(z, n)
        for h in prange(Hq):
            if redo[h]:
                ok, mx, s, th, ls = _head_threshold(z[h], n, tau, hist[h], cand[h], ebuf[h])
                m_out[h], s_out[h], theta[h], lse[h] = mx, s, th, ls

    limit = max(cap, floor)  # a floor above the cap raises the cap
    for k in prange(H):
        cnt = _select_kv_head(z, n, exclude, theta, lse, k, limit, floor, flags, keys, cand[k],
                              hist[k], idx)
        count[k] = cnt
        idx[k, cnt:] = -1
        for r in range(rep):
            h = k * rep + r
            acc = 0.0
            for t in range(cnt):  # 0 where h's score is NaN
                acc += fast_exp64(np.float64(z[h, idx[k, t]]) - lse[h])
            mass_out[h] = acc


class Selection(NamedTuple):
    """Result of :func:`tau_select`.

    idx: (H, cap_alloc) int32 selected offloaded tokens of each kv head, ascending, -1 past
    count; count: (H,) int32; m: (Hq,) float32 max score; s: (Hq,) float32 sum of
    exp(z - m) over all n tokens; mass: (Hq,) float32 softmax mass of the selected tokens.
    Over finite scores only: a head without one has m = -inf, s = 0, mass = 0.
    """

    idx: np.ndarray
    count: np.ndarray
    m: np.ndarray
    s: np.ndarray
    mass: np.ndarray


def tau_select(z, exclude, tau, cap, floor=0, *, n=None, n_kv_heads=None, cap_alloc=None,
               out=None) -> Selection:
    """tau-cumulative selection of offloaded tokens, one union per kv head.

    Per query head h: p = softmax(z[h, :n]); S_h = {j : p_j >= theta_h}, theta_h the largest t
    with sum_{p_j >= t} p_j >= tau (ties at theta all in; tau = 1 takes every token). Per kv
    head k: U_k = union of S_h over its rep heads, minus exclude[k]. If |U_k| > cap the cap
    tokens of largest max_h p_hj are kept (ties: lower index); if |U_k| < floor, available
    tokens are added by descending max_h p_hj up to floor. A floor above cap raises the cap.

    Non-finite scores (NaN, +-inf) are absent: the selection is that of the same scores without
    them (a head's non-finite score of a token counts for nothing; a token without a finite
    score in any head of its group is never selected); a kv head without a finite score
    selects nothing. Any values, no crash or hang.

    z: (Hq, >= n) float32 scores; exclude: (H, >= n) bool/uint8, or None (then pass
    n_kv_heads); tau in (0, 1]; cap >= 1; floor >= 0; cap_alloc: columns of idx (default
    max(cap, floor)); out: a previous Selection to reuse its buffers. O(n) per head (histogram
    passes, no full sort).
    """
    _check("z", z, (None, None), (np.dtype(np.float32),))
    Hq = z.shape[0]
    n = z.shape[1] if n is None else int(n)
    if not 0 <= n <= z.shape[1]:
        raise ValueError(f"Invalid n: {n} (z holds {z.shape[1]} tokens)")
    if exclude is None:
        if n_kv_heads is None:
            raise ValueError("tau_select needs exclude or n_kv_heads")
        H = int(n_kv_heads)
        exclude = np.zeros((H, 0), np.uint8)
    else:
        _check("exclude", exclude, (None, None), (np.dtype(np.bool_), np.dtype(np.uint8)))
        H = exclude.shape[0]
        if exclude.shape[1] < n:
            raise ValueError(f"Invalid shape of exclude: expected (H, >= {n}), got {exclude.shape}")
        exclude = np.ascontiguousarray(exclude).view(np.uint8)
    if H < 1 or Hq % H:
        raise ValueError(f"Invalid shape of z: {Hq} query heads is not a multiple of H = {H}")
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"Invalid tau: {tau} (expected 0 < tau <= 1)")
    if int(cap) < 1 or int(floor) < 0:
        raise ValueError(f"Invalid cap/floor: cap={cap} (>= 1), floor={floor} (>= 0)")
    cap, floor = int(cap), int(floor)
    need = max(cap, floor)
    if out is None:
        cap_alloc = need if cap_alloc is None else int(cap_alloc)
        out = Selection(np.empty((H, cap_alloc), np.int32), np.empty(H, np.int32),
                        *(np.empty(Hq, np.float32) for _ in range(3)))
    if out.idx.ndim != 2 or out.idx.shape[1] < need:
        raise ValueError(f"Invalid shape of idx: expected (H, >= {need}), got {out.idx.shape}")
    _check_out("idx", out.idx, (H, None), np.int32)
    _check_out("count", out.count, (H,), np.int32)
    for name in ("m", "s", "mass"):
        _check_out(name, getattr(out, name), (Hq,), np.float32)
    if n == 0:  # nothing live: empty selection, softmax statistics of an empty set
        out.idx[:] = -1
        out.count[:] = 0
        out.m[:], out.s[:], out.mass[:] = -np.inf, 0.0, 0.0
        return out
    _tau_select(np.ascontiguousarray(z), n, exclude, float(tau), cap, floor, *out)
    return out


# ---- (c) gather + partial attention from the paged host store ------------------------------
@kernel(inline=True)
def _log2_exact(x):
    """log2(x) for a power of two x >= 1, else -1."""
    if x < 1 or (x & (x - 1)) != 0:
        return -1
    s = 0
    while (1 << s) < x:
        s += 1
    return s


@kernel(inf_safe=True, inline=True)
def _row_location(page_ids, page_size, ppb, shifts, H, k, j):
    """(block, row) of token j of kv head k: the row's index within its block, counted in
    rows of one head (block shape (ppb, H, page_size, dim)). shifts: (log2 page_size,
    log2 ppb) from _log2_exact, or a -1 for sizes that are not powers of two. A 64-bit
    division costs tens of cycles, most of a gathered row's arithmetic; shifts do not."""
    if shifts[0] >= 0 and shifts[1] >= 0:
        lp = j >> shifts[0]
        phys = page_ids[lp]
        blk = phys >> shifts[1]
    else:
        lp = j // page_size
        phys = page_ids[lp]
        blk = phys // ppb
    return blk, ((phys - blk * ppb) * H + k) * page_size + (j - lp * page_size)


@kernel(inf_safe=True, inline=True)
def _locate_rows(page_ids, page_size, ppb, shifts, H, k, idx, cnt, blk, row):
    """blk[t], row[t] = _row_location of token idx[k, t], t < cnt: computed once per token for
    the key and the value pass and their prefetches."""
    for t in range(cnt):
        blk[t], row[t] = _row_location(page_ids, page_size, ppb, shifts, H, k, idx[k, t])


@kernel(inf_safe=True, inline=True)
def _load_row(addrs, scale_addrs, code, dim, blk, row, f16, out):
    """Decode row ``row`` of block ``blk`` (see _row_location) into out (dim,) float32.

    Inlined with a literal code, so only one decode loop remains and it vectorizes (a runtime
    code measured 2x slower per row). No bounds checks here (they cost 25% per row): the
    caller checks tokens and page ids once (_check_pages)."""
    if code == 0:
        p16 = address_as_pointer(addrs[blk] + 2 * row * dim, np.uint16)
        for e in range(dim):
            out[e] = f16[p16[e]]
    elif code == _FLOAT16_NATIVE:
        p16 = address_as_pointer(addrs[blk] + 2 * row * dim, np.uint16)
        for e in range(dim):
            out[e] = half_bits_as_float32(p16[e])
    elif code == 1:
        p32 = address_as_pointer(addrs[blk] + 4 * row * dim, np.float32)
        for e in range(dim):
            out[e] = p32[e]
    else:
        p8 = address_as_pointer(addrs[blk] + row * dim, np.int8)
        scale = address_as_pointer(scale_addrs[blk] + 4 * row, np.float32)[0]
        for e in range(dim):
            out[e] = np.float32(p8[e]) * scale


# Rows ahead of the one being decoded whose cache lines are requested early: a selected row is
# a scattered 256-byte read, so a serial loop waits a full memory latency per row otherwise.
PREFETCH_ROWS = 8


@kernel(inf_safe=True, inline=True)
def _prefetch_row(addrs, code, dim, blk, row):
    """Request the cache lines of row ``row`` of block ``blk`` (no load, no fault)."""
    width = 4 if code == 1 else (1 if code == 2 else 2)
    start = addrs[blk] + width * row * dim
    for off in range(0, width * dim, 64):
        prefetch_address(start + off)


@kernel("void(int64[::1], int64[::1], int64, int64, int32[:, ::1], uint8[:, :, ::1])",
        inf_safe=True)
def _copy_rows(addrs, page_ids, page_size, ppb, tokens, out):
    """out[h, i] = the stored bytes of token tokens[h, i]'s row of kv head h (zeros for a
    negative token). The caller checks tokens and page ids (as _check_pages does)."""
    H = tokens.shape[0]
    width = out.shape[2]
    shifts = (_log2_exact(page_size), _log2_exact(ppb))
    for h in range(H):
        for i in range(tokens.shape[1]):
            j = tokens[h, i]
            if j < 0:
                for e in range(width):
                    out[h, i, e] = 0
                continue
            blk, row = _row_location(page_ids, page_size, ppb, shifts, H, h, j)
            src = address_as_pointer(addrs[blk] + width * row, np.uint8)
            for e in range(width):
                out[h, i, e] = src[e]


def copy_rows(addrs, page_ids, page_size, pages_per_block, tokens, row_bytes):
    """(H, m, row_bytes) uint8: the stored rows of tokens (H, m) int32 (-1: zeros), each kv
    head h from its own rows; view the result as the storage dtype. Raises IndexError for a
    token past the pages or a page outside the blocks."""
    tokens = np.ascontiguousarray(tokens, np.int32)
    page_ids = np.asarray(page_ids, np.int64)
    addrs = np.asarray(addrs, np.int64)
    valid = np.ascontiguousarray(tokens[tokens >= 0].reshape(1, -1))
    _check_pages(valid, np.array([valid.shape[1]], np.int32), 0, 1,
                 page_ids.shape[0] * int(page_size), page_ids, int(pages_per_block), len(addrs))
    out = np.empty(tokens.shape + (int(row_bytes),), np.uint8)
    _copy_rows(addrs, page_ids, int(page_size), int(pages_per_block), tokens, out)
    return out


@kernel("void(int32[:, ::1], int32[::1], int32[:, ::1], int64, boolean, int32[:, ::1], "
        "uint8[::1], int32[:, ::1], int32[:, ::1], int32[::1])")
def _spill_changes(idx, count, res_tok, n, shift, spill_tok, mark, slots, toks, n_changes):
    H, C = spill_tok.shape
    for h in range(H):
        # mark: 1 resident, 2 wanted, 3 wanted and already held; 0 elsewhere (reset below).
        for r in range(res_tok.shape[1]):
            j = res_tok[h, r]
            if 0 <= j < n:
                mark[j] = 1
        wanted = 0
        for pass_ in range(2 if shift else 1):  # the selection first, then its successors
            for t in range(count[h]):
                j = idx[h, t] + pass_
                if wanted < C and 0 <= j < n and mark[j] == 0:
                    mark[j] = 2
                    wanted += 1
        free = 0  # slots [0, free) of toks[h] list the slots to fill, in order
        for s in range(C):
            j = spill_tok[h, s]
            if 0 <= j < n and mark[j] == 2:
                mark[j] = 3
            else:
                slots[h, free] = s
                free += 1
        used = 0
        for pass_ in range(2 if shift else 1):
            for t in range(count[h]):
                j = idx[h, t] + pass_
                if 0 <= j < n and mark[j] == 2:
                    mark[j] = 3
                    s = slots[h, used]
                    toks[h, used] = j
                    spill_tok[h, s] = j
                    used += 1
        m = used
        for f in range(used, free):  # freed slots nothing moved into: emptied
            s = slots[h, f]
            if spill_tok[h, s] != -1:
                slots[h, m] = s
                toks[h, m] = -1
                spill_tok[h, s] = -1
                m += 1
        n_changes[h] = m
        for r in range(res_tok.shape[1]):
            j = res_tok[h, r]
            if 0 <= j < n:
                mark[j] = 0
        for pass_ in range(2 if shift else 1):
            for t in range(count[h]):
                j = idx[h, t] + pass_
                if 0 <= j < n:
                    mark[j] = 0


def spill_changes(idx, count, res_tok, n, spill_tok, *, shift=True):
    """Bring an accelerator-side buffer of offloaded tokens up to date with a selection.

    The buffer holds, per kv head, the tokens ``spill_tok`` (H, C) int32 (-1: empty slot). The
    wanted set of head h is its selection ``idx[h, :count[h]]`` and, with ``shift``, each selected
    token's successor (a head that copies moves one token forward per generated token), minus
    the tokens of ``res_tok`` (H, R) (already resident) and anything outside [0, n); at most C,
    the selection first. Held tokens keep their slots, new ones take freed slots, unwanted
    ones are emptied. Updates ``spill_tok`` in place and returns ``(slots, toks)`` (H, M) int32:
    the changed slots and their new tokens (-1: emptied), padded with slot C (a slot past the
    buffer) and token -1."""
    _check("idx", idx, (None, None), (np.dtype(np.int32),))
    H = idx.shape[0]
    _check("count", count, (H,), (np.dtype(np.int32),))
    _check("res_tok", res_tok, (H, None), (np.dtype(np.int32),))
    _check_out("spill_tok", spill_tok, (H, None), np.int32)
    if count.min(initial=0) < 0 or count.max(initial=0) > idx.shape[1]:
        raise ValueError(f"Invalid count: {count} (idx has {idx.shape[1]} columns)")
    C = spill_tok.shape[1]
    mark = np.zeros(n + 1, np.uint8)  # the kernel's per-token scratch (left zeroed)
    slots = np.empty((H, C), np.int32)
    toks = np.empty((H, C), np.int32)
    n_changes = np.zeros(H, np.int32)
    _spill_changes(np.ascontiguousarray(idx), np.ascontiguousarray(count),
                   np.ascontiguousarray(res_tok), int(n), bool(shift), spill_tok, mark, slots,
                   toks, n_changes)
    M = int(n_changes.max(initial=0))
    cols = np.arange(M)[None, :] < n_changes[:, None]
    return (np.where(cols, slots[:, :M], C).astype(np.int32),
            np.where(cols, toks[:, :M], -1).astype(np.int32))


@kernel(inf_safe=True)
def _check_pages(idx, count, kv_start, kv_stop, n_tokens, page_ids, ppb, n_blocks):
    """Raise IndexError unless every selected token is one of n_tokens and every page id lies
    in the n_blocks allocated blocks: the kernels below read raw addresses unchecked."""
    for lp in range(page_ids.shape[0]):
        if page_ids[lp] < 0 or page_ids[lp] // ppb >= n_blocks:
            raise IndexError("page id outside the allocated blocks")
    for k in range(kv_start, kv_stop):
        lo = 0
        hi = 0
        for t in range(count[k]):
            lo = min(lo, idx[k, t])
            hi = max(hi, idx[k, t])
        if lo < 0 or hi >= n_tokens:
            raise IndexError("selected token outside the pages (or scores) of the sequence")


@kernel(inf_safe=True, inline=True)
def _exact_logits(q, k, cnt, rep, addrs, scale_addrs, code, d, blk, rows, f16, row, w):
    """w[r, t] = q[k*rep + r] . key of the t-th selected token of kv head k (at blk[t],
    rows[t]: _locate_rows); each key row is decoded once."""
    for t in range(cnt):
        if t + PREFETCH_ROWS < cnt:
            _prefetch_row(addrs, code, d, blk[t + PREFETCH_ROWS], rows[t + PREFETCH_ROWS])
        _load_row(addrs, scale_addrs, code, d, blk[t], rows[t], f16, row)
        for r in range(rep):
            acc = np.float32(0.0)
            for e in range(d):
                acc += q[k * rep + r, e] * row[e]
            w[r, t] = acc


@kernel(inf_safe=True, inline=True)
def _weighted_values(cnt, rep, addrs, scale_addrs, code, dv, blk, rows, f16, row, w, acc,
                     dropped):
    """acc[r*dv:(r+1)*dv] = sum_t w[r, t] * value of the t-th selected token (at blk[t],
    rows[t]); each value row is decoded once. acc is a flat local buffer: accumulating into the
    2-D output measured 1.5x slower. dropped: some head dropped a token (weight 0), see below."""
    acc[: rep * dv] = 0.0
    for t in range(cnt):
        if t + PREFETCH_ROWS < cnt:
            _prefetch_row(addrs, code, dv, blk[t + PREFETCH_ROWS], rows[t + PREFETCH_ROWS])
        _load_row(addrs, scale_addrs, code, dv, blk[t], rows[t], f16, row)
        for r in range(rep):
            p = w[r, t]
            for e in range(dv):
                acc[r * dv + e] += p * row[e]
    if dropped:
        _without_dropped(cnt, rep, addrs, scale_addrs, code, dv, blk, rows, f16, row, w, acc)


@kernel(inf_safe=True, inline=True)
def _without_dropped(cnt, rep, addrs, scale_addrs, code, dv, blk, rows, f16, row, w, acc):
    """Redo the sum of each head that came out not finite and that drops a token another head
    keeps (weight 0 here, positive there): that token's value row (NaN or Inf) was read for
    every head, and 0 times NaN is NaN. Rare: only behind a non-finite logit."""
    for r in range(rep):
        finite = True
        for e in range(dv):
            finite = finite and abs(acc[r * dv + e]) < _INF32
        drops = False
        for t in range(cnt):
            drops = drops or w[r, t] == 0.0
        if finite or not drops:
            continue
        acc[r * dv:(r + 1) * dv] = 0.0
        for t in range(cnt):
            p = w[r, t]
            if p != 0.0:
                _load_row(addrs, scale_addrs, code, dv, blk[t], rows[t], f16, row)
                for e in range(dv):
                    acc[r * dv + e] += p * row[e]


@kernel(inf_safe=True, inline=True)
def _weighted_only(w, blk, rows, rep, cnt):
    """Move the tokens t < cnt with a nonzero weight w[r, t] in some head to the front of w,
    blk and rows, in order; returns their count."""
    kept = 0
    for t in range(cnt):
        live = False
        for r in range(rep):
            live = live or w[r, t] != 0.0
        if live:
            blk[kept] = blk[t]
            rows[kept] = rows[t]
            for r in range(rep):
                w[r, kept] = w[r, t]
            kept += 1
    return kept


@kernel(
    "void(float32[:, ::1], float32[:, :], int32[:, ::1], int32[::1], int64, int64[::1], int64, "
    "int64, int64[::1], int64[::1], int64, int64, int64[::1], int64[::1], int64, int64, "
    "boolean, boolean, float32[::1], int64, int64, float32[:, ::1], float32[::1])",
    inf_safe=True,
)
def _gather_partial(q, z, idx, count, rep, page_ids, page_size, ppb, val_addrs,
                    val_scale_addrs, val_code, dv, key_addrs, key_scale_addrs, key_code, d,
                    rescore_exact, z_by_slot, f16, kv_start, kv_stop, o_out, lse_out):
    n_tokens = page_ids.shape[0] * page_size
    if not rescore_exact and not z_by_slot:
        n_tokens = min(n_tokens, z.shape[1])
    n_blocks = val_addrs.shape[0]
    if rescore_exact:
        n_blocks = min(n_blocks, key_addrs.shape[0])
    _check_pages(idx, count, kv_start, kv_stop, n_tokens, page_ids, ppb, n_blocks)
    cmax = 0
    for k in range(kv_start, kv_stop):
        cmax = max(cmax, count[k])
    w = np.empty((rep, cmax), np.float32)
    row = np.empty(max(d, dv), np.float32)
    acc = np.empty(rep * dv, np.float32)
    blk = np.empty(cmax, np.int64)
    rows = np.empty(cmax, np.int64)
    H = idx.shape[0]
    shifts = (_log2_exact(page_size), _log2_exact(ppb))
    for k in range(kv_start, kv_stop):
        cnt = count[k]
        h0 = k * rep
        _locate_rows(page_ids, page_size, ppb, shifts, H, k, idx, cnt, blk, rows)
        # Pass 1: logits of the rep heads. Literal dtype codes: see _load_row.
        if not rescore_exact and z_by_slot:
            for t in range(cnt):
                for r in range(rep):
                    w[r, t] = z[h0 + r, t]
        elif not rescore_exact:
            for t in range(cnt):
                for r in range(rep):
                    w[r, t] = z[h0 + r, idx[k, t]]
        elif NATIVE_HALF and key_code == _FLOAT16_NATIVE:
            _exact_logits(q, k, cnt, rep, key_addrs, key_scale_addrs, _FLOAT16_NATIVE, d, blk,
                          rows, f16, row, w)
        elif key_code == 0:
            _exact_logits(q, k, cnt, rep, key_addrs, key_scale_addrs, 0, d, blk, rows, f16,
                          row, w)
        elif key_code == 1:
            _exact_logits(q, k, cnt, rep, key_addrs, key_scale_addrs, 1, d, blk, rows, f16,
                          row, w)
        else:
            _exact_logits(q, k, cnt, rep, key_addrs, key_scale_addrs, 2, d, blk, rows, f16,
                          row, w)
        # Softmax weights in place, in loops of their own so max and exp vectorize. A token
        # whose logit is not finite (a NaN or Inf in its key row or score) is dropped: counted
        # in the max loop, so that the exp loop stays as it was unless a head has one (a test
        # per logit there measured 45% slower per layer with exact rescoring).
        dropped = 0
        for r in range(rep):
            mx = -_INF32
            bad = 0
            for t in range(cnt):
                v = w[r, t]
                mx = max(mx, v)  # skips NaN (see _row_max)
                bad += 0 if abs(v) < _INF32 else 1
            if bad > 0:  # rare: the max of the finite logits only
                mx = -_INF32
                for t in range(cnt):
                    v = w[r, t]
                    mx = max(mx, v if v < _INF32 else -_INF32)
            total = 0.0
            if mx > -_INF32 and bad == 0:
                for t in range(cnt):
                    p = fast_exp(w[r, t] - mx)
                    w[r, t] = p
                    total += p
            elif mx > -_INF32:  # weight 0 for the non-finite logits
                for t in range(cnt):
                    v = w[r, t]
                    p = fast_exp(v - mx) if abs(v) < _INF32 else np.float32(0.0)
                    w[r, t] = p
                    total += p
            dropped += bad
            if total > 0.0:
                lse_out[h0 + r] = mx + math.log(total)
                inv = np.float32(1.0 / total)
                for t in range(cnt):
                    w[r, t] *= inv
            else:  # nothing selected (or no finite logit): o = 0, lse = -inf
                lse_out[h0 + r] = -np.inf
                dropped += cnt
                for t in range(cnt):
                    w[r, t] = 0.0
        # A token dropped by every head is not read (0 times a NaN in its value row would be
        # NaN): the tokens weighted in some head move to the front. A weight-0 test in pass 2
        # instead measured 15% slower. (A token dropped by some heads only: _without_dropped.)
        if dropped > 0:
            cnt = _weighted_only(w, blk, rows, rep, cnt)
        # Pass 2: each value row is decoded once and accumulated into all rep heads.
        if NATIVE_HALF and val_code == _FLOAT16_NATIVE:
            _weighted_values(cnt, rep, val_addrs, val_scale_addrs, _FLOAT16_NATIVE, dv,
                             blk, rows, f16, row, w, acc, dropped > 0)
        elif val_code == 0:
            _weighted_values(cnt, rep, val_addrs, val_scale_addrs, 0, dv, blk, rows, f16,
                             row, w, acc, dropped > 0)
        elif val_code == 1:
            _weighted_values(cnt, rep, val_addrs, val_scale_addrs, 1, dv, blk, rows, f16,
                             row, w, acc, dropped > 0)
        else:
            _weighted_values(cnt, rep, val_addrs, val_scale_addrs, 2, dv, blk, rows, f16,
                             row, w, acc, dropped > 0)
        for r in range(rep):
            for e in range(dv):
                o_out[h0 + r, e] = acc[r * dv + e]


_EMPTY_ADDRS = np.zeros(0, np.int64)
_NO_QUERIES = np.zeros((0, 0), np.float32)


def gather_partial(q, z, idx, count, rep, page_ids, page_size, pages_per_block, val_addrs,
                   val_scale_addrs, val_dtype_code, dv, key_addrs, key_scale_addrs,
                   key_dtype_code, d, rescore_exact, o_out, lse_out, *, kv_heads=None,
                   native_half=NATIVE_HALF, z_by_slot=False):
    """Softmax-weighted sum of the selected host values, per query head (serial, nogil).

    For query head qh (kv head k = qh // rep) over tokens j in idx[k, :count[k]]: logits
    w_j = z[qh, j], or q[qh] . key_j read from the host keys when rescore_exact; writes
    o_out[qh] = sum_j softmax(w)_j v_j and lse_out[qh] = logsumexp_j w_j (0 and -inf for an
    empty selection). A token whose w_j is not finite (a NaN or Inf in its key row or score,
    a NaN query) is dropped from qh's partial: the partial of the others, whose value rows
    alone reach o_out[qh] (a NaN in a kept token's value row makes it NaN). Blocks are reached
    by address: block p // pages_per_block of val_addrs (fp16/fp32/int8 per DTYPE_CODES; int8
    scales at val_scale_addrs), page slot p % pages_per_block, shape (pages_per_block, H,
    page_size, dim).

    q: (Hq, d) float32 scaled queries (read only when rescore_exact); z: (Hq, >= n) float32
    scores (may be None when rescore_exact);
    idx: (H, cap_alloc) int32; count: (H,) int32; page_ids: (n_pages,) int64 physical page of
    each logical page; *_addrs: int64 block addresses (key_* unused unless rescore_exact);
    o_out: (Hq, dv) float32; lse_out: (Hq,) float32. kv_heads: (start, stop) to compute only
    those kv heads (split one step across workers); other rows are left untouched.
    native_half: decode float16 in hardware (default where available) instead of F16_TO_F32.
    z_by_slot: z is (Hq, >= cap) indexed by selection slot (z[qh, t] weighs idx[k, t]) rather
    than by token id: an accelerator hands over only the scores of the selected tokens.
    """
    _check("idx", idx, (None, None), (np.dtype(np.int32),))
    H = idx.shape[0]
    Hq = H * int(rep)
    _check("count", count, (H,), (np.dtype(np.int32),))
    if z is None and rescore_exact:
        z = np.zeros((Hq, 0), np.float32)
    _check("z", z, (Hq, None), (np.dtype(np.float32),))
    _check_out("o_out", o_out, (Hq, int(dv)), np.float32)
    _check_out("lse_out", lse_out, (Hq,), np.float32)
    start, stop = (0, H) if kv_heads is None else (int(kv_heads[0]), int(kv_heads[1]))
    if not 0 <= start <= stop <= H:
        raise ValueError(f"Invalid kv_heads: {kv_heads} (H = {H})")
    if count.min(initial=0) < 0 or count.max(initial=0) > idx.shape[1]:
        raise ValueError(f"Invalid count: {count} (idx has {idx.shape[1]} columns)")
    val_addrs = np.asarray(val_addrs, np.int64)
    val_scale_addrs = _EMPTY_ADDRS if val_scale_addrs is None else np.asarray(val_scale_addrs,
                                                                               np.int64)
    if val_dtype_code not in (0, 1, 2) or (val_dtype_code == 2
                                           and val_scale_addrs.size < val_addrs.size):
        raise ValueError(f"Invalid val_dtype_code {val_dtype_code} (or int8 without scales)")
    if rescore_exact:
        _check("q", q, (Hq, int(d)), (np.dtype(np.float32),))
        key_addrs = np.asarray(key_addrs, np.int64)
        key_scale_addrs = _EMPTY_ADDRS if key_scale_addrs is None else np.asarray(
            key_scale_addrs, np.int64)
        if key_dtype_code not in (0, 1, 2) or key_addrs.size == 0 or (
                key_dtype_code == 2 and key_scale_addrs.size < key_addrs.size):
            raise ValueError("rescore_exact needs host keys (key_addrs, and scales for int8)")
    else:
        q = _NO_QUERIES  # not read without rescoring
        key_addrs = key_scale_addrs = _EMPTY_ADDRS
        key_dtype_code = 1
    half = _FLOAT16_NATIVE if native_half and NATIVE_HALF else 0
    val_dtype_code = half if val_dtype_code == 0 else val_dtype_code
    key_dtype_code = half if key_dtype_code == 0 else key_dtype_code
    _gather_partial(_c32(q), z, idx, count, int(rep), np.asarray(page_ids, np.int64),
                    int(page_size), int(pages_per_block), val_addrs, val_scale_addrs,
                    int(val_dtype_code), int(dv), key_addrs, key_scale_addrs, int(key_dtype_code),
                    int(d), bool(rescore_exact), bool(z_by_slot), F16_TO_F32, start, stop, o_out,
                    lse_out)
    return o_out, lse_out


def host_store_args(store, b=0):
    """The paging arguments of :func:`gather_partial` for sequence b of a ``HostStore``:
    (page_ids, page_size, pages_per_block, val_addrs, val_scale_addrs, val_dtype_code, dv,
    key_addrs, key_scale_addrs, key_dtype_code, d). Read them again after the store grows."""
    v, k = store.values, store.keys
    return (store.logical_pages(b), store.page_size, v.pages_per_block, v.addrs, v.scale_addrs,
            DTYPE_CODES[v.dtype], store.value_dim,
            _EMPTY_ADDRS if k is None else k.addrs, _EMPTY_ADDRS if k is None else k.scale_addrs,
            1 if k is None else DTYPE_CODES[k.dtype], store.head_dim)


def merge_partials(o1, lse1, o2, lse2):
    """Exact merge of two softmax partials over disjoint token sets (flash-decoding).

    o*: (..., dv) normalized partial outputs; lse*: (...) their log-sum-exp (-inf for an empty
    set). Returns (o, lse) of the union; o = 0 and lse = -inf when both are empty. A NaN in
    either partial (a NaN query gives a NaN resident partial) comes out as NaN, without a
    warning: numpy's floating-point warnings are off here.
    """
    lse1, lse2 = np.asarray(lse1), np.asarray(lse2)
    with np.errstate(all="ignore"):
        m = np.maximum(lse1, lse2)
        m = np.where(np.isfinite(m), m, 0.0)  # both -inf: weights exp(-inf) = 0, no NaN
        w1, w2 = np.exp(lse1 - m), np.exp(lse2 - m)
        total = w1 + w2
        lse = (m + np.log(total)).astype(np.result_type(lse1, lse2))
        o = (w1[..., None] * o1 + w2[..., None] * o2) / total[..., None]
    # Both empty: 0. A NaN total (a NaN lse) keeps its NaN output rather than reading as empty.
    o = np.where(total[..., None] == 0, 0.0, o).astype(np.result_type(o1, o2))
    return o, lse


# ---- (d) causal softmax for the CPU prefill -------------------------------------------------
@kernel("void(float32[:, ::1], int64, int64, float32[::1])", parallel=True)
def _causal_softmax_rows(S, block_rows, first_visible, inv_sum):
    """In place: row r sees columns [0, first_visible + r % block_rows] (inclusive); there
    S <- exp(S - max), beyond it 0. inv_sum[r] = 1 / sum of the row (normalize after P @ V)."""
    ncols = S.shape[1]
    for r in prange(S.shape[0]):
        vis = min(ncols, first_visible + r % block_rows + 1)
        mx = _row_max(S[r], vis)
        acc = np.float32(0.0)
        for j in range(vis):
            e = fast_exp(S[r, j] - mx)
            S[r, j] = e
            acc += e
        for j in range(vis, ncols):
            S[r, j] = 0.0
        inv_sum[r] = np.float32(1.0) / acc
