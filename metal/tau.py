"""Tau-cumulative token selection: softmax statistics, threshold, and the per-kv-head set.

HCAttention keeps, per query head, the smallest set of tokens (by descending softmax weight)
whose mass reaches tau. :func:`tau_threshold` finds that set's boundary as a logit without a
sort (kernel: histogram passes; reference: sort). :func:`tau_select` turns the thresholds of
the rep query heads of each kv head into one capped, topped-up index list with MLX ops.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import mlx.core as mx

from ._build import (
    KernelSpec,
    Launch,
    build_kernel,
    device_floats,
    device_ints,
    launch,
    resolve_backend,
    token_blocks,
)

TAU_SPEC = KernelSpec(
    name="tiered_tau_threshold",
    body="tau_threshold.h",
    input_names=("z", "params", "fparams"),
    output_names=("m_out", "s_out", "theta_out"),
    headers=("reduce_common.h",),
)
THREADS = {"metal": 256, "cuda": 1024}  # one threadgroup per head; Metal kept modest (registers)
BINS = 32  # log-domain bins per histogram pass
PASSES = 4  # final bin width: SPAN / BINS**PASSES = 6e-5 logits
SPAN = 64.0  # first pass covers [m - SPAN, m): exp(-64) ~ 1.6e-28, below float32 resolution of s


def _make_tau_kernel(backend: str):
    """The tau-threshold kernel for ``backend`` (cached: built on first use only)."""
    return build_kernel(TAU_SPEC, backend)


def _check(z, n, tau):
    if z.ndim != 2:
        raise ValueError(f"Invalid shape of z: expected (Hq, N), got {tuple(z.shape)}")
    if not 1 <= n <= z.shape[1]:
        raise ValueError(f"Invalid n: {n!r} (expected 1 <= n <= {z.shape[1]})")
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"Invalid tau: {tau!r} (expected 0 < tau <= 1)")


def tau_threshold_ops(z: mx.array, n: int, tau: float) -> tuple[mx.array, mx.array, mx.array]:
    """Softmax statistics and the exact tau-cumulative threshold, by sorting (reference).

    z float32 (Hq, N), N >= n; columns >= n are never read. 0 < tau <= 1.
    Returns (m, s, theta_logit), each float32 (Hq,): m = max z, s = sum exp(z - m), and
    theta_logit = z of the k-th largest token, k the smallest count whose softmax mass
    reaches tau (so {j : z_j >= theta_logit} is that set, plus exact ties); tau == 1 gives
    min z (every token kept). Only finite scores count (NaN and +-inf are absent: the set is
    {j : z_j finite and >= theta_logit}); a row without one gives m = -inf, s = 0 and
    theta_logit = +inf.
    """
    _check(z, n, tau)
    zv = z[:, :n].astype(mx.float32)
    # Non-finite scores sort first as -inf, with weight exp(-inf) = 0.
    zs = mx.sort(_finite_or(zv, -math.inf), axis=1)  # ascending
    m = zs[:, -1]
    e = mx.exp(zs - mx.where(m > -math.inf, m, 0.0)[:, None])
    # Summing from the smallest terms up keeps the many tiny ones that a running float32
    # sum dominated by the heavy hitters would round away.
    before = mx.cumsum(e, axis=1, inclusive=False)  # mass of the tokens below each one
    s = before[:, -1] + e[:, -1]
    # The boundary is the highest token whose mass-from-the-top still reaches tau * s, i.e.
    # the last position whose mass below is <= (1 - tau) * s (position 0 always qualifies).
    k = (before <= ((1.0 - tau) * s)[:, None]).astype(mx.int32).sum(axis=1) - 1
    theta = mx.take_along_axis(zs, k[:, None], axis=1)[:, 0]
    if tau >= 1.0:  # keep every token, also those whose exp(z - m) underflows to 0
        theta = _finite_or(zv, math.inf).min(axis=1)
    return m, s, mx.where(m > -math.inf, theta, math.inf)


def _finite_or(z: mx.array, other: float) -> mx.array:
    """z where it is finite (the comparison is false for NaN), else other."""
    return mx.where(mx.abs(z) < math.inf, z, other)


def tau_launch(z: mx.array, n: int, tau: float, *, backend: str) -> Launch:
    """Launch plan of the threshold kernel: one threadgroup per query head."""
    hq, n_total = z.shape
    threads = THREADS[backend]
    return Launch(
        inputs=[
            z,
            device_ints(n, n_total),
            device_floats(tau, SPAN),
        ],
        template=[("NB", BINS), ("PASSES", PASSES)],
        grid=(threads, hq, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(hq,), (hq,), (hq,)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )


def tau_threshold(
    z: mx.array, n: int, tau: float, *, use_kernel: bool | None = None
) -> tuple[mx.array, mx.array, mx.array]:
    """(m, s, theta_logit) float32 (Hq,) per query head; shapes as in :func:`tau_threshold_ops`.

    Keep token j of head qh when z[qh, j] >= theta_logit[qh]. The kernel (Metal/CUDA; one
    threadgroup per head, no sort) makes one max pass and PASSES histogram passes of BINS
    log-domain bins, each refining the previous boundary bin; its theta sits at most ~1.5
    final bin widths (SPAN / BINS**PASSES logits) below the exact one, so it keeps the exact
    set plus at most the tokens that are within that hair of the boundary. tau == 1 keeps
    every token (theta = min z, an MLX reduction). use_kernel as in the other kernels.
    """
    _check(z, n, tau)
    backend = resolve_backend(use_kernel, "tau_threshold")
    if backend is None:
        return tau_threshold_ops(z, n, tau)
    z = z.astype(mx.float32)
    m, s, theta = launch(TAU_SPEC, backend, tau_launch(z, n, tau, backend=backend))
    if tau >= 1.0:
        theta = mx.where(m > -math.inf, _finite_or(z[:, :n], math.inf).min(axis=1), math.inf)
    return m, s, theta


class Selection(NamedTuple):
    """:func:`tau_select` with ``with_stats=True`` (the fields of ``tiered.cpu``'s Selection).

    idx (H, cap_alloc) int32 ascending, -1 past count; count (H,) int32; m, s (Hq,) float32
    softmax max and sum over the n tokens; mass (Hq,) float32 softmax mass of the selection;
    theta (Hq,) float32 the logit thresholds used (kept: z >= theta), None from the reference.
    """

    idx: mx.array
    count: mx.array
    m: mx.array
    s: mx.array
    mass: mx.array
    theta: mx.array | None = None


# The fused selection (passes: tau_hist.h, tau_theta.h or both in tau_hist_theta.h,
# tau_keys.h, tau_compact.h).
SELECT_BINS = {"metal": 2048, "cuda": 4096}  # mass bins (Metal: 32 KB of threadgroup memory)
LMAX_BINS = 2048  # bins of the cap ranking
SELECT_THREADS = {"metal": 256, "cuda": 1024}
# Threadgroups per pass when n is large: one wave on the H100. The CUDA passes need more than
# 32 registers per thread at 1024 threads, so one threadgroup fits an SM; at 128k tokens, 256
# threadgroups (two waves on 132 SMs) took 0.111 ms of device time for the selection, 128 took
# 0.069 (select_variants run committed in 09cd281, docs/kernels.md).
SELECT_GROUPS = 128
SELECT_CHUNKS = 32  # most chunks per kv head in passes 2 and 3
# Rows of at most this many tokens take passes 1 and 1b in one launch, one threadgroup per
# query head (tau_hist_theta.h); longer rows split pass 1 across threadgroups. H100, 32 query
# heads, selection device ms in one launch / two (bench/results/select_variants_h100.txt):
# 64k 0.068 / 0.082, 128k 0.100-0.104 / 0.104, 256k 0.151 / 0.131.
SELECT_FUSED_TOKENS = 131072
SELECT_FUSED_LOADS = 16  # scores per thread whose loads are issued together in that launch
SPAN_T = 32.0  # logits below the max that the mass histogram resolves (exp(-32) ~ 1e-14)
SPAN_L = 32.0  # logits of max-over-heads log-probability that the cap ranking resolves
SELECT_MAX_TOKENS = 2**24  # the passes count tokens in float32 (exact below this); above: MLX ops
HIST_SPEC = KernelSpec(
    name="tiered_tau_hist", body="tau_hist.h", input_names=("z", "zmax", "params", "fparams"),
    output_names=("hist",), headers=("reduce_common.h", "select_common.h"),
)
THETA_SPEC = KernelSpec(
    name="tiered_tau_theta", body="tau_theta.h",
    input_names=("hist", "zmax", "z", "params", "fparams"),
    output_names=("m_out", "s_out", "theta_out"), headers=("reduce_common.h", "select_common.h"),
)
HIST_THETA_SPEC = KernelSpec(  # passes 1 and 1b in one threadgroup per query head
    name="tiered_tau_hist_theta", body="tau_hist_theta.h",
    input_names=("z", "zmax", "params", "fparams"), output_names=("m_out", "s_out", "theta_out"),
    headers=("reduce_common.h", "select_common.h"),
)
KEYS_SPEC = KernelSpec(
    name="tiered_tau_keys", body="tau_keys.h",
    input_names=("z", "m", "s", "theta", "exclude", "params", "fparams"),
    output_names=("code", "lhist", "counts"), headers=("reduce_common.h", "select_common.h"),
)
COMPACT_SPEC = KernelSpec(
    name="tiered_tau_compact", body="tau_compact.h",
    input_names=("code", "lhist", "counts", "z", "m", "s", "params"),
    output_names=("idx", "count", "mass"), atomic_outputs=True,
    headers=("reduce_common.h", "select_common.h"),
)


def select_bin_widths(backend: str) -> tuple[float, float]:
    """(threshold bin width, cap-ranking bin width) in logits of the fused selection."""
    return SPAN_T / SELECT_BINS[backend], SPAN_L / LMAX_BINS


def threshold_launches(z, n, zmax, tau, *, backend):
    """Launch plans of passes 1 and 1b in two launches, for rows longer than
    SELECT_FUSED_TOKENS: pass 1's plan, and pass 1b's as a function of pass 1's output. Pass 1
    writes one histogram per chunk (every element), which pass 1b sums, so neither is
    zero-filled."""
    hq, n_total = z.shape
    nb = SELECT_BINS[backend]
    threads = SELECT_THREADS[backend]
    m_blocks = zmax.shape[1]
    chunk_q, blocks_q = token_blocks(n, threads, rows=hq, min_block=threads,
                                     target_groups=SELECT_GROUPS)
    hist = Launch(
        inputs=[z, zmax, device_ints(n, n_total, m_blocks, chunk_q, blocks_q),
                device_floats(SPAN_T)],
        template=[("NB", nb)], grid=(blocks_q * threads, hq, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(hq, blocks_q, nb, 2)], output_dtypes=[mx.uint32],
    )

    def theta(hist_out):
        return Launch(
            inputs=[hist_out, zmax, z, device_ints(m_blocks, blocks_q, n, n_total),
                    device_floats(tau, SPAN_T)],
            template=[("NB", nb)], grid=(threads, hq, 1), threadgroup=(threads, 1, 1),
            output_shapes=[(hq,), (hq,), (hq,)],
            output_dtypes=[mx.float32, mx.float32, mx.float32],
        )

    return hist, theta


def rank_launches(z, n, exclude, cap, floor, cap_alloc, *, backend):
    """Launch plans of passes 2 and 3, as functions of the earlier passes' outputs. Both
    write every element of their outputs (pass 2 a histogram per chunk, summed by pass 3)."""
    hq, n_total = z.shape
    h, e = exclude.shape
    rep = hq // h
    threads = SELECT_THREADS[backend]
    # At most SELECT_CHUNKS chunks per kv head: every threadgroup of pass 3 sums the lmax
    # histograms of all the chunks of its head.
    chunk_h, blocks_h = token_blocks(n, threads, rows=max(h, SELECT_GROUPS // SELECT_CHUNKS),
                                     min_block=threads, target_groups=SELECT_GROUPS)

    def keys(m, s, theta_out):
        return Launch(
            inputs=[z, m, s, theta_out, exclude, device_ints(n, n_total, e, chunk_h, blocks_h),
                    device_floats(SPAN_L)],
            template=[("NL", LMAX_BINS), ("REP", rep), ("ET", exclude.dtype)],
            grid=(blocks_h * threads, h, 1), threadgroup=(threads, 1, 1),
            output_shapes=[(h, n), (h, blocks_h, 2, LMAX_BINS), (h, blocks_h, 2)],
            output_dtypes=[mx.uint32, mx.uint32, mx.uint32],
        )

    def compact(code, lhist, counts, m, s):
        return Launch(
            inputs=[code, lhist, counts, z, m, s,
                    device_ints(n, n_total, cap, floor, cap_alloc, chunk_h, blocks_h)],
            template=[("NL", LMAX_BINS), ("REP", rep)],
            grid=(blocks_h * threads, h, 1), threadgroup=(threads, 1, 1),
            output_shapes=[(h, cap_alloc), (h,), (hq, blocks_h)],
            output_dtypes=[mx.uint32, mx.int32, mx.float32],  # every element written
        )

    return keys, compact


def hist_theta_launch(z, n, zmax, tau, *, backend):
    """Launch plan of passes 1 and 1b in one (tau_hist_theta.h): m, s, theta per query head."""
    hq, n_total = z.shape
    nb = SELECT_BINS[backend]
    threads = SELECT_THREADS[backend]
    if nb % threads:
        raise ValueError(f"{nb} bins do not split evenly over {threads} threads")
    return Launch(
        inputs=[z, zmax, device_ints(n, n_total, zmax.shape[1]), device_floats(tau, SPAN_T)],
        template=[("NB", nb), ("BPT", nb // threads), ("U", SELECT_FUSED_LOADS)],
        grid=(threads, hq, 1), threadgroup=(threads, 1, 1), output_shapes=[(hq,), (hq,), (hq,)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )


def tau_select_fused(z, n, exclude, tau, cap, floor, cap_alloc, *, backend, zmax=None):
    """The kernel path of :func:`tau_select`: passes 1, 1b, 2 and 3, all on the device (1 and
    1b in one launch for rows of at most SELECT_FUSED_TOKENS tokens), with the same
    result in every run (order-independent sums and tie-breaks, select_common.h; the last
    pass writes the indices in ascending order). Returns a :class:`Selection` (theta
    included)."""
    if zmax is None:
        zmax = z[:, :n].max(axis=1, keepdims=True)
    if exclude.dtype not in (mx.bool_, mx.uint8):
        exclude = exclude.astype(mx.uint8)
    if n <= SELECT_FUSED_TOKENS:
        m, s, theta = launch(HIST_THETA_SPEC, backend,
                             hist_theta_launch(z, n, zmax, tau, backend=backend))
    else:
        hist_plan, theta_plan = threshold_launches(z, n, zmax, tau, backend=backend)
        (hist,) = launch(HIST_SPEC, backend, hist_plan)
        m, s, theta = launch(THETA_SPEC, backend, theta_plan(hist))
    keys_plan, compact_plan = rank_launches(z, n, exclude, cap, floor, cap_alloc,
                                            backend=backend)
    code, lhist, counts = launch(KEYS_SPEC, backend, keys_plan(m, s, theta))
    idx, count, mass = launch(COMPACT_SPEC, backend, compact_plan(code, lhist, counts, m, s))
    mass = mass.sum(axis=1)
    idx = idx.view(mx.int32)  # ascending; the 0xffffffff padding reads as -1
    return Selection(idx, count, m, s, mass, theta)


def tau_select_args(hq, n, exclude, tau, cap, floor, cap_alloc):
    """:func:`tau_select`'s checks of exclude, cap, floor and cap_alloc for Hq query heads;
    returns (cap, cap_alloc) as the selection uses them (cap raised to floor)."""
    if exclude is None:
        raise ValueError("Invalid exclude: None (pass an all-False (H, n) mask; it names H)")
    if exclude.ndim != 2 or exclude.shape[1] < n or hq % exclude.shape[0]:
        raise ValueError(
            f"Invalid shape of exclude: expected (H, >= {n}) with H dividing {hq}, "
            f"got {tuple(exclude.shape)}"
        )
    if cap < 1 or floor < 0:
        raise ValueError(f"Invalid cap/floor: cap={cap!r} (>= 1), floor={floor!r} (>= 0)")
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"Invalid tau: {tau!r} (expected 0 < tau <= 1)")
    cap = max(cap, floor)
    cap_alloc = cap if cap_alloc is None else cap_alloc
    if cap_alloc < cap:
        raise ValueError(f"Invalid cap_alloc: {cap_alloc!r} (expected >= {cap})")
    return cap, cap_alloc


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
    exclude bool or uint8 (H, >= n): tokens never to select (e.g. resident ones); names H
    tau     0 < tau <= 1; cap >= 1 the most tokens per kv head; floor >= 0 the fewest (a floor
            above cap raises the cap, as in ``tiered.cpu.kernels.tau_select``)
    cap_alloc columns of idx, >= max(cap, floor) (default that)
    Returns (idx int32 (H, cap_alloc), count int32 (H,)): idx[h, :count[h]] are the selected
    token indices in ascending order, the rest -1; with_stats=True returns a :class:`Selection`
    that adds m, s and the selected softmax mass per query head.

    The set is {j : z[qh, j] >= theta[qh] for some qh of the group} minus exclude. Over cap,
    the tokens with the largest max-over-heads probability stay; under floor, the most
    probable other non-excluded tokens are added (count <= non-excluded tokens).
    Non-finite scores (NaN, +-inf) are absent, on every path: the selection is that of the
    same scores without them (a query head's score of a token is dropped, and a token with no
    finite score in its group is never selected). A query head without a finite score has
    m = -inf, s = 0, mass 0 (lse = -inf, an empty partial); a group without one selects
    nothing.
    Where it runs: on CUDA, up to persist.MAX_TOKENS tokens where the grid fits
    (:mod:`tiered.metal.persist`), the passes below as phases of one persistent launch
    (tau_persist.h), with the same result (the selected mass summed over other chunks). On a
    Metal or CUDA device (use_kernel None/True), kernel passes and no sort: tau_hist_theta.h
    (rows of up to SELECT_FUSED_TOKENS tokens; longer ones tau_hist.h and tau_theta.h),
    tau_keys.h, tau_compact.h. Their thresholds sit
    up to 1.5 bins of SPAN_T / SELECT_BINS logits below the exact ones (a hair more kept),
    and over cap the ranking by max-over-heads probability is exact to one bin of SPAN_L /
    LMAX_BINS logits (ties within that bin go to the lower token index);
    :func:`select_bin_widths` gives both widths. The
    result is the same in every run: masses are summed in fixed point, ties by index.
    zmax (Hq, M): maxima of blocks of z (the codebook kernel's second output) save a
    reduction. Elsewhere, lazy MLX ops (sort-based reference threshold, argpartition over n;
    exact ties in probability at the cap broken arbitrarily); also from SELECT_MAX_TOKENS tokens
    up, where the kernels' float32 token counts would stop being exact.
    No host synchronisation either way.
    """
    hq = z.shape[0]
    cap, cap_alloc = tau_select_args(hq, n, exclude, tau, cap, floor, cap_alloc)
    h = exclude.shape[0]
    rep = hq // h
    if n == 0:
        idx = mx.full((h, cap_alloc), -1, dtype=mx.int32)
        count = mx.zeros((h,), dtype=mx.int32)
        if not with_stats:
            return idx, count
        empty = mx.zeros((hq,), dtype=mx.float32)
        return Selection(idx, count, mx.full((hq,), -math.inf, dtype=mx.float32), empty, empty)
    _check(z, n, tau)
    backend = resolve_backend(use_kernel, "tau_select")
    from . import persist  # (it imports this module)

    use = backend == "cuda" and n <= persist.MAX_TOKENS
    grid = persist.plan_grid(n, h, rep) if use else None
    if grid is not None and n < SELECT_MAX_TOKENS:
        if zmax is None:
            zmax = z[:, :n].max(axis=1, keepdims=True)
        sel = persist.tau_select_persistent(z.astype(mx.float32), n, exclude, tau, cap, floor,
                                            cap_alloc, zmax=zmax, grid=grid).sel
        return sel if with_stats else (sel.idx, sel.count)
    if backend is not None and n < SELECT_MAX_TOKENS:
        sel = tau_select_fused(z.astype(mx.float32), n, exclude, tau, cap, floor, cap_alloc,
                               backend=backend, zmax=zmax)
        return sel if with_stats else (sel.idx, sel.count)

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
    if not with_stats:
        return idx, count
    # Softmax mass of the selection for each query head: gather its rep rows at the k picks.
    p_top = mx.exp(mx.take_along_axis(logp, mx.broadcast_to(top[:, None], (h, rep, k)), axis=2))
    mass = (p_top * chosen[:, None]).sum(axis=2).reshape(hq)
    return Selection(idx, count, m, s, mass)
