"""Runs tiered's CUDA kernels (``mx.fast.cuda_kernel`` bodies) on the CPU executor.

The kernel text is the source MLX generates for the launch
(:func:`tiered.metal.kernel_source.kernel_source`, the one tiered compiles into MLX's PTX cache),
with MLX's includes replaced by cuda_shim.h, each ``Shape`` / ``Strides`` argument a pointer
to the input's sizes / strides, and, once preprocessed (the shared kernels' CUDA prelude is
macros), each ``__shared__`` declaration rewritten into a reference to one array per block
and ``extern __shared__`` into a pointer to the launch's dynamic shared memory. Blocks run as
the executor's threadgroups, whole as CUDA launches them (the grid is rounded up to whole
blocks; MLX computes ``ceil(grid / threadgroup)`` blocks).

:func:`cuda_kernel` has ``mx.fast.cuda_kernel``'s call signature and returns MLX arrays, so a
test can put it in place of a module's ``cuda_kernel`` and run the module's own wrapper;
:func:`route_device_path` sends all of tiered's device path here. Users: the raw kernels of
the device step and its op-by-op decode (tests/test_device_decode.py,
tests/test_device_attend_kernels.py, tests/test_device_door.py), the shared kernels of
tiered.metal in their CUDA form (tests/test_cuda_exec_kernels.py).
"""

from __future__ import annotations

import ctypes
import functools
import os
import re

import mlx.core as mx
import numpy as np

from tiered.metal.kernel_source import HEADER, kernel_source

from . import MAX_THREADS, _output, to_numpy
from .build import CXX, HERE, _run, build_unit

MARK = "__tqx_shared"  # __shared__ as the preprocessor leaves it (see _rewritten)
STATEMENT = re.compile(r"(extern\s+)?" + MARK + r"\s+([^;{}]*);")


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "[(" and 1 or ch in "])" and -1 or 0
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def rewrite_shared(text: str, dynamic_bytes: int = 0) -> tuple[str, int]:
    """Each ``__shared__ T a[..], b[..][..];`` of the preprocessed ``text`` as references to
    the runtime's per-block storage, and ``extern __shared__ T name[];`` as a pointer to
    ``dynamic_bytes`` of it (the launch's dynamic shared memory); returns the text and the
    number of declarators."""
    sites = 0

    def alloc(nbytes: str) -> str:
        nonlocal sites
        sites += 1
        return f"::tqx::threadgroup_alloc({sites - 1}, {nbytes})"

    def replace(m):
        extern, stmt = m.group(1), m.group(2)
        first = re.search(r"(\w+)\s*\[", stmt)
        if first is None:
            raise NotImplementedError(f"__shared__ {stmt}: only arrays are emulated")
        ctype = stmt[: first.start()].strip()
        if extern:
            return (f"{ctype}* {first.group(1)} = reinterpret_cast<{ctype}*>("
                    f"{alloc(str(max(16, dynamic_bytes)))});")
        out = []
        for d in _split_top(stmt[first.start():]):
            name = re.match(r"\s*(\w+)", d).group(1)
            dims = d[d.index("["):].strip()
            out.append(f"{ctype} (&{name}){dims} = *reinterpret_cast<{ctype}(*){dims}>("
                       f"{alloc(f'sizeof({ctype}{dims})')});")
        return " ".join(out)

    return STATEMENT.sub(replace, text), sites


@functools.lru_cache(maxsize=512)
def _rewritten(text: str, dynamic_bytes: int) -> tuple[str, int]:
    """``text`` preprocessed (the shared kernels' prelude is macros: TQ_SHARED and the like
    expand to ``__shared__`` declarations), then :func:`rewrite_shared`."""
    pre = _run([CXX, "-std=c++17", "-E", "-P", f"-D__shared__={MARK}", "-x", "c++", "-"], text)
    return rewrite_shared(pre, dynamic_bytes)


def _params(input_names, inputs, output_names, source) -> list[tuple[str, int]]:
    """(kind, index) of each argument of MLX's generated kernel, in order."""
    out = []
    for i, (n, (_, ndim)) in enumerate(zip(input_names, inputs)):
        out.append(("input", i))
        if ndim > 0:
            out += [(kind, i) for kind in ("shape", "strides", "ndim") if f"{n}_{kind}" in source]
    return out + [("output", i) for i in range(len(output_names))]


# PTX the executor maps to its own code (statement as the kernels write it -> C++).
PTX = {'asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));': "t = tqx_cuda_globaltimer();"}


def written_inputs(source: str, input_names) -> set[str]:
    """Inputs the kernel writes through a ``const_cast`` (CUDA allows it; tiered's persistent
    selection counts in its ``sync`` input): mapped writable, the others read-only."""
    return {n for n in input_names if re.search(rf"const_cast<[^>]*>\(\s*{n}\s*\)", source)}


def kernel_unit(name, input_names, output_names, source, header, inputs, output_dtypes,
                template, dynamic_bytes: int = 0) -> tuple[str, int]:
    """The C++ translation unit of one launch and its number of shared declarators."""
    func, text = kernel_source(name, input_names, output_names, source, header, inputs,
                               output_dtypes, template)
    text = text.replace(HEADER, "").replace("namespace cg = cooperative_groups;", "")
    for ptx, cpp in PTX.items():
        text = text.replace(ptx, cpp)
    text = text.replace("const __grid_constant__ Shape ", "const int32_t* ")
    text = text.replace("const __grid_constant__ Strides ", "const int64_t* ")
    text, sites = _rewritten(text, dynamic_bytes)
    args = [f"*(const int*)b[{k}]" if kind == "ndim" else f"tqx_cuda_arg(b[{k}])"
            for k, (kind, _) in enumerate(_params(input_names, inputs, output_names, source))]
    call = f"mlx::core::cu::{func}(" + ", ".join(args) + ");"
    entry = ('extern "C" void tqx_kernel_thread(void* const* b) {\n  ' + call + "\n}\n")
    shim = ('#include "cuda_shim.h"\n#define inf INFINITY\n'
            "struct tqx_cuda_ptr { void* p; template <typename T> operator T*() const "
            "{ return static_cast<T*>(p); } };\n"
            "inline tqx_cuda_ptr tqx_cuda_arg(void* p) { return tqx_cuda_ptr{p}; }\n")
    return shim + text + entry, sites


def run(spec: dict, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
        init_value=None, seed: int = 1, workers: int | None = None) -> list[np.ndarray]:
    """One launch of the kernel ``spec`` (``mx.fast.cuda_kernel``'s keyword arguments) on the
    CPU; the outputs as numpy arrays (bfloat16 as its bits)."""
    arrays = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
    arrays = [mx.contiguous(a) for a in arrays]  # MLX's ensure_row_contiguous
    sig = [(a.dtype, a.ndim) for a in arrays]
    template = list(template or ())
    names, source = spec["input_names"], spec["source"]
    dynamic = int(spec.get("shared_memory", 0) or 0)
    unit, _ = kernel_unit(spec["name"], names, spec["output_names"], source,
                          spec.get("header", ""), sig, output_dtypes, template, dynamic)
    lib = build_unit(unit, "cuda-" + spec["name"], salt=(HERE / "cuda_shim.h").read_bytes())
    params = _params(names, sig, spec["output_names"], source)
    bufs = []
    for kind, i in params:
        a = arrays[i] if kind != "output" else None
        if kind == "input":
            bufs.append(to_numpy(a))
        elif kind == "shape":
            bufs.append(np.array(a.shape or (0,), np.int32))
        elif kind == "strides":
            st = np.cumprod((a.shape[1:] + (1,))[::-1])[::-1] if a.ndim else [0]
            bufs.append(np.array(st, np.int64))
        elif kind == "ndim":
            bufs.append(np.array([a.ndim], np.int32))
        else:
            bufs.append(_output(output_shapes[i], output_dtypes[i], init_value))
    outputs = bufs[-len(output_shapes):]
    n = len(bufs)
    threads = int(np.prod(threadgroup))
    if threads > MAX_THREADS:
        raise RuntimeError(f"{spec['name']}: a block of {threads} threads")
    whole = [-(-g // t) * t for g, t in zip(grid, threadgroup)]
    ptrs = (ctypes.c_void_p * n)(*[b.ctypes.data for b in bufs])
    nbytes = (ctypes.c_ulong * n)(*[b.nbytes for b in bufs])
    written = written_inputs(spec.get("header", "") + source, names)
    writable = (ctypes.c_int * n)(*[int(kind == "output" or kind == "input"
                                        and names[i] in written) for kind, i in params])
    stats = (ctypes.c_ulonglong * 2)()
    err = ctypes.create_string_buffer(4096)
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2
    rc = lib.tqx_launch(ptrs, nbytes, writable, ctypes.c_int(n), (ctypes.c_uint * 3)(*whole),
                        (ctypes.c_uint * 3)(*threadgroup), ctypes.c_ulong(48 * 1024 + dynamic),
                        ctypes.c_int(workers), ctypes.c_ulonglong(seed), stats, err,
                        ctypes.c_int(len(err)))
    if rc != 0:
        raise RuntimeError(f"{spec['name']}: {err.value.decode()}")
    return outputs


def cuda_kernel(**spec):
    """``mx.fast.cuda_kernel`` run on the CPU: the launch returns MLX arrays."""
    def launch(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
               init_value=None, **_):
        outs = run(spec, inputs=inputs, output_shapes=output_shapes,
                   output_dtypes=output_dtypes, grid=grid, threadgroup=threadgroup,
                   template=template, init_value=init_value)
        return [mx.array(o).view(mx.bfloat16) if d == mx.bfloat16 else mx.array(o)
                for o, d in zip(outs, output_dtypes)]
    return launch


def route_device_path(monkeypatch) -> None:
    """Make tiered take its CUDA device path on this (CPU) machine, op by op, every kernel run
    here: MLX's ``cuda_kernel`` is :func:`cuda_kernel`, the accelerator answers "cuda", the
    host pages' addresses are their own (page-locking and advice do nothing), uploads are
    ``mx.array`` (no page-locked ring) and ``TIERED_COMPILE=0`` (a compiled trace cannot call
    a kernel that runs at once). ``monkeypatch`` undoes it; the caller clears
    ``tiered.metal._build.build_kernel``'s cache after (it is cleared here first)."""
    import sys

    from tiered.step import device_chunks, device_encode
    from tiered.runtime import staging, uva
    from tiered.metal import _build, ptx_cache
    from tiered.step.chunk_word import KernelTable

    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_kernel)
    monkeypatch.setitem(ptx_cache._state, "enabled", False)
    monkeypatch.setenv("TIERED_COMPILE", "0")
    monkeypatch.setattr(staging, "ENABLED", False)
    monkeypatch.setattr(uva, "available", lambda: True)
    monkeypatch.setattr(uva, "advise_host", lambda view: view.ctypes.data)
    monkeypatch.setattr(uva, "register", lambda buf: buf.ctypes.data)
    monkeypatch.setattr(uva, "unregister", lambda buf_or_ptr: None)
    real = _build.accelerator
    for mod in list(sys.modules.values()):
        if not (getattr(mod, "__name__", "") or "").startswith("tiered"):
            continue
        if getattr(mod, "accelerator", None) is real:
            monkeypatch.setattr(mod, "accelerator", lambda: "cuda")
        for value in list(vars(mod).values()):  # kernels built elsewhere
            if isinstance(value, KernelTable):
                monkeypatch.setattr(value, "built", {})
    monkeypatch.setattr(device_chunks, "_KERNEL", None)
    monkeypatch.setattr(device_encode, "_kernel", None)
    _build.build_kernel.cache_clear()
