"""The tau-cumulative selection on the CPU (Numba): per kv head, the union over its query
heads of the smallest token sets holding tau of the softmax mass, within cap and floor;
non-finite scores count for nothing (see :mod:`tiered.cpu.kernels` for the notation)."""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from tiered.runtime.primitives import Selection, check_select_args

from ._numba import kernel
from .kernel_base import (AVAILABLE, EXCLUDED, EXP_CHUNK, IN_UNION, MASS_SPAN, NBINS,
                          NO_FLAG, SMALL, check_array, check_out, nan_for_inf, row_max, row_min,
                          fast_exp64)


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
        lo_bin = max(lo, hi - MASS_SPAN) if weighted else lo
        scale = nbins / (hi - lo_bin)
        if nc <= SMALL or not scale < 1e300:
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
    lo_bin = max(lo, mx - MASS_SPAN)  # the tail below holds < n e^-100 of the mass
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
    mx = np.float64(row_max(row, n))
    lo = np.float64(row_min(row, n))
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
        # 1 -> IN_UNION, 0 -> AVAILABLE, excluded -> EXCLUDED (branch-free)
        member[j] = keep * (2 - member[j])
    if n_union > limit:  # keep the limit best of U_k (each has a finite score: a finite key)
        m = _rank_candidates(z, lse, rep, k, n, flags, IN_UNION, keys, cand)
        v = _refine_threshold(keys[k], 0.0, cand, m, 0.0, float(limit), False, hist)
        return _emit(k, n, flags, keys, NO_FLAG, IN_UNION, v, limit, idx)
    if n_union < floor and n_free > 0:  # all of U_k and the best available up to floor
        m = _rank_candidates(z, lse, rep, k, n, flags, AVAILABLE, keys, cand)
        kept = 0
        for t in range(m):  # a token NaN in every head (key -inf) is absent; here, not in
            # _rank_candidates: a test per token there measured 5-10% slower
            if keys[k, cand[t]] > -np.inf:
                cand[kept] = cand[t]
                kept += 1
            else:
                flags[k, cand[t]] = EXCLUDED
        m = kept
        need = min(floor - n_union, m)
        if need > 0:
            v = _refine_threshold(keys[k], 0.0, cand, m, 0.0, float(need), False, hist)
            return _emit(k, n, flags, keys, IN_UNION, AVAILABLE, v, need, idx)
    return _emit(k, n, flags, keys, IN_UNION, NO_FLAG, 0.0, 0, idx)


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
    hist = np.empty((rows, NBINS), np.float64)
    ebuf = np.empty((rows, EXP_CHUNK), np.float64)
    theta = np.empty(Hq, np.float32)  # S_h = {j : z[h, j] >= theta[h]}
    lse = np.empty(Hq, np.float64)
    keys = np.empty((H, n), np.float64)  # max_h log p_hj, filled for ranked candidates only
    flags = np.empty((H, n), np.uint8)  # EXCLUDED, IN_UNION or AVAILABLE per token

    redo = np.zeros(Hq, np.bool_)
    for h in prange(Hq):
        ok, mx, s, th, ls = _head_threshold(z[h], n, tau, hist[h], cand[h], ebuf[h])
        redo[h] = not ok
        m_out[h], s_out[h], theta[h], lse[h] = mx, s, th, ls
    if redo.any():  # rare: rows holding +-inf, read again from a copy where they are NaN
        z = nan_for_inf(z, n)
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


def tau_select(z, n, exclude, tau, cap, floor=0, *, cap_alloc=None, with_stats=False,
               out=None):
    """tau-cumulative selection of offloaded tokens, one union per kv head: the arguments and
    result of :func:`tiered.metal.tau_select` (:mod:`tiered.runtime.primitives`), on numpy arrays.

    z (Hq, >= n) float32 scores, columns >= n never read; n live tokens; exclude (H, >= n)
    bool/uint8, nonzero: never select (names H); tau in (0, 1]; cap >= 1; floor >= 0;
    cap_alloc: columns of idx (default max(cap, floor)); out: a previous Selection to reuse its
    buffers. Returns (idx, count), or with_stats=True the :class:`Selection` (theta None).

    Per query head h: p = softmax(z[h, :n]); S_h = {j : p_j >= theta_h}, theta_h the largest t
    with sum_{p_j >= t} p_j >= tau (ties at theta all in; tau = 1 takes every token). Per kv
    head k: U_k = union of S_h over its rep heads, minus exclude[k]. If |U_k| > cap the cap
    tokens of largest max_h p_hj are kept (ties: lower index); if |U_k| < floor, available
    tokens are added by descending max_h p_hj up to floor. A floor above cap raises the cap.

    Non-finite scores (NaN, +-inf) are absent: the selection is that of the same scores without
    them (a head's non-finite score of a token counts for nothing; a token without a finite
    score in any head of its group is never selected); a kv head without a finite score
    selects nothing. Any values, no crash or hang. O(n) per head (histogram passes, no full
    sort).
    """
    cap, cap_alloc = check_select_args(z.shape, int(n), exclude, tau, cap, floor, cap_alloc)
    check_array("z", z, (None, None), (np.dtype(np.float32),))
    check_array("exclude", exclude, (None, None), (np.dtype(np.bool_), np.dtype(np.uint8)))
    n, floor = int(n), int(floor)
    H, Hq = exclude.shape[0], z.shape[0]
    exclude = np.ascontiguousarray(exclude).view(np.uint8)
    if out is None:
        out = Selection(np.empty((H, cap_alloc), np.int32), np.empty(H, np.int32),
                        *(np.empty(Hq, np.float32) for _ in range(3)))
    if out.idx.ndim != 2 or out.idx.shape[1] < cap:
        raise ValueError(f"Invalid shape of idx: expected (H, >= {cap}), got {out.idx.shape}")
    check_out("idx", out.idx, (H, None), np.int32)
    check_out("count", out.count, (H,), np.int32)
    for name in ("m", "s", "mass"):
        check_out(name, getattr(out, name), (Hq,), np.float32)
    if n == 0:  # nothing live: empty selection, softmax statistics of an empty set
        out.idx[:] = -1
        out.count[:] = 0
        out.m[:], out.s[:], out.mass[:] = -np.inf, 0.0, 0.0
    else:
        _tau_select(np.ascontiguousarray(z), n, exclude, float(tau), cap, floor, out.idx,
                    out.count, out.m, out.s, out.mass)
    return out if with_stats else (out.idx, out.count)
