"""How much of a decode step's chunk selection the next step selects again (issue 62): what a
cache of the chunks staged at one step (tiered.cpu.disk_cache) can save the next.

Runs ``bench/decode_speed.py`` with its arguments (tiered only makes sense) and records, for
every layer's CPU-path selection (tiered.step.chunk_select.select_np), the chunk ids of each kv
head; prints, over the last ``--window`` steps of each layer, the share of a step's selected
chunks that the step before selected too (per layer and head, then mean and percentiles):

    python bench/probes/selection_overlap.py --layers 30 -- --model embedded --contexts 65536 \
        --budgets 0.125 --methods tiered --steps 10 --warmup 3 --name overlap

(the embedded model on its real-text cache at 65,536 tokens: mean 0.824, median 0.875;
``--layers 2 -- --model llama3-8b-2l`` with random weights: mean 0.085). Remove the result
files the run writes under bench/results afterwards.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import runpy
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)
import numpy as np

from tiered.step import chunk_select


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, required=True, help="the model's tiered layers")
    ap.add_argument("--window", type=int, default=8, help="steps compared per layer (the last)")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- then decode_speed.py's arguments")
    args = ap.parse_args()
    calls = []
    expand = chunk_select.expand_chunks

    def recorded(idxc, countc, *a, **k):
        calls.append([set(idxc[h, :countc[h]].tolist()) for h in range(idxc.shape[0])])
        return expand(idxc, countc, *a, **k)

    chunk_select.expand_chunks = recorded

    def report():
        per = collections.defaultdict(list)
        for i, c in enumerate(calls):  # the layers take turns, every step
            per[i % args.layers].append(c)
        shares = [len(a & b) / len(b)
                  for steps in per.values()
                  for before, now in zip(steps[-args.window - 1:-1], steps[-args.window:])
                  for a, b in zip(before, now) if b]
        if not shares:
            print("selection overlap: no decode step selected chunks on the CPU path")
            return
        print(f"selection overlap over {len(calls)} layer-steps: chunks a step selected that "
              f"the step before selected too: mean {np.mean(shares):.3f}, p10 "
              f"{np.percentile(shares, 10):.3f}, median {np.median(shares):.3f}, p90 "
              f"{np.percentile(shares, 90):.3f} ({len(shares)} layer-step-heads)")

    atexit.register(report)
    rest = [a for a in args.rest if a != "--"]
    sys.argv = [str(BENCH / "decode_speed.py"), *rest]
    runpy.run_path(str(BENCH / "decode_speed.py"), run_name="__main__")


if __name__ == "__main__":
    main()
