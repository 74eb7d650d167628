"""Numba kernels of the H2O policy: the accumulated-attention EMA and heavy-hitter rows."""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from ._numba import kernel


@kernel("void(float32[:, ::1], float32[:, ::1], float32[::1], float32[::1], int64, int64, "
        "float32)", parallel=True, inf_safe=True)  # inf_safe: the guard below compares with inf
def _acc_update(acc, z, m, s, rep, n, alpha):
    # Per block of a kv head's tokens, its query heads one after another over contiguous
    # scores into a float32 block sum (one head at a time vectorizes; the heads inside the
    # token loop did not): 6.74 -> 3.63 ms at 65,536 tokens, 9 query heads, 2 cores.
    H = acc.shape[0]
    inv = np.empty(z.shape[0], np.float32)
    for h in range(z.shape[0]):
        inv[h] = (1.0 - alpha) / (rep * s[h]) if s[h] > 0 else 0.0
    B = 1024
    blocks = (n + B - 1) // B
    for b in prange(blocks * H):
        k = b // blocks
        lo = (b % blocks) * B
        hi = min(lo + B, n)
        p = np.zeros(hi - lo, np.float32)
        for r in range(rep):
            h = k * rep + r
            mh, ih = m[h], inv[h]
            for j in range(lo, hi):
                c = np.float32(math.exp(z[h, j] - mh)) * ih
                # A non-finite contribution (a NaN or Inf score, or a head with no finite
                # score: m = -inf, s = 0) is skipped, so the accumulators stay finite.
                if c < np.inf:
                    p[j - lo] += c
        for j in range(lo, hi):
            acc[k, j] = alpha * acc[k, j] + p[j - lo]


def acc_update(acc: np.ndarray, z: np.ndarray, m: np.ndarray, s: np.ndarray, rep: int, n: int,
               alpha: float) -> None:
    """In place: acc[k, j] = alpha * acc[k, j] + (1 - alpha) * mean_{h in group k} p[h, j].

    acc: (H, >= n) float32 accumulators; z: (Hq, >= n) float32 scores with softmax statistics
    m (max) and s (sum of exp(z - m)) per query head, so p[h, j] = exp(z[h, j] - m[h]) / s[h].
    A p[h, j] that is not finite (NaN or Inf in z, m or s) adds nothing: finite accumulators
    stay finite given statistics as tau_select returns them (s >= 1, or m = -inf and s = 0).
    """
    H = acc.shape[0]
    if z.shape[0] != H * rep or acc.shape[1] < n or z.shape[1] < n:
        raise ValueError(
            f"Invalid shapes: acc {acc.shape}, z {z.shape} for rep={rep}, n={n}"
        )
    _acc_update(acc, z, np.ascontiguousarray(m, np.float32),
                np.ascontiguousarray(s, np.float32), int(rep), int(n), np.float32(alpha))
