"""Where the fused tau selection's time goes, on a Metal or CUDA device, by launch shape.

Runs tiered.metal.tau_select (Llama-3-8B attention shape: 8 kv / 32 query heads; scores from
the codebook kernel with its block maxima, tau 0.9, cap 2048, floor 32, nothing excluded) with
the selection's launch constants changed: threads per threadgroup (SELECT_THREADS), the most
chunks per kv head of passes 2 and 3 (SELECT_CHUNKS: pass 3 sums every chunk's histogram),
the threadgroups per pass (SELECT_GROUPS), the longest row whose passes 1 and 1b run in one
launch (SELECT_FUSED_TOKENS) and that launch's loads in flight per thread
(SELECT_FUSED_LOADS). Every variant must select exactly what the
default selects (the sums are exact and ties go by index, whatever the partition); a variant
that does not is reported as such. Time per call: median over --reps evaluations of 8 queued
calls, and on CUDA the GPU busy time per call with each pass's share (CUPTI, through
kernel_timing.device_profile). Prints a table; writes nothing.

    python bench/probes/select_variants.py --sizes 131072 1048576
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)
from kernel_timing import device_profile, timed, variant_args

import mlx.core as mx
import numpy as np

from tiered import metal
from tiered.metal import select_passes as tm
from tiered.metal.codebook import codebook_scores_and_max

H, HQ, D, G, C = 8, 32, 128, 32, 256
REP = HQ // H
PASSES = ("tau_hist_theta", "tau_hist", "tau_theta", "tau_keys", "tau_compact")
ALWAYS, NEVER = 2**24, 0
VARIANTS = [  # (threads, most chunks per kv head, threadgroups per pass, SELECT_FUSED_TOKENS,
    #           SELECT_FUSED_LOADS); the first is the reference
    (1024, 32, 128, 131072, 16),
    (1024, 32, 128, ALWAYS, 16),
    (1024, 32, 128, ALWAYS, 8),
    (1024, 32, 128, NEVER, 16),
    (1024, 32, 256, NEVER, 16),
    (512, 32, 128, ALWAYS, 16),
]


def launch_pass(name: str) -> str | None:
    """The pass a CUPTI kernel name belongs to (the longest PASSES entry it names)."""
    hits = [p for p in PASSES if f"tiered_{p}_" in name]
    return max(hits, key=len) if hits else None


def main(argv=None):
    args, backend = variant_args(__doc__, "select_variants.py", argv)
    saved = (dict(tm.SELECT_THREADS), tm.SELECT_CHUNKS, tm.SELECT_GROUPS,
             tm.SELECT_FUSED_TOKENS, tm.SELECT_FUSED_LOADS)
    print(f"{'tokens':>8} {'threads':>7} {'chunks':>6} {'groups':>6} {'fused to':>9} "
          f"{'loads':>5} {'ms':>8} {'device':>8} "
          + " ".join(f"{name.replace('tau_', ''):>10}" for name in PASSES) + "  same as first")
    try:
        for n in args.sizes:
            q = mx.random.normal((HQ, D), key=mx.random.key(n)) * D**-0.5
            cb = mx.random.normal((H, 1, C, D // G))
            codes = mx.random.randint(0, C, (H, n, G), key=mx.random.key(1)).astype(mx.uint8)
            z, zmax, _ = codebook_scores_and_max(q, cb, codes, n, rep=REP, backend=backend)
            exclude = mx.zeros((H, n), mx.bool_)
            mx.eval(z, zmax, exclude)
            first = None
            for threads, chunks, groups, fused_tokens, loads in VARIANTS:
                tm.SELECT_THREADS[backend] = threads
                tm.SELECT_CHUNKS = chunks
                tm.SELECT_GROUPS = groups
                tm.SELECT_FUSED_TOKENS = fused_tokens
                tm.SELECT_FUSED_LOADS = loads

                def call(z=z, n=n, exclude=exclude, zmax=zmax):
                    return metal.tau_select(z, n, exclude, 0.9, 2048, 32, with_stats=True,
                                         zmax=zmax).idx

                sel = metal.tau_select(z, n, exclude, 0.9, 2048, 32, with_stats=True, zmax=zmax)
                got = (np.asarray(sel.idx), np.asarray(sel.count))
                first = got if first is None else first
                same = all(np.array_equal(a, b) for a, b in zip(got, first))
                t = timed(call, reps=args.reps, warmup=3, batch=8)
                prof = device_profile(call, reps=args.reps) if backend == "cuda" else None
                if prof:
                    by_pass = {name: sum(ms for k, ms in prof["name_ms"].items()
                                         if launch_pass(k) == name) for name in PASSES}
                    dev = f"{prof['device_ms']:8.4f} " + " ".join(
                        f"{by_pass[name]:10.4f}" for name in PASSES)
                else:
                    dev = f"{'n/a':>8} " + " ".join(f"{'':>10}" for _ in PASSES)
                print(f"{n:>8} {threads:>7} {chunks:>6} {groups:>6} {fused_tokens:>9} "
                      f"{loads:>5} {1e3 * t:8.4f} {dev}  "
                      f"{'yes' if same else 'NO: differs from the first variant'}", flush=True)
            del z, zmax, codes, exclude
            mx.clear_cache()
    finally:
        tm.SELECT_THREADS.clear()
        tm.SELECT_THREADS.update(saved[0])
        (tm.SELECT_CHUNKS, tm.SELECT_GROUPS, tm.SELECT_FUSED_TOKENS,
         tm.SELECT_FUSED_LOADS) = saved[1:]


if __name__ == "__main__":
    main()
