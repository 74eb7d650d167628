"""Run under ``mlx.launch -n N --backend ring``: greedy tokens of a prompt through a ShardedCache
(tests/test_shard.py compares them with one process's KVCache). Also a plain script:
``python tests/shard_worker.py --out tokens.json`` with one rank.

--die-after K: rank 1 exits after K decode steps (the other ranks must then raise ShardError).
--turns: the document read in turns, each rank its own shard (ShardedCacheList.read)."""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tiered  # noqa: E402,F401  (optimized BLAS before mlx)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from tiered.shard import ShardedCache, ShardError, init_group  # noqa: E402


def greedy(model, prompt, cache, steps: int, chunk: int, die_after: int | None = None,
           rank: int = 0, turns: bool = False) -> list[int]:
    if turns:  # each rank reads its own shard, in rank order
        cache.read(model, prompt[:-1], step=chunk, progress=False)
    else:  # every rank runs the model on every chunk
        for i in range(0, len(prompt) - 1, chunk):
            model(mx.array(prompt[i : min(i + chunk, len(prompt) - 1)])[None], cache=cache)
        if hasattr(cache, "finish_prefill"):
            cache.finish_prefill()
    tok, out = prompt[-1], []
    for step in range(steps):
        if die_after is not None and step == die_after and rank == 1:
            os._exit(3)
        logits = model(mx.array([[tok]]), cache=cache)
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
    return out


def niced_threads() -> int:
    """This process's threads at nice 19 (tiered.shard.init_group's for the ring's threads)."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            count += int(f.read().rsplit(")", 1)[1].split()[16]) == 19
    return count


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="small", choices=["small", "embedded"])
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--die-after", type=int, default=None)
    p.add_argument("--budget", type=float, default=1.0, help="gpu_budget of each rank's shard")
    p.add_argument("--options", default="{}", help="TieredConfig options as JSON (budget < 1)")
    p.add_argument("--turns", action="store_true",
                   help="read the document in turns (ShardedCacheList.read)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.model == "small":
        from conftest import make_small_model

        model = make_small_model("llama-gqa-d64", layers=3)
    else:
        model, _ = tiered.load()
    prompt = np.random.default_rng(11).integers(10, 1000, size=a.tokens).tolist()
    group = init_group()
    cache = ShardedCache.for_model(model, document_tokens=a.tokens - 1, group=group,
                                   gpu_budget=a.budget, **json.loads(a.options))
    try:
        tokens = greedy(model, prompt, cache, a.steps, a.chunk, a.die_after, group.rank(),
                        a.turns)
    except ShardError as e:
        with open(f"{a.out}.rank{group.rank()}.error", "w") as f:
            f.write(str(e))
        return 4
    with open(f"{a.out}.rank{group.rank()}", "w") as f:
        json.dump({"tokens": tokens, "held": cache[0].held_tokens, "bounds": cache[0].bounds,
                   "phases": sorted({getattr(c.local, "phase", "exact") for c in cache}),
                   "bytes": cache.tier_bytes(), "niced_threads": niced_threads()}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
