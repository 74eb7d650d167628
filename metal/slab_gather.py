"""The device step's chunk gather from host pages held in slabs (issue 61: Apple silicon).

On CUDA the step reads the selected chunks from host pages at their addresses
(:func:`tiered.step.device_decode.gather_chunks`). A Metal kernel takes arrays, so there the host
tensor's blocks are carved from slabs (:mod:`tiered.cpu.slabs`) and :func:`gather_slabs` takes
the tensor's ``MAX_SLABS`` slabs and their table as inputs: the same rows, zeros where a token
is not attended, and which tokens were read (``ok``). The body (``slab_gather.h``) is shared by
Metal and CUDA; :func:`gather_slabs_ops` is its plain-MLX reference.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..cpu.slabs import MAX_SLABS
from ._build import KernelSpec, Launch, device_ints, launch, resolve_backend

SLABS = tuple(f"s{i}" for i in range(10))  # the body's inputs s0..s9
assert len(SLABS) == MAX_SLABS, "slab_gather.h reads exactly MAX_SLABS slabs"
SPEC = KernelSpec(
    name="tiered_slab_gather", body="slab_gather.h",
    input_names=("idx", "count", "pages", "flags", "params", "table") + SLABS + ("after",),
    output_names=("out", "ok"),
)
THREADS = 256
HOST_MX = {"float16": mx.float16, "float32": mx.float32}


def _check(tensor, idx, count, pages, flags, n_host: int, chunk: int):
    if tensor.slabs is None:
        raise ValueError("gather_slabs needs a host tensor on slabs (unified=True)")
    H = tensor.n_kv_heads
    if idx.ndim != 2 or idx.shape[0] != H or count.shape != (H,):
        raise ValueError(f"Invalid shapes: idx {tuple(idx.shape)}, count {tuple(count.shape)} "
                         f"(expected ({H}, CAPC) and ({H},))")
    if flags.ndim != 2 or flags.shape[0] != H or flags.shape[1] < n_host:
        raise ValueError(f"Invalid flags shape {tuple(flags.shape)}: expected ({H}, >= {n_host})")
    if pages.ndim != 1 or pages.shape[0] * tensor.page_size < n_host:
        raise ValueError(f"Invalid page table of {pages.shape[0]} pages for {n_host} tokens")
    if chunk < 1 or tensor.page_size % chunk:
        raise ValueError(f"Invalid chunk {chunk}: must divide the page size {tensor.page_size}")


def gather_slabs(tensor, idx: mx.array, count: mx.array, pages: mx.array, flags: mx.array,
                 n_host: int, chunk: int, *, after: mx.array | None = None,
                 params: mx.array | None = None, use_kernel: bool | None = None):
    """Rows (H, CAPC * chunk, D) in the host dtype of the selected chunks of ``tensor`` (a
    HostTensor on slabs) and ``ok`` (H, CAPC * chunk) bool: chunk idx[h, s] of kv head h for
    s < count[h], token by token where it is below ``n_host`` and not resident (flags[h, t]
    == 0); zeros elsewhere. ``pages``: int32 physical page of each logical page. ``params``:
    the kernel's int32 [CAPC, F, n_host] as an array the caller holds (a compiled step);
    ``after``: an array the launch waits for (the pages' fence)."""
    _check(tensor, idx, count, pages, flags, n_host, chunk)
    backend = resolve_backend(use_kernel, "gather_slabs")
    if backend is None:
        return gather_slabs_ops(tensor, idx, count, pages, flags, n_host, chunk)
    plan = gather_launch(tensor, idx, count, pages, flags, n_host, chunk, after, params)
    return tuple(launch(SPEC, backend, plan))


def gather_launch(tensor, idx, count, pages, flags, n_host: int, chunk: int,
                  after: mx.array | None = None, params: mx.array | None = None) -> Launch:
    """Launch plan of slab_gather.h: one thread per element of the rows read."""
    H, capc = idx.shape
    D, pool = tensor.head_dim, tensor.slabs
    params = device_ints(capc, flags.shape[1], n_host) if params is None else params
    return Launch(
        inputs=[idx.astype(mx.int32), count.astype(mx.int32), pages.astype(mx.int32), flags,
                params, pool.table(), *pool.inputs(),
                device_ints(0) if after is None else after],
        template=[("H", H), ("C", chunk), ("P", tensor.page_size),
                  ("PPB", tensor.pages_per_block), ("D", D)],
        grid=(-(-H * capc * chunk * D // THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(H, capc * chunk, D), (H, capc * chunk)],
        output_dtypes=[HOST_MX[tensor.dtype], mx.bool_],
    )


def gather_slabs_ops(tensor, idx, count, pages, flags, n_host: int, chunk: int):
    """Reference of :func:`gather_slabs` in MLX ops (any device)."""
    _check(tensor, idx, count, pages, flags, n_host, chunk)
    H, capc = idx.shape
    D, P, ppb, pool = tensor.head_dim, tensor.page_size, tensor.pages_per_block, tensor.slabs
    j = mx.arange(chunk, dtype=mx.int32)
    slot = mx.arange(capc, dtype=mx.int32)
    t = (idx.astype(mx.int32)[:, :, None] * chunk + j).reshape(H, capc * chunk)
    selected = mx.repeat(slot[None, :] < count.astype(mx.int32)[:, None], chunk, axis=1)
    safe = mx.where(selected & (t < n_host), t, 0)
    resident = mx.take_along_axis(flags, safe, axis=1).astype(mx.int32) != 0
    ok = selected & (t < n_host) & ~resident
    pp = mx.take(pages.astype(mx.int32), safe // P)
    b = pp // ppb
    starts = mx.array(np.array(pool.starts[:-1], np.int32))
    s = mx.sum(b[..., None] >= starts[1:], axis=-1)  # the last slab whose start <= b
    heads = mx.arange(H, dtype=mx.int32)[:, None]
    row = ((b - mx.take(starts, s)) * ppb + pp % ppb) * H + heads
    at = (row * P + safe % P)[..., None] * D + mx.arange(D, dtype=mx.int32)
    out = mx.zeros((H, capc * chunk, D), mx.float32)
    for k, slab in enumerate(pool.slabs):
        here = (ok & (s == k))[..., None]
        vals = mx.take(slab, mx.where(here, at, 0).reshape(-1)).reshape(at.shape)
        out = mx.where(here, vals.astype(mx.float32), out)
    return out.astype(HOST_MX[tensor.dtype]), ok
