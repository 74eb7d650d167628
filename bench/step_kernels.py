"""The device step's attention kernels timed alone, variant by variant (issue 24, CUDA).

In a 128k decode step on an H200 the resident scores (47-68 us a layer), the splits (39 us)
and the merge run far slower than their bytes at the device's bandwidth would take. This
times each one standalone at the Llama-3-8B shape (8 kv heads, 4 query heads each, head_dim
128) over --resident slots and 2048 gathered rows a head, with device time from CUPTI
(kernels.device_profile: summed kernel durations, no host time), for the knobs that change
them: ``tiered.device_attend.SPLIT_LOADS`` (tokens a splits warp loads before computing) and
``tiered.device_resident.RESIDENT_ITER`` (0: a warp per slot; k: the tiled kernel, k slots a
lane group). Inputs rotate over --sets copies so the L2 cache (50 MB on an H200) holds none.

    python bench/step_kernels.py --resident 8192 16384 --loads 1 2 4 8 --iters 0 1 2 4
"""

from __future__ import annotations

import argparse

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
import numpy as np
from kernels import device_profile, rotating

from tiered import device_attend, device_resident

H, REP, D, T = 8, 4, 128, 2048


def inputs(R: int, seed: int):
    """One input set: queries (1, Hq, 1, D) fp16, resident keys/values (H, R, D) fp16 with
    a tenth of the slots empty, gathered keys/values (H, T, D) fp16, 70% of them attended."""
    rng = np.random.default_rng(seed)
    queries = mx.array(rng.normal(size=(1, H * REP, 1, D)).astype(np.float16))
    rk, rv = (mx.array(rng.normal(size=(H, R, D)).astype(np.float16)) for _ in range(2))
    gk, gv = (mx.array(rng.normal(size=(H, T, D)).astype(np.float16)) for _ in range(2))
    rtok = np.arange(H * R, dtype=np.int32).reshape(H, R)
    rtok[rng.random((H, R)) < 0.1] = -1
    ok = mx.array(rng.random((H, T)) < 0.7)
    return queries, rk, rv, mx.array(rtok), gk, gv, ok


def kernel_us(prof: dict | None, part: str) -> float:
    """Microseconds per call of the kernels whose name holds ``part``."""
    if prof is None:
        return float("nan")
    return 1e3 * sum(ms for name, ms in prof["name_ms"].items() if part in name)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--resident", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--loads", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--iters", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--sets", type=int, default=4)
    args = ap.parse_args()
    scale = D ** -0.5
    for R in args.resident:
        nxt = rotating(lambda i, R=R: inputs(R, i), args.sets)
        for it in args.iters:
            device_resident.RESIDENT_ITER = it

            def resident():
                queries, rk, _, rtok, *_ = nxt()
                return device_resident.resident_scores(queries, scale, rk, rtok, H * R)

            prof = device_profile(resident, reps=args.reps)
            print(f"R={R:6d} resident RESIDENT_ITER={it}: {kernel_us(prof, 'resident'):7.1f} us "
                  f"({2 * H * R * D / 1e3 / max(kernel_us(prof, 'resident'), 1e-9):.0f} GB/s of keys)",
                  flush=True)
        device_resident.RESIDENT_ITER = 0
        first, check = None, inputs(R, 99)
        for u in args.loads:
            device_attend.SPLIT_LOADS = u

            def splits(fixed=None):
                queries, rk, rv, rtok, gk, gv, ok = fixed or nxt()
                q, s_r, _ = device_resident.resident_scores(queries, scale, rk, rtok, H * R)
                return device_attend.attend(q, rk, rv, rtok, gk, gv, ok, None, mx.float16,
                                            s_r=s_r)

            got = [np.array(a.astype(mx.float32)) for a in splits(check)]
            first = got if first is None else first
            same = all(np.array_equal(a, b) for a, b in zip(got, first))
            prof = device_profile(splits, reps=args.reps)
            us = kernel_us(prof, "splits")
            print(f"R={R:6d} splits SPLIT_LOADS={u}: {us:7.1f} us, merge "
                  f"{kernel_us(prof, 'merge'):5.1f} us ({2 * H * (R + 2 * T) * D / 1e3 / max(us, 1e-9):.0f}"
                  f" GB/s of rows; output {'the same bits' if same else 'DIFFERS'} as "
                  f"SPLIT_LOADS={args.loads[0]})", flush=True)
        device_attend.SPLIT_LOADS = 4


if __name__ == "__main__":
    main()
