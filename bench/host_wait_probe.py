"""When does reading a host block made on MLX's CPU stream wait for the GPU? (issue 24: a
1M-token prefill's chunks that grow the host pages cost ~80 ms more, and an 8 MB block made on
the CPU stream took 65 ms to become readable while ~100 ms of matmuls were queued:
bench/host_block_probe.py --busy 100.)

Each case, median of --reps, host milliseconds, with ~--busy ms of matmuls queued on the GPU:

- before: the block queued and filled (sleep) before the GPU work is queued, read during it;
- during: the block queued after the GPU work, read 20 ms later;
- numpy: a NaN block made in numpy and copied into an MLX array (no CPU stream), read;
- pinned: ``cuMemHostRegister`` of a numpy block (tiered.uva.register), then unregistered;
- thread: 32 blocks advised (tiered.uva.advise_host) on another thread while the main
  thread queues 400 small GPU ops; the main loop's time against the same loop alone.

    python3 bench/host_wait_probe.py --reps 3 --busy 100
"""

from __future__ import annotations

import argparse
import threading
import time

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
import numpy as np
from host_block_probe import _occupier

from tiered import uva

SHAPE = (16, 8, 256, 128)  # one 8 MB fp16 block of 16 pages


def ms(t0):
    return 1e3 * (time.perf_counter() - t0)


def cpu_block():
    arr = mx.full(SHAPE, float("nan"), dtype=mx.float16, stream=mx.cpu)
    mx.async_eval(arr)
    return arr


def _read_wait(occupy, block_first: bool) -> float:
    """Milliseconds to read a CPU-stream block 20 ms into the GPU work; the block queued (and
    filled, 10 ms) before that work, or after it."""
    if block_first:
        arr = cpu_block()
        time.sleep(0.01)
        work = occupy()
    else:
        work = occupy()
        arr = cpu_block()
    time.sleep(0.02)
    t = time.perf_counter()
    np.array(arr, copy=False)
    wait = ms(t)
    mx.eval(work)
    return wait


def case_before(occupy):
    return _read_wait(occupy, block_first=True)


def case_during(occupy):
    return _read_wait(occupy, block_first=False)


def case_numpy(occupy):
    work = occupy()
    t = time.perf_counter()
    arr = mx.array(np.full(SHAPE, np.nan, np.float16))
    np.array(arr, copy=False)
    took = ms(t)
    mx.eval(work)
    return took


def case_pinned(occupy):
    block = np.full(SHAPE, np.nan, np.float16)
    work = occupy()
    t = time.perf_counter()
    uva.register(block)
    took = ms(t)
    uva.unregister(block)
    mx.eval(work)
    return took


def main_loop(n=400):
    y = mx.zeros((1024,))
    mx.eval(y)
    t = time.perf_counter()
    for _ in range(n):
        y = y + 1
        mx.async_eval(y)
    took = ms(t)
    mx.eval(y)
    return took


def beside(work) -> tuple[float, float, float]:
    """Milliseconds of :func:`main_loop` alone, then beside a thread running ``work()``, and
    the thread's own."""
    alone = main_loop()
    took = {}

    def run():
        t = time.perf_counter()
        work()
        took["thread"] = ms(t)

    th = threading.Thread(target=run)
    th.start()
    together = main_loop()
    th.join()
    return alone, together, took["thread"]


def case_thread(_occupy):
    blocks = [mx.full(SHAPE, float("nan"), dtype=mx.float16, stream=mx.cpu) for _ in range(32)]
    mx.eval(blocks)
    views = [np.array(b, copy=False) for b in blocks]
    alone, beside_ms, thread = beside(lambda: [uva.advise_host(v) for v in views])
    return f"main loop alone {alone:.1f}, beside the thread {beside_ms:.1f}, thread {thread:.1f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--busy", type=float, default=100.0)
    args = ap.parse_args()
    occupy = _occupier(args.busy)
    cpu_block()
    mx.eval(occupy())
    for name, fn in (("before", case_before), ("during", case_during), ("numpy", case_numpy),
                     ("pinned", case_pinned), ("thread", case_thread)):
        got = [fn(occupy) for _ in range(args.reps + 1)][1:]
        if isinstance(got[0], str):
            print(f"{name}: " + "; ".join(got), flush=True)
        else:
            print(f"{name}: median {np.median(got):.2f} ms (all {', '.join(f'{g:.1f}' for g in got)})",
                  flush=True)


if __name__ == "__main__":
    main()
