"""The document read in rank order: each rank prefills its own shard, the ranks before it
answering for theirs.

In rank t's turn, t alone runs the model, on its shard's tokens, chunk by chunk (positions from
its bound, as RoPE needs). In every layer the chunk's queries reach every rank (one
``all_sum``, the other ranks adding zeros, after a four-number header: heads, head_dim, value
dim, scale); each rank before t returns its partial over its whole shard, t its causal partial
over its own tokens, each rank after t an empty one, and the partials merge as in decode (one
``all_gather``, :func:`tiered.shard.merge.gather_merge`). The other ranks run no model while t
reads: each token goes through the model once, not once per rank, and the ranks after t wait.

What a rank holds while the document is read is its shard exact (``prefill_window`` covers
it); :meth:`ShardedCacheList.finish_prefill` compresses the tiered shards once every turn is
over. Question and answer then go through every rank, as in decode."""

from __future__ import annotations

import sys
import time

import mlx.core as mx

HEADER = 4  # query heads, query dim, value dim, scale


def chunks(lo: int, hi: int, step: int) -> list[tuple[int, int]]:
    """The prompt chunks [a, b) of a shard [lo, hi) read ``step`` tokens at a time."""
    return [(a, min(a + step, hi)) for a in range(lo, hi, step)]


def read_in_turns(model, caches, tokens: list[int], *, step: int = 2048,
                  progress: bool = True) -> float:
    """Prefill ``tokens`` (the document ``caches`` was cut for) into a ShardedCacheList, each
    rank its own shard in rank order (module docstring). Every rank calls this with the same
    tokens. Returns the seconds the read took on this rank (all ranks end together: the last
    turn's layers are every rank's collectives)."""
    if step < 1:
        raise ValueError(f"Invalid step: {step} (expected >= 1)")
    first = caches[0]
    if any(c.offset for c in caches):
        raise ValueError("read_in_turns: the sharded cache already holds tokens (the document "
                         "is read once, into a fresh cache)")
    n = len(tokens)
    bounds = first.bounds + [n]
    if bounds[-2] >= n:
        raise ValueError(f"read_in_turns: {n} tokens for a cache cut for a longer document "
                         f"(shard bounds {first.bounds})")
    t0 = time.perf_counter()
    for turn in range(len(first.bounds)):
        for a, b in chunks(bounds[turn], bounds[turn + 1], step):
            for c in caches:
                c.turn, c.offset = turn, a
            if turn == first.rank:
                model(mx.array(tokens[a:b])[None], cache=caches)
                mx.eval([c.state for c in caches])
                if progress:
                    print(f"\rrank {turn}: prefill {b - bounds[turn]}/"
                          f"{bounds[turn + 1] - bounds[turn]} tokens of its shard",
                          end="", file=sys.stderr, flush=True)
            else:
                for c in caches:
                    c.answer_turn(b - a)
        if turn == first.rank and progress:
            print(file=sys.stderr, flush=True)
    for c in caches:
        c.turn, c.offset = None, n
    return time.perf_counter() - t0


def broadcast(x, root: int, rank: int, shape: tuple, group) -> mx.array:
    """``x`` (float32, ``shape``) of rank ``root`` on every rank: one all_sum, the others
    adding zeros."""
    mine = x.astype(mx.float32) if rank == root else mx.zeros(shape, mx.float32)
    return mx.distributed.all_sum(mine, group=group)


def header(queries=None, dv: int = 0, scale: float = 0.0) -> mx.array:
    if queries is None:
        return mx.zeros((HEADER,), mx.float32)
    return mx.array([queries.shape[1], queries.shape[3], dv, scale], mx.float32)
