"""NVRTC through ctypes: compile one MLX CUDA custom kernel's generated source as MLX would.

MLX 0.32's CUDA backend compiles a custom kernel (``mx.fast.cuda_kernel``) with NVRTC in every
process and never writes the result to its PTX disk cache (``use_disk_cache`` is false for
custom kernels), though it reads that cache first. :mod:`tiered.metal.ptx_cache` fills the cache;
this module does the compiling. It mirrors MLX's ``compile`` (``jit_module.cpp``): the headers
MLX embeds in ``libmlx.so`` (``jit_source_*``, read from its symbol table), the same include
paths and the same ``--gpu-architecture`` (SASS where NVRTC supports the device).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np

from .nvrtc_child import check, compile_program

CHILD_S = 300.0  # one compile's process (the largest kernels took ~5 s on an H100)

_SYM = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                 ("value", "<u8"), ("size", "<u8")])
_SEC = np.dtype([("name", "<u4"), ("type", "<u4"), ("flags", "<u8"), ("addr", "<u8"),
                 ("offset", "<u8"), ("size", "<u8"), ("link", "<u4"), ("info", "<u4"),
                 ("align", "<u8"), ("entsize", "<u8")])
_PREFIX = b"_ZN3mlx4coreL"  # mlx::core's static constants: _ZN3mlx4coreL<n>jit_source_<x>E


def libmlx() -> Path:
    """The loaded MLX build's ``libmlx.so`` (the CUDA wheel puts it in ``mlx/lib``)."""
    import mlx

    for root in mlx.__path__:
        path = Path(root) / "lib" / "libmlx.so"
        if path.exists():
            return path
    raise FileNotFoundError("libmlx.so is not in any mlx package directory")


def cache_dir() -> Path:
    """MLX's ``ptx_cache_dir`` (where tiered.metal.ptx_cache and tiered.metal.native keep
    compiled kernels): $MLX_PTX_CACHE_DIR, else <temp>/mlx/<version>/ptx."""
    if d := os.environ.get("MLX_PTX_CACHE_DIR"):
        return Path(d)
    tmp = next((os.environ[v] for v in ("TMPDIR", "TMP", "TEMP", "TEMPDIR") if os.environ.get(v)),
               "/tmp")
    return Path(tmp) / "mlx" / _mlx_version() / "ptx"


def _mlx_version() -> str:
    import mlx.core as mx

    return mx.__version__


@functools.cache
def embedded_headers() -> dict[str, bytes]:
    """Include name -> text of the device headers MLX compiles custom kernels against (it
    embeds them in libmlx.so rather than shipping them as files)."""
    with open(libmlx(), "rb") as f:
        def read(at, size):
            f.seek(int(at))
            return f.read(int(size))

        head = read(0, 64)
        shoff = int.from_bytes(head[0x28:0x30], "little")
        shnum = int.from_bytes(head[0x3C:0x3E], "little")
        secs = np.frombuffer(read(shoff, shnum * _SEC.itemsize), _SEC)
        symtab = np.nonzero(secs["type"] == 2)[0]  # SHT_SYMTAB
        if not len(symtab):
            raise RuntimeError(f"{libmlx()} has no symbol table to find its JIT headers in")
        sym_sec = secs[symtab[0]]
        str_sec = secs[sym_sec["link"]]
        strtab = read(str_sec["offset"], str_sec["size"])
        wanted, start = {}, 0
        while (at := strtab.find(b"jit_source_", start)) >= 0:
            begin = strtab.rfind(b"\0", 0, at) + 1
            end = strtab.find(b"\0", at)
            name = strtab[begin:end]
            if name.startswith(_PREFIX) and name.endswith(b"E"):
                wanted[begin] = name[name.index(b"jit_source_") + 11:-1].decode()
            start = end
        syms = np.frombuffer(read(sym_sec["offset"], sym_sec["size"]), _SYM)
        hits = syms[np.isin(syms["name"], np.fromiter(wanted, np.uint32, len(wanted)))]
        headers = {}
        for s in hits:
            sec = secs[s["shndx"]]
            stem = wanted[int(s["name"])]
            text = read(s["value"] - sec["addr"] + sec["offset"], s["size"]).rstrip(b"\0")
            suffix = ".h" if stem == "config" else ".cuh"
            headers.setdefault(f"mlx/backend/cuda/device/{stem}{suffix}", text)
    if "mlx/backend/cuda/device/utils.cuh" not in headers:
        raise RuntimeError(f"{libmlx()} embeds no utils.cuh: not a CUDA build of MLX")
    return headers


def include_paths() -> list[str]:
    """MLX's ``include_path_args``: its bundled headers, CCCL, then the CUDA runtime's."""
    root = libmlx().parent.parent  # site-packages/mlx
    paths = []
    inc = root / "include"
    if inc.exists():
        paths.append(inc)
    if (inc / "cccl").exists():
        paths.append(inc / "cccl")
    cuda = [root.parent / "nvidia" / d / "include" for d in ("cu13", "cuda_runtime")]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    cuda.append(Path(home) / "include")
    paths += [p for p in cuda if p.exists()][:1]
    return [f"--include-path={p}" for p in paths]


def _load(names: list[str], patterns: list[str]) -> ctypes.CDLL:
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    root = libmlx().parent.parent.parent  # site-packages
    for pattern in patterns:
        for path in sorted(glob.glob(str(root / pattern)), reverse=True):
            return ctypes.CDLL(path)
    raise OSError(f"none of {names} could be loaded")


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    return _load(["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"],
                 ["nvidia/*/lib/libnvrtc.so*", "nvidia/cuda_nvrtc/lib/libnvrtc.so*"])


@functools.cache
def compute_capability(ordinal: int = 0) -> tuple[int, int]:
    """(major, minor) of CUDA device ``ordinal``, from the driver."""
    cuda = _load(["libcuda.so.1", "libcuda.so"], [])
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    for call in (lambda: cuda.cuInit(0), lambda: cuda.cuDeviceGet(ctypes.byref(dev), ordinal),
                 lambda: cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev),
                 lambda: cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)):
        if (err := call()) != 0:
            raise RuntimeError(f"CUDA driver call failed with error {err}")
    return major.value, minor.value


def _sass(nvrtc, cc: tuple[int, int]) -> bool:
    """MLX's ``compiler_supports_device_sass``."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    check(nvrtc, nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    limit = {9: (7, 2), 10: (7, 5)}.get(major.value)
    if major.value < 9:
        return False
    if limit is None and major.value == 11 and minor.value < 8:
        limit = (8, 0) if minor.value == 0 else (8, 6)
    return limit is None or cc <= limit


def compile_kernel(source: str, module_name: str, kernel_name: str,
                   ordinal: int = 0) -> tuple[bytes, str]:
    """(PTX or CUBIN, lowered name of ``kernel_name``) for ``source``, as MLX compiles it: in a
    process of its own (:mod:`tiered.metal.nvrtc_child`; in one process NVRTC compiles one
    program at a time, and MLX's own compiles wait behind them), or in this one where no
    process can be started or ``TIERED_COMPILE_PROCESSES=0``."""
    lib = _nvrtc()
    cc = compute_capability(ordinal)
    cubin = _sass(lib, cc)
    arch = f"--gpu-architecture={'sm' if cubin else 'compute'}_{cc[0]}{cc[1]}"
    args = ["--device-as-default-execution-space", arch + ("a" if cc[0] >= 9 else "")]
    args += include_paths()
    program = (source, module_name, kernel_name, embedded_headers(), args, cubin)
    if _children["ok"] and os.environ.get("TIERED_COMPILE_PROCESSES", "1") != "0":
        got = _in_child(lib, *program)
        if got is not None:
            return got
    return compile_program(lib, *program)


_children = {"ok": True}  # False once a child could not run: this process compiles from then


@functools.cache
def _library_path(name: str) -> str:
    """The file ``name`` was loaded from: a name such as ``libnvrtc.so.13`` resolves here
    because MLX loaded that library first, from a directory a child's search would not look
    in (the wheel's ``nvidia/cu13/lib``); this process's memory map says where."""
    if os.path.isabs(name):
        return name
    base = name.split(".so")[0] + ".so"
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if os.path.basename(path).startswith(base) and os.path.isabs(path):
                    return path
    except OSError:
        pass
    return name


def _in_child(lib, source, module_name, kernel_name, headers, args, cubin):
    """:func:`compile_kernel` in a child process: its result, or None where the child could
    not run (the caller then compiles here). NVRTC's own errors raise as they would here."""
    req = dict(library=_library_path(lib._name), source=source, module=module_name,
               kernel=kernel_name, headers=headers, args=args, cubin=cubin)
    try:
        done = subprocess.run([sys.executable, "-I", str(Path(__file__).with_name(
            "nvrtc_child.py"))], input=pickle.dumps(req), capture_output=True, timeout=CHILD_S)
        got = pickle.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, pickle.UnpicklingError, EOFError):
        got = ("failed",)
    if got[0] == "error":
        raise RuntimeError(got[1])
    if got[0] != "ok":
        _children["ok"] = False
        return None
    return got[1], got[2]
