"""The selection in one launch of persistent threadgroups, alone or fused with codebook scoring.

The selection passes of :mod:`.select_passes` (the path of :func:`tiered.metal.tau.tau_select`
without this one) each pay a launch's fixed latency (ramp-up, a tail, a drained pipeline): at
128k tokens on an H100 the keys and compaction passes took about as long as at 64k
(``bench/results/kernels_cuda_h100.md``, its selection variants). ``tau_persistent.h`` runs
the same passes as phases of one kernel: its threadgroups take units of work (a kv head's chunk
in one phase) from a counter in order, and a unit waits until the phase before it is done.
:func:`codebook_select` puts the codebook scoring (``codebook_scores.h``) in front of them in
the same launch. Results equal the separate passes' (fixed-point sums, integer counts); only
the float sum of the selected mass follows this kernel's chunks.

CUDA only (persistent_cuda.h: Metal lacks the 64-bit atomics). Units are taken in order, so a
waiting unit waits only for units that running threadgroups hold: no assumption about how
many threadgroups the GPU runs at once, and launches side by side (MLX's CUDA graphs run
independent nodes concurrently) cannot deadlock. A wait that still lasts after a second sets
the status word (the result is then wrong, not hung). The grid has one threadgroup per SM
(the driver's SM count, read once). ``TIERED_PERSISTENT=0`` turns the path off.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import NamedTuple

import mlx.core as mx

from ._build import (
    KernelSpec,
    Launch,
    device_floats,
    device_ints,
    launch,
    shared_memory_limit,
)
from tiered.runtime.primitives import Selection, check_select_args

from .codebook import CODEBOOK_SPEC, codebook_launch, static_shared
from .select_passes import LMAX_BINS, SELECT_BINS, SPAN_L, SPAN_T

# Threads per threadgroup. At 1024, MLX's NVRTC build of the kernel needed more than the 64
# registers per thread that an SM has for them (H100: "too many resources requested for
# launch"); at 512 each thread may have 128.
THREADS = 512
MIN_CHUNK = 1024  # fewest tokens per threadgroup (a round of its threads)
# Rows of at most this many tokens take the persistent kernel. H100, Llama-3-8B shape (32
# query heads), selection device ms, persistent / separate launches: with the kernel's first
# version (grid-wide barriers; runs committed in fa7f9db, docs/kernels.md) 16k
# 0.050 / 0.070, 128k 0.082 / 0.099, 1M 0.419 / 0.358 (there the passes' wider grids win);
# with units taken in order (bench/results/kernels_cuda_h100.md) 128k 0.089 / 0.104.
MAX_TOKENS = 131072
WORK_BYTES = 128 * 1024  # the mass histograms of one round: HR heads x NB bins x 8 bytes
STAMPS = 5  # globaltimer stamps at the phase ends (bench/kernels.py reports them)
_SELECT_OUTPUTS = ("m_out", "s_out", "theta_out", "idx", "count", "mass", "hist", "code",
                   "lhist", "counts", "status", "stamps")
_HEADERS = ("reduce_common.h", "select_boundary.h", "select_mass.h", "select_rank.h",
            "persistent_cuda.h")
PERSISTENT_SPEC = KernelSpec(
    name="tiered_tau_persistent", body="tau_persistent.h",
    input_names=("z", "zmax", "exclude", "sync", "sparams", "sfparams"),
    output_names=_SELECT_OUTPUTS, headers=_HEADERS,
)
FUSED_SPEC = KernelSpec(
    name="tiered_codebook_select", body="tau_persistent.h", inner=CODEBOOK_SPEC.body,
    input_names=CODEBOOK_SPEC.input_names + ("exclude", "sync", "sparams", "sfparams"),
    output_names=CODEBOOK_SPEC.output_names + _SELECT_OUTPUTS,
    headers=("scale_common.h",) + _HEADERS,
)


@functools.cache
def cuda_sm_count(index: int = 0) -> int | None:
    """Streaming multiprocessors of CUDA device ``index`` as the driver reports them (a MIG
    slice reports its own), or None where the driver library cannot be asked."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev, count = ctypes.c_int(), ctypes.c_int()
    if lib.cuInit(0) != 0 or lib.cuDeviceGet(ctypes.byref(dev), index) != 0:
        return None
    if lib.cuDeviceGetAttribute(ctypes.byref(count), 16, dev) != 0:  # MULTIPROCESSOR_COUNT
        return None
    return count.value if count.value > 0 else None


class Grid(NamedTuple):
    """A persistent launch: `blocks` chunks of `chunk` tokens per kv head (every chunk has
    tokens; a unit of work per phase each), `groups` threadgroups taking the units, `hr` query
    heads per histogram round, `smem` bytes of dynamic shared memory."""

    chunk: int
    blocks: int
    hr: int
    smem: int
    groups: int


def plan_grid(n: int, h: int, rep: int, *, table_bytes: int = 0, static_bytes: int = 0
              ) -> Grid | None:
    """The persistent launch for n tokens, h kv heads of rep query heads (about one unit per
    SM and phase, one threadgroup per SM), or None where this device cannot run it (no CUDA
    driver here, more kv heads than SMs, too little shared memory, or TIERED_PERSISTENT=0)."""
    if os.environ.get("TIERED_PERSISTENT", "1") == "0" or n < 1:
        return None
    sms = cuda_sm_count()
    if sms is None or h > sms:
        return None
    nb = SELECT_BINS["cuda"]
    hr = max(d for d in range(1, rep + 1) if rep % d == 0 and d * nb * 8 <= WORK_BYTES)
    smem = max(hr * nb * 8, rep * nb * 4, 4 * LMAX_BINS * 4, table_bytes)
    if smem + static_bytes + 4096 > shared_memory_limit("cuda"):
        return None
    per = min(sms // h, max(1, -(-n // MIN_CHUNK)))
    chunk = -(-n // per)
    blocks = -(-n // chunk)
    return Grid(chunk, blocks, hr, smem, min(sms, h * blocks))


class PersistentResult(NamedTuple):
    """A persistent launch's selection, its status (0: no wait timed out) and its phase
    stamps (globaltimer nanoseconds: the first unit's start, then the end of each phase's last
    unit)."""

    sel: Selection
    status: mx.array
    stamps: mx.array


def _select_launch(inputs, template, grid: Grid, n, h, rep, n_total, m_cols, exclude, tau,
                   cap, floor, cap_alloc, *, extra_shapes=(), extra_dtypes=(), stamps=False):
    hq = h * rep
    nb = SELECT_BINS["cuda"]
    if exclude.dtype not in (mx.bool_, mx.uint8):
        exclude = exclude.astype(mx.uint8)
    return Launch(
        inputs=inputs + [
            exclude, mx.zeros((8,), dtype=mx.uint32),
            device_ints(n, n_total, m_cols, exclude.shape[1], cap, floor, cap_alloc,
                        grid.chunk, grid.blocks, h),
            device_floats(tau, SPAN_T, SPAN_L),
        ],
        template=template + [("NB", nb), ("NL", LMAX_BINS), ("ET", exclude.dtype),
                             ("HR", grid.hr), ("STAMPS", int(stamps))],
        grid=(grid.groups * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=list(extra_shapes) + [
            (hq,), (hq,), (hq,), (h, cap_alloc), (h,), (hq, grid.blocks), (hq, nb), (h, n),
            (h, grid.blocks, 2, LMAX_BINS), (h, grid.blocks, 2), (1,), (STAMPS if stamps else 1,)],
        output_dtypes=list(extra_dtypes) + [
            mx.float32, mx.float32, mx.float32, mx.uint32, mx.int32, mx.float32, mx.uint64,
            mx.uint32, mx.uint32, mx.uint32, mx.uint32, mx.uint64],
        shared_memory=grid.smem,
    )


def _result(outs) -> PersistentResult:
    m, s, theta, idx, count, mass = outs[:6]
    status, stamps = outs[10], outs[11]
    sel = Selection(idx.view(mx.int32), count, m, s, mass.sum(axis=1), theta)
    return PersistentResult(sel, status, stamps)


def tau_select_persistent(z, n, exclude, tau, cap, floor, cap_alloc, *, zmax, grid: Grid,
                          stamps: bool = False) -> PersistentResult:
    """The selection of :func:`tiered.metal.tau.tau_select` (arguments checked there) in one
    persistent launch on CUDA; ``grid`` from :func:`plan_grid`."""
    h = exclude.shape[0]
    plan = _select_launch([z, zmax], [("REP", z.shape[0] // h)], grid, n, h,
                          z.shape[0] // h, z.shape[1], zmax.shape[1], exclude, tau, cap,
                          floor, cap_alloc, stamps=stamps)
    return _result(launch(PERSISTENT_SPEC, "cuda", plan))


def fused_plan(q, codebook, codes, n, exclude, tau, cap, floor, cap_alloc, *, rep,
               lut_half=None, stamps=False, grid: Grid | None = None) -> Launch | None:
    """Launch plan of :func:`codebook_select`'s kernel, or None where it does not apply.
    ``grid`` overrides :func:`plan_grid` (source checks on machines without a GPU)."""
    h = codebook.shape[0]
    if n < 1 or (codes.shape[2] * codes.dtype.size) % 4:
        return None
    words = mx.contiguous(codes).view(mx.uint32)
    plan = codebook_launch(q, codebook, words, n, rep=rep, code_bits=8 * codes.dtype.size,
                           backend="cuda", lut_half=lut_half)
    if plan.notes["rep_tile"] != rep or not plan.notes["lut_shared"]:
        return None
    if grid is None:
        grid = plan_grid(n, h, rep, table_bytes=plan.shared_memory,
                         static_bytes=static_shared(rep, q.shape[1]))
    if grid is None:
        return None
    return _select_launch(
        plan.inputs[:4] + [device_ints(n, words.shape[1], grid.chunk)], plan.template, grid, n,
        h, rep, n, grid.blocks, exclude, tau, cap, floor, cap_alloc,
        extra_shapes=plan.output_shapes[:1] + [(q.shape[0], grid.blocks)],
        extra_dtypes=plan.output_dtypes, stamps=stamps)


def codebook_select(q, codebook, codes, n, exclude, tau, cap, floor=0, *, rep, cap_alloc=None,
                    lut_half=None, stamps=False):
    """Codebook scores and their selection in one launch (CUDA), or None where the fused
    kernel does not apply (then score with :func:`tiered.metal.codebook.codebook_scores` and
    select with :func:`tiered.metal.tau.tau_select`, which give the same result).

    Arguments as those two functions take them (q (Hq, d), codebook (H, Gc, c, ds), codes
    (H, n_cap, g) uint8/uint16, exclude (H, >= n)). Returns (z (Hq, n) float32,
    PersistentResult).
    Applies up to MAX_TOKENS tokens, where all rep heads of a kv head share one
    shared-memory table (the codebook kernel's own tiling) and the persistent grid fits this
    device. Measured on an H100 it was no faster than the codebook kernel followed by the
    persistent selection (bench/kernels.py); it stays for the benchmark's phase timings.
    """
    cap, cap_alloc = check_select_args((q.shape[0], n), n, exclude, tau, cap, floor, cap_alloc)
    if n > MAX_TOKENS:
        return None
    plan = fused_plan(q, codebook, codes, n, exclude, tau, cap, floor, cap_alloc, rep=rep,
                      lut_half=lut_half, stamps=stamps)
    if plan is None:
        return None
    outs = launch(FUSED_SPEC, "cuda", plan)
    return outs[0], _result(outs[2:])
