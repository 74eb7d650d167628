"""How a host block's allocation scales with what the process already holds (issue 24: at 800k
tokens of a 1M-token prefill, ``_block_ahead`` took 123 ms of the main thread per chunk that
grew the pages, against 43 ms at 400k; bench/prefill_profile.py --timers).

Allocates --block-mb blocks until --total-gb are held, two ways in turn, and prints the median
host time of one allocation per --step-gb held:

- **mlx**: what tiered does (``mx.full(..., stream=mx.cpu)`` + ``mx.async_eval``: MLX CUDA's
  managed memory, NaN-filled on its CPU stream), the queueing call only;
- **pinned**: ``cuMemHostAlloc`` (page-locked, mapped for the device), then a NaN fill on this
  thread with numpy, both timed.

    python3 bench/host_alloc_scaling.py --total-gb 64 --step-gb 8
"""

from __future__ import annotations

import argparse
import ctypes
import time

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
import numpy as np


def _mlx(nbytes):
    arr = mx.full((nbytes // 2,), float("nan"), dtype=mx.float16, stream=mx.cpu)
    mx.async_eval(arr)
    return arr


def _pinned(lib, nbytes):
    ptr = ctypes.c_void_p()
    rc = lib.cuMemHostAlloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes), 0x2)  # DEVICEMAP
    if rc != 0:
        raise RuntimeError(f"cuMemHostAlloc failed: {rc}")
    buf = (ctypes.c_uint16 * (nbytes // 2)).from_address(ptr.value)
    np.frombuffer(buf, np.float16).fill(np.nan)
    return ptr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-mb", type=int, default=32)
    ap.add_argument("--total-gb", type=float, default=64)
    ap.add_argument("--step-gb", type=float, default=8)
    args = ap.parse_args()
    nbytes = args.block_mb << 20
    per_step = max(1, int(args.step_gb * 1024 / args.block_mb))
    steps = int(args.total_gb / args.step_gb)
    lib = ctypes.CDLL("libcuda.so.1")
    mx.eval(mx.zeros(1))  # the context exists before the driver calls
    for name, alloc in (("mlx", _mlx), ("pinned", lambda n: _pinned(lib, n))):
        held, row = [], []
        for s in range(steps):
            times = []
            for _ in range(per_step):
                t = time.perf_counter()
                held.append(alloc(nbytes))
                times.append(1e3 * (time.perf_counter() - t))
            if name == "mlx":
                mx.eval(held[-1])
            row.append(f"{(s + 1) * args.step_gb:.0f} GB {np.median(times):.2f}")
        print(f"{name}: ms per {args.block_mb} MB block (median over the last {args.step_gb} GB) "
              f"at held: " + ", ".join(row), flush=True)
        if name == "pinned":
            for p in held:
                lib.cuMemFreeHost(p)
        del held
        mx.clear_cache()


if __name__ == "__main__":
    main()
