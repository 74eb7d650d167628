"""Backend choice, kernel-source assembly and launches shared by the kernels of this package.

A kernel body is written once (``<name>.h``) in a small dialect that both ``mx.fast.metal_kernel``
and ``mx.fast.cuda_kernel`` accept once a per-backend prelude (``prelude.metal``,
``prelude.cu``) is put around it: the prelude's header part defines the barrier, shared-memory,
unroll and warp-reduction macros, its body-prologue part reads the thread indices into plain
ints (``tq_tid``, ``tq_bx`` ...). MLX generates the kernel signature from the input and output
names on both backends; runtime sizes travel as small int32/float32 arrays (``params``), since
a scalar input is a reference on Metal and a pointer on CUDA, and compile-time sizes as
template constants, which MLX turns into template parameters (Metal) or ``constexpr`` (CUDA).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from importlib import resources

import mlx.core as mx

from .compact import compact
from .ptx_cache import cuda_kernel

BACKENDS = ("metal", "cuda")
PROLOGUE_MARK = "// @body-prologue"
INNER_MARK = "// @inner"  # where a KernelSpec's inner body goes

# Bytes of threadgroup memory a Metal kernel may use (all Apple GPUs MLX runs on).
METAL_SHARED_BYTES = 32768
# Opt-in dynamic shared memory per block by CUDA compute capability (CUDA programming guide,
# "Technical Specifications per Compute Capability"); unknown devices get the portable 48 KB.
_CUDA_SHARED_BYTES = {
    (7, 0): 96 * 1024,
    (7, 2): 96 * 1024,
    (7, 5): 64 * 1024,
    (8, 0): 163 * 1024,
    (8, 6): 99 * 1024,
    (8, 7): 163 * 1024,
    (8, 9): 99 * 1024,
    (9, 0): 227 * 1024,
    (10, 0): 227 * 1024,
    (10, 3): 227 * 1024,
    (12, 0): 99 * 1024,
}
CUDA_PORTABLE_SHARED_BYTES = 48 * 1024


def accelerator() -> str:
    """Which kernel family the default device runs: ``"metal"``, ``"cuda"`` or ``"cpu"``.

    ``"cpu"`` also when a GPU exists but the default device was set to the CPU: custom kernels
    only run on a GPU stream, and the plain-MLX references run anywhere.
    """
    if mx.default_device().type != mx.DeviceType.gpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return "cpu"


def resolve_backend(use_kernel: bool | None, name: str) -> str | None:
    """The backend whose kernel to run, or None for the plain-MLX reference.

    ``use_kernel=None`` picks the kernel where one exists; ``True`` insists and raises
    ``ValueError`` on the CPU backend; ``False`` always takes the reference.
    """
    if use_kernel is False:
        return None
    backend = accelerator()
    if backend in BACKENDS:
        return backend
    if use_kernel:
        raise ValueError(
            f"Invalid use_kernel=True for {name}: no Metal or CUDA backend on the default "
            f"device ({mx.default_device()})"
        )
    return None


@functools.cache
def shared_memory_limit(backend: str) -> int:
    """Bytes of threadgroup/shared memory one kernel may ask for on ``backend`` (asked once per
    process: kernels are planned on every call)."""
    if backend == "metal":
        return METAL_SHARED_BYTES
    if backend == "cuda":
        try:
            info = mx.device_info()
            cc = (int(info["compute_capability_major"]), int(info["compute_capability_minor"]))
        except (KeyError, TypeError, ValueError, RuntimeError):
            return CUDA_PORTABLE_SHARED_BYTES
        return _CUDA_SHARED_BYTES.get(cc, CUDA_PORTABLE_SHARED_BYTES)
    raise ValueError(f"Invalid backend: {backend!r} (expected one of {BACKENDS})")


@functools.cache
def read_source(filename: str) -> str:
    """Text of a kernel source shipped in this package."""
    return resources.files(__package__).joinpath(filename).read_text(encoding="utf-8")


@functools.cache
def prelude(backend: str) -> tuple[str, str]:
    """(header, body prologue) of ``prelude.metal`` or ``prelude.cu``."""
    if backend not in BACKENDS:
        raise ValueError(f"Invalid backend: {backend!r} (expected one of {BACKENDS})")
    text = read_source("prelude.metal" if backend == "metal" else "prelude.cu")
    header, sep, prologue = text.partition(PROLOGUE_MARK + "\n")
    if not sep:
        raise RuntimeError(f"prelude for {backend} lacks the line {PROLOGUE_MARK!r}")
    return header, prologue


@dataclass(frozen=True)
class KernelSpec:
    """One kernel: its MLX name, the shared body file and the signature's names."""

    name: str
    body: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    atomic_outputs: bool = False  # Metal: outputs declared device atomic<T>*
    headers: tuple[str, ...] = ()  # source files appended to the prelude's header part
    inner: str | None = None  # a body put, in its own scope, at the body's INNER_MARK line

    def sources(self, backend: str, raw: bool = False) -> tuple[str, str]:
        """(header, source) exactly as handed to MLX for ``backend`` (``raw``: with the
        comments that CUDA's are handed over without)."""
        header, prologue = prelude(backend)
        header += "".join(read_source(f) for f in self.headers)
        body = read_source(self.body)
        if INNER_MARK in body:
            inner = "{\n" + read_source(self.inner) + "}\n" if self.inner else ""
            body = body.replace(INNER_MARK + "\n", inner, 1)
        elif self.inner:
            raise RuntimeError(f"{self.body} has no {INNER_MARK!r} line for {self.inner}")
        if backend == "cuda" and not raw:  # MLX CUDA hashes it at every launch: compact.py
            return compact(header), compact(prologue + body)
        return header, prologue + body


@dataclass
class Launch:
    """Everything one call of a kernel needs besides the kernel itself."""

    inputs: list
    template: list
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list
    output_dtypes: list
    shared_memory: int = 0  # CUDA dynamic shared memory in bytes (fixed per kernel object)
    init_value: float | None = None  # outputs filled with this before the kernel runs
    notes: dict = field(default_factory=dict)


@functools.cache
def build_kernel(spec: KernelSpec, backend: str, shared_memory: int = 0):
    """The MLX custom kernel for ``spec`` on ``backend``, built once per (spec, bytes)."""
    header, source = spec.sources(backend)
    if backend == "metal":
        return mx.fast.metal_kernel(
            name=spec.name,
            input_names=list(spec.input_names),
            output_names=list(spec.output_names),
            source=source,
            header=header,
            atomic_outputs=spec.atomic_outputs,
        )
    if backend == "cuda":
        return cuda_kernel(
            name=spec.name,
            input_names=list(spec.input_names),
            output_names=list(spec.output_names),
            source=source,
            header=header,
            shared_memory=shared_memory,
        )
    raise ValueError(f"Invalid backend: {backend!r} (expected one of {BACKENDS})")


def launch(spec: KernelSpec, backend: str, plan: Launch) -> list[mx.array]:
    """Run ``spec`` on ``backend`` as ``plan`` says; returns the outputs (lazy)."""
    kernel = build_kernel(spec, backend, plan.shared_memory if backend == "cuda" else 0)
    return kernel(
        inputs=plan.inputs,
        template=plan.template,
        grid=plan.grid,
        threadgroup=plan.threadgroup,
        output_shapes=plan.output_shapes,
        output_dtypes=plan.output_dtypes,
        init_value=plan.init_value,
    )


def token_blocks(n: int, lanes: int, *, rows: int, min_block: int, target_groups: int = 1024):
    """Split n tokens into blocks for ``rows`` independent rows of threadgroups.

    Returns (block_len, n_blocks): block_len a multiple of ``lanes`` and at least
    ``min_block`` tokens (to amortise per-threadgroup set-up), and about ``target_groups``
    threadgroups in all when n is large.
    """
    per_row = max(1, -(-target_groups // max(1, rows)))
    block = max(min_block, -(-n // per_row), lanes)
    block = -(-block // lanes) * lanes
    return block, max(1, -(-n // block))


# Small parameter arrays (sizes, tau ...) by value, created and evaluated once. On MLX's CUDA
# backend a fresh mx.array made from host values cost ~0.26 ms at its first use by a kernel
# (measured on an H200: 284 us for an op with a fresh 4 KB array vs 27 us with a cached one),
# more than the kernels themselves; decode steps repeat the same values across layers.
PARAM_CACHE_SIZE = 4096
_param_cache: OrderedDict = OrderedDict()
_param_lock = threading.Lock()


# Inside a compiled function's trace (:func:`traced_params`) the arrays are copies in device
# memory on CUDA instead: an array made from host values is managed memory there, and one of
# <= 8 bytes sits in MLX's small pool, which the GPU reads where it lies, over the bus. H200,
# the resident-scores kernel alone at 8192 slots a head (bench/probes/kernel_floor.py): 28.4 us with
# its two 4-byte parameters made from host values, 10.8 us with device copies. A trace keeps
# what it captures, so the copy is made once per value; outside a trace values that change
# every step (a host length) stay host-made (a copy would be a GPU op to wait for each time).
_traced = threading.local()


class traced_params:
    """Context (re-entrant, per thread) in which :func:`device_ints` / :func:`device_floats`
    give device-memory copies on MLX's CUDA backend: for the constants a trace captures."""

    def __enter__(self):
        _traced.depth = getattr(_traced, "depth", 0) + 1

    def __exit__(self, *exc):
        _traced.depth -= 1


def traced(fn):
    """``fn`` run inside :class:`traced_params` (the body given to ``mx.compile``: it runs only
    while a trace is made, so replays pay nothing)."""

    def body(*args):
        with traced_params():
            return fn(*args)

    return body


def _cuda_now() -> bool:
    # the device itself, not accelerator(): tools that fake the CUDA path on the CPU set that
    return mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available()


def _copy_stream() -> mx.Stream:
    """This thread's own GPU stream for the copies: evaluating one there waits for the copy
    alone, not for the step queued on the shared stream (tiered.runtime.dispatch)."""
    s = getattr(_traced, "stream", None)
    if s is None:
        s = _traced.stream = mx.new_stream(mx.gpu)
    return s


def _device_copy(values: tuple, dtype) -> mx.array:
    """``values`` in device memory: padded past MLX's 8-byte small pool, copied by a GPU op,
    evaluated; the first len(values) elements (a view) when padded."""
    padded = list(values) + [0] * max(0, 4 - len(values))
    with mx.stream(_copy_stream()):
        host = mx.array(padded, dtype=dtype)
        dev = host + mx.zeros(host.shape, dtype)
        if len(padded) > len(values):
            dev = dev[: len(values)]
        mx.eval(dev)
    return dev


def _host_made(values: tuple, dtype) -> mx.array:
    arr = mx.array(list(values), dtype=dtype)
    mx.eval(arr)  # made from host values: encodes nothing (no wait for tiered.runtime.dispatch)
    return arr


def _device_array(values: tuple, dtype) -> mx.array:
    on_device = bool(getattr(_traced, "depth", 0)) and _cuda_now()
    key = ("device" if on_device else "host", str(dtype), values)
    with _param_lock:
        arr = _param_cache.get(key)
        if arr is not None:
            _param_cache.move_to_end(key)
            return arr
    arr = (_device_copy if on_device else _host_made)(values, dtype)
    with _param_lock:
        _param_cache[key] = arr
        while len(_param_cache) > PARAM_CACHE_SIZE:
            _param_cache.popitem(last=False)
    return arr


def device_ints(*values: int) -> mx.array:
    """int32 array of ``values`` for a kernel's params input (cached by value; never mutate)."""
    return _device_array(tuple(int(v) for v in values), mx.int32)


def device_floats(*values: float) -> mx.array:
    """float32 array of ``values`` (cached by value; never mutate)."""
    return _device_array(tuple(float(v) for v in values), mx.float32)


def check_shape(name: str, arr: mx.array, expected: tuple, dtypes=None) -> None:
    """``ValueError`` naming ``name`` unless ``arr`` has ``expected`` shape (None: any size)."""
    shape = tuple(arr.shape)
    ok = len(shape) == len(expected) and all(e is None or e == s for e, s in zip(expected, shape))
    if not ok:
        want = "(" + ", ".join("*" if e is None else str(e) for e in expected) + ")"
        raise ValueError(f"Invalid shape of {name}: expected {want}, got {shape}")
    if dtypes is not None and arr.dtype not in dtypes:
        raise ValueError(f"Invalid dtype of {name}: expected one of {dtypes}, got {arr.dtype}")
