"""Attention over one rank's shard as a partial (output, log-sum-exp), and the exact merge of
every rank's partials after an ``all_gather`` (flash-decoding across processes).

A rank holds the keys and values of a contiguous range of the sequence's positions. A query at
position p sees the keys at positions <= p: a shard before the chunk is seen whole, the shard
the chunk falls in is seen causally, a shard after it not at all (its partial is empty: output
0, log-sum-exp -inf). The merged output is the attention over every position the query sees:
softmax(s) v = sum_r exp(lse_r - lse) o_r with lse = logsumexp_r lse_r."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..cpu.attention import partial_attention as cpu_partial_attention
from ..runtime.ops import on_cpu_backend

# Largest score block (query heads x queries x keys, float32) before the queries are split:
# a 2048-token prompt chunk over a 32k-token shard would be 2.4 GB of scores at once
MAX_SCORE_BYTES = 256 * 2**20


def partial_attention(queries, keys, values, *, scale: float, q_start: int, k_start: int):
    """(o, lse) of ``queries`` (1, Hq, L, d) at positions q_start.. over ``keys`` / ``values``
    (1, H, m, d) / (1, H, m, dv) at positions k_start.., causally by position, in float32.
    o (1, Hq, L, dv) is normalized over the visible keys; lse (1, Hq, L) their log-sum-exp
    (-inf and o = 0 where a query sees none of them)."""
    _, Hq, L, d = queries.shape
    H, m, dv = keys.shape[1], keys.shape[2], values.shape[3]
    if m == 0 or k_start > q_start + L - 1:  # nothing here is visible to any query
        return (mx.zeros((1, Hq, L, dv), mx.float32),
                mx.full((1, Hq, L), -mx.inf, mx.float32))
    if on_cpu_backend() and L > 1:  # a prompt chunk: BLAS and a Numba softmax (MLX's CPU exp
        # is scalar); one query stays in MLX (no copy of the shard's keys and values per step)
        o, lse = cpu_partial_attention(np.array(queries[0].astype(mx.float32)),
                                       np.array(keys[0].astype(mx.float32)),
                                       np.array(values[0].astype(mx.float32)), scale,
                                       q_start - k_start)
        return mx.array(o)[None], mx.array(lse)[None]
    rep = Hq // H
    k = keys[0].astype(mx.float32)  # (H, m, d)
    v = values[0].astype(mx.float32)
    q = (queries[0].astype(mx.float32) * scale).reshape(H, rep, L, d)
    block = max(1, min(L, MAX_SCORE_BYTES // max(1, 4 * Hq * m)))
    outs, lses = [], []
    for i in range(0, L, block):
        qb = q[:, :, i : i + block]  # (H, rep, b, d)
        b = qb.shape[2]
        s = qb.reshape(H, rep * b, d) @ k.swapaxes(-1, -2)  # (H, rep * b, m)
        s = s.reshape(H, rep, b, m)
        last = k_start + m - 1
        if last > q_start + i:  # some key lies after some query of the block: causal mask
            qpos = mx.arange(q_start + i, q_start + i + b)[:, None]
            kpos = mx.arange(k_start, k_start + m)[None]
            s = mx.where(kpos <= qpos, s, -mx.inf)
        mx_ = s.max(axis=-1, keepdims=True)
        safe = mx.where(mx.isfinite(mx_), mx_, 0.0)
        p = mx.exp(s - safe)
        z = p.sum(axis=-1, keepdims=True)
        o = (p.reshape(H, rep * b, m) @ v).reshape(H, rep, b, dv) / mx.maximum(z, 1e-30)
        lse = mx.where(z[..., 0] > 0, mx.log(z[..., 0]) + safe[..., 0], -mx.inf)
        outs.append(o)
        lses.append(lse)
    o = mx.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]
    lse = mx.concatenate(lses, axis=2) if len(lses) > 1 else lses[0]
    return o.reshape(1, Hq, L, dv), lse.reshape(1, Hq, L)


def merge(o, lse):
    """The exact attention from every rank's partial: o (R, Hq, L, dv), lse (R, Hq, L) ->
    (1, Hq, L, dv) float32. Every query sees position 0 (held by rank 0): never all empty."""
    top = lse.max(axis=0, keepdims=True)
    w = mx.exp(lse - top)  # 0 for an empty partial
    total = w.sum(axis=0)
    return ((w[..., None] * o).sum(axis=0) / total[..., None])[None]


def gather_merge(o, lse, group):
    """:func:`merge` over the ranks of ``group``: one ``all_gather`` of the packed partials
    (1, Hq, L, dv + 1)."""
    packed = mx.concatenate([o, lse[..., None]], axis=-1)
    every = mx.distributed.all_gather(packed, group=group) if group.size() > 1 else packed
    return merge(every[..., :-1], every[..., -1])
