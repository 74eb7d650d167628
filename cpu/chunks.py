"""Chunk logits and chunk expansion on the CPU (Numba): the tau rule over chunks of ``C``
tokens that every decode path uses (:mod:`tiered.step.chunk_select`), here for numpy arrays.

A chunk's logit is the log-sum-exp of its live tokens (on the host pages, not resident); a
chunk without a live token keeps the log-sum-exp of all its host tokens and is excluded, as in
the device kernel (:mod:`tiered.step.device_chunks`). Non-finite scores count for nothing.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from ._numba import kernel


@kernel(parallel=True, inf_safe=True)
def _chunk_logits(z, n, n_host, flags, C, zc, excl, m_out, s_out):
    # One exp per token, in float32: each chunk's terms are taken against its own maximum (so
    # none exceeds 1 and a chunk's 8 terms sum without loss), its live tokens' sum is a part of
    # them, and the head's softmax total over the n tokens is folded in float64 from the
    # chunks' (one exp per chunk) and the tokens past n_host. 65,536 tokens, 9 query heads,
    # 2 cores: three float64 exps per token 10 ms a layer, one 3.1 ms, one in float32 1.85.
    Hq, nc = zc.shape
    rep = Hq // flags.shape[0]
    NEG, POS = np.float32(-np.inf), np.float32(np.inf)
    for h in prange(Hq):
        k = h // rep
        M, S = -np.inf, 0.0  # the softmax statistics of the n tokens (the H2O update's)
        for c in range(nc):
            lo, hi = c * C, min(c * C + C, n_host)
            m_live, m_all = NEG, NEG
            for t in range(lo, hi):
                x = z[h, t]
                if x > NEG and x < POS:
                    if x > m_all:
                        m_all = x
                    if flags[k, t] == 0 and x > m_live:
                        m_live = x
            s_live, s_all = np.float32(0.0), np.float32(0.0)
            if m_all > NEG:
                for t in range(lo, hi):
                    x = z[h, t]
                    if x > NEG and x < POS:
                        e = np.float32(math.exp(x - m_all))
                        s_all += e
                        if flags[k, t] == 0:
                            s_live += e
            if m_live > NEG and s_live == 0.0:  # live terms below the chunk's range
                for t in range(lo, hi):
                    x = z[h, t]
                    if x > NEG and x < POS and flags[k, t] == 0:
                        s_live += np.float32(math.exp(x - m_live))
                zc[h, c] = m_live + math.log(s_live)
            elif m_live > NEG:
                zc[h, c] = m_all + math.log(s_live)
            elif m_all > NEG:
                zc[h, c] = m_all + math.log(s_all)
            else:
                zc[h, c] = NEG
            if h % rep == 0:
                excl[k, c] = 1 if m_live == NEG else 0
            ma = np.float64(m_all)
            if ma > M:
                S = S * math.exp(M - ma) + s_all if M > -np.inf else np.float64(s_all)
                M = ma
            elif ma > -np.inf:
                S += s_all * math.exp(ma - M)
        for t in range(n_host, n):  # the tokens no chunk holds (the ring past the pages)
            x = np.float64(z[h, t])
            if x > -np.inf and x < np.inf:
                if x > M:
                    S = S * math.exp(M - x) + 1.0 if M > -np.inf else 1.0
                    M = x
                else:
                    S += math.exp(x - M)
        m_out[h] = M
        s_out[h] = S


def chunk_logits(z: np.ndarray, n: int, n_host: int, flags: np.ndarray, chunk: int):
    """(zc (Hq, nc) float32, excl (H, nc) uint8, m (Hq,), s (Hq,) float32) of scores z
    (Hq, >= n) float32 and resident flags (H, >= n_host): nc = ceil(n_host / chunk) chunk
    logits, which chunks hold no live token, and each query head's softmax max and sum over
    its n tokens' finite scores (-inf and 0 where none)."""
    if not 0 <= n_host <= n <= z.shape[1] or flags.shape[1] < n_host:
        raise ValueError(f"Invalid sizes: n_host {n_host}, n {n}, z {z.shape}, flags "
                         f"{flags.shape} (expected n_host <= n <= z's and flags' columns)")
    Hq, H = z.shape[0], flags.shape[0]
    if H == 0 or Hq % H:
        raise ValueError(f"Invalid heads: {Hq} query heads for {H} kv heads")
    nc = -(-n_host // chunk)
    zc = np.empty((Hq, nc), np.float32)
    excl = np.empty((H, nc), np.uint8)
    m, s = np.empty(Hq, np.float32), np.empty(Hq, np.float32)
    _chunk_logits(np.ascontiguousarray(z, np.float32), n, n_host,
                  np.ascontiguousarray(flags).view(np.uint8), chunk, zc, excl, m, s)
    return zc, excl, m, s


@kernel(parallel=True, inf_safe=True)
def _expand(idxc, countc, n_host, flags, C, z, m, s, out, count, mass):
    H = out.shape[0]
    rep = z.shape[0] // H
    for k in prange(H):
        j = 0
        for i in range(countc[k]):
            c = idxc[k, i]
            for t in range(c * C, min(c * C + C, n_host)):
                if flags[k, t] == 0:
                    out[k, j] = t
                    j += 1
        count[k] = j
        out[k, j:] = -1
        for r in range(rep):  # each query head's share of its softmax mass, selected
            h = k * rep + r
            acc = 0.0
            if s[h] > 0:
                for i in range(j):
                    x = np.float64(z[h, out[k, i]])
                    if x > -np.inf and x < np.inf:
                        acc += math.exp(x - m[h])
                acc /= s[h]
            mass[h] = acc


def expand_chunks(idxc: np.ndarray, countc: np.ndarray, n_host: int, flags: np.ndarray,
                  chunk: int, width: int, z: np.ndarray, m: np.ndarray, s: np.ndarray):
    """Token ids of selected chunks: idxc (H, >= countc) ascending chunk ids -> (idx (H, width)
    ascending token ids, -1 past count; count (H,); mass (Hq,)), each chunk's tokens on the
    host pages (< n_host) that ``flags`` (H, >= n_host) does not mark resident, and each query
    head's softmax mass on them (scores z (Hq, >= n), the softmax max m and sum s of
    :func:`chunk_logits`). width >= the chunks' tokens (countc.max() * chunk)."""
    H = idxc.shape[0]
    if countc.size and int(countc.max()) * chunk > width:
        raise ValueError(f"Invalid width {width}: {int(countc.max())} chunks of {chunk} tokens")
    out = np.empty((H, width), np.int32)
    count = np.empty(H, np.int32)
    mass = np.empty(z.shape[0], np.float32)
    _expand(np.ascontiguousarray(idxc, np.int32), np.ascontiguousarray(countc, np.int32),
            n_host, np.ascontiguousarray(flags).view(np.uint8), chunk,
            np.ascontiguousarray(z, np.float32), m, s, out, count, mass)
    return out, count, mass
