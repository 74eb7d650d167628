"""Exact causal attention for a prefill chunk on the CPU backend.

MLX's CPU ``exp`` is scalar (~77M/s on a 2-core x86 host), so ``mx.fast.scaled_dot_product_
attention`` spends most of a long prefill in the softmax. Here the two products go to numpy's
BLAS and the softmax to a parallel Numba kernel with a vectorized exp: per kv head the rep query
heads of its group are stacked into one (rep * block, d) @ (d, n) product, the rows are
softmaxed in place under the causal limit, then multiplied by V and normalized.
"""

from __future__ import annotations

import contextlib

import numpy as np

from .gather import causal_softmax_rows, softmax_pv_rows

# Largest score buffer (rep * block * n float32) before the query block is shrunk to fit.
MAX_SCRATCH_BYTES = 256 * 2**20
_scratch = [MAX_SCRATCH_BYTES]  # the cap in force (scratch_limit), process-wide


@contextlib.contextmanager
def scratch_limit(nbytes: int):
    """Cap the score buffer at ``nbytes`` (at least one query row) while inside, for every
    thread: a prefill under a memory budget (tiered.layerwise_prefill) bounds its attention
    this way rather than by smaller prompt chunks, each of which copies the layer's keys and
    values (a 64-token chunk at 64k tokens: ~100 s a layer, mostly those copies)."""
    before = _scratch[0]
    _scratch[0] = max(1, min(int(nbytes), before))
    try:
        yield
    finally:
        _scratch[0] = before


def scratch_bytes() -> int:
    """The score buffer's cap in force."""
    return _scratch[0]


def _as_f32(name, x, want, copy: bool = False):
    try:
        x = (np.array(x, dtype=np.float32, order="C", copy=True) if copy
             else np.ascontiguousarray(x, dtype=np.float32))
    except (TypeError, ValueError) as err:
        raise ValueError(f"Invalid {name}: cannot be read as a float32 array ({err})") from None
    if x.ndim != 3:
        raise ValueError(f"Invalid shape of {name}: expected {want}, got {tuple(x.shape)}")
    return x


def causal_attention(q, k, v, scale, *, block=512, column_mass=None, lse=None):
    """softmax(q k^T * scale + causal mask) v for the last L positions of a sequence of n.

    Args:
        q: (Hq, L, d) float32 queries of the chunk (unscaled).
        k: (H, n, d) float32 keys, n >= L; the chunk's own keys are the last L rows.
        v: (H, n, dv) float32 values.
        scale: the attention scale (usually d ** -0.5).
        block: query rows per step; the score buffer holds rep * block * n float32 (shrunk to
            stay under ``MAX_SCRATCH_BYTES``, or :func:`scratch_limit`'s cap).

    Query row i sees keys 0 .. n - L + i; query head qh reads kv head qh // (Hq // H).
    Returns (Hq, L, dv) float32.

    column_mass: optional (H, >= n) float32, accumulated in place with the attention mass every
    key receives, summed over the chunk's rows and the rep query heads of its group (H2O's
    accumulated attention, exported from the softmax already computed: no second QK pass).
    lse: optional (Hq, L) float32, filled with each row's log-sum-exp (a shard's partial over
    its own chunk needs it: tiered.shard.tiered).
    """
    q, k, v = _checked(q, k, v, block)
    if k.shape[1] < q.shape[1]:
        raise ValueError(f"Invalid shape of k: n = {k.shape[1]} keys for L = {q.shape[1]} "
                         "queries (need n >= L)")
    return _attend(q, k, v, scale, k.shape[1] - q.shape[1], int(block), column_mass, lse)


def partial_attention(q, k, v, scale, first_visible: int, *, block=512):
    """(o (Hq, L, dv), lse (Hq, L)) float32: row i of q sees keys 0 .. first_visible + i of k
    (every key where that is past its end); o normalized over them, lse their log-sum-exp; a
    row that sees none: o 0, lse -inf. A shard's partial of a prompt chunk (tiered.shard)."""
    q, k, v = _checked(q, k, v, block)
    Hq, L, _ = q.shape
    out = np.zeros((Hq, L, v.shape[2]), np.float32)
    lse = np.full((Hq, L), -np.inf, np.float32)
    r0 = min(L, max(0, -int(first_visible)))  # rows before the first key see nothing
    if r0 < L and k.shape[1]:
        lse_rows = np.empty((Hq, L - r0), np.float32)
        out[:, r0:] = _attend(np.ascontiguousarray(q[:, r0:]), k, v, scale,
                              int(first_visible) + r0, int(block), None, lse_rows)
        lse[:, r0:] = lse_rows
    return out, lse


def _checked(q, k, v, block):
    q = _as_f32("q", q, "(Hq, L, d)")
    k, v = _as_f32("k", k, "(H, n, d)"), _as_f32("v", v, "(H, n, dv)")
    Hq, L, d = q.shape
    H, n, dk = k.shape
    if dk != d or H == 0 or Hq % H:
        raise ValueError(f"Invalid shape of k: expected (H, n, {d}) with Hq = {Hq} a multiple "
                         f"of H, got {k.shape}")
    if v.shape[:2] != (H, n):
        raise ValueError(f"Invalid shape of v: expected ({H}, {n}, dv), got {v.shape}")
    if int(block) < 1:
        raise ValueError(f"Invalid block: {block} (expected >= 1)")
    return q, k, v


def _attend(q, k, v, scale, past: int, block: int, column_mass, lse_out):
    """Rows i of q see keys 0 .. past + i (at most all n); lse_out (Hq, L) or None."""
    Hq, L, d = q.shape
    H, n, _ = k.shape
    rep, dv = Hq // H, v.shape[2]
    out = np.empty((Hq, L, dv), np.float32)
    if L == 0:
        return out
    block = max(1, min(block, L, _scratch[0] // (4 * rep * max(n, 1))))
    # Buffers reused by every block and head: fresh multi-MB arrays per block would pay page
    # faults on every touch.
    scores = np.empty(rep * block * n, np.float32)
    qbuf = np.empty((rep * block, d), np.float32)
    obuf = np.empty((rep * block, dv), np.float32)
    inv_sum = np.empty(rep * block, np.float32)
    lse = np.empty(rep * block, np.float32)
    for kh in range(H):
        heads = slice(kh * rep, (kh + 1) * rep)
        for i0 in range(0, L, block):
            b = min(block, L - i0)
            ncols = min(n, past + i0 + b)  # keys visible to the block's last row
            qb = qbuf[: rep * b]
            np.multiply(q[heads, i0 : i0 + b], np.float32(scale), out=qb.reshape(rep, b, d))
            S = scores[: rep * b * ncols].reshape(rep * b, ncols)
            np.matmul(qb, k[kh, :ncols].T, out=S)
            causal_softmax_rows(S, b, past + i0, inv_sum[: rep * b], lse[: rep * b])
            if column_mass is not None:  # sum_r p[r, :] = inv_sum @ exp-scores
                column_mass[kh, :ncols] += inv_sum[: rep * b] @ S
            if lse_out is not None:
                lse_out[heads, i0 : i0 + b] = lse[: rep * b].reshape(rep, b)
            ob = obuf[: rep * b]
            np.matmul(S, v[kh, :ncols], out=ob)
            ob *= inv_sum[: rep * b, None]
            out[heads, i0 : i0 + b] = ob.reshape(rep, b, dv)
    return out


def softmax_pv(s, v):
    """A decode query's exact partial over a set of tokens from its scores: s (H, rep, R)
    float32 (-inf: a slot not in the set), v (H, R, dv) float32. Returns (o (H, rep, dv)
    normalized, lse (H, rep)); a row of no token: o 0, lse -inf. One Numba kernel on the calling
    thread with a vectorized exp (MLX's CPU exp is scalar)."""
    s = _as_f32("s", s, "(H, rep, R)", copy=True)  # the kernel writes p over it
    v = _as_f32("v", v, "(H, R, dv)")
    H, rep, R = s.shape
    if v.shape[:2] != (H, R):
        raise ValueError(f"Invalid shape of v: expected ({H}, {R}, dv), got {v.shape}")
    o = np.empty((H, rep, v.shape[2]), np.float32)
    lse = np.empty((H, rep), np.float32)
    softmax_pv_rows(s, v, o, lse)
    return o, lse
