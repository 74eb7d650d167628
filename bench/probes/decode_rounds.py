"""Decode steps in rounds, each round's median and its host split (issue 24).

A decode step's cost changes after compression: for the first ``recent`` steps nothing leaves
the ring for the host pages and the undo journal copies the ring's rows; afterwards every
step writes one token behind per layer. bench/decode_speed.py reports one median after its
warm-up; this prints a median per round of --steps steps, the Python queuing time against the
final wait, so the phases and any drift show. --sample N then samples the host's Python lines
for N more steps (bench/probes/line_sampler.py). For native stacks (inside MLX's dispatch), attach
py-spy to the process while it runs:

    python bench/probes/decode_rounds.py --rounds 14 &
    py-spy record --pid $! --native -r 60 -d 6 -f raw -o spy.txt

    python bench/probes/decode_rounds.py --model llama3-8b --context 131072 --rounds 10
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
import numpy as np
from decode_setup import build_model, kv_caches, queued_steps, seed_kv, tiered_caches


def rounds(model, cache, name: str, count: int, steps: int):
    y = mx.array([[1]])
    for r in range(count):
        y, queue, wait = queued_steps(model, cache, y, steps)
        total = 1e3 * (np.array(queue) + np.array(wait))
        print(f"{name} round {r} (steps {r * steps}-{(r + 1) * steps - 1}): median "
              f"{np.median(total):.2f} ms (queue {1e3 * np.median(queue):.2f}, eval "
              f"{1e3 * np.median(wait):.2f}); steps " + " ".join(f"{x:.0f}" for x in total),
              flush=True)
    return y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b", choices=["llama3-8b-2l", "llama3-8b"])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--budget", type=float, default=0.125)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--kv", action="store_true", help="time KVCache first")
    ap.add_argument("--sample", type=int, default=0, help="then sample Python lines for N steps")
    args = ap.parse_args()
    model, _ = build_model(args.model, mx.float16)
    seed = seed_kv(model, None, 2048)
    if args.kv:
        kv = kv_caches(seed, args.context)
        rounds(model, kv, "KVCache", 3, args.steps)
        del kv
    cache = tiered_caches(model, seed, args.context, args.budget, dict(calibration_tokens=2048))
    y = rounds(model, cache, "tiered", args.rounds, args.steps)
    if args.sample:
        from line_sampler import LineSampler

        with LineSampler() as s:
            for _ in range(args.sample):
                y = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)[:, None]
                mx.eval(y)
        s.report(per=args.sample, top=45)
    cache.close()


if __name__ == "__main__":
    main()
