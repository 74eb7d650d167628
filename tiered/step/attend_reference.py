"""MLX references of the device decode step's CUDA kernels (tiered.step.device_attend): the tests
compare the kernels with these, and :func:`approx_attend_ops` is also the path off CUDA."""

from __future__ import annotations

import mlx.core as mx

from ..runtime import ops
from ..runtime.primitives import merge_partials
from .device_chunks import chunk_token_ids


def resident_scores_ops(queries, scale: float, rk, rtok, n: int):
    """:func:`resident_scores` with MLX ops, in float32."""
    Hq, D = queries.shape[1], queries.shape[3]
    H, R = rtok.shape
    q = queries[0, :, 0, :].astype(mx.float32) * scale
    s = (q.reshape(H, Hq // H, D) @ rk.astype(mx.float32).swapaxes(-1, -2)).reshape(Hq, R)
    tok = mx.repeat(rtok, Hq // H, axis=0)
    return q, mx.where(tok >= 0, s, -mx.inf), mx.where(tok >= 0, tok, n)


def attend_ops(q, rk, rv, rtok, gk, gv, ok, sinks, out_dtype):
    """:func:`attend` with MLX ops (the reference): two exact partials and
    :func:`tiered.runtime.primitives.merge_partials`."""
    Hq, D = q.shape
    H = rk.shape[0]
    rep = Hq // H
    qh = q.reshape(H, rep, D)

    def partial(k, v, mask):
        s = (qh @ k.astype(mx.float32).swapaxes(-1, -2))
        s = mx.where(mask[:, None, :], s, -mx.inf)
        lse = mx.logsumexp(s, axis=-1)
        p = mx.exp(s - mx.where(mx.isfinite(lse), lse, 0)[..., None])
        return (p @ v.astype(mx.float32)).reshape(Hq, D), lse.reshape(Hq)

    o_r, lse_r = partial(rk, rv, rtok >= 0)
    o_g, lse_g = partial(gk, gv, ok)
    sink = None if sinks is None else mx.array(sinks).astype(mx.float32).reshape(Hq)
    o, lse = merge_partials(o_r, lse_r, o_g, lse_g, sink)
    count = mx.repeat(ok.sum(axis=1), rep).astype(mx.float32)
    share = mx.where(lse_r > -mx.inf, mx.exp(lse_r - lse), 0.0)  # as the kernel: 0 if none
    return o.astype(out_dtype), mx.stack([count, share], axis=1)


def approx_attend_ops(z, s_r, vals, ok, idx, res_v, sinks, rep: int):
    """:func:`approx_attend` with MLX ops (the reference, and the path off CUDA)."""
    H = vals.shape[0]
    Hq = H * rep
    tok = chunk_token_ids(idx)
    s_c = mx.take_along_axis(z.reshape(H, rep, -1),
                             mx.broadcast_to(tok[:, None, :], (H, rep, tok.shape[1])), axis=2)
    s_c = mx.where(ok[:, None, :], s_c, -mx.inf)
    o_c, lse_c = ops.softmax_partial(s_c, vals)
    o_r, lse_r = ops.softmax_partial(s_r.reshape(H, rep, -1), res_v)
    lse_r = lse_r.reshape(Hq)
    sink = None if sinks is None else mx.array(sinks).astype(mx.float32).reshape(Hq)
    o, lse = merge_partials(o_r.reshape(Hq, -1), lse_r, o_c.reshape(Hq, -1), lse_c.reshape(Hq),
                            sink)
    count = mx.repeat(ok.astype(mx.float32).sum(axis=1), rep)
    return o, mx.stack([count, mx.exp(lse_r - lse)], axis=1)
