"""How a host block is allocated on MLX (tiered.cpu.host_tensor's blocks): a CPU-stream
``mx.full`` (managed memory on CUDA), asked a little longer than it is on CUDA, its fills spread
over a few CPU streams, queued ahead of need for the block maker's thread to read (issue 24)."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np

from .block_maker import MAKER, Ticket

MX_DTYPES = {"float16": mx.float16, "float32": mx.float32, "int8": mx.int8}
NP_DTYPES = {"float16": np.float16, "float32": np.float32, "int8": np.int8}

# Host pages per allocation, at most. Each block is an allocation of managed memory on MLX CUDA
# (cudaMallocManaged on the main thread, ahead of need): fewer, larger blocks cost less once
# the rest of a prompt chunk is cheap. H200, one lease, steady 2048-token prefill chunks of a
# Llama-3-8B at 200k tokens (bench/probes/prefill_profile.py --warm 200704 --chunks 32
# --pages-per-block 16 / 64): 116.1 ms per chunk with 16 pages (8 MB of values per layer) and
# 84.7 with 64 (32 MB). A block is still sized down to the tokens a layer holds when its pages
# are made, so short contexts do not take whole blocks.
MAX_PAGES_PER_BLOCK = 64

CUDA = bool(getattr(getattr(mx, "cuda", None), "is_available", lambda: False)())
# Bytes a block is asked longer than it is, on MLX's CUDA backend. MLX's allocator serves an
# allocation from its buffer cache when a freed buffer of at least the size and less than
# size + 32 KB is there, and a device buffer it hands to a CPU-stream array is first moved to
# managed memory (``move_to_unified_memory``: a managed allocation and a synchronous
# ``cudaMemcpy`` on the calling thread). A prefill frees device buffers of a block's exact
# 32 MB; 16 KB more (one allocator page) matches none of them: H200, a 32 MB block queued
# with such a buffer cached took 2.1-2.6 ms of the calling thread, 0.20 ms asked 16 KB longer
# (bench/probes/block_alloc_probe.py). The array is flat, its views the first elements, shaped.
PAD_BYTES = 16384 if CUDA else 0
PAD_MIN_BYTES = 1 << 20  # smaller blocks are asked as they are (a pad would outweigh them)
# CPU streams the blocks' fills are spread over (each stream is a thread of MLX's): one fill
# of a fresh 32 MB managed block took ~28 ms on an H200's host (first touch of its pages).
FILL_STREAMS = 4 if CUDA else 1
# Per thread: MLX streams belong to the thread that made them ("There is no Stream(cpu, 7) in
# current thread" when a cache made in one thread grew its host pages in another).
_local = threading.local()


def _fill_stream():
    """The next CPU stream of FILL_STREAMS (made on first use in this thread), in turn."""
    if FILL_STREAMS <= 1:
        return mx.cpu
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = [mx.new_stream(mx.cpu) for _ in range(FILL_STREAMS)]
    streams.append(streams.pop(0))
    return streams[-1]


def full_block(shape, dtype: str, fill) -> mx.array:
    """The block as one lazy CPU-stream array: ``mx.full`` of ``shape``, or flat and
    PAD_BYTES longer (its numpy views: ``block_maker.np_view(arr, shape)``; its MLX array
    as shaped: :func:`shaped`)."""
    dt = MX_DTYPES[dtype]
    n = int(np.prod(shape))
    pad = PAD_BYTES // dt.size if PAD_BYTES and n * dt.size >= PAD_MIN_BYTES else 0
    shape = shape if not pad else (n + pad,)
    return mx.full(shape, fill, dtype=dt, stream=_fill_stream())


def shaped(arr: mx.array, shape) -> mx.array:
    """A block's MLX array as ``shape`` (its first elements where it was allocated longer)."""
    shape = tuple(shape)
    if arr.shape == shape:
        return arr
    return arr[: int(np.prod(shape))].reshape(shape)


def alloc_block(shape, dtype: str):
    # Unwritten slots hold NaN (int8: 0, with NaN scales) so a read past the end shows up.
    fill = 0 if dtype == "int8" else float("nan")
    arr = full_block(shape, dtype, fill)
    mx.eval(arr)
    return arr


def block_ahead(shape, dtype: str, prepare=None) -> Ticket:
    """A block like :func:`alloc_block`'s, queued on a CPU stream ahead of need (its fill
    runs there) and read (and prepared) by the block maker's thread, not this one."""
    arr = full_block(shape, dtype, float("nan"))
    mx.async_eval(arr)
    return MAKER.submit(arr, prepare, shape)
