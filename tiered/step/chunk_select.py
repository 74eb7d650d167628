"""One selection rule for every decode path: the tau-cumulative rule over chunks of
``CHUNK`` tokens (issue 58).

The device step (:mod:`tiered.step.device_step`) always selected chunks: each chunk's logit is the
log-sum-exp of its live tokens (:mod:`tiered.step.device_chunks`), the tau rule, cap and floor hold
per chunk (cap and floor divided by ``CHUNK``), and the selected chunks' live tokens are
attended. The paths that gather on the CPU (MLX's CPU backend, Metal, ``device_gather="off"``)
selected tokens one by one, and at the same bytes answered worse: H200, float16 embedded model,
7.9k tokens at 1/16, 0/8 pass keys against the chunk path's 5/8, with 119-212 offloaded tokens
per kv head selected against 673-1015. A code score of one token is coarse; a chunk's sums
eight of them, so the tau mass is reached over more of the tokens that hold it.

:func:`select_np` (numpy, Numba kernels of :mod:`tiered.cpu.chunks`) and :func:`select_mx`
(MLX ops, lazy) return a :class:`tiered.runtime.primitives.Selection` of token ids, as the
token-level ``tau_select`` did, so gathers, host sinks and the H2O update read it unchanged:
``m``/``s`` are the softmax statistics over all n tokens (the H2O update's), ``mass`` the
selected tokens' share of it. The CPU-gather paths pass n_host = n: the flags mark the ring's tokens
resident, every other token is on the host pages once the step's write-behind ran (how far the
write-behind got would otherwise change the selection). ``TIERED_SELECT_CHUNK=1`` selects token by
token (the rule before; for measurements).
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np

from ..cpu.chunks import chunk_logits, expand_chunks
from ..runtime.primitives import Selection
from .device_chunks import chunk_scores, chunk_tokens
from .device_decode import CHUNK as DEVICE_CHUNK

CHUNK = int(os.environ.get("TIERED_SELECT_CHUNK") or DEVICE_CHUNK)


def chunk_limits(cap: int, floor: int, chunk: int) -> tuple[int, int]:
    """(cap, floor) in chunks for a cap and floor in tokens, as the device step takes them."""
    capc = max(1, cap // chunk)
    return capc, min(capc, -(-floor // chunk))


def select_np(z: np.ndarray, n: int, n_host: int, flags: np.ndarray, tau: float, cap: int,
              floor: int, select=None) -> Selection:
    """The selection of scores z (Hq, >= n) float32 numpy with resident flags (H, >= n) over the
    n_host tokens of the host pages. ``select``: the token rule (tiered.runtime.ops.select), used as
    is when CHUNK is 1 and on the chunk logits otherwise."""
    from ..runtime import ops

    select = select or ops.select
    if CHUNK <= 1:
        return select(z, n, flags, tau, cap, floor)
    n_host = min(n_host, n)  # pages past n (a trim's undo) hold no live token
    zc, excl, m, s = chunk_logits(z, n, n_host, flags, CHUNK)
    capc, floorc = chunk_limits(cap, floor, CHUNK)
    nc = zc.shape[1]
    if nc == 0:
        H = flags.shape[0]
        return Selection(np.full((H, capc * CHUNK), -1, np.int32), np.zeros(H, np.int32), m, s,
                         np.zeros_like(m))
    sel = select(zc, nc, excl, tau, capc, floorc)
    idx, count, mass = expand_chunks(sel.idx, sel.count, n_host, flags, CHUNK,
                                     max(capc, floorc) * CHUNK, z, m, s)
    return Selection(idx, count, m, s, mass)


def select_mx(z: mx.array, n: int, n_host: int, flags: mx.array, tau: float, cap: int,
              floor: int) -> Selection:
    """:func:`select_np` on MLX arrays (lazy): z (Hq, >= n) float32, flags (H, >= n)."""
    import tiered.metal as metal

    if CHUNK <= 1:
        return metal.tau_select(z, n, flags, tau, cap, floor, with_stats=True)
    n_host = min(n_host, n)
    Hq, H = z.shape[0], flags.shape[0]
    rep = Hq // H
    zn = z[:, :n]
    finite = mx.abs(zn) < mx.inf
    zf = mx.where(finite, zn, -mx.inf)
    m = mx.max(zf, axis=1) if n else mx.full((Hq,), -mx.inf)
    m_safe = mx.where(m > -mx.inf, m, 0.0)
    e = mx.exp(zf - m_safe[:, None])
    s = mx.sum(e, axis=1) if n else mx.zeros((Hq,))
    capc, floorc = chunk_limits(cap, floor, CHUNK)
    width = max(capc, floorc) * CHUNK
    nc = -(-n_host // CHUNK)
    if nc == 0:
        return Selection(mx.full((H, width), -1, mx.int32), mx.zeros((H,), mx.int32), m, s,
                         mx.zeros((Hq,)))
    zc, excl = chunk_scores(z, flags, n_host, rep)
    sel = metal.tau_select(zc, nc, excl, tau, capc, floorc, with_stats=True)
    tok, ok = chunk_tokens(sel.idx, sel.count, flags, n_host)
    # compact: the live tokens first, ascending (chunks are), -1 after them
    pos = mx.cumsum(ok.astype(mx.int32), axis=1) - 1
    spare = tok.shape[1]
    at = mx.where(ok, pos, spare)
    out = mx.full((H, spare + 1), -1, mx.int32)
    out = mx.put_along_axis(out, at, mx.where(ok, tok, -1).astype(mx.int32), axis=1)
    idx = out[:, :spare]
    if spare < width:
        idx = mx.concatenate([idx, mx.full((H, width - spare), -1, mx.int32)], axis=1)
    count = mx.sum(ok, axis=1).astype(mx.int32)
    # the selected tokens' share of each query head's softmax mass
    rows = mx.repeat(mx.maximum(tok, 0), rep, axis=0)
    okq = mx.repeat(ok, rep, axis=0)
    picked = mx.where(okq, mx.take_along_axis(e, mx.minimum(rows, max(n - 1, 0)), axis=1), 0.0)
    mass = mx.where(s > 0, mx.sum(picked, axis=1) / mx.maximum(s, 1e-30), 0.0)
    return Selection(idx, count, m, s, mass)
