"""Custom CUDA kernels compiled once per machine, not once per process.

MLX 0.32 names each custom kernel's module ``custom_kernel_<name><template hash>_<hash>`` (the
hash: ``std::hash`` of the generated source) and looks for it in its PTX disk cache before it
compiles with NVRTC, but it never writes custom kernels there. So every process compiled every
kernel again: 5-8 s of a 1M-token prefill on an H200 and most of the first decode step
(py-spy: ``JitModule::JitModule`` under ``CustomKernel::eval_gpu``). :func:`cuda_kernel` wraps
``mx.fast.cuda_kernel``: the first launch of each (template, dtypes) signature builds the source
MLX will build (``build_kernel`` of ``custom_kernel.cpp``) and, when the cache lacks it, compiles
it (:mod:`tiered.metal.nvrtc`) and writes the entry; MLX then reads it instead of compiling.

The compiles run side by side while the graph is built, each started from a pool thread in a
process of its own (:mod:`tiered.metal.nvrtc_child`: NVRTC compiles one program at a time per
process), and the places that hand a graph to MLX wait for them first (:func:`settle`): MLX
compiles its own JIT kernels one at a time under a process-wide lock, and so did this cache in
the launching thread, which left a cold machine's first decode step compiling for well over a
minute (H200, Llama-3-8B shape: still compiling 105 s into the run, py-spy).

Processes side by side share the compiles: each entry is compiled under a lock file beside it
(:mod:`tiered.metal.ptx_claim`), and the others wait for it.

Nothing depends on it for correctness: an entry is found only under the hash of the exact source
MLX generates, so a mismatch (another MLX version) is a miss and MLX compiles as before, and any
failure turns the cache off with one warning. ``TIERED_PTX_CACHE=0`` turns it off.
"""

from __future__ import annotations

import os
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

from .kernel_source import CUDA_TYPES, kernel_source, ptx_path, std_hash

_lock = threading.Lock()
_state = {"enabled": os.environ.get("TIERED_PTX_CACHE", "1") != "0", "compiled": 0}
_pending: dict = {}  # entry path -> the Future writing it
_later: dict = {}  # the same, for compiles nothing waits for before join_later
_idle: dict = {}  # the same, for compiles only a launch (or a request now) waits for
_pool: ThreadPoolExecutor | None = None
_ahead = threading.local()  # .on: launches only request their compiles (see ahead)


def request(name, input_names, output_names, source, header, inputs, output_dtypes,
            template, later: bool = False, idle: bool = False) -> Future | None:
    """Start writing the cache entry for one launch unless it is there or being written: the
    compile runs from a pool of threads, each in a process of its own (tiered.metal.nvrtc),
    so the kernels a graph needs compile side by side while it is built; :func:`settle`
    waits for them before the graph is evaluated (``later``, ``idle``: see :func:`pending`).
    Returns the compile's future, or None."""
    func, text = kernel_source(name, input_names, output_names, source, header, inputs,
                               output_dtypes, template)
    module = f"{func}_{std_hash(text):x}"
    path = ptx_path(module)
    if path.exists():
        return None
    ordinal = _ordinal()  # read on the caller's thread (MLX's default device is per thread)
    return pending(path, _write, text, module, func, path, ordinal, later=later, idle=idle)


def pending(path: Path, make, *args, later: bool = False, idle: bool = False) -> Future:
    """The job writing the entry ``path``: the one already started, else ``make(*args)``
    started on the pool; :func:`settle` waits for it (:mod:`tiered.metal.mlx_warm` adds
    MLX's own), or, ``later``, only :func:`join_later` (compiles for a later phase, which the
    graphs before it do not wait for), or, ``idle``, nothing until a launch of it (the decode
    step's, compiled during a prefill whose compressions need none of them). A job started
    for later or idle and asked for now is waited for now; one started idle and asked for
    later, by join_later."""
    with _lock:
        if not (later or idle):
            _wait_now([path])
        elif later and not idle and path in _idle:  # made at import, now for a compression
            _later[path] = _idle.pop(path)
        got = _pending.get(path) or _later.get(path) or _idle.get(path)
        if got is None:
            got = _executor().submit(make, *args)
            (_idle if idle else _later if later else _pending)[path] = got
    return got


@contextmanager
def ahead():
    """Inside, on this thread, a launch of a cached kernel launches nothing: it requests its
    compile, idle (:meth:`CachedKernel.prepare`), and returns zeros of its output shapes. A
    graph built inside and never evaluated then says which kernels it would launch, and they
    compile meanwhile (:func:`tiered.step.compile_ahead.decode_kernels`)."""
    before = getattr(_ahead, "on", False)
    _ahead.on = True
    try:
        yield
    finally:
        _ahead.on = before


def _wait_now(paths) -> None:
    """Entries started for later or idle that the next settle waits for (the caller holds
    _lock)."""
    for path in paths:
        for bucket in (_later, _idle):
            if path in bucket:
                _pending.setdefault(path, bucket.pop(path))


def join_later() -> None:
    """Wait for the compiles started for later (a layer's compression waits for those
    requested for it: :mod:`tiered.step.compile_ahead`, the modules of
    :mod:`tiered.metal.mlx_warm` the compression launches)."""
    if _later:
        with _lock:
            _wait_now(list(_later))
    settle()


def _write(text: str, module: str, func: str, path: Path, ordinal: int) -> Path:
    from . import nvrtc, ptx_claim

    with ptx_claim.held(path):
        if path.exists():
            return path  # another process compiled it while this one waited
        return _compile_entry(nvrtc, text, module, func, path, ordinal)


def _compile_entry(nvrtc, text: str, module: str, func: str, path: Path, ordinal: int) -> Path:
    kernel = "mlx::core::cu::" + func
    code, mangled = nvrtc.compile_kernel(text, module, kernel, ordinal)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = f".{os.getpid()}.{threading.get_ident()}.tmp"
    txt = path.with_suffix(".txt")
    Path(str(txt) + tmp).write_text(f"{kernel}\t{mangled}\n")
    os.replace(str(txt) + tmp, txt)  # MLX finds the .ptx first, then reads the names
    Path(str(path) + tmp).write_bytes(code)
    os.replace(str(path) + tmp, path)
    with _lock:
        _state["compiled"] += 1
    return path


def compile_threads() -> int:
    """Threads that compile kernels side by side: ``TIERED_COMPILE_THREADS``, else one per
    core up to 16."""
    env = os.environ.get("TIERED_COMPILE_THREADS")
    return max(1, int(env)) if env else max(1, min(16, os.cpu_count() or 1))


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(compile_threads(), thread_name_prefix="tiered-nvrtc")
    return _pool


def settle() -> None:
    """Wait for the compiles started so far, before MLX evaluates a graph that launches those
    kernels (MLX would otherwise compile each missing one itself, one at a time). A failed
    compile turns the cache off with one warning: MLX then compiles as it would without it."""
    if not _pending:
        return
    with _lock:
        jobs = list(_pending.items())
    for path, job in jobs:
        try:
            job.result()
        except Exception as e:  # noqa: BLE001 - never worse than MLX compiling it
            _disable(e)
        finally:
            with _lock:
                _pending.pop(path, None)


def _disable(e: BaseException) -> None:
    if _state["enabled"]:
        _state["enabled"] = False
        warnings.warn(f"tiered: custom kernels are not cached on disk ({e}); MLX compiles "
                      "them in each process", RuntimeWarning, stacklevel=3)


def _ordinal() -> int:
    """The default device's CUDA ordinal (MLX's Python Device may not expose it)."""
    return int(getattr(mx.default_device(), "index", 0) or 0)


def _signature(x) -> tuple:
    return (x.dtype, x.ndim) if isinstance(x, mx.array) else (mx.array(x).dtype, 0)


class CachedKernel:
    """``mx.fast.cuda_kernel(...)`` whose launches find their compiled module on disk; with the
    native launcher (``TIERED_NATIVE=1``, :mod:`tiered.metal.native`) each launch is instead a
    native program of the same compiled kernel (:class:`NativeKernel`)."""

    def __init__(self, **spec):
        self.spec = spec
        self.kernel = mx.fast.cuda_kernel(**spec)
        self.seen: set = set()
        self.later: dict = {}  # key -> the compile prepared for later (see prepare)
        self.native: NativeKernel | None = None

    def __call__(self, **launch):
        if getattr(_ahead, "on", False):
            self.prepare([_signature(x) for x in launch["inputs"]], launch["output_dtypes"],
                         launch.get("template") or (), idle=True)
            return [mx.zeros(s, d) for s, d in zip(launch["output_shapes"],
                                                   launch["output_dtypes"])]
        if NATIVE:
            if self.native is None:
                self.native = NativeKernel(self.spec)
            got = self.native(launch)
            if got is not None:
                return got
        if _state["enabled"]:
            template = tuple(launch.get("template") or ())
            inputs = tuple(_signature(x) for x in launch["inputs"])
            key = (template, inputs, tuple(launch["output_dtypes"]))
            if key not in self.seen:
                self._ensure(template, inputs, launch["output_dtypes"], key)
            elif self.later and key in self.later:  # prepared: the next settle waits for it
                job = self.later.pop(key)
                with _lock:
                    _wait_now([p for bucket in (_later, _idle) for p, got in bucket.items()
                               if got is job])
        return self.kernel(**launch)

    def prepare(self, inputs, output_dtypes, template=(), idle: bool = False) -> None:
        """Start compiling the launch with ``inputs`` given as (dtype, ndim) pairs (what a
        launch's key holds of its arrays), ``output_dtypes`` and ``template``, without
        launching, for later: no settle waits for it until :func:`join_later` (not where
        ``idle``) or a launch of that signature."""
        if _state["enabled"]:
            template, inputs = tuple(template or ()), tuple(tuple(i) for i in inputs)
            key = (template, inputs, tuple(output_dtypes))
            if key not in self.seen:
                self._ensure(template, inputs, output_dtypes, key, later=True, idle=idle)

    def _ensure(self, template, inputs, output_dtypes, key, later: bool = False,
                idle: bool = False) -> None:
        s = self.spec
        with _lock:
            if key in self.seen or not _state["enabled"]:
                return
            self.seen.add(key)
        try:
            job = request(s["name"], s["input_names"], s["output_names"], s["source"],
                          s.get("header", ""), inputs, output_dtypes, template, later=later,
                          idle=idle)
            if later and job is not None:
                self.later[key] = job
        except Exception as e:  # noqa: BLE001 - never worse than MLX compiling it
            _disable(e)


NATIVE = True  # False: custom kernels launch through MLX even where the native launcher runs


class NativeKernel:
    """One custom kernel launched as a native program (:mod:`tiered.metal.native`): the source
    MLX would generate, compiled once per machine (the PTX cache's entry) and loaded once per
    process, its parameters laid out as MLX lays them (each input's address, then its shape,
    strides and ndim where the source names them, then each output's address). What MLX's
    launch costs the host and this does not: the source hashed at every launch, the module
    looked up by name, a fill kernel and a scalar array per ``init_value``."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.built: dict = {}

    def __call__(self, launch: dict) -> list | None:
        from . import native

        mod = native.cuda()
        if mod is None:
            return None
        inputs = [x if isinstance(x, mx.array) else mx.array(x) for x in launch["inputs"]]
        dtypes = list(launch["output_dtypes"])
        template = tuple(launch.get("template") or ())
        key = (template, tuple((x.dtype, x.ndim) for x in inputs), tuple(dtypes))
        got = self.built.get(key)
        if got is None:
            got = self.built[key] = self._build(mod, key, inputs, dtypes, template)
        fn, args, contiguous = got
        grid, group = launch["grid"], launch["threadgroup"]
        blocks = tuple(-(-g // t) for g, t in zip(grid, group))
        threads = tuple(min(t, g) for g, t in zip(grid, group))
        launches = []
        init = launch.get("init_value")
        shapes = [list(s) for s in launch["output_shapes"]]
        if init is not None:
            launches += [_fill(mod, o, d, shape, init) for o, (d, shape) in
                         enumerate(zip(dtypes, shapes))]
        launches.append(mod.Launch(fn, blocks, threads, self.spec.get("shared_memory", 0), args))
        return list(mod.run(launches, inputs, shapes, dtypes, [-1] * len(dtypes), [],
                            contiguous, launch.get("stream") or _stream()))

    def _build(self, mod, key, inputs, dtypes, template) -> tuple:
        from . import native

        s = self.spec
        sig = key[1]
        path = ptx_path(self._module(sig, dtypes, template))
        job = request(s["name"], s["input_names"], s["output_names"], s["source"],
                      s.get("header", ""), sig, dtypes, template)
        if job is not None:
            job.result()
        code = path.read_bytes()
        mangled = path.with_suffix(".txt").read_text().split("\t")[1].strip()
        fn = mod.load_function(code, mangled, s.get("shared_memory", 0))
        args = []
        for i, (n, (_, ndim)) in enumerate(zip(s["input_names"], sig)):
            args.append(native.inp(i))
            if ndim > 0:
                args += [(kind, i) for suffix, kind in (("_shape", native.SHAPE),
                                                        ("_strides", native.STRIDES),
                                                        ("_ndim", native.NDIM))
                         if n + suffix in s["source"]]
        args += [native.out(o) for o in range(len(dtypes))]
        contiguous = list(range(len(inputs))) if s.get("ensure_row_contiguous", True) else []
        return fn, args, contiguous

    def _module(self, sig, dtypes, template) -> str:
        s = self.spec
        func, text = kernel_source(s["name"], s["input_names"], s["output_names"], s["source"],
                                   s.get("header", ""), sig, dtypes, template)
        return f"{func}_{std_hash(text):x}"


_FILL = r"""
#include "mlx/backend/cuda/device/utils.cuh"

__global__ void tiered_native_fill(%(T)s* out, long long n, float v) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = static_cast<%(T)s>(v);
}
"""


def _fill(mod, o: int, dtype, shape: list, value: float):
    """A launch filling output ``o`` with ``value`` cast to its dtype (MLX's init_value)."""
    from . import native

    n = 1
    for d in shape:
        n *= d
    fn = native.function(_FILL % {"T": CUDA_TYPES[dtype]}, "tiered_native_fill")
    return mod.Launch(fn, (max(1, -(-n // 256)), 1, 1), (256, 1, 1), 0,
                      [native.out(o), native.i64(n), native.f32(value)])


def _stream():
    """The default stream of this thread's default device, read at every launch (the
    dispatcher's shared stream becomes a thread's default after its first kernels)."""
    return mx.default_stream(mx.default_device())


def cuda_kernel(**spec) -> CachedKernel:
    """``mx.fast.cuda_kernel`` with the same keyword arguments, cached per machine."""
    return CachedKernel(**spec)


def enable(flag: bool) -> None:
    """Turn the cache on or off for this process (tools that fake the kernels turn it off)."""
    _state["enabled"] = bool(flag)


def compiled_here() -> int:
    """How many cache entries this process compiled and wrote."""
    return _state["compiled"]
