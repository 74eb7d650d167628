"""MLX's own CUDA kernels compiled side by side, before a cold machine's first prefill needs them.

MLX compiles its JIT kernels (gathers, scatters) on the thread that first evaluates one, one at
a time under a process-wide lock, and keeps each in its PTX disk cache
(:func:`tiered.metal.nvrtc.cache_dir`). A module's name holds dtypes and the number of index
arrays, not sizes, so a tiny op compiles the module a million-token step launches. On an H100
that had run nothing, a 1M-token prefill of the Llama-3-8B shape waited for seven of them
(~4.5 s each; docs/million-tokens.md): 12,020 tok/s against 20,563 on the same machine once
they were cached. Seven small processes compiled seven such modules (six of those gathers and a
scatter) in 5.6 s together, against 27.1 s one after another.

:func:`start` (``TieredCache.for_model`` on CUDA) runs one small process per module that the
device path launches and the cache lacks (:func:`modules`: the gathers and scatters, and the
model's fused swiglu, which on a second cold H100 was the first evaluation's longest wait, 6.5
s), each with its own ``MLX_PTX_CACHE_DIR`` beside the cache, then moves what it wrote into
the cache: the names file first, then the PTX, each by a rename, as
:mod:`tiered.metal.ptx_cache` writes its own entries (MLX finds the PTX, then reads the names).
Each entry is made under its lock file (:mod:`tiered.metal.ptx_claim`), so processes side by
side make it once. Each module is made for the part of a run that first launches it
(:data:`_MODULES`): the first prompt chunk's two (the embedding's gather, the swiglu) join the
PTX cache's pending compiles, and the first graph tiered hands to MLX waits for them
(:func:`tiered.metal.ptx_cache.settle`); the compression's compile meanwhile, and a layer
waits for them where it compresses (:func:`tiered.metal.ptx_cache.join_later`); the decode's
are made once those are done, on a thread nothing waits for, and a long prompt's decode finds
them made. (On that H100, the first evaluation waited 7.1 s for all twelve side by side.)
The prefill's modules start at ``import tiered`` (:func:`start_early`). A failure only warns
(MLX then compiles as before); ``TIERED_WARM_KERNELS=0`` turns it off.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from concurrent import futures
from pathlib import Path

import mlx.core as mx

from . import ptx_cache, ptx_claim
from .nvrtc import cache_dir

TIMEOUT_S = 90.0  # one module's process (an MLX import and one NVRTC compile: ~3 s on an H100)
_started: set = set()  # the dtypes started in this process
_warned = threading.Event()

# MLX module name -> the op that makes MLX compile it, with {D} the data dtype and {I} the
# index dtype; {d} is the model's dtype, and float16 too (the host rows). The others: scores
# (float32), codes (uint8), ids (int32, int64).
_GATHER = "x = mx.zeros((64, 8), {D}); mx.eval(x[mx.zeros((2,), {I})])"
_GATHER2 = "x = mx.zeros((4, 8, 2), {D}); i = mx.zeros((1,), {I}); mx.eval(x[i, i])"
_AXIS = "x = mx.zeros((4, 64), {D}); mx.eval(mx.take_along_axis(x, mx.zeros((4, 2), {I}), axis=1))"
_SCATTER2 = ("x = mx.zeros((4, 8, 2), {D}); i = mx.zeros((1,), {I}); "
             "x[i, i] = mx.ones((1, 2), {D}); mx.eval(x)")
_SCATTER_AXIS = ("x = mx.zeros((4, 64), {D}); mx.eval(mx.put_along_axis(x, mx.zeros((4, 2), {I}), "
                 "mx.ones((4, 2), {D}), axis=1))")
# mlx-lm's swiglu (Llama, Mistral, Qwen MLPs), an ``mx.compile``d function: MLX names its fused
# module after the traced graph, the inputs' kinds and dtypes (f2 float16, V2 bfloat16, f4
# float32) and a hash of its constants, never the shapes (``Compiled``'s kernel_lib_, the same
# on every backend). On a cold H100 it was the first evaluation's longest wait (6.5 s); the same
# function traced here makes the same module without importing mlx-lm (its import took a
# process ~1 s more here, and that process was the last of the prefill's to finish, 12 s).
_SWIGLU = ("import mlx.nn as nn; f = mx.compile(lambda g, x: nn.silu(g) * x, shapeless=True); "
           "a = mx.zeros((2, 8), {D}); b = mx.zeros((2, 8), {D}); mx.eval(f(a, b))")
_SWIGLU_NAME = ("C{k}ISigmoidAD{k}IBroadcastACE{k}IBroadcastCAF{k}IMultiplyDEG{k}IBroadcastFBH{k}"
                "IBroadcastBFI{k}OMultiplyGH_VV_{k}{k}_6142509188972423790")
_KINDS = {"float16": "f2", "bfloat16": "V2", "float32": "f4"}
# When a 1M-token prefill on a cold H100 first launched each (MLX's PTX cache by write time,
# compiled one at a time as met): the first prompt chunk the embedding's gather and the swiglu;
# the compression at the prefill window's end the others of the prefill; the first decode steps
# the gathers and scatters of DECODE.
FIRST, COMPRESS, DECODE = "first", "compress", "decode"
PREFILL = (FIRST, COMPRESS)
_MODULES = [  # (name, op, data dtype: None for the model's and float16, "model" for the
    # model's alone, index dtype, first needed)
    ("gather_{d}_int32_1", _GATHER, "model", "int32", FIRST),  # the embedding
    ("gather_{d}_int32_1", _GATHER, "float16", "int32", COMPRESS),  # host rows
    ("gather_{d}_uint32_1", _GATHER, None, "uint32", COMPRESS),
    ("gather_{d}_int64_2", _GATHER2, None, "int64", DECODE),
    ("gather_axis_{d}_int32", _AXIS, None, "int32", COMPRESS),
    ("scatter_{d}_int64_Assign_2", _SCATTER2, None, "int64", DECODE),
    ("scatter_axis_{d}_int32_Assign", _SCATTER_AXIS, None, "int32", DECODE),
    ("gather_axis_{d}_int32", _AXIS, "float32", "int32", COMPRESS),
    ("gather_axis_{d}_uint32", _AXIS, "float32", "uint32", COMPRESS),
    ("gather_{d}_int32_1", _GATHER, "int64", "int32", COMPRESS),
    ("scatter_axis_{d}_int32_Assign", _SCATTER_AXIS, "float32", "int32", DECODE),
    ("scatter_axis_{d}_int32_Assign", _SCATTER_AXIS, "uint8", "int32", DECODE),
    ("scatter_axis_{d}_int32_Assign", _SCATTER_AXIS, "int32", "int32", DECODE),
    ("{swiglu}", _SWIGLU, "model", None, FIRST),
]


def enabled() -> bool:
    return os.environ.get("TIERED_WARM_KERNELS", "1") != "0"


def modules(dtype: str, phase=None) -> dict[str, str]:
    """MLX module name -> the Python that compiles it, for a model of ``dtype`` ("float16",
    "bfloat16", "float32"); ``phase``: only those a run first needs then (:data:`FIRST`,
    :data:`COMPRESS`, :data:`DECODE`, or a tuple of them), each in the earliest."""
    out, first = {}, {}
    for name, op, data, index, when in _MODULES:
        dtypes = {None: dict.fromkeys((dtype, "float16")), "model": (dtype,)}.get(data, (data,))
        for d in dtypes:
            full = name.format(d=d, swiglu=_SWIGLU_NAME.format(k=_KINDS.get(d, "?")))
            if full not in out:
                out[full], first[full] = op.format(D=f"mx.{d}", I=f"mx.{index}"), when
    wanted = (phase,) if isinstance(phase, str) else phase
    return {k: v for k, v in out.items() if wanted is None or first[k] in wanted}


def model_dtype(model) -> str | None:
    """The floating dtype of ``model``'s first floating parameter (a quantized model's scales),
    as MLX names it, or None."""
    from mlx.utils import tree_flatten

    for _, p in tree_flatten(model.parameters()):
        if isinstance(p, mx.array) and p.dtype in (mx.float16, mx.bfloat16, mx.float32):
            return str(p.dtype).rsplit(".", 1)[-1]
    return None


def start(dtype: str | None, root: Path | None = None, python: str | None = None) -> list:
    """Compile the modules of :func:`modules` missing from MLX's PTX cache (``root``), each in
    its own process, on the PTX cache's pool; the futures of the prefill's (the first settle
    waits for the first chunk's, a layer's compression for the others: ``join_later``).
    Nothing where the default device is not a CUDA GPU, turned off, or started for ``dtype``
    before."""
    from ._build import _cuda_now

    # the device itself, not accelerator(): the tools and tests that fake the CUDA path on
    # the CPU set that, and MLX on the CPU compiles nothing
    if dtype is None or not enabled() or not _cuda_now() or dtype in _started:
        return []
    _started.add(dtype)
    root = cache_dir() if root is None else root
    python = python or sys.executable
    jobs, decode = [], []
    for phase in (FIRST, COMPRESS, DECODE):
        for job in _missing(dtype, phase, root, python):
            if phase == DECODE:
                decode.append(job)
            else:  # the compression's: waited for where a layer compresses (join_later)
                jobs.append(ptx_cache.pending(job[2], _make, *job, later=phase == COMPRESS))
    if decode:  # once the prefill's are made, on their own thread: no settle waits for them
        threading.Thread(target=_after, args=(jobs, decode), name="tiered-warm-decode",
                         daemon=True).start()
    return jobs


EARLY_DTYPES = ("float16", "bfloat16")  # what models run in on a GPU


def start_early(root: Path | None = None, python: str | None = None) -> list:
    """The prefill's modules (:data:`PREFILL`: the first chunk's, then the compression's) for
    float16 and bfloat16 models, missing from MLX's PTX cache, started at ``import tiered`` on
    a CUDA GPU: they compile while the model loads. Started only once it had loaded
    (:func:`start`, ``TieredCache.for_model``), a cold H100 waited 7.5 s for the first chunk's
    at a 1M-token prefill's first chunk; with those made at import, the main thread still spent
    6.2 s of the first chunks in NVRTC under MLX's ``Gather::eval_gpu`` (py-spy, native): a
    gather compiled in the process while the compression's were compiling aside. Idle:
    :func:`start` for the model's dtype makes the first settle wait for the first chunk's and a
    compression for the others; nothing waits for the other dtype's. Their futures; nothing
    off CUDA or turned off."""
    from ._build import _cuda_now

    if not enabled() or not _cuda_now():
        return []
    root = cache_dir() if root is None else root
    python = python or sys.executable
    return [ptx_cache.pending(job[2], _make, *job, idle=True)
            for phase in PREFILL for dtype in EARLY_DTYPES
            for job in _missing(dtype, phase, root, python)]


def _missing(dtype: str, phase: str, root: Path, python: str) -> list[tuple]:
    """:func:`_make`'s arguments (name, op, entry, root, python) for each module of ``phase``
    that the cache under ``root`` lacks."""
    out = []
    for name, op in modules(dtype, phase).items():
        entry = ptx_cache.ptx_path(name, root)
        if not entry.exists():
            out.append((name, op, entry, root, python))
    return out


def _after(first: list, later: list) -> None:
    """The decode's modules, side by side, once ``first`` (the prefill's jobs) are done: they
    do not take cores from the modules a prefill waits for."""
    futures.wait(first)
    with futures.ThreadPoolExecutor(len(later), thread_name_prefix="tiered-warm") as pool:
        list(pool.map(lambda job: _make(*job), later))


def start_for(model) -> list:
    """:func:`start` for ``model``'s dtype (read only where it can start)."""
    from ._build import _cuda_now

    return start(model_dtype(model)) if enabled() and _cuda_now() else []


def _make(name: str, op: str, entry: Path, root: Path, python: str) -> bool:
    """One module in a process of its own, moved into the cache; False (with one warning)
    where that failed."""
    try:
        with ptx_claim.held(entry):
            if entry.exists():
                return True  # another process made it while this one waited
            root.mkdir(parents=True, exist_ok=True)
            private = Path(tempfile.mkdtemp(prefix=".warm.", dir=root))
            try:
                env = dict(os.environ, MLX_PTX_CACHE_DIR=str(private))
                # out at once when made: on a cold H100 processes ended 1.4-2 s after writing
                # their entry (the module's load, then CUDA's teardown at exit)
                code = "import mlx.core as mx\n" + op + "\nimport os; os._exit(0)"
                subprocess.run([python, "-c", code], env=env,
                               check=True, timeout=TIMEOUT_S, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
                made = ptx_cache.ptx_path(name, private)
                if not made.exists():
                    raise RuntimeError(f"MLX wrote no {made.name} ({sorted(private.iterdir())})")
                for suffix in (".txt", ".ptx", ".cu"):  # the names before the PTX
                    src = made.with_suffix(suffix)
                    if src.exists():
                        os.replace(src, entry.with_suffix(suffix))
                return True
            finally:
                shutil.rmtree(private, ignore_errors=True)
    except Exception as e:  # noqa: BLE001 - never worse than MLX compiling it itself
        if not _warned.is_set():
            _warned.set()
            detail = getattr(e, "stderr", b"") or b""
            warnings.warn(f"tiered: MLX's kernel {name} was not compiled ahead ({e!r} "
                          f"{detail.decode(errors='replace')[-300:]}); MLX compiles it when "
                          "first needed", RuntimeWarning, stacklevel=2)
        return False
