"""What an upload costs on MLX's CUDA backend (issue 24): ``mx.array(numpy)`` into a buffer
the GPU has just used (its managed pages on the device: the CPU's copy faults them back)
against one it has not, and a device-to-host read, at a few sizes.

    python bench/upload_probe.py --sizes 16000 128000 400000
"""

from __future__ import annotations

import argparse
import time

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
import numpy as np


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        times.append(fn())
    return 1e3 * float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[16_000, 128_000, 400_000],
                    help="int32 elements per upload")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    for n in args.sizes:
        a = np.arange(n, dtype=np.int32)

        def upload(gpu_uses: bool) -> float:
            t = time.perf_counter()
            x = mx.array(a)
            dt = time.perf_counter() - t
            if gpu_uses:  # the buffer goes back to MLX's cache after the GPU touched it
                mx.eval((x + 1).sum())
            return dt

        def read() -> float:
            z = mx.arange(n, dtype=mx.int32) * 2
            mx.eval(z)
            t = time.perf_counter()
            np.array(z)
            return time.perf_counter() - t

        used = median_ms(lambda: upload(True), args.reps)
        fresh = median_ms(lambda: upload(False), args.reps)
        print(f"{n * 4 / 1e6:6.2f} MB: upload {used:.3f} ms into a buffer the GPU used, "
              f"{fresh:.3f} ms otherwise; device-to-host read {median_ms(read, args.reps):.3f} "
              f"ms", flush=True)


if __name__ == "__main__":
    main()
