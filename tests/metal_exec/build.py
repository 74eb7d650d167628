"""Compiles a wrapped Metal kernel into a shared library that runs it on the CPU.

The kernel text is exactly what ``mx.fast.metal_kernel`` compiles (tests/metal_wrap.py). It is
preprocessed once with ``threadgroup`` renamed to a marker, so that the threadgroup-memory
declarations the prelude's macros expand to can be found; each becomes a reference to storage
that the runtime gives every thread of a threadgroup alike (a declaration in Metal names one
array per threadgroup; left as it is, C++ would give each thread its own). Everything else in
the text is compiled unchanged against shim.h and linked with the runtime (threadgroup.cpp,
launch.cpp). Libraries are cached under a directory keyed by a hash of everything that goes
into them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from metal_wrap import kernel_name, metal_params, metal_source, template_args

HERE = Path(__file__).resolve().parent
CXX = os.environ.get("CXX", "g++")
FLAGS = ["-std=c++17", "-O2", "-fPIC", "-Wno-attributes", "-Wno-unknown-pragmas"]
if sys.platform == "darwin":  # ucontext fibers there (not tried: no Mac was at hand)
    FLAGS += ["-D_XOPEN_SOURCE=700", "-D_DARWIN_C_SOURCE"]
RUNTIME = ("threadgroup.cpp", "launch.cpp")
MARK = "__tqx_threadgroup"
# `threadgroup T name[count];` after preprocessing: a type (no brackets, parentheses or =),
# the name, and the count up to the statement's end.
DECLARATION = re.compile(MARK + r"\s+([^;{}()\[\]=]+?)\s+(\w+)\s*\[([^;]*)\]\s*;")
# Each Metal attribute from the running thread's position (runtime.h, ThreadPos).
ATTRIBUTES = {
    "thread_position_in_threadgroup": "tqx_uint3(p.in_group)",
    "threads_per_threadgroup": "tqx_uint3(p.group_size)",
    "dispatch_threads_per_threadgroup": "tqx_uint3(p.dispatch_size)",
    "threadgroup_position_in_grid": "tqx_uint3(p.group)",
    "threadgroups_per_grid": "tqx_uint3(p.groups)",
    "threads_per_grid": "tqx_uint3(p.grid)",
    "grid_size": "tqx_uint3(p.grid)",
    "grid_origin": "uint3{0, 0, 0}",
    "thread_position_in_grid": "tqx_uint3(p.in_grid)",
    "thread_index_in_threadgroup": "p.index",
    "simdgroup_index_in_threadgroup": "p.index / 32",
    "thread_index_in_simdgroup": "p.index % 32",
    "simdgroups_per_threadgroup": "(p.threads + 31) / 32",
    "dispatch_simdgroups_per_threadgroup":
        "(p.dispatch_size.x * p.dispatch_size.y * p.dispatch_size.z + 31) / 32",
    "threads_per_simdgroup": "32u",
    "thread_execution_width": "32u",
    "quadgroup_index_in_threadgroup": "p.index / 4",
    "thread_index_in_quadgroup": "p.index % 4",
    "quadgroups_per_threadgroup": "(p.threads + 3) / 4",
    "dispatch_quadgroups_per_threadgroup":
        "(p.dispatch_size.x * p.dispatch_size.y * p.dispatch_size.z + 3) / 4",
}  # fmt: skip


def compiler() -> str | None:
    """Path of the C++ compiler the executor uses, or None where there is none."""
    return shutil.which(CXX)


@functools.cache
def cache_dir() -> Path:
    """$TIERED_METAL_EXEC_CACHE, else the user's cache directory, else the temp directory."""
    root = os.environ.get("TIERED_METAL_EXEC_CACHE")
    if root:
        return Path(root)
    home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tiered-metal-exec"
    try:
        home.mkdir(parents=True, exist_ok=True)
        return home
    except OSError:
        return Path(tempfile.gettempdir()) / f"tiered-metal-exec-{os.getuid()}"


def _run(cmd: list[str], text: str | None = None) -> str:
    out = subprocess.run(cmd, input=text, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr}")
    return out.stdout


@functools.cache
def _toolchain_key(extra: tuple[str, ...]) -> str:
    h = hashlib.sha256(_run([CXX, "--version"]).encode())
    for name in ("runtime.h", "worker.h", "shim.h", *RUNTIME):
        h.update((HERE / name).read_bytes())
    h.update(" ".join(FLAGS + list(extra)).encode())
    return h.hexdigest()[:16]


def _publish(produce, target: Path) -> Path:
    """Builds target through produce(temporary path) unless it exists; atomic for readers."""
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=target.suffix)
        os.close(fd)
        try:
            produce(Path(tmp))
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def _runtime_objects(extra: tuple[str, ...]) -> list[Path]:
    out = []
    for name in RUNTIME:
        target = cache_dir() / f"{Path(name).stem}-{_toolchain_key(extra)}.o"
        out.append(_publish(lambda tmp, name=name: _run(
            [CXX, *FLAGS, *extra, "-c", str(HERE / name), "-o", str(tmp)]), target))
    return out


def rewrite_threadgroup(text: str) -> tuple[str, int]:
    """Each threadgroup-memory declaration of the preprocessed text as a reference to the
    runtime's storage for it; returns the text and the number of declarations."""
    sites = []

    def replace(m):
        ctype, name, count = m.group(1).strip(), m.group(2), m.group(3)
        arr = f"{ctype}(*)[({count})]"
        sites.append(name)
        return (f"{ctype} (&{name})[({count})] = *reinterpret_cast<{arr}>("
                f"::tqx::threadgroup_alloc({len(sites) - 1}, sizeof({ctype}[({count})])));")

    text = DECLARATION.sub(replace, text)
    return text.replace(MARK, ""), len(sites)


@functools.lru_cache(maxsize=512)
def _rewritten(text: str) -> tuple[str, int]:
    pre = _run([CXX, "-std=c++17", "-E", "-P", f"-Dthreadgroup={MARK}", "-x", "c++", "-"], text)
    return rewrite_threadgroup(pre)


def kernel_unit(spec, plan, header: str, source: str) -> tuple[str, int]:
    """The C++ translation unit of one kernel: shim, rewritten kernel text, and the entry
    point that calls the kernel with its buffers and the running thread's attributes."""
    body, sites = _rewritten(metal_source(spec, header, source, plan))
    args, k = [], 0
    for p in metal_params(spec, source, plan):
        if p.kind == "attribute":
            args.append(ATTRIBUTES[p.name])
            continue
        if p.kind not in ("input", "output"):
            raise NotImplementedError(f"{p.name}: the executor passes no shape arguments")
        args.append(f"*({p.ctype[:-1]}*)b[{k}]" if p.ctype.endswith("&") else f"({p.ctype})b[{k}]")
        k += 1
    name = kernel_name(spec, plan)
    call = name + (f"<{template_args(plan)}>" if plan.template else "")
    entry = (
        'extern "C" void tqx_kernel_thread(void* const* b) {\n'
        "  const tqx::ThreadPos& p = tqx::self();\n  (void)p;\n"
        f"  {call}(\n    " + ",\n    ".join(args) + ");\n}\n"
    )
    return '#include "shim.h"\n' + body + "\n" + entry, sites


_loaded: dict[Path, ctypes.CDLL] = {}
_lock = threading.Lock()


def build(spec, plan, header: str, source: str, extra: tuple[str, ...] = ()):
    """(library, declaration sites): the kernel compiled and loaded (cached on disk and in
    this process). extra: more compiler flags (e.g. -DTQX_UCONTEXT, the portable fibers)."""
    unit, sites = kernel_unit(spec, plan, header, source)
    return build_unit(unit, spec.name, extra), sites


def build_unit(unit: str, name: str, extra: tuple[str, ...] = (), salt: bytes = b""):
    """The translation unit ``unit`` compiled with the runtime and loaded (cached on disk
    under ``name`` and a hash of the toolchain, ``unit`` and ``salt``, and in this process)."""
    runtime = _runtime_objects(extra)
    key = hashlib.sha256((_toolchain_key(extra) + unit).encode() + salt).hexdigest()[:24]
    target = cache_dir() / f"{name}-{key}.so"

    def produce(tmp: Path):
        src = tmp.with_suffix(".cpp")
        src.write_text(unit)
        try:
            _run([CXX, *FLAGS, *extra, "-shared", "-I", str(HERE), str(src),
                  *(str(o) for o in runtime), "-o", str(tmp), "-pthread"])
        finally:
            src.unlink()

    _publish(produce, target)
    with _lock:
        if target not in _loaded:
            lib = ctypes.CDLL(str(target))
            lib.tqx_launch.restype = ctypes.c_int
            _loaded[target] = lib
        return _loaded[target]
