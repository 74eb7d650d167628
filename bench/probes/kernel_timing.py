"""Helper: how bench/kernels.py and the kernel probes time a kernel. The Llama-3-8B attention
shape; the device's copy bandwidth over 1 GiB (also decode_speed's floor, through
decode_setup.memory_bandwidth); the median time per call queued, synced or pipelined; the GPU
busy time per call from CUPTI (torch.profiler); input sets used round-robin; the arguments of
the variants scripts (codebook_variants.py, select_variants.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter

from tiered import metal  # first: tiered loads the optimized BLAS before mlx

import mlx.core as mx
import numpy as np

H, REP, D = 8, 4, 128
HQ = H * REP
G, C = D // 4, 256


COPY_SOURCE = """
// Each thread copies UNROLL float4 at a stride of the grid, all loads issued before stores.
const size_t t0 = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
const size_t stride = size_t(gridDim.x) * blockDim.x;
const float4* a4 = reinterpret_cast<const float4*>(a);
float4* o4 = reinterpret_cast<float4*>(o);
float4 v[UNROLL];
for (size_t base = t0; base < size_t(N4); base += stride * UNROLL) {
  #pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const size_t i = base + u * stride;
    if (i < size_t(N4)) v[u] = a4[i];
  }
  #pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const size_t i = base + u * stride;
    if (i < size_t(N4)) o4[i] = v[u];
  }
}
"""


def measured_bandwidth() -> dict:
    """Device memory bandwidth in GB/s over a 1 GiB buffer: ``copy`` is the best copy (bytes
    read + written) of MLX's x + 0 and, on CUDA, a plain vectorised copy kernel at a few grid
    sizes; ``read`` a read-only sum (bytes read), for comparison. Kernels are held to ``copy``."""
    x = mx.random.uniform(shape=(256 * 2**20,))  # 1 GiB of fp32
    mx.eval(x)
    copies = {"x + 0": 2 * x.nbytes / timed(lambda: x + 0, reps=10, warmup=2) / 1e9}
    if metal.accelerator() == "cuda":
        kernel = mx.fast.cuda_kernel(name="bench_copy", input_names=["a"], output_names=["o"],
                                     source=COPY_SOURCE)
        for blocks, unroll in [(132 * 8, 4), (132 * 32, 4), (132 * 8, 8), (132 * 64, 1)]:
            def run(blocks=blocks, unroll=unroll):
                return kernel(inputs=[x], template=[("N4", x.size // 4), ("UNROLL", unroll)],
                              grid=(blocks * 256, 1, 1), threadgroup=(256, 1, 1),
                              output_shapes=[x.shape], output_dtypes=[x.dtype])[0]
            got = run()
            if not mx.array_equal(got, x).item():
                raise RuntimeError("copy kernel produced a wrong copy")
            del got
            copies[f"kernel {blocks}x256 unroll {unroll}"] = (
                2 * x.nbytes / timed(run, reps=10, warmup=2) / 1e9)
    read = x.nbytes / timed(lambda: mx.sum(x), reps=10, warmup=2) / 1e9
    best = max(copies, key=copies.get)
    return {"copy": copies[best], "copy_how": best, "copies": copies, "read": read}


def timed(fn, *, reps: int, warmup: int, batch: int = 1) -> float:
    """Median seconds per call of fn(), ``batch`` calls queued per evaluation (batch > 1
    measures the device's throughput for back-to-back calls, as in a decode step where the
    layers' work is queued without host synchronisation; batch 1 adds one host round trip)."""
    for _ in range(warmup):
        mx.eval([fn() for _ in range(batch)])
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval([fn() for _ in range(batch)])
        out.append((time.perf_counter() - t) / batch)
    return float(np.median(out))


def timed_pipelined(fn, *, reps: int, warmup: int, batch: int = 8) -> float:
    """Seconds per call with the host building batch i + 1 while the device runs batch i
    (mx.async_eval), as a decode loop does: about max(host time, device time) per call."""
    for _ in range(warmup):
        mx.eval([fn() for _ in range(batch)])
    t = time.perf_counter()
    prev = None
    for _ in range(reps):
        outs = [fn() for _ in range(batch)]
        mx.async_eval(outs)
        if prev is not None:
            mx.eval(prev)
        prev = outs
    mx.eval(prev)
    return (time.perf_counter() - t) / (reps * batch)


def variant_args(doc: str, script: str, argv=None):
    """Arguments (--sizes, --reps) and backend of a variants script (codebook_variants.py,
    select_variants.py); exits where MLX runs on the CPU (the variants are kernels)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[131072, 1048576])
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    backend = metal.accelerator()
    if backend == "cpu":
        sys.exit(f"{script} needs a Metal or CUDA device (this one runs MLX on the CPU)")
    return args, backend


_PROFILER = {}


def device_profile(fn, *, reps: int) -> dict | None:
    """Device time per call from CUPTI's kernel records, through torch.profiler (CUDA only):
    ``device_ms`` the summed durations of the kernels, fills and copies one call runs (GPU
    busy time, no host time), ``launches`` how many there are per call, ``names`` the
    most frequent ones and ``name_ms`` the device ms per call of the busiest ones. None
    where torch or its profiler is missing or records nothing (the reason is printed once)."""
    if "error" in _PROFILER:
        return None
    try:
        from torch.profiler import ProfilerActivity, profile
    except Exception as e:  # noqa: BLE001  (torch is optional)
        _PROFILER["error"] = f"no torch.profiler ({type(e).__name__}: {e})"
        print("device time: " + _PROFILER["error"], flush=True)
        return None
    mx.eval(fn())
    mx.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                mx.eval(fn())
            mx.synchronize()
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    dev = [e for e in events
           if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in e]
    if not dev:
        _PROFILER["error"] = "the profiler recorded no device activity"
        print("device time: " + _PROFILER["error"], flush=True)
        return None
    names = Counter(e["name"][:60] for e in dev)
    busy = Counter()
    for e in dev:
        busy[e["name"][:60]] += float(e["dur"])
    return {"device_ms": sum(busy.values()) / reps / 1e3,
            "launches": len(dev) / reps,
            "names": {k: v / reps for k, v in names.most_common(8)},
            "name_ms": {k: v / reps / 1e3 for k, v in busy.most_common(8)}}


def rotating(make, count: int):
    """count independent input sets, used round-robin (defeats the L2 cache at small n)."""
    sets = [make(i) for i in range(count)]
    mx.eval(sets)
    state = {"i": 0}

    def next_set():
        state["i"] = (state["i"] + 1) % count
        return sets[state["i"]]

    return next_set


def rel_err(a, b) -> float:
    a, b = np.array(a, np.float64), np.array(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


