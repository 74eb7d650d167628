"""One dispatcher for the per-step compute of a compressed layer.

Every function takes and returns numpy arrays (CPU memory: MLX's CPU backend and unified
memory share it). On the CPU backend the work runs in the Numba kernels of ``tiered.cpu``
(MLX's CPU gather ops are ~20x slower for table lookups); on GPU backends the scoring and
selection kernels of ``tiered.metal`` take over where they exist.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np

from ..cpu import kernels as K
from ..cpu.attention import causal_attention, scratch_bytes
from ..cpu.h2o import acc_update  # noqa: F401  (re-exported)
from ..scheduler import split_heads
from . import dispatch


def batch0(x: mx.array) -> mx.array:
    """``x[0]`` as a view when the batch is 1: MLX's integer index is a gather launch that
    copies the array (eight per layer and 2048-token prompt chunk of a Llama-3-8B on an H200,
    13 ms of its ~90 ms of GPU time; bench/probes/prefill_profile.py)."""
    return x.reshape(x.shape[1:]) if x.shape[0] == 1 else x[0]


def on_cpu_backend() -> bool:
    return mx.default_device() == mx.cpu


def numpy_path(config) -> bool:
    """Whether a compressed layer runs its step with Numba kernels on zero-copy views (the CPU
    backend, or kernels='numba') rather than MLX ops and device kernels."""
    if config.kernels == "auto":
        return on_cpu_backend()
    return config.kernels == "numba"


def numpy_view(a: mx.array) -> np.ndarray:
    """Zero-copy numpy view of an evaluated MLX array (CPU memory)."""
    dispatch.eval(a)
    return np.array(a, copy=False)


@contextlib.contextmanager
def kernel_threads(n: int):
    """Numba threads for the parallel kernels called inside (thread-local, restored after)."""
    import numba

    before = numba.get_num_threads()
    n = max(1, min(n, numba.config.NUMBA_NUM_THREADS))
    if n != before:
        numba.set_num_threads(n)
    try:
        yield
    finally:
        if n != before:
            numba.set_num_threads(before)


# ---- exact attention ---------------------------------------------------------------------------
GEMM_ALIGN = 8  # elements: cuBLAS / CUTLASS take their fast kernels on 16-byte-aligned rows


def aligned_pv(p: mx.array, values: mx.array, split: bool | None = None) -> mx.array:
    """p (..., M, R) @ values (..., R, d), with the long R axis cut to a multiple of GEMM_ALIGN
    plus a remainder. A row stride R that is not a multiple of 8 halves made MLX CUDA run an
    align-1 CUTLASS GEMM (H200, approximate rescoring at 1M tokens, resident R ~ 35k per head:
    0.65 ms per layer, ~110 GB/s, the step's largest kernel). ``split``: None cuts on GPUs
    only, True / False force it."""
    R = p.shape[-1]
    Ra = R - R % GEMM_ALIGN
    split = mx.default_device() == mx.gpu if split is None else split
    if Ra == R or Ra == 0 or not split:
        return p @ values
    head = mx.contiguous(p[..., :Ra]) @ values[..., :Ra, :]
    return head + p[..., Ra:] @ values[..., Ra:, :]


def softmax_partial(s: mx.array, values: mx.array):
    """Exact attention over a set of tokens from their scores s (H, rep, R) and values
    (H, R, dv). Returns (o (H, rep, dv) normalized float32, lse (H, rep); -inf where the set is
    empty)."""
    m = mx.max(s, axis=-1, keepdims=True)
    m = mx.where(mx.isfinite(m), m, 0)
    p = mx.exp(s - m)
    den = mx.sum(p, axis=-1, keepdims=True)
    o = aligned_pv(p.astype(values.dtype), values).astype(mx.float32)
    o = o / mx.maximum(den, 1e-30)
    lse = mx.where(den[..., 0] > 0, (m + mx.log(den))[..., 0], -mx.inf)
    return o, lse


def exports_column_mass(queries, mask, sinks, fast: bool) -> bool:
    """Whether :func:`exact_attention` takes the CPU backend's BLAS + Numba softmax path,
    which adds the attention mass per key to a host buffer as it goes."""
    causal = isinstance(mask, str) and mask == "causal"
    # float32 only: the model runs in it on the CPU backend (weights dequantized at load); a
    # float16 / bfloat16 graph stays lazy (MLX's CPU lacks some half kernels, e.g. GatherMM)
    return (fast and queries.shape[2] > 1 and sinks is None and on_cpu_backend()
            and queries.shape[0] == 1 and causal and queries.dtype == mx.float32)


def column_mass_applies(queries, mask) -> bool:
    """Whether :func:`column_mass` covers this attention (a prompt chunk of one sequence,
    causal or unmasked)."""
    return queries.shape[2] > 1 and queries.shape[0] == 1 and (
        mask is None or (isinstance(mask, str) and mask == "causal"))


def exact_attention(queries, keys, values, *, scale, mask, sinks=None, fast=False,
                    column_mass=None, lse=None):
    """Attention over full keys/values. ``fast``: on the CPU backend, prompt chunks go through
    BLAS + a Numba softmax (MLX's CPU exp is the bottleneck there); else mlx's SDPA, bit-equal
    to mlx-lm.

    column_mass: optional numpy (H, >= n) float32 the fast path adds, per key, the attention
    mass the chunk's queries (and the rep heads of each group) put on it (elsewhere
    :func:`column_mass` computes it). lse: optional numpy (Hq, L) float32 the fast path fills
    with each query row's log-sum-exp (untouched elsewhere)."""
    if exports_column_mass(queries, mask, sinks, fast):
        q = np.array(queries[0].astype(mx.float32))
        k = np.array(keys[0].astype(mx.float32))
        v = np.array(values[0].astype(mx.float32))
        out = causal_attention(q, k, v, float(scale), column_mass=column_mass, lse=lse)
        return mx.array(out)[None].astype(queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask,
                                                sinks=sinks)


def column_mass(queries, keys, scale, causal):
    """(H, n) float32, lazy: the attention mass per key of a chunk of queries (1, Hq, L, d)
    over keys (1, H, n, d), summed over the queries and the rep query heads of each group.

    In the model's dtype (float16 scores from float32-accumulated products, a float32 softmax,
    a float32-accumulated sum), with the causal mask applied to the chunk's own L keys only.
    H200, 2048-token chunks of a Llama-3-8B at 8k-12k tokens: the float32 scores, a mask over
    all n keys and the softmax took 290 ms of GPU time per chunk
    (bench/probes/prefill_profile.py)."""
    _, Hq, L, d = queries.shape
    H, n = keys.shape[1], keys.shape[2]
    rep = Hq // H
    q = (queries[0] * scale).astype(keys.dtype).reshape(H, rep * L, d)
    k = keys[0]
    s = q @ k.swapaxes(-1, -2)  # (H, rep * L, n)
    if causal:  # query p of the chunk sees keys up to n - L + p
        p = mx.tile(mx.arange(L), (rep,))[:, None]
        tail = q @ k[:, n - L:].swapaxes(-1, -2)  # its own product: s is updated in place
        s[..., n - L:] = mx.where(mx.arange(L)[None] <= p, tail, -mx.inf)
    w = mx.softmax(s, axis=-1, precise=True)
    ones = mx.ones((H, 1, rep * L), w.dtype)
    return (ones @ w)[:, 0].astype(mx.float32)  # the sum over queries, float32-accumulated


# ---- codes -------------------------------------------------------------------------------------
def encode(keys: np.ndarray, codebook: np.ndarray) -> np.ndarray:
    """keys (H, L, d) float32 -> codes (H, L, g)."""
    return K.codebook_encode(np.ascontiguousarray(keys, np.float32), codebook)


def scores(q: np.ndarray, codebook: np.ndarray, codes: np.ndarray, n: int, rep: int,
           out: np.ndarray | None = None) -> np.ndarray:
    """Approximate scores (Hq, n) of every live token from its codes; q (Hq, d) scaled."""
    T = K.codebook_lut(q, codebook, rep)
    return K.codebook_scores(codes, n, T, rep, out)


def h2o_seed(obs_q: mx.array | None, keys: mx.array, scale: float,
             column_mass: np.ndarray | None, rep: int) -> np.ndarray:
    """(H, n) initial H2O accumulators at compression: the mean attention each key received
    over the whole exact prefill (from the exported column mass: sum over queries that could
    see it, / (their count x rep)) plus what the last queries (the observation window, usually
    the question) put on it. keys (H, n, d) and obs_q (Hq, w, d) stay on the device."""
    H, n, _ = keys.shape
    out = np.zeros((H, n), np.float32)
    if column_mass is not None:
        m = min(n, column_mass.shape[1])  # keys appended after the last prompt chunk: no mass yet
        seen = (n - np.arange(m, dtype=np.float32)) * rep
        out[:, :m] += column_mass[:, :m] / seen
    if obs_q is not None:
        out += observed_weights(obs_q, keys, scale)
    return out


def observed_weights(obs_q: mx.array, keys: mx.array, scale: float,
                     block: int | None = None) -> np.ndarray:
    """(H, n) mean softmax weight that the observation queries (Hq, w, d) put on each key
    (H, n, d), computed on the device in blocks of keys (a max-and-sum pass, then the weights),
    so that memory stays O(w x block) whatever n is. ``block`` (keys): by default as many as
    keep a block's float32 scores within the score buffer's cap in force
    (cpu.attention.scratch_bytes, which a memory_budget's prefill lowers), at least 1024."""
    Hq, w, d = obs_q.shape
    H, n, _ = keys.shape
    rep = Hq // H
    if block is None:
        block = max(1024, scratch_bytes() // (4 * Hq * w))
    q = (obs_q.astype(mx.float32) * scale).reshape(H, rep * w, d)

    def scores(i):
        return mx.matmul(q, keys[:, i : i + block].astype(mx.float32).swapaxes(-1, -2))

    if n <= block:  # one block: one score pass
        return np.array(mx.softmax(scores(0), axis=-1).mean(axis=1).astype(mx.float32))
    m = mx.full((H, rep * w, 1), -mx.inf)
    total = mx.zeros((H, rep * w, 1))
    for i in range(0, n, block):  # online max and sum, a block's scores at a time
        s = scores(i)
        m_new = mx.maximum(m, s.max(axis=-1, keepdims=True))
        total = total * mx.exp(m - m_new) + mx.exp(s - m_new).sum(axis=-1, keepdims=True)
        m = m_new
        dispatch.eval(m, total)
    out = np.empty((H, n), np.float32)
    for i in range(0, n, block):
        out[:, i : i + block] = np.array((mx.exp(scores(i) - m) / total).mean(axis=1)
                                         .astype(mx.float32))
    return out


# ---- selection and the host partial --------------------------------------------------------------
def select(z, n, exclude, tau, cap, floor):
    """The CPU's tau_select (arguments in the order :mod:`tiered.runtime.primitives` gives) with its
    statistics: a :class:`tiered.runtime.primitives.Selection` of numpy arrays."""
    return K.tau_select(z, n, exclude, tau, cap, floor, with_stats=True)


def with_host_sinks(idx: np.ndarray, count: np.ndarray, sinks: int, exclude=None,
                    extra: np.ndarray | None = None):
    """A selection (idx (H, cap) ascending, -1 past count (H,)) that also holds the first
    ``sinks`` tokens of every kv head, except those ``exclude`` (H, >= sinks) flags as resident:
    the offloaded layout's sinks, gathered and rescored from the host with the rest (no
    accelerator bytes). ``extra`` (H, m): more tokens per head to join (-1: none; those
    ``exclude`` flags are left out too). Returns new (idx (H, cap + sinks + m), count)."""
    H, cap = idx.shape
    m = 0 if extra is None else extra.shape[1]
    first = np.arange(sinks, dtype=np.int32)
    out = np.full((H, cap + sinks + m), -1, np.int32)
    got = np.zeros(H, np.int32)
    for h in range(H):
        head = first if exclude is None else first[exclude[h, :sinks] == 0]
        sel = idx[h, : count[h]]
        row = np.concatenate([head, sel[sel >= sinks]])
        if m:
            more = extra[h][extra[h] >= sinks]
            if exclude is not None:  # a resident token is attended there, not twice
                more = more[exclude[h, more] == 0]
            row = np.union1d(row, more).astype(np.int32)
        out[h, : row.size] = row
        got[h] = row.size
    return out, got


def spill_changes(idx, count, res_tok, n, spill_tok):
    """See :func:`tiered.cpu.kernels.spill_changes` (the lookahead buffer's update)."""
    return K.spill_changes(idx, count, res_tok, n, spill_tok)


def submit_gather(scheduler, layer, q, z, idx, count, rep, host, rescore_exact, *,
                  z_by_slot=False):
    """Start the weighted sums of the selected host values, split by KV head across the
    workers. Returns a handle for :func:`wait_gather`; the caller works meanwhile.

    q (Hq, d) scaled queries (read when rescore_exact); z (Hq, n) scores by token id, or
    (Hq, cap) by selection slot with ``z_by_slot``; idx (H, cap) int32; count (H,) int32."""
    H = idx.shape[0]
    Hq = H * rep
    host.check_disk()  # a page file that shrank is an error here, not a SIGBUS in a worker
    args = K.host_store_args(host)
    o = np.zeros((Hq, host.value_dim), np.float32)
    lse = np.full(Hq, -np.inf, np.float32)
    if z is not None:
        z = np.ascontiguousarray(z, np.float32)
    batch = scheduler.batch(layer)
    for heads in split_heads(H, scheduler.workers or 1):
        batch.submit(_gather_job, q, z, idx, count, rep, args, rescore_exact, z_by_slot, o, lse,
                     (heads.start, heads.stop))
    return batch, o, lse


def wait_gather(handle, accelerator_seconds: float = 0.0):
    """(o (Hq, dv) normalized, lse (Hq,)) of a submitted gather; worker errors raise here."""
    batch, o, lse = handle
    batch.wait(accelerator_seconds)
    return o, lse


def gather_partial(scheduler, layer, q, z, idx, count, rep, host, rescore_exact):
    return wait_gather(submit_gather(scheduler, layer, q, z, idx, count, rep, host,
                                     rescore_exact))


def _gather_job(q, z, idx, count, rep, args, rescore_exact, z_by_slot, o, lse, heads):
    (page_ids, page_size, ppb, va, vsa, vcode, dv, ka, ksa, kcode, d) = args
    K.gather_partial(q, z, idx, count, rep, page_ids, page_size, ppb, va, vsa, vcode, dv, ka,
                     ksa, kcode, d, rescore_exact, o, lse, kv_heads=heads, z_by_slot=z_by_slot)

