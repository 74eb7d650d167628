"""What each half of a host block's advice costs, and whether a block needs both (issue 24: with
host blocks made ready on a background thread, a 1M-token prefill's chunks that grow the host
pages still cost ~65 ms more on an H200, the main thread's dispatch slowed while the other
thread advised 32 blocks).

For --blocks fresh 8 MB blocks (fp16, MLX CPU stream, as the host store makes them), each advice
mode in turn: ``pref`` (preferred location: host), ``access`` (accessed by: device 0), ``both``
(what ``tiered.uva.advise_host`` does), ``none``:

- the advice's host time per block, idle and with --busy ms of matmuls queued;
- a main-thread loop of 400 small launches, alone and beside a thread advising the blocks;
- a GPU kernel writing every byte of each block by address, first and second time, then the
  CPU reading the blocks (a block whose pages moved to the device reads slowly on the host),
  and the device memory NVML counts before and after (pages that moved show up there).

    python3 bench/advise_probe.py --blocks 32 --busy 100
"""

from __future__ import annotations

import argparse
import ctypes
import time

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
import numpy as np
from host_block_probe import _occupier, fill_kernel
from host_wait_probe import beside
from million import DeviceMemory

from tiered import uva

MODES = {"pref": ((uva._ADVISE_PREFERRED_LOCATION, uva._LOCATION_HOST, 0),),
         "access": ((uva._ADVISE_ACCESSED_BY, uva._LOCATION_DEVICE, 0),),
         "both": ((uva._ADVISE_PREFERRED_LOCATION, uva._LOCATION_HOST, 0),
                  (uva._ADVISE_ACCESSED_BY, uva._LOCATION_DEVICE, 0)),
         "none": ()}


def advise(view: np.ndarray, mode: str):
    uva._current_context()
    fn = uva._driver().cuMemAdvise_v2
    fn.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, uva._Location]
    for advice, kind, dev in MODES[mode]:
        uva._check(f"cuMemAdvise({advice})",
                   fn(view.ctypes.data, view.nbytes, advice, uva._Location(kind, dev)))


def blocks(n: int) -> list[np.ndarray]:
    arrs = [mx.full((8 << 19,), float("nan"), dtype=mx.float16, stream=mx.cpu) for _ in range(n)]
    mx.eval(arrs)
    return arrs, [np.array(a, copy=False) for a in arrs]


def per_block_ms(views, mode, occupy=None) -> float:
    work = occupy() if occupy else None
    t = time.perf_counter()
    for v in views:
        advise(v, mode)
    took = 1e3 * (time.perf_counter() - t) / len(views)
    if work is not None:
        mx.eval(work)
    return took


def beside_thread(views, mode) -> str:
    alone, together, _ = beside(lambda: [advise(v, mode) for v in views])
    return f"launch loop {alone:.1f} ms alone, {together:.1f} beside the advising thread"


def writes_and_reads(kern, views, dev) -> str:
    used0 = dev.used()
    words = views[0].nbytes // 16
    ins = [uva.address_array([v.ctypes.data for v in views]), mx.array([words], mx.int64)]
    times = []
    for _ in range(2):
        t = time.perf_counter()
        for i in range(len(views)):
            (done,) = kern(inputs=[ins[0][i : i + 1], ins[1]], output_shapes=[(1,)],
                           output_dtypes=[mx.int32], grid=(words, 1, 1),
                           threadgroup=(256, 1, 1))
            mx.eval(done)
        times.append(1e3 * (time.perf_counter() - t) / len(views))
    used1 = dev.used()
    t = time.perf_counter()
    total = sum(int(v.view(np.uint32)[::1024].sum()) for v in views)
    read = 1e3 * (time.perf_counter() - t) / len(views)
    t = time.perf_counter()
    for v in views:
        v.view(np.uint8).sum()
    read2 = 1e3 * (time.perf_counter() - t) / len(views)
    grew = "" if used0 is None else f", device memory +{(used1 - used0) / 2**20:.0f} MiB"
    return (f"device write {times[0]:.2f} ms first, {times[1]:.2f} second per block; host read "
            f"{read:.2f} ms (a word per 4 KB) then {read2:.2f} ms (every byte) per block{grew}"
            f" [{total % 7}]")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--busy", type=float, default=100.0)
    args = ap.parse_args()
    occupy = _occupier(args.busy)
    kern = fill_kernel()
    dev = DeviceMemory()
    _, warm = blocks(1)
    advise(warm[0], "both")
    writes_and_reads(kern, warm, dev)  # compiles the kernel
    held = []  # every mode's blocks stay allocated: freed ones come back with their advice
    for mode in MODES:
        keep, views = blocks(args.blocks)
        idle = per_block_ms(views[: args.blocks // 2], mode)
        busy = per_block_ms(views[args.blocks // 2 :], mode, occupy)
        keep2, views2 = blocks(args.blocks)
        side = beside_thread(views2, mode)
        print(f"{mode}: advice {idle:.3f} ms per block idle, {busy:.3f} with the GPU busy; "
              f"{side}; {writes_and_reads(kern, views, dev)}", flush=True)
        held += [keep, keep2]
    dev.stop()


if __name__ == "__main__":
    main()
