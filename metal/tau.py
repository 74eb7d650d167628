"""Tau-cumulative token selection on the accelerator: the set per kv head.

HCAttention keeps, per query head, the smallest set of tokens (by descending softmax weight)
whose mass reaches tau (the threshold: :mod:`.threshold`). :func:`tau_select` unites the sets
of the rep query heads of each kv head into one capped, topped-up index list, with the same
arguments and result as the CPU's :func:`tiered.cpu.kernels.tau_select`
(:mod:`tiered.runtime.primitives`). Three implementations, one result up to the kernels' bin widths:
:func:`tau_select_ops` (plain MLX ops, the reference and the CPU backend's path), the kernel
passes (:mod:`.select_passes`, Metal and CUDA) and one persistent launch (:mod:`.persistent`,
CUDA).
"""

from __future__ import annotations

import math

import mlx.core as mx

from tiered.runtime.primitives import Selection, check_select_args

from . import persistent
from ._build import resolve_backend
from .select_passes import tau_select_fused
from .threshold import tau_threshold

SELECT_MAX_TOKENS = 2**24  # the passes count tokens in float32 (exact below this); above: MLX ops


def _empty(h: int, hq: int, cap_alloc: int) -> Selection:
    """The selection over no tokens: nothing selected, softmax statistics of an empty set."""
    zeros = mx.zeros((hq,), dtype=mx.float32)
    return Selection(mx.full((h, cap_alloc), -1, dtype=mx.int32), mx.zeros((h,), dtype=mx.int32),
                     mx.full((hq,), -math.inf, dtype=mx.float32), zeros, zeros)


def tau_select_ops(z: mx.array, n: int, exclude: mx.array, tau: float, cap: int,
                   floor: int = 0, *, cap_alloc: int | None = None) -> Selection:
    """:func:`tau_select` in plain MLX ops (reference; lazy): the exact thresholds (a sort),
    the cap by argpartition over n (exact ties in probability at the cap broken arbitrarily).
    Shapes and rule as there; returns a :class:`Selection` without theta."""
    hq = z.shape[0]
    cap, cap_alloc = check_select_args(z.shape, n, exclude, tau, cap, floor, cap_alloc)
    h = exclude.shape[0]
    rep = hq // h
    if n == 0:
        return _empty(h, hq, cap_alloc)
    m, s, theta = tau_threshold(z, n, tau, use_kernel=False)
    zv = z[:, :n].astype(mx.float32)
    # A non-finite score is absent: log-probability -inf, never kept; a token without a
    # finite score in any head of its group is never selected.
    finite = mx.abs(zv) < math.inf
    logp = mx.where(finite, zv - (m + mx.log(s))[:, None], -math.inf).reshape(h, rep, n)
    allowed = mx.logical_not(exclude[:, :n].astype(mx.bool_))
    allowed = allowed & finite.reshape(h, rep, n).any(axis=1)
    keep = (finite & (zv >= theta[:, None])).reshape(h, rep, n).any(axis=1) & allowed
    lmax = logp.max(axis=1)  # (H, n): log of the max-over-heads probability

    # Rank kept tokens above all others, each group by lmax: lift the kept ones by a per-head
    # offset just large enough (a constant offset would cost float precision).
    kept_min = mx.where(keep, lmax, math.inf).min(axis=1, keepdims=True)
    other_max = mx.where(allowed & ~keep, lmax, -math.inf).max(axis=1, keepdims=True)
    lift = mx.where(
        mx.isfinite(kept_min) & mx.isfinite(other_max),
        mx.maximum(other_max - kept_min + 1.0, 0.0),
        0.0,
    )
    key = mx.where(keep, lmax + lift, mx.where(allowed, lmax, -math.inf))

    n_keep = keep.astype(mx.int32).sum(axis=1)
    n_allowed = allowed.astype(mx.int32).sum(axis=1)
    count = mx.minimum(mx.clip(n_keep, floor, cap), n_allowed).astype(mx.int32)

    k = min(cap, n)
    if n > cap:
        top = mx.argpartition(-key, kth=cap - 1, axis=1)[:, :cap]
    else:
        top = mx.broadcast_to(mx.arange(n, dtype=mx.uint32)[None], (h, n))
    order = mx.argsort(-mx.take_along_axis(key, top, axis=1), axis=1)
    top = mx.take_along_axis(top, order, axis=1).astype(mx.int32)  # (H, k) by key, descending
    chosen = mx.arange(k, dtype=mx.int32)[None] < count[:, None]
    big = 2**31 - 1
    idx = mx.sort(mx.where(chosen, top, big), axis=1)
    idx = mx.where(idx == big, -1, idx)
    if k < cap_alloc:
        idx = mx.concatenate([idx, mx.full((h, cap_alloc - k), -1, dtype=mx.int32)], axis=1)
    # Softmax mass of the selection for each query head: gather its rep rows at the k picks.
    p_top = mx.exp(mx.take_along_axis(logp, mx.broadcast_to(top[:, None], (h, rep, k)), axis=2))
    mass = (p_top * chosen[:, None]).sum(axis=2).reshape(hq)
    return Selection(idx, count, m, s, mass)


def tau_select(
    z: mx.array,
    n: int,
    exclude: mx.array,
    tau: float,
    cap: int,
    floor: int = 0,
    *,
    cap_alloc: int | None = None,
    with_stats: bool = False,
    use_kernel: bool | None = None,
    zmax: mx.array | None = None,
):
    """Per kv head token set: union over its rep query heads of the tau-cumulative sets.

    z       float32 (Hq, N), N >= n: exported scores; columns >= n are never read
    n       live tokens, 0 <= n <= N
    exclude bool or uint8 (H, >= n): tokens never to select (e.g. resident ones); names H
    tau     0 < tau <= 1; cap >= 1 the most tokens per kv head; floor >= 0 the fewest (a floor
            above cap raises the cap)
    cap_alloc columns of idx, >= max(cap, floor) (default that)
    Returns (idx int32 (H, cap_alloc), count int32 (H,)): idx[h, :count[h]] are the selected
    token indices in ascending order, the rest -1; with_stats=True returns a
    :class:`tiered.runtime.primitives.Selection` that adds m, s and the selected softmax mass per
    query head (and the kernels' thresholds). The arguments and result of
    :func:`tiered.cpu.kernels.tau_select` (``use_kernel`` and ``zmax`` are this one's own).

    The set is {j : z[qh, j] >= theta[qh] for some qh of the group} minus exclude. Over cap,
    the tokens with the largest max-over-heads probability stay; under floor, the most
    probable other non-excluded tokens are added (count <= non-excluded tokens).
    Non-finite scores (NaN, +-inf) are absent, on every path: the selection is that of the
    same scores without them (a query head's score of a token is dropped, and a token with no
    finite score in its group is never selected). A query head without a finite score has
    m = -inf, s = 0, mass 0 (lse = -inf, an empty partial); a group without one selects
    nothing.
    Where it runs: on CUDA, up to persistent.MAX_TOKENS tokens where the grid fits
    (:mod:`tiered.metal.persistent`), the passes below as phases of one persistent launch
    (tau_persistent.h), with the same result (the selected mass summed over other chunks). On
    a Metal or CUDA device (use_kernel None/True), kernel passes and no sort
    (:mod:`tiered.metal.select_passes`). Their thresholds sit up to 1.5 bins of
    SPAN_T / SELECT_BINS logits below the exact ones (a hair more kept), and over cap the
    ranking by max-over-heads probability is exact to one bin of SPAN_L / LMAX_BINS logits
    (ties within that bin go to the lower token index); ``select_bin_widths`` gives both
    widths. The result is the same in every run: masses are summed in fixed point, ties by
    index. zmax (Hq, M): maxima of blocks of z (the codebook kernel's second output) save a
    reduction. Elsewhere :func:`tau_select_ops`; also from SELECT_MAX_TOKENS tokens up, where
    the kernels' float32 token counts would stop being exact.
    No host synchronisation either way.
    """
    hq = z.shape[0]
    cap, cap_alloc = check_select_args(z.shape, n, exclude, tau, cap, floor, cap_alloc)
    h = exclude.shape[0]
    backend = resolve_backend(use_kernel, "tau_select")
    if n == 0 or backend is None or n >= SELECT_MAX_TOKENS:
        sel = tau_select_ops(z, n, exclude, tau, cap, floor, cap_alloc=cap_alloc)
    else:
        z = z.astype(mx.float32)
        grid = None
        if backend == "cuda" and n <= persistent.MAX_TOKENS:
            grid = persistent.plan_grid(n, h, hq // h)
        if grid is not None:
            if zmax is None:
                zmax = z[:, :n].max(axis=1, keepdims=True)
            sel = persistent.tau_select_persistent(z, n, exclude, tau, cap, floor, cap_alloc,
                                                   zmax=zmax, grid=grid).sel
        else:
            sel = tau_select_fused(z, n, exclude, tau, cap, floor, cap_alloc, backend=backend,
                                   zmax=zmax)
    return sel if with_stats else (sel.idx, sel.count)
