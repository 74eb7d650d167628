"""Runs tiered's Metal kernels on the CPU, for tests on machines without an Apple GPU.

``run(spec, plan)`` launches ``spec`` as ``tiered.metal._build.launch`` would on Metal: the
kernel text wrapped as ``mx.fast.metal_kernel`` wraps it, the plan's inputs, template
arguments, grid (in threads) and threadgroup, and returns the outputs as numpy arrays. The
kernel is compiled by the system C++ compiler against an executing shim of the Metal standard
library (shim.h) and run by runtime.cpp: threadgroups on a few OS threads, each threadgroup's
threads as fibers that meet at barriers and at 32-lane simdgroup operations. Outputs start as
a NaN pattern (or the plan's init_value), so an element the kernel leaves unwritten shows.
"""

from __future__ import annotations

import ctypes
import os
from typing import NamedTuple

import mlx.core as mx
import numpy as np
import pytest

from tiered.metal._build import METAL_SHARED_BYTES

from .build import build, compiler

__all__ = ["Result", "compiler", "needs_compiler", "run", "to_numpy"]

# The tests that run kernels here skip where there is no compiler.
needs_compiler = pytest.mark.skipif(
    compiler() is None,
    reason="the kernel executor needs a C++ compiler (g++, or the one $CXX names): none found",
)
MAX_THREADS = 1024  # per threadgroup on every Apple GPU (maxTotalThreadsPerThreadgroup)
_NUMPY = {mx.bfloat16: np.uint16}  # no numpy dtype: carried as its bits
# An unwritten output element reads as this (a NaN in float dtypes).
_POISON = {1: b"\xa5", 2: b"\x5a\x7e", 4: b"\xa5\xa5\xa5\x7f", 8: b"\xa5" * 7 + b"\x7f"}


class Result(NamedTuple):
    outputs: list  # numpy arrays, the plan's output shapes and dtypes
    threadgroup_bytes: int  # threadgroup memory the kernel declares (16-byte aligned arrays)
    threads: int  # threads per threadgroup as dispatched (the plan's, clipped to the grid)


def to_numpy(arr: mx.array) -> np.ndarray:
    """arr as a row-contiguous numpy array of the same bits (bfloat16 as uint16)."""
    if arr.dtype in _NUMPY:
        arr = arr.view(mx.uint16)
    return np.ascontiguousarray(np.array(arr))


def _output(shape, dtype, init_value) -> np.ndarray:
    np_dtype = np.dtype(_NUMPY[dtype] if dtype in _NUMPY else str(dtype).split(".")[-1])
    if init_value is not None:
        return np.full(shape, init_value, dtype=np_dtype)
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(_POISON[np_dtype.itemsize] * count, dtype=np_dtype).reshape(shape).copy()


def run(spec, plan, *, header: str | None = None, source: str | None = None, seed: int = 1,
        threadgroup_limit: int = METAL_SHARED_BYTES, workers: int | None = None,
        extra_flags: tuple[str, ...] = ()) -> Result:
    """Launch ``spec`` (a KernelSpec) as ``plan`` (a Launch) says; header/source replace the
    spec's Metal sources (a test's own kernel, or an edited copy). seed picks the fibers'
    order in each round (0: thread order). Raises RuntimeError on a kernel error (divergent
    barrier or simdgroup operation, threadgroup memory over threadgroup_limit, more than
    MAX_THREADS threads per threadgroup)."""
    if header is None or source is None:
        spec_header, spec_source = spec.sources("metal")
        header = spec_header if header is None else header
        source = spec_source if source is None else source
    lib, sites = build(spec, plan, header, source, tuple(extra_flags))
    buffers = [to_numpy(a) for a in plan.inputs]
    outputs = [_output(s, d, plan.init_value)
               for s, d in zip(plan.output_shapes, plan.output_dtypes)]
    arrays = buffers + outputs
    n = len(arrays)
    ptrs = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
    nbytes = (ctypes.c_ulong * n)(*[a.nbytes for a in arrays])
    writable = (ctypes.c_int * n)(*([0] * len(buffers) + [1] * len(outputs)))
    grid = (ctypes.c_uint * 3)(*plan.grid)
    group = (ctypes.c_uint * 3)(*plan.threadgroup)
    stats = (ctypes.c_ulonglong * 2)()
    err = ctypes.create_string_buffer(4096)
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2
    rc = lib.tqx_launch(ptrs, nbytes, writable, ctypes.c_int(n), grid, group,
                        ctypes.c_ulong(threadgroup_limit), ctypes.c_int(workers),
                        ctypes.c_ulonglong(seed), stats, err, ctypes.c_int(len(err)))
    if rc != 0:
        raise RuntimeError(f"{spec.name}: {err.value.decode()}")
    if sites and stats[1] != (1 << sites) - 1:
        raise RuntimeError(f"{spec.name}: a threadgroup-memory declaration was never reached, "
                           "so the bytes it adds are unknown")
    threads = int(np.prod([min(t, g) for t, g in zip(plan.threadgroup, plan.grid)]))
    return Result(outputs, int(stats[0]), threads)
