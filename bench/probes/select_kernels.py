"""The device step's scoring and selection kernels timed alone, variant by variant (issue 24, CUDA).

In a 128k decode step on an H200 the codebook scores (36-46 us a layer), the chunk logits (15)
and the tau selection (48) take ~100 us of a layer's ~600 on the GPU, far more than their bytes
would. This times each one standalone at the Llama-3-8B shape (8 kv heads, 4 query heads
each) with device time from CUPTI (kernel_timing.device_profile): the codebook kernel over --tokens
for two code layouts, the chunk-logits kernel, and the selection over the tokens / CHUNK chunk
logits as one persistent launch for several chunks per threadgroup (``persistent.MIN_CHUNK``),
with the end of each of its phases (globaltimer stamps), and as separate passes. Inputs are
made on the device and rotate over --sets copies.

    python bench/probes/select_kernels.py --tokens 131072 --min-chunks 512 1024 2048 4096 16384
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
import numpy as np
from kernel_timing import device_profile, rotating
from step_kernels import kernel_us, profile

from tiered import metal
from tiered.step.device_chunks import chunk_logits, chunk_sizes
from tiered.step.device_decode import CHUNK
from tiered.metal import persistent
from tiered.metal.select_passes import tau_select_fused

H, REP, D = 8, 4, 128
TAU, CAP, FLOOR = 0.9, 2048, 128


def codebook_inputs(n: int, g: int, c: int, gc: int, seed: int):
    """Scaled queries (Hq, D) float32, a codebook (H, gc, c, D / g) and codes (H, n + 1, g)."""
    k = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((H * REP, D), key=k[0]) * D ** -0.5
    cb = mx.random.normal((H, gc, c, D // g), key=k[1])
    codes = mx.random.randint(0, c, (H, n + 1, g), key=k[2]).astype(mx.uint8)
    return q, cb, codes


def select_inputs(nz: int, seed: int):
    """Chunk logits (Hq, nz) of flat attention, their block maxima (Hq, 1) and 5% of the chunks
    excluded (H, nz)."""
    k = mx.random.split(mx.random.key(seed), 2)
    zc = mx.random.normal((H * REP, nz), key=k[0]) * 0.5
    excl = mx.random.uniform(shape=(H, nz), key=k[1]) < 0.05
    return zc, zc.max(axis=1, keepdims=True), excl


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--min-chunks", type=int, nargs="+", default=[512, 1024, 2048, 4096, 16384])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--sets", type=int, default=4)
    args = ap.parse_args()
    n = args.tokens
    nz = n // CHUNK
    capc, floorc = CAP // CHUNK, FLOOR // CHUNK

    for g, c, gc in ((32, 256, 1), (32, 64, 32), (16, 256, 1)):
        nxt = rotating(lambda i: codebook_inputs(n, g, c, gc, i), args.sets)
        prof = profile(lambda: metal.codebook_scores(*nxt(), n, rep=REP), args.reps, args.sets)
        us = kernel_us(prof, "codebook")
        print(f"n={n} codebook g={g} c={c} gc={gc}: {us:7.1f} us "
              f"({H * n * g / 1e3 / max(us, 1e-9):.0f} GB/s of codes)", flush=True)

    flags = mx.random.uniform(shape=(H, n + 1)) < 0.1
    nxt = rotating(lambda i: mx.random.normal((H * REP, n + 1), key=mx.random.key(i)),
                   args.sets)
    sizes = chunk_sizes(n, n, n)
    prof = profile(lambda: chunk_logits(nxt(), flags, n, REP, n, width=n, sizes=sizes),
                   args.reps, args.sets)
    print(f"n={n} chunk logits: {kernel_us(prof, 'chunk'):7.1f} us", flush=True)

    nxt = rotating(lambda i: select_inputs(nz, i), args.sets)
    before = persistent.MIN_CHUNK
    for mc in args.min_chunks:
        persistent.MIN_CHUNK = mc
        grid = persistent.plan_grid(nz, H, REP)
        if grid is None:
            print("no persistent grid here", flush=True)
            break

        def sel(grid=grid, stamps=False):
            zc, zmax, excl = nxt()
            return persistent.tau_select_persistent(zc, nz, excl, TAU, capc, floorc, capc,
                                                    zmax=zmax, grid=grid, stamps=stamps)

        prof = profile(lambda: sel().sel.idx, args.reps, args.sets)
        phases = []
        for _ in range(8):
            st = np.array(sel(stamps=True).stamps).astype(np.int64)
            phases.append(np.diff(st) / 1e3)
        ph = np.median(np.array(phases), axis=0)
        print(f"chunks={nz} persistent MIN_CHUNK={mc} ({grid.blocks} units a head, "
              f"{grid.groups} groups): {kernel_us(prof, 'tau_persistent'):7.1f} us; phases "
              + " / ".join(f"{p:.1f}" for p in ph) + " us", flush=True)
    persistent.MIN_CHUNK = before

    def passes():
        zc, zmax, excl = nxt()
        return tau_select_fused(zc, nz, excl, TAU, capc, floorc, capc, backend="cuda",
                                zmax=zmax).idx

    prof = profile(passes, args.reps, args.sets)
    if prof is not None:
        print(f"chunks={nz} separate passes: {prof['device_ms'] * 1e3:7.1f} us in "
              f"{prof['launches']} launches: "
              + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in prof["name_ms"].items()), flush=True)


if __name__ == "__main__":
    main()
