"""What a host block's allocation costs the main thread on MLX CUDA, and why (issue 24: in a
1M-token prefill the chunks that grew the host pages took ~100-180 ms more than the others).

A host block is ``mx.full(shape, nan, stream=mx.cpu)`` queued with ``mx.async_eval``
(tiered.cpu.host_tensor). MLX's CUDA allocator serves it from its buffer cache when a freed
buffer of about that size is there (``BufferCache::reuse_from_cache``: at least the size and
less than size + 32 KB), and when that buffer is device memory it moves it to managed memory
first (``move_to_unified_memory``: a managed allocation and a synchronous ``cudaMemcpy`` on
the calling thread). The prefill frees device buffers of exactly a block's 32 MB (e.g. a
2048 x 4096 float32 activation), so a block can cost a copy and a wait.

Cases, each with --work-ms of matmuls queued on the GPU before the allocation:

- ``cached``: a device buffer of the block's size freed into the cache just before;
- ``fresh``: the cache emptied first;
- ``padded``: as ``cached``, the block asked 16 KB longer (no cached buffer matches).

Then --fill-blocks fresh blocks are filled on each of --streams CPU streams (the fill's rate:
the first touch of managed pages), and --hold-gb of blocks are allocated and held (padded),
timing the queueing call as the held memory grows. Host times are of the calling thread; ``ready`` is the wait for the fill
(the numpy view).

    python3 bench/probes/block_alloc_probe.py --block-mb 32 --reps 8 --hold-gb 48
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
import numpy as np


def queue_work(ms: float, a) -> mx.array:
    """About ``ms`` of GPU work (chained matmuls), queued, not waited for."""
    t = time.perf_counter()
    y = a @ a
    mx.eval(y)
    one = max(1e-4, time.perf_counter() - t)
    y = a
    for _ in range(max(1, int(ms / 1e3 / one))):
        y = (y @ a) * 1e-3
    mx.async_eval(y)
    return y


def block(nelem: int):
    t = time.perf_counter()
    arr = mx.full((nelem,), float("nan"), dtype=mx.float16, stream=mx.cpu)
    mx.async_eval(arr)
    queued = time.perf_counter() - t
    np.array(arr, copy=False)
    return arr, queued, time.perf_counter() - t


def seed(nbytes: int):
    t = mx.zeros((nbytes // 2,), mx.float16) + 1  # device memory (the GPU stream)
    mx.eval(t)
    del t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--block-mb", type=int, default=32)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--work-ms", type=float, default=60.0)
    p.add_argument("--hold-gb", type=float, default=48.0)
    p.add_argument("--step-gb", type=float, default=8.0)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--fill-blocks", type=int, default=32)
    p.add_argument("--dim", type=int, default=4096, help="side of the matmuls of the GPU work")
    args = p.parse_args(argv)
    nbytes = args.block_mb << 20
    n = nbytes // 2
    a = mx.random.normal((args.dim, args.dim)).astype(mx.float16)
    mx.eval(a)
    mx.set_cache_limit(4 << 30)
    keep = []
    for case in ("cached", "fresh", "padded", "cached", "fresh", "padded"):
        q, r, w = [], [], []
        for _ in range(args.reps):
            if case == "fresh":
                mx.clear_cache()
            else:
                seed(nbytes)
            y = queue_work(args.work_ms, a)
            arr, queued, ready = block(n + (8192 if case == "padded" else 0))
            t = time.perf_counter()
            mx.eval(y)
            w.append(time.perf_counter() - t)
            q.append(queued)
            r.append(ready)
            keep.append(arr)
        print(f"{case:7s} {args.block_mb} MB block: queue {1e3 * np.median(q):7.2f} ms "
              f"(max {1e3 * max(q):.2f}), ready {1e3 * np.median(r):7.2f} ms; work left after "
              f"it {1e3 * np.median(w):.1f} ms", flush=True)
    del keep
    mx.clear_cache()
    # fills spread over CPU streams (each a thread of MLX's): fresh blocks, held, so no fill
    # reuses a buffer another one freed
    held_fills = []
    for k in args.streams:
        streams = [mx.new_stream(mx.cpu) for _ in range(k)]
        t = time.perf_counter()
        arrs = [mx.full((n + 8192,), float("nan"), dtype=mx.float16, stream=streams[i % k])
                for i in range(args.fill_blocks)]
        mx.async_eval(arrs)
        queued = time.perf_counter() - t
        for a_ in arrs:
            np.array(a_, copy=False)
        dt = time.perf_counter() - t
        print(f"fill of {args.fill_blocks} fresh {args.block_mb} MB blocks on {k} CPU streams: "
              f"{1e3 * dt:.0f} ms ({args.fill_blocks * nbytes / dt / 1e9:.2f} GB/s; queueing "
              f"{1e3 * queued:.1f} ms)", flush=True)
        held_fills.append(arrs)
    del held_fills
    mx.clear_cache()
    held, mark, times = [], args.step_gb, []
    while len(held) * nbytes < args.hold_gb * 2**30:
        y = queue_work(5.0, a) if len(held) % 8 == 0 else None
        arr, queued, _ = block(n + 8192)
        held.append(arr)
        times.append(queued)
        if y is not None:
            mx.eval(y)
        if len(held) * nbytes >= mark * 2**30:
            print(f"  holding {len(held) * nbytes / 2**30:5.1f} GiB: queue {1e3 * np.median(times):.2f} ms "
                  f"median, {1e3 * max(times):.2f} max over the last {len(times)}", flush=True)
            mark += args.step_gb
            times = []
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
