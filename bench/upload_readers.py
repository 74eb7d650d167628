"""What the GPU kernels that read a fresh upload cost on MLX's CUDA backend (issue 24).

A refresh uploads a few kilobytes of int32 indices (``mx.array(numpy)``: managed memory the
CPU wrote) and small kernels read them; on an H200 those kernels took 0.15-0.3 ms each where
the same kernels on device memory take microseconds. Kernel times (CUPTI) of three readers
(a compare, a cast, a row gather) per upload, for the upload as it is, copied once on the
device first, staged through page-locked memory (:mod:`tiered.staging`), and an array the GPU
made; and the host time of making each. One H200 (2026-11-26, 8 KB): the readers took 400 us
per upload as it is, 55 copied, 19 prefetched to the device (``cuMemPrefetchAsync``), 102
advised to stay in host memory (which left MLX's buffer cache with advised buffers that later
arrays reused: every kernel after it ran slower).

    python bench/upload_readers.py --elements 2048 --reps 50
"""

from __future__ import annotations

import argparse
import collections
import time

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
import numpy as np
from device_kernel_profile import cuda_kernels

from tiered import staging

MODES = ("fresh", "copied", "staged", "device")


def make(mode: str, a: np.ndarray) -> mx.array:
    if mode == "device":
        return (mx.arange(a.size, dtype=mx.int32) % 4096).reshape(a.shape)
    if mode == "staged":
        return staging.upload(a)
    x = mx.array(a)
    return x + 0 if mode == "copied" else x


def round_(mode: str, a: np.ndarray, big: mx.array, reps: int) -> float:
    host = []
    for _ in range(reps):
        t = time.perf_counter()
        x = make(mode, a)
        host.append(time.perf_counter() - t)
        y1 = x == 2
        y2 = x.astype(mx.uint8)
        y3 = mx.take_along_axis(big, x[..., None], axis=1)
        mx.eval(y1, y2, y3)
    return 1e3 * float(np.median(host))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, nargs="+", default=[2048, 32768])
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    big = mx.zeros((8, 4096, 128), mx.float16)
    mx.eval(big)
    for n in args.elements:
        a = np.random.default_rng(0).integers(0, 4096, (8, n // 8)).astype(np.int32)
        for mode in MODES:
            round_(mode, a, big, 5)  # warm: compile, allocate
            out = {}
            kern = cuda_kernels(lambda: out.update(ms=round_(mode, a, big, args.reps)))
            total = collections.Counter()
            for name, (launches, us) in kern.items():
                total[name] += us / args.reps
            top = ", ".join(f"{k[:40]} {v:.1f}" for k, v in total.most_common(4))
            print(f"{n * 4 / 1e3:7.1f} KB {mode:10s}: kernels {sum(total.values()):8.1f} us per "
                  f"upload; host {out['ms']:.3f} ms to make it; {top}", flush=True)


if __name__ == "__main__":
    main()
