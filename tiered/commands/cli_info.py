"""``tiered info``: the backend, BLAS, versions and the decode step this machine runs."""

from __future__ import annotations

import json
import os
import sys
import time

import tiered

from ..runtime import allocator


def _matmul_gflops(n: int = 1024, reps: int = 5) -> float:
    import mlx.core as mx

    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a, b, a @ b)
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(a @ b)
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e9


def info_dict() -> dict:
    import platform

    import mlx.core as mx

    versions = {}
    for pkg in ("mlx", "mlx-lm", "numpy", "numba", "faiss-cpu"):
        try:
            from importlib.metadata import version

            versions[pkg] = version(pkg)
        except Exception:
            versions[pkg] = "not installed"
    backend = "cpu"
    if mx.default_device() != mx.cpu:
        backend = "metal" if mx.metal.is_available() else "cuda"
    return {
        "tiered": tiered.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "backend": backend,
        "device": str(mx.default_device()),
        "blas": {"status": tiered.BLAS.status, "path": tiered.BLAS.path,
                 "detail": tiered.BLAS.detail},
        "allocator": _allocator(),
        "versions": versions,
        "cpu_count": os.cpu_count(),
        "matmul_gflops": round(_matmul_gflops(), 1),
        "decode_step": _decode_step(),
    }


def _allocator() -> dict:
    """The host allocator this process runs on and the jemalloc it would take
    (tiered.runtime.allocator)."""
    return {"in_use": allocator.in_use(), "jemalloc": allocator.find_jemalloc(),
            "setting": allocator.choice()}


def _no_jemalloc() -> str:
    """Why no jemalloc would be preloaded here."""
    if allocator.turned_off():
        return f"jemalloc not taken: TIERED_MALLOC={allocator.choice()}"
    if allocator.choice() != "auto":
        return f"no jemalloc: TIERED_MALLOC={allocator.choice()} is not a file"
    return "no jemalloc library found; Debian: apt-get install libjemalloc2"


def _decode_step() -> dict:
    """Which decode step a compressed layer takes here, and the native launcher's state."""
    from ..metal import accelerator, native
    from ..runtime import uva

    if uva.available():
        step = "device step: selected chunks read from the host pages in place (CUDA)"
    elif accelerator() == "cpu":
        step = "CPU backend: Numba kernels over the host pages"
    else:
        step = "one sync a layer, CPU workers gather (the device step runs on CUDA only)"
    why = native.why_not() if native.enabled() else "not asked for (TIERED_NATIVE=1)"
    return {"path": step, "native_append": "in place" if why is None else why}


def cmd_info(args) -> int:
    if getattr(args, "preload", False):
        found = allocator.find_jemalloc()
        print(found or _no_jemalloc(), file=sys.stdout if found else sys.stderr)
        return 0 if found else 1
    d = info_dict()
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    blas = d["blas"]
    print(f"tiered {d['tiered']} | python {d['python']} | {d['platform']}")
    print(f"backend: {d['backend']} ({d['device']}), {d['cpu_count']} CPU cores")
    print(f"BLAS: {blas['status']}" + (f" {blas['path']}" if blas["path"] else "")
          + (f" ({blas['detail']})" if blas["detail"] else ""))
    al = d["allocator"]
    print(f"host allocator: {al['in_use']}"
          + ("" if al["in_use"] == "jemalloc" else f" ({al['jemalloc'] or _no_jemalloc()})"))
    print("versions: " + ", ".join(f"{k} {v}" for k, v in d["versions"].items()))
    print(f"matmul: {d['matmul_gflops']} GFLOP/s (fp32 1024x1024)")
    step = d["decode_step"]
    print(f"decode step of a compressed layer: {step['path']}; native in-place append: "
          f"{step['native_append']}")
    return 0
