"""tiered's native launcher: kernels as one MLX primitive that may write its inputs in place.

On an H200 the device step's time is the host's: MLX spends ~10 us of host time per custom
kernel it encodes (output allocation, the source hashed at every launch, an ``init_value``
fill, its graph bookkeeping; docs/decode-speed-gpu.md), and a decode token's append was a
dozen such kernels a layer plus the copies its scatters made of their sources. MLX arrays are
immutable and MLX's CUDA graph orders a kernel only after the last *declared* writer of each
buffer it reads, so a custom kernel cannot safely update a buffer in place from Python.

``native.cpp`` adds the missing primitive: launches of kernels compiled here (NVRTC,
:mod:`tiered.metal.nvrtc`) with a plain parameter list (64-bit integers, new output addresses,
input addresses), whose outputs may alias inputs that the kernels write. It declares every
buffer it writes to MLX's command encoder, so later readers are ordered after it. Readers
*before* it in the same graph are not (MLX has no such edge): the caller passes every lazy array
that still reads a buffer it writes as an input (:mod:`tiered.step.native_append`).

Its users: a decode token's append (:mod:`tiered.step.native_append`), every custom kernel
(:class:`tiered.metal.ptx_cache.NativeKernel`) and the dispatcher's worker thread
(``native_dispatch.cpp``, :mod:`tiered.runtime.dispatch`). It is opt-in (``TIERED_NATIVE=1``):
on an H200 none of them measured faster (32k, alternating rounds on one cache: the append 23.1
against 22.7 ms/token; native kernels 19.9 against 19.6; the C++ worker 18.8; rounds spread
~2 ms; docs/decode-speed-gpu.md), the token being bound by the GPU there as much as the host. Once asked for, it is built
with the C++ compiler and nanobind (a dependency), against the MLX headers the wheel ships, into
``~/.cache/tiered/native`` (``TIERED_NATIVE_DIR``); about 5 s. Where that fails (no compiler,
another MLX ABI), :func:`load` says why once and returns None, and tiered keeps the Python
route. ``python -m tiered.metal.native`` builds it and prints where.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import threading
import warnings
from importlib import resources
from pathlib import Path

_lock = threading.Lock()
_state: dict = {}
_loaded: dict = {}  # build path -> the module executed from it
NAME = "_tiered_native"


def enabled() -> bool:
    """Whether the native launcher is asked for (``TIERED_NATIVE=1``)."""
    return os.environ.get("TIERED_NATIVE", "0") == "1"


SOURCES = ("native.cpp", "native_dispatch.cpp")


def source() -> str:
    """The module's C++ sources, joined (what its build directory is named after)."""
    return "".join(resources.files(__package__).joinpath(f).read_text(encoding="utf-8")
                   for f in SOURCES)


def _mlx_root() -> Path:
    import mlx

    for root in mlx.__path__:
        if (Path(root) / "include" / "mlx" / "array.h").exists():
            return Path(root)
    raise FileNotFoundError("the MLX package ships no C++ headers (mlx/include)")


def build_dir() -> Path:
    """Where the module for this source, Python ABI and MLX version is built: a new directory
    whenever any of them changes."""
    import mlx.core as mx

    key = hashlib.sha256((source() + sysconfig.get_config_var("EXT_SUFFIX") + mx.__version__)
                         .encode()).hexdigest()[:16]
    root = os.environ.get("TIERED_NATIVE_DIR") or Path.home() / ".cache" / "tiered" / "native"
    return Path(root) / key


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which(
        "clang++")


def build(verbose: bool = False) -> Path:
    """Compile native.cpp into this build's directory (nothing when it is there); its path."""
    out_dir = build_dir()
    target = out_dir / (NAME + sysconfig.get_config_var("EXT_SUFFIX"))
    if target.exists():
        return target
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++; or set CXX)")
    import nanobind

    nb = Path(nanobind.include_dir()).parent
    mlx_root = _mlx_root()
    out_dir.mkdir(parents=True, exist_ok=True)
    srcs = []
    for name in SOURCES:
        srcs.append(out_dir / name)
        srcs[-1].write_text(resources.files(__package__).joinpath(name).read_text(
            encoding="utf-8"))
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cxx, "-std=c++20", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-DNDEBUG",
           "-DNB_DOMAIN=mlx", f"-I{nb / 'include'}", f"-I{nb / 'ext' / 'robin_map' / 'include'}",
           f"-I{sysconfig.get_paths()['include']}", f"-I{mlx_root / 'include'}", *map(str, srcs),
           str(nb / "src" / "nb_combined.cpp"), f"-L{mlx_root / 'lib'}", "-lmlx",
           f"-Wl,-rpath,{mlx_root / 'lib'}", "-ldl", "-o", str(tmp)]
    if verbose:
        print("tiered.native: building", target, file=sys.stderr, flush=True)
    got = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if got.returncode != 0:
        raise RuntimeError(f"{cxx} failed:\n{got.stderr[-4000:]}")
    os.replace(tmp, target)
    return target


def load():
    """The native module, or None where it cannot be built or loaded (said once)."""
    with _lock:
        if "module" in _state:
            return _state["module"]
        module, why = None, None
        if not enabled():
            why = "not asked for (TIERED_NATIVE=1)"
        else:
            try:
                import mlx.core  # noqa: F401 - the module's array type comes from here

                path = build(verbose=os.environ.get("TIERED_NATIVE_VERBOSE") == "1")
                module = _loaded.get(path)
                if module is None:  # once per process: nanobind registers its types once
                    spec = importlib.util.spec_from_file_location(NAME, path)
                    module = importlib.util.module_from_spec(spec)
                    spec.loader.exec_module(module)
                    _loaded[path] = module
            except Exception as e:  # noqa: BLE001 - the Python route stays
                module, why = None, f"{type(e).__name__}: {e}"
        _state["module"], _state["why"] = module, why
        if why is not None and enabled():
            warnings.warn(f"tiered: the native launcher is unavailable ({why}); the Python "
                          "route runs instead", RuntimeWarning, stacklevel=2)
        return module


def why_not() -> str | None:
    """Why the native launcher does not run on this process's MLX build, or None."""
    module = load()
    if module is None:
        return _state.get("why") or "not built"
    if not module.cuda_ready():
        return f"not on MLX's CUDA backend ({module.cuda_missing()})"
    return None


def cuda():
    """The module where it can launch on CUDA, else None."""
    got = _state.get("cuda", False)
    if got is not False:
        return got
    module = load()
    got = module if module is not None and module.cuda_ready() else None
    if got is not None:
        try:
            got.set_copy_functions([function(_COPY % {"T": t}, "tiered_native_copy")
                                    for t in ("uint8_t", "uint16_t", "uint32_t", "uint64_t")])
        except Exception as e:  # noqa: BLE001 - the Python route stays
            warnings.warn(f"tiered: the native launcher is unavailable ({type(e).__name__}: "
                          f"{e}); the Python route runs instead", RuntimeWarning, stacklevel=2)
            got = None
    _state["cuda"] = got
    return got


# A kernel parameter (:class:`Launch`'s ``args``): (kind, value); native.cpp's Kind
INT64, INT32, FLOAT32, INPUT, OUTPUT, SHAPE, STRIDES, NDIM = range(8)


def i64(v: int) -> tuple:
    return (INT64, int(v))


def f32(v: float) -> tuple:
    return (FLOAT32, struct.unpack("<I", struct.pack("<f", float(v)))[0])


def inp(i: int) -> tuple:
    return (INPUT, i)


def out(o: int) -> tuple:
    return (OUTPUT, o)


# Copies a strided input into a row-contiguous buffer (native.cpp's Program::copy)
_COPY = r"""
#include "mlx/backend/cuda/device/utils.cuh"

__global__ void tiered_native_copy(const %(T)s* in, %(T)s* out,
                                   const __grid_constant__ mlx::core::cu::Shape shape,
                                   const __grid_constant__ mlx::core::cu::Strides strides,
                                   int ndim, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    long long rest = i, at = 0;
    for (int d = ndim - 1; d >= 0; --d) {
        at += (rest %% shape[d]) * strides[d];
        rest /= shape[d];
    }
    out[i] = in[at];
}
"""


def function(source: str, kernel: str, shared_bytes: int = 0) -> int:
    """``kernel`` of ``source`` (CUDA C++ that may include MLX's device headers), compiled once
    per machine (an image under MLX's PTX cache directory) and loaded once per process."""
    key = (source, kernel, shared_bytes)
    got = _functions.get(key)
    if got is None:
        from . import nvrtc

        cc = nvrtc.compute_capability(0)
        digest = hashlib.sha256(f"{source}{kernel}{cc}".encode()).hexdigest()[:20]
        path = nvrtc.cache_dir() / f"tiered_native_{digest}"
        names = path.with_suffix(".name")
        if path.exists() and names.exists():
            code, mangled = path.read_bytes(), names.read_text()
        else:
            code, mangled = nvrtc.compile_kernel(source, f"tiered_native_{digest}", kernel)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = f".{os.getpid()}.{threading.get_ident()}.tmp"
            Path(str(names) + tmp).write_text(mangled)
            os.replace(str(names) + tmp, names)
            Path(str(path) + tmp).write_bytes(code)
            os.replace(str(path) + tmp, path)
        got = _functions[key] = load().load_function(code, mangled, shared_bytes)
    return got


_functions: dict = {}


if __name__ == "__main__":
    os.environ["TIERED_NATIVE"] = "1"
    print(build(verbose=True))
    print("launches on CUDA" if why_not() is None else f"loads; does not launch: {why_not()}")
