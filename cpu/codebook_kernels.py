"""Numba codebook kernels: the per-query lookup table, scores of every token from its codes,
and the encoder (see :mod:`tiered.cpu.kernels` for the notation)."""

from __future__ import annotations

import numpy as np
from numba import prange

from ._numba import kernel
from .kernel_base import ENCODE_BLOCK, SCORE_BLOCK, check_array, check_out


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
    for b in prange((n + SCORE_BLOCK - 1) // SCORE_BLOCK):
        j1 = min(n, (b + 1) * SCORE_BLOCK)
        # Tokens outer, heads inner: a row of codes is loaded once and reused from L1 by the
        # rep query heads of its kv head.
        for k in range(H):
            for j in range(b * SCORE_BLOCK, j1):
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
    n_tasks = (H * L + ENCODE_BLOCK - 1) // ENCODE_BLOCK
    dist = np.empty((n_tasks, c), np.float32)
    for b in prange(n_tasks):
        for t in range(b * ENCODE_BLOCK, min(H * L, (b + 1) * ENCODE_BLOCK)):
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
    check_array("C", C, (None, None, None, None), (np.dtype(np.float32),))
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
    check_array("q", q, (None, None), (np.dtype(np.float32),))
    H, g, c = _codebook_geometry(C, q.shape[1])
    check_array("q", q, (H * rep, g * C.shape[3]))
    if out is None:
        out = np.empty((H * rep, g, c), np.float32)
    check_out("out", out, (H * rep, g, c), np.float32)
    _codebook_lut(np.ascontiguousarray(q), np.ascontiguousarray(C), int(rep), out)
    return out


def codebook_scores(P, n, T, rep, out=None):
    """Approximate scores z[qh, j] = sum_i T[qh, i, P[qh // rep, j, i]] for tokens j < n.

    P: (H, n_cap, g) uint8/uint16 codes (rows >= n ignored); T: (Hq, g, c) float32 from
    :func:`codebook_lut`; out: optional (Hq, >= n) float32, C-contiguous (only [:, :n] is
    written). Returns out. Codes must be < c (not checked: an index past c reads garbage).
    """
    check_array("P", P, (None, None, None), (np.dtype(np.uint8), np.dtype(np.uint16)))
    H, n_cap, g = P.shape
    check_array("T", T, (H * rep, g, None), (np.dtype(np.float32),))
    if not 0 <= n <= n_cap:
        raise ValueError(f"Invalid n: {n} (the codes hold {n_cap} tokens)")
    if out is None:
        out = np.empty((H * rep, n), np.float32)
    check_out("out", out, (H * rep, None), np.float32)
    if out.shape[1] < n:
        raise ValueError(f"Invalid shape of out: expected (Hq, >= {n}), got {out.shape}")
    _codebook_scores(np.ascontiguousarray(P), int(n), np.ascontiguousarray(T), int(rep), out)
    return out


def codebook_encode(x, C, out=None):
    """Nearest centroid (squared L2) of every group of every key.

    x: (H, L, d) float32 keys; C: (H, Gc, c, ds) float32; out: optional (H, L, g) uint8
    (c <= 256) or uint16 codes. Returns out.
    """
    check_array("x", x, (None, None, None), (np.dtype(np.float32),))
    H, g, c = _codebook_geometry(C, x.shape[2])
    check_array("x", x, (H, None, g * C.shape[3]))
    if out is None:
        out = np.empty((H, x.shape[1], g), np.uint8 if c <= 256 else np.uint16)
    check_out("out", out, (H, x.shape[1], g), out.dtype)
    if out.dtype not in (np.uint8, np.uint16) or (out.dtype == np.uint8 and c > 256):
        raise ValueError(f"Invalid dtype of out: {out.dtype} cannot hold {c} codes")
    _codebook_encode(np.ascontiguousarray(x), np.ascontiguousarray(C), out)
    return out
