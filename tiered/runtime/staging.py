"""Small int32 uploads on MLX's CUDA backend without ``mx.array(numpy)`` (issue 24).

A decode step uploads a few small index arrays per token (the append's columns, the step's
sizes, a refresh's slots and ids). ``mx.array(numpy)`` takes its buffer from MLX's cache, and
when that buffer was a GPU output (device memory), MLX first moves it to managed memory
(``move_to_unified_memory``: ``cudaMallocManaged``, a ``cudaMemcpy`` and a free), and when it
was managed memory the GPU touched, the CPU's copy faults its pages back. On an H200 at 128k
tokens those uploads took 1.9 ms of the main thread per token, 0.14 ms each, and a
refresh's about 1 ms (bench/probes/device_host_profile.py).

Here an upload is written into a ring of page-locked host memory
(:func:`tiered.runtime.uva.register`)
and one small kernel copies it into a device array in the stream's order, reading the host
memory in place: the CPU writes memory no GPU maps for writing, and MLX allocates the output
as any kernel's. A region of the ring is written again only once the copies that read it ran:
before the ring wraps over records it still holds, their outputs are evaluated
(:func:`tiered.runtime.dispatch.eval`, which returns at once for copies already run), half a ring at
a time. A decode token makes a few records of 1 KiB; at 128k tokens with flat attention (most
heavy tokens replaced) a refresh made one of more than 1 MiB, over the largest record of the
4 MiB ring of before (a quarter of it): it fell back to ``mx.array`` (py-spy, H200).

Elsewhere (the CPU backend, Metal's unified memory) :func:`upload` is ``mx.array``.

H200, 2026-11-26: an 8 KB upload takes 0.025 ms of host time against 0.051, and three small
kernels reading it 24 us of device time against 452 (bench/upload_readers.py, in git history); in
the 128k decode step (bench/probes/device_probe.py, rounds of 15 steps alternating ``ENABLED``, two
leases) 9 of 10 paired rounds were faster with the ring, by 0.9 ms/token on average.
"""

from __future__ import annotations

import collections
import os
import threading

import mlx.core as mx
import numpy as np

from ..metal.compact import compact
from ..metal.ptx_cache import cuda_kernel
from . import dispatch, uva

RING_INTS = 1 << 22  # 16 MiB of int32 (a refresh at 128k with flat attention: over 1 MiB)
HEADER = 4  # ints before each record's data: its length, then padding (16-byte aligned data)
# Records start at multiples of GRANULE ints, so at most RING_INTS / GRANULE address arrays are
# ever made (one per start, kept): starts at any 4-int boundary made a new one for most
# uploads (itself an mx.array upload) and kept up to 262,144 of them.
GRANULE = 256
BLOCKS = 64  # most threadgroups of a copy

_COPY = r"""
    // out[i] = the record's data[i]: the record (host memory, page-locked) starts at
    // addr[0] with its length as its first int32; data begin 16 bytes in.
    const int32_t* src = reinterpret_cast<const int32_t*>(addr[0]);
    const uint32_t n = (uint32_t)src[0];
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = src[4 + i];
"""


ENABLED = os.environ.get("TIERED_STAGING", "1") != "0"  # TIERED_STAGING=0: mx.array as before


def enabled() -> bool:
    """Whether uploads go through the ring (MLX on CUDA, and ``ENABLED``)."""
    return bool(ENABLED) and uva.available()


_copy_kernel = None


def copy_kernel():
    """The ring's copy kernel (one per process): an address (1,) uint64 in, int32 out."""
    global _copy_kernel
    if _copy_kernel is None:
        _copy_kernel = cuda_kernel(name="tiered_staged_copy", input_names=["addr"],
                                   output_names=["out"], source=compact(_COPY))
    return _copy_kernel


class Ring:
    """The page-locked ring and the copies still reading it (see the module docstring)."""

    def __init__(self, ints: int = RING_INTS):
        if ints % GRANULE or ints < 4 * GRANULE:
            raise ValueError(f"ring of {ints} ints: a multiple of {GRANULE}, at least "
                             f"{4 * GRANULE}")
        self.buf = np.zeros(ints, np.int32)
        self.base = uva.register(self.buf)
        self.at = 0  # next free int
        self.held: collections.deque = collections.deque()  # (start, end, out) in ring order
        self.addrs: dict[int, mx.array] = {}  # record start -> its address array
        self.lock = threading.Lock()
        self.kernel = copy_kernel()

    def upload(self, a: np.ndarray) -> mx.array:
        flat = np.ascontiguousarray(a, np.int32).reshape(-1)
        n = flat.size
        need = -(-(HEADER + n) // GRANULE) * GRANULE
        if n == 0 or need > self.buf.size // 4:
            return _host_made(a)
        with self.lock:
            tail = None
            if self.at + need > self.buf.size:
                tail, self.at = self.at, 0  # wrap: records never straddle the end
            start, end = self.at, self.at + need
            self._release(start, end, tail)
            self.buf[start] = n
            self.buf[start + HEADER : start + HEADER + n] = flat
            self.at = end
            addr = self.addrs.get(start)
            if addr is None:
                addr = self.addrs[start] = uva.address_array([self.base + 4 * start])
            threads = min(BLOCKS, -(-n // 256)) * 256
            # At least 16 bytes out: MLX puts arrays of <= 8 bytes in its small pool of
            # managed memory, which kernels read over the bus (metal._build._device_copy)
            (out,) = self.kernel(inputs=[addr], output_shapes=[(max(n, 4),)],
                                 output_dtypes=[mx.int32], grid=(threads, 1, 1),
                                 threadgroup=(256, 1, 1))
            self.held.append((start, end, out))
        return (out if n >= 4 else out[:n]).reshape(np.shape(a))

    def _release(self, start: int, end: int, tail: int | None) -> None:
        """Wait for the copies that read [start, end) of the ring (held from the lap before)
        and, at a wrap from ``tail``, for the records the last lap did not reach (two laps
        old: the front of ``held`` from ``tail`` on). Records are released a half ring at a
        time: the whole half [start, end) falls in, so the next records there wait for
        nothing. A wait (:func:`tiered.runtime.dispatch.eval`) first waits for the dispatcher
        thread, which one per record made the main thread wait once the ring had wrapped."""
        half = self.buf.size // 2
        end = -(-end // half) * half
        outs = []
        while self.held and tail is not None and self.held[0][0] >= tail:
            outs.append(self.held.popleft()[2])
        while self.held and _overlaps(self.held[0], start, end):
            outs.append(self.held.popleft()[2])
        if outs:
            dispatch.eval(*outs)


def _overlaps(rec: tuple, start: int, end: int) -> bool:
    return rec[0] < end and start < rec[1]


def _host_made(a: np.ndarray) -> mx.array:
    x = mx.array(np.asarray(a, np.int32))  # int32 as the staged copy
    mx.eval(x)  # made from host values: encodes nothing (no wait for tiered.runtime.dispatch)
    return x


_ring: Ring | None = None


def upload(a: np.ndarray) -> mx.array:
    """An int32 device copy of ``a``: staged through the ring on CUDA (lazy: evaluated with
    what reads it), else ``mx.array`` (evaluated)."""
    global _ring
    if not enabled():
        return _host_made(a)
    if _ring is None:
        _ring = Ring()
    return _ring.upload(a)


def pack(parts: list) -> np.ndarray:
    """The arrays of ``parts`` as int32, flattened and concatenated (what :func:`upload_many`
    uploads; tiered.layer.refresh_plan packs on a worker thread ahead)."""
    return np.concatenate([np.asarray(a, np.int32).reshape(-1) for a in parts])


def upload_many(parts: list, packed: np.ndarray | None = None) -> list:
    """Views of one upload (:func:`upload`) of every int32 array in ``parts`` (``packed``:
    :func:`pack` of them, made already)."""
    flat = upload(pack(parts) if packed is None else packed)
    views, at = [], 0
    for a in parts:
        views.append(flat[at : at + np.size(a)].reshape(np.shape(a)))
        at += np.size(a)
    return views
