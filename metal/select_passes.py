"""The tau selection as kernel passes on the device (Metal and CUDA): the path of
:func:`tiered.metal.tau.tau_select` where the persistent launch (:mod:`.persistent`) does not
apply.

Pass 1 histograms each query head's softmax mass in log-domain bins below its max, pass 1b
finds its threshold (tau_hist.h and tau_theta.h; one launch, tau_hist_theta.h, for rows of up
to SELECT_FUSED_TOKENS tokens); pass 2 classes and bins every token of a kv head by its
max-over-heads log-probability (tau_keys.h), pass 3 cuts the ranking at the cap and writes the
indices in ascending order (tau_compact.h). Bodies of the passes: select_*.h.
"""

from __future__ import annotations

import mlx.core as mx

from tiered.runtime.primitives import Selection

from ._build import KernelSpec, Launch, device_floats, device_ints, launch, token_blocks

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
# heads, selection device ms in one launch / two (bench/results/kernels_cuda_h100.md):
# 64k 0.068 / 0.082, 128k 0.100-0.104 / 0.104, 256k 0.151 / 0.131.
SELECT_FUSED_TOKENS = 131072
SELECT_FUSED_LOADS = 16  # scores per thread whose loads are issued together in that launch
SPAN_T = 32.0  # logits below the max that the mass histogram resolves (exp(-32) ~ 1e-14)
SPAN_L = 32.0  # logits of max-over-heads log-probability that the cap ranking resolves
MASS_HEADERS = ("reduce_common.h", "select_boundary.h", "select_mass.h")  # passes 1 and 1b
RANK_HEADERS = ("reduce_common.h", "select_boundary.h", "select_rank.h")  # passes 2 and 3
HIST_SPEC = KernelSpec(
    name="tiered_tau_hist", body="tau_hist.h", input_names=("z", "zmax", "params", "fparams"),
    output_names=("hist",), headers=MASS_HEADERS,
)
THETA_SPEC = KernelSpec(
    name="tiered_tau_theta", body="tau_theta.h",
    input_names=("hist", "zmax", "z", "params", "fparams"),
    output_names=("m_out", "s_out", "theta_out"), headers=MASS_HEADERS,
)
HIST_THETA_SPEC = KernelSpec(  # passes 1 and 1b in one threadgroup per query head
    name="tiered_tau_hist_theta", body="tau_hist_theta.h",
    input_names=("z", "zmax", "params", "fparams"), output_names=("m_out", "s_out", "theta_out"),
    headers=MASS_HEADERS,
)
KEYS_SPEC = KernelSpec(
    name="tiered_tau_keys", body="tau_keys.h",
    input_names=("z", "m", "s", "theta", "exclude", "params", "fparams"),
    output_names=("code", "lhist", "counts"), headers=RANK_HEADERS,
)
COMPACT_SPEC = KernelSpec(
    name="tiered_tau_compact", body="tau_compact.h",
    input_names=("code", "lhist", "counts", "z", "m", "s", "params"),
    output_names=("idx", "count", "mass"), atomic_outputs=True, headers=RANK_HEADERS,
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
    result in every run (order-independent sums and tie-breaks, select_mass.h; the last
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
