"""Platform set-up that must run before ``mlx.core`` is imported.

The Linux ``mlx[cpu]`` wheel links the reference netlib BLAS (a matmul at ~5 GFLOP/s). MLX
resolves ``cblas_sgemm`` and friends dynamically, so loading an optimized BLAS into the global
symbol namespace first makes every MLX matmul use it (measured here: ~25x faster forwards).
On macOS MLX uses Accelerate and Metal and nothing is done.

This module imports nothing from MLX: ``tiered/__init__.py`` calls :func:`preload_blas` first.
When ``mlx.core`` was imported before tiered, its BLAS calls are rebound in place instead
(:mod:`tiered.runtime._blas_rebind`), so the import order does not matter.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import os
import sys
import warnings

from . import streams
from ._blas_rebind import rebind

# Candidates in order of preference. 64-bit-integer builds (libopenblas64) are excluded on
# purpose: their cblas_* symbols take int64 sizes and would corrupt MLX's calls.
_LINUX_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/openblas-serial/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

INSTALL_HINT = (
    "install an optimized BLAS (Debian/Ubuntu: `apt-get install libopenblas0-pthread`) "
    "or point TIERED_BLAS at a libblas.so that exports cblas_sgemm"
)


class BlasState:
    """What happened at import: which library serves MLX's BLAS calls, and why."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.status = "not-attempted"  # loaded | already-loaded | rebound | not-needed | missing | too-late
        self.detail = ""
        self.warned = False

    def __repr__(self) -> str:
        return f"BlasState(status={self.status!r}, path={self.path!r})"


BLAS = BlasState()


def _serves_mlx(path: str) -> bool:
    """Whether a library exports the unprefixed CBLAS symbols MLX resolves (numpy's bundled
    OpenBLAS, for one, prefixes them: scipy_cblas_sgemm64_, and cannot serve MLX)."""
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
    except (OSError, AttributeError):
        return False
    return hasattr(lib, "cblas_sgemm")


def _loaded_optimized_blas() -> str | None:
    """Path of an optimized BLAS already mapped into this process and usable by MLX, if any."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        name = os.path.basename(path)
        if ("openblas" in path or name.startswith(("libmkl_rt", "libblis"))) and _serves_mlx(path):
            return path
    return None


def _candidates() -> list[str]:
    env = os.environ.get("TIERED_BLAS")
    out = [env] if env else []
    out += [p for p in _LINUX_CANDIDATES if os.path.exists(p)]
    found = ctypes.util.find_library("openblas")
    if found:
        out.append(found)
    return out


def _warn(message: str) -> None:
    if not BLAS.warned:
        BLAS.warned = True
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _rebind_loaded() -> BlasState:
    """mlx.core came first: its BLAS calls are bound already; rebind them
    (tiered.runtime._blas_rebind)."""
    errors = []
    for path in _candidates():
        try:
            n = rebind(path)
        except (OSError, ValueError) as e:
            errors.append(f"{path}: {e}")
            continue
        if n:
            BLAS.status, BLAS.path = "rebound", path
            BLAS.detail = f"mlx.core was imported first; {n} BLAS/LAPACK calls of libmlx rebound"
            return BLAS
        errors.append(f"{path}: no BLAS call of libmlx to rebind")
    BLAS.status = "too-late"
    BLAS.detail = "mlx.core was imported before tiered; " + ("; ".join(errors) or
                                                              "no optimized BLAS found")
    _warn(
        "tiered: mlx.core was imported before tiered and its BLAS calls could not be rebound, "
        f"so MLX keeps its bundled reference BLAS (~30x slower matmuls on the CPU). To fix: "
        f"import tiered first, or {INSTALL_HINT}."
    )
    return BLAS


def preload_blas() -> BlasState:
    """Load an optimized BLAS globally before MLX, once. Warns (once) when it cannot. Where one
    serves MLX, MLX's queued work is waited for at exit (see :mod:`tiered.runtime.streams`)."""
    if BLAS.status != "not-attempted":
        return BLAS
    _find_blas()
    if BLAS.status in ("loaded", "already-loaded", "rebound"):
        atexit.register(streams.drain_at_exit)
    return BLAS


def _find_blas() -> BlasState:
    if not sys.platform.startswith("linux"):
        BLAS.status, BLAS.detail = "not-needed", f"{sys.platform}: MLX uses its own BLAS"
        return BLAS
    already = _loaded_optimized_blas()
    if already:
        BLAS.status, BLAS.path = "already-loaded", already
        return BLAS
    if "mlx.core" in sys.modules:
        return _rebind_loaded()
    errors = []
    for path in _candidates():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            errors.append(f"{path}: {e}")
            continue
        BLAS.status, BLAS.path = "loaded", path
        return BLAS
    BLAS.status = "missing"
    BLAS.detail = "; ".join(errors) if errors else "no candidate library found"
    _warn(
        "tiered: no optimized BLAS found, MLX's CPU matmuls will use the bundled reference "
        f"BLAS (~30x slower). To fix: {INSTALL_HINT}."
    )
    return BLAS


_MALLOC_BOUNDED = []


def bounded_malloc() -> bool:
    """glibc only, once per process: allocations of 128 KiB and more are mapped and returned to
    the system when freed (``mallopt(M_MMAP_THRESHOLD)``), instead of glibc's default, whose
    threshold rises as large blocks are freed, keeping them in the heap. A cache with a host
    or memory budget asks for it: a 200k-token block-wise prefill retrieving from pages on
    disk grew the process by ~26 MiB of freed temporaries that way, flat with this.
    ``TIERED_MALLOC=default`` leaves the allocator alone. Returns whether it was set."""
    if _MALLOC_BOUNDED or os.environ.get("TIERED_MALLOC") == "default":
        return bool(_MALLOC_BOUNDED)
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        ok = bool(libc.mallopt(-3, 128 * 1024))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False
    if ok:
        _MALLOC_BOUNDED.append(True)
    return ok


def passive_openmp() -> bool:
    """``OMP_WAIT_POLICY=PASSIVE`` unless the user set a policy: an OpenMP thread (Numba's CPU
    workers, faiss) then sleeps as soon as its parallel region ends instead of spinning for
    its next one. tiered runs several teams beside the threads that build and hand over the
    decode step (the refresh worker, the disk rows' copies, the scheduler's workers), and
    spinning teams took the cores those threads need: 1M tokens over the disk tier on an H100
    host (two leases), the rows' copies 17.6 -> 9.5 ms a token, decode 62.6 -> 53.3 ms/token
    (docs/million-tokens.md). The OpenMP runtime reads it when it loads: False when one was
    loaded before tiered (another library's import), where this comes too late."""
    if "OMP_WAIT_POLICY" in os.environ:
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        with open("/proc/self/maps") as f:
            return "libgomp" not in f.read()
    except OSError:
        return True
