"""Which option restores an answer: one exact prefill per document, then a fork of it per
variant of the options (``TieredCacheList.fork``), each answered greedily.

    python bench/probes/fork_variants.py --budget 0.03125 --docs facts:1 facts:3 \\
        --variants '{"default": {}, "tau99": {"tau": 0.99}, "all": {"min_selected": 6144}}'

A variant of ``null`` is mlx-lm's ``KVCache`` (the full cache). Documents as
bench/accuracy_grid.py makes them (``TASK:INDEX``, ``--length`` tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)
from accuracy_grid import make_sample
from common import continue_greedy, shared_prefill

import mlx.core as mx

import tiered
from tiered.planning.tasks import is_correct


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--budget", type=float, required=True)
    p.add_argument("--docs", nargs="+", required=True, help="TASK:INDEX, e.g. facts:1")
    p.add_argument("--variants", required=True, help="JSON {name: options or null}")
    p.add_argument("--length", type=int, default=6144)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    args = p.parse_args(argv)
    variants = json.loads(args.variants)
    model, tok = tiered.load(dtype=getattr(mx, args.dtype) if args.dtype else None)
    for doc in args.docs:
        task, i = doc.split(":")
        s = make_sample(task, tok, args.length - 8, int(i))
        base, last = shared_prefill(model, tok.encode(s.prompt))
        gen = len(tok.encode(" " + s.answer)) + 2
        for name, opts in variants.items():
            t = time.perf_counter()
            cache = base.to_kvcache() if opts is None else base.fork(gpu_budget=args.budget, **opts)
            text = continue_greedy(model, tok, cache, last, gen)
            ok = "Y" if is_correct(s.answer, text) else "n"
            print(f"{doc:10s} {name:12s} {ok} {text!r:30.30} {time.perf_counter() - t:.0f}s",
                  flush=True)
            if opts is not None:
                cache.close()
        base.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
