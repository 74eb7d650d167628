"""``tiered run`` under ``mlx.launch -n N``: the document's cache sharded over the ranks
(:mod:`tiered.shard`). The ranks read the document in turn, each its own shard
(:meth:`tiered.shard.cache.ShardedCacheList.read`), then all decode the same tokens; rank 0
prints the answer and a summary with every rank's share."""

from __future__ import annotations

import json
import os

import mlx.core as mx

from .. import prefill
from ..options.config import format_bytes
from ..planning import tasks
from ..shard import ShardedCache, init_group

REFUSED = ("save_cache", "load_cache")


def distributed_group():
    """The ``mx.distributed`` group when this process is one rank of several (started by
    ``mlx.launch`` or MPI), else None."""
    if not any(k in os.environ for k in ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")):
        return None
    group = init_group()
    return group if group.size() > 1 else None


def run_sharded(args, group, model, tokenizer, prefix, suffix, expected, options) -> int:
    import mlx_lm

    rank = group.rank()
    for flag in REFUSED:
        if getattr(args, flag, None):
            raise ValueError(f"--{flag.replace('_', '-')} is not supported with a sharded cache "
                             f"(mlx.launch with {group.size()} ranks)")
    opts = dict(options)
    budget = opts.pop("gpu_budget", 0.125)
    cache = ShardedCache.for_model(model, document_tokens=len(prefix), group=group,
                                   gpu_budget=budget, **opts)
    try:
        # each rank reads its own shard in rank order, the ranks before it answering for theirs
        seconds = cache.read(model, prefix, step=args.prefill_step)
        max_tokens = args.max_tokens or (10 if expected is not None else 32)
        text, last = [], None
        for response in mlx_lm.stream_generate(model, tokenizer, suffix, max_tokens=max_tokens,
                                               prompt_cache=cache):
            text.append(response.text)
            last = response
        answer = "".join(text)
        mine = {"rank": rank, "held_tokens": cache[0].held_tokens, "bytes": cache.tier_bytes(),
                "peak_rss_bytes": prefill.peak_rss_bytes()}
        every = _gather_json(mine, group)
        if rank != 0:
            return 0
        print(f"answer: {answer}")
        print("\n--- summary ---")
        print(f"tokens: {len(prefix)} document + {len(suffix)} question, "
              f"{last.generation_tokens} generated | {group.size()} ranks")
        print(f"prefill: {len(prefix) / seconds:,.1f} tok/s ({seconds:.1f}s) | decode: "
              f"{last.generation_tps:,.2f} tok/s")
        for r in every:
            b = r["bytes"]
            print(f"  rank {r['rank']}: {r['held_tokens']} positions | accelerator "
                  f"{format_bytes(b['accelerator'])} | host {format_bytes(b['host'])} | disk "
                  f"{format_bytes(b['disk'])} | peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB")
        ok = None
        if expected is not None:
            ok = tasks.is_correct(expected, answer)
            print(f"pass key {expected}: {'found' if ok else 'NOT found'}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"answer": answer, "ranks": every, "prefill_s": seconds,
                           "generation_tps": last.generation_tps, "expected": expected,
                           "found": ok, "gpu_budget": budget}, f, indent=2, default=str)
        return 0
    finally:
        cache.close()


def _gather_json(obj, group) -> list:
    """Every rank's ``obj`` (JSON-able), in rank order, through one ``all_gather`` of bytes."""
    raw = json.dumps(obj).encode()
    size = mx.distributed.all_gather(mx.array([len(raw)], mx.int32), group=group)
    width = int(mx.max(size).item())
    buf = mx.array(list(raw) + [0] * (width - len(raw)), mx.uint8)[None]
    every = mx.distributed.all_gather(buf, group=group)
    return [json.loads(bytes(every[r, : int(size[r].item())].tolist()).decode())
            for r in range(group.size())]
