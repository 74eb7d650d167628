"""The device step's attention kernels timed alone, variant by variant (issue 24, CUDA).

In a 128k decode step on an H200 the resident scores (47-68 us a layer), the splits (39 us)
and the merge run far slower than their bytes at the device's bandwidth would take. This
times each one standalone at the Llama-3-8B shape (8 kv heads, 4 query heads each, head_dim
128) over --resident slots and 2048 gathered rows a head, with device time from CUPTI
(kernel_timing.device_profile: summed kernel durations, no host time), for the knobs that change
them: ``tiered.step.device_resident.RESIDENT_ITER`` (0: a warp per slot; k: the tiled kernel, k
slots a lane group). Inputs rotate over --sets copies so the L2 cache (50 MB on an H200) holds none.

    python bench/probes/step_kernels.py --resident 8192 16384 --iters 0 1 2 4 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
from kernel_timing import device_profile, rotating

from tiered.step import device_attend, device_resident

H, REP, D, T = 8, 4, 128, 2048


def inputs(R: int, seed: int):
    """One input set, made on the device (arrays made from host data would be managed memory
    that the GPU reads over the bus until it migrates): queries (1, Hq, 1, D) fp16, resident
    keys/values (H, R, D) fp16 with a tenth of the slots empty, gathered keys/values
    (H, T, D) fp16, 70% of them attended."""
    k = mx.random.split(mx.random.key(seed), 6)
    queries = mx.random.normal((1, H * REP, 1, D), key=k[0]).astype(mx.float16)
    rk, rv = (mx.random.normal((H, R, D), key=k[i]).astype(mx.float16) for i in (1, 2))
    gk, gv = (mx.random.normal((H, T, D), key=k[i]).astype(mx.float16) for i in (3, 4))
    tok = mx.arange(H * R, dtype=mx.int32).reshape(H, R)
    rtok = mx.where(mx.random.uniform(shape=(H, R), key=k[5]) < 0.1, -1, tok)
    ok = mx.random.uniform(shape=(H, T), key=k[0]) < 0.7
    return queries, rk, rv, rtok, gk, gv, ok


def profile(fn, reps: int, sets: int):
    """device_profile after one pass over every input set."""
    for _ in range(sets):
        mx.eval(fn())
    return device_profile(fn, reps=reps)


def kernel_us(prof: dict | None, part: str) -> float:
    """Microseconds per call of the kernels whose name holds ``part``."""
    if prof is None:
        return float("nan")
    return 1e3 * sum(ms for name, ms in prof["name_ms"].items() if part in name)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--resident", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--iters", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--sets", type=int, default=4)
    args = ap.parse_args()
    scale = D ** -0.5
    iter_before = device_resident.RESIDENT_ITER
    for R in args.resident:
        nxt = rotating(lambda i, R=R: inputs(R, i), args.sets)
        for it in args.iters:
            device_resident.RESIDENT_ITER = it

            def resident():
                queries, rk, _, rtok, *_ = nxt()
                return device_resident.resident_scores(queries, scale, rk, rtok, H * R)

            prof = profile(resident, args.reps, args.sets)
            print(f"R={R:6d} resident RESIDENT_ITER={it}: {kernel_us(prof, 'resident'):7.1f} us "
                  f"({2 * H * R * D / 1e3 / max(kernel_us(prof, 'resident'), 1e-9):.0f} GB/s of keys)",
                  flush=True)
        device_resident.RESIDENT_ITER = iter_before

        def splits():
            queries, rk, rv, rtok, gk, gv, ok = nxt()
            q, s_r, _ = device_resident.resident_scores(queries, scale, rk, rtok, H * R)
            return device_attend.attend(q, rk, rv, rtok, gk, gv, ok, None, mx.float16, s_r=s_r)

        prof = profile(splits, args.reps, args.sets)
        us = kernel_us(prof, "splits")
        print(f"R={R:6d} splits: {us:7.1f} us, merge {kernel_us(prof, 'merge'):5.1f} us "
              f"({2 * H * (R + 2 * T) * D / 1e3 / max(us, 1e-9):.0f} GB/s of rows)", flush=True)
    device_resident.RESIDENT_ITER = iter_before


if __name__ == "__main__":
    main()
