"""ShardedCache: one layer's cache of a document split by position over the ranks of an
``mx.distributed`` group (see the package docstring).

    import mlx.core as mx, mlx_lm, tiered
    from tiered.shard import ShardedCache
    group = tiered.shard.init_group()               # under mlx.launch -n N
    cache = ShardedCache.for_model(model, document_tokens=len(document), group=group)
    cache.read(model, document)                      # each rank its own shard, in turn
    text = mlx_lm.generate(model, tokenizer, prompt=question, prompt_cache=cache)

Every rank runs this with the same tokens; rank r keeps positions [bounds[r], bounds[r + 1])
(the last rank also every decoded token), so each holds about 1/N of the document's keys and
values. The answer is the single-process ``KVCache``'s: attention is merged exactly.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..runtime import integration
from .group import init_group
from .merge import gather_merge, partial_attention
from .tiered import empty_partial, local_caches, tiered_partial, tiered_store
from .turns import HEADER, broadcast, header, read_in_turns


class ShardError(RuntimeError):
    """A rank of the sharded cache was lost (its process died or its link broke): the shard it
    held is gone, and the document must be read again."""


def shard_bounds(document_tokens: int, ranks: int) -> list[int]:
    """First position of each rank's shard: contiguous, as even as whole tokens allow (rank r
    keeps [bounds[r], bounds[r + 1]); the last rank keeps everything from its bound on)."""
    if ranks < 1:
        raise ValueError(f"Invalid ranks: {ranks} (expected >= 1)")
    if document_tokens < ranks:
        raise ValueError(f"Invalid document_tokens: {document_tokens} for {ranks} ranks (each "
                         "rank's shard needs at least one token)")
    per = -(-document_tokens // ranks)
    return [min(r * per, document_tokens - (ranks - r)) for r in range(ranks)]


class ShardedCache:
    """One layer: this rank's shard of the positions in a ``KVCache``, attention merged over
    the group. ``offset`` is the sequence's (every rank's alike), as the model's RoPE needs."""

    def __init__(self, group, bounds: list[int], layer: int = 0, local=None):
        if len(bounds) != group.size() or bounds[0] != 0 or any(
                b >= c for b, c in zip(bounds, bounds[1:])):
            raise ValueError(f"Invalid bounds {bounds} for a group of {group.size()} ranks "
                             "(increasing, from 0, one per rank)")
        self.group, self.rank, self.layer = group, group.rank(), layer
        self.bounds = list(bounds)
        self.lo = bounds[self.rank]
        self.hi = bounds[self.rank + 1] if self.rank + 1 < len(bounds) else None
        self.offset = 0
        # positions [lo, lo + local.offset): a KVCache, or a TieredCache layer (tiered.shard.tiered)
        self.local = KVCache() if local is None else local
        self.tiered = local is not None
        self._waiting = None  # a compressed shard's new tokens, stored one by one in attention
        self.turn = None  # the reading rank while the document is read in turns (.turns)

    @classmethod
    def for_model(cls, model, *, document_tokens: int, group=None, gpu_budget=1.0,
                  **options) -> "ShardedCacheList":
        """A ShardedCache for every layer of ``model`` (full attention in every layer: models
        whose mlx-lm cache is not a ``KVCache`` everywhere are refused), the shards cut for a
        document of ``document_tokens`` tokens over ``group`` (default:
        :func:`tiered.shard.group.init_group`).
        ``gpu_budget`` 1.0: each rank holds its shard exact; below it, each rank's shard is a
        TieredCache with that budget (and ``options``), exact while the document is read and
        compressed after it (:meth:`ShardedCacheList.finish_prefill`)."""
        group = init_group() if group is None else group
        made = model.make_cache() if hasattr(model, "make_cache") else [
            KVCache() for _ in model.layers]
        other = sorted({type(c).__name__ for c in made if type(c) is not KVCache})
        if other:
            raise ValueError(f"ShardedCache shards full-attention layers only; this model's "
                             f"cache also holds {', '.join(other)}")
        integration.install()
        bounds = shard_bounds(document_tokens, group.size())
        local = local_caches(model, group.rank(), bounds, document_tokens, gpu_budget, options)
        return ShardedCacheList(
            [cls(group, bounds, layer=i, local=None if local is None else local[i])
             for i in range(len(made))], local)

    # ---- mlx-lm's cache protocol --------------------------------------------------------------
    def update_and_fetch(self, keys, values):
        """Keep the part of positions [offset, offset + L) in this rank's range."""
        if keys.shape[0] != 1:
            raise ValueError(f"ShardedCache holds one sequence, got a batch of {keys.shape[0]}")
        a = self.offset
        b = a + keys.shape[2]
        lo, hi = max(a, self.lo), b if self.hi is None else min(b, self.hi)
        if lo < hi:
            k, v = keys[:, :, lo - a : hi - a], values[:, :, lo - a : hi - a]
            if self.tiered:
                self._waiting = tiered_store(self.local, k, v, lo - a)
            else:
                self.local.update_and_fetch(k, v)
        self.offset = b
        return keys, values

    def attention(self, queries, keys, values, *, scale, mask, sinks=None):
        """This rank's partial over its shard, merged with every other rank's (all_gather).
        In this rank's turn of the read (:mod:`.turns`) the queries first go to every rank."""
        if sinks is not None:
            raise ValueError("ShardedCache: attention sinks are not supported")
        L = queries.shape[2]
        if self.turn is not None:  # each collective evaluated in the order every rank runs it
            hdr = header(queries, values.shape[3], float(scale))
            self._checked(lambda: mx.eval(broadcast(hdr, self.turn, self.rank, (HEADER,),
                                                    self.group)))
            self._checked(lambda: mx.eval(broadcast(queries, self.turn, self.rank,
                                                    queries.shape, self.group)))
        if self.tiered:
            waiting, self._waiting = self._waiting, None
            o, lse = tiered_partial(self.local, queries, waiting, scale=float(scale),
                                    q_start=self.offset - L, k_start=self.lo)
        else:
            o, lse = self._exact_partial(queries, values.shape[3], float(scale),
                                         self.offset - L)
        return self._merged(o, lse).astype(queries.dtype)

    def answer_turn(self, L: int) -> None:
        """Another rank's turn of the read: its chunk of L queries (at position ``offset``)
        arrives, and this rank's partial goes back: over its whole shard where the shard lies
        before the chunk, empty where after (:mod:`.turns`)."""
        hdr = broadcast(None, self.turn, self.rank, (HEADER,), self.group)
        hq, d, dv, scale = self._checked(lambda: hdr.tolist())
        q = broadcast(None, self.turn, self.rank, (1, int(hq), L, int(d)), self.group)
        self._checked(lambda: mx.eval(q))
        if self.rank < self.turn:
            o, lse = self._exact_partial(q, int(dv), scale, self.offset)
        else:
            o, lse = empty_partial(q, int(dv))
        self._merged(o, lse)

    def _exact_partial(self, queries, dv: int, scale: float, q_start: int):
        """(o, lse) of ``queries`` at q_start.. over this rank's shard while it is exact."""
        local = self.local
        if local.offset == 0:
            return empty_partial(queries, dv)
        k, v = local.keys_and_values()
        return partial_attention(queries, k, v, scale=scale, q_start=q_start, k_start=self.lo)

    def _merged(self, o, lse):
        out = gather_merge(o, lse, self.group)
        self._checked(lambda: mx.eval(out))  # here, so that a lost rank is named where it is
        return out

    def _checked(self, fn):
        try:
            return fn()
        except RuntimeError as e:
            raise ShardError(f"rank {self.rank}: the sharded cache lost a rank in layer "
                             f"{self.layer} ({e}); the shards it held are gone: read the "
                             "document again") from e

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise ValueError("ShardedCache: sliding-window attention is not supported")
        return None if N == 1 else "causal"  # attention masks by position itself

    @property
    def state(self):
        if self.tiered:
            return self.local.state
        return self.local.keys_and_values() if self.local.keys is not None else []

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last n positions of the sequence (each rank those it holds)."""
        if self.tiered and not self.local.is_trimmable():
            raise ValueError(f"ShardedCache: rank {self.rank}'s shard cannot be trimmed now")
        n = min(self.offset, n)
        self.offset -= n
        keep = min(max(0, self.offset - self.lo), self.local.offset)
        self.local.trim(self.local.offset - keep)
        return n

    def empty(self) -> bool:
        return self.offset == 0

    def size(self) -> int:
        return self.offset

    @property
    def held_tokens(self) -> int:
        """Positions this rank holds."""
        return self.local.offset

    def tier_bytes(self) -> dict:
        """This rank's bytes per tier (its shard: exact on the accelerator, or its tiers)."""
        if self.tiered:
            return self.local.tier_bytes()
        held = 0 if self.local.keys is None else self.local.nbytes
        return {"accelerator": held, "transient": 0, "host": 0, "disk": 0, "bookkeeping": 0}


class ShardedCacheList(list):
    """The model's ShardedCache layers (a list, as mlx-lm's prompt caches are); ``local``: this
    rank's TieredCacheList where the shards are tiered (None where they are exact)."""

    def __init__(self, layers, local=None):
        super().__init__(layers)
        self.local = local

    def read(self, model, tokens: list[int], *, step: int = 2048, progress: bool = True) -> float:
        """Prefill the document, each rank its own shard in rank order, then compress the
        tiered shards (:func:`tiered.shard.turns.read_in_turns`, :meth:`finish_prefill`).
        Every rank calls it with the same tokens; returns the read's seconds."""
        seconds = read_in_turns(model, self, tokens, step=step, progress=progress)
        self.finish_prefill()
        return seconds

    def finish_prefill(self) -> None:
        """The document is read: each rank's tiered shard compresses now (the last rank's would
        at its first decode step; the others get no decode step of their own)."""
        if self.local is not None:
            for c in self.local:
                if hasattr(c, "settle"):
                    c.settle()

    def tier_bytes(self) -> dict:
        """This rank's bytes per tier, every layer."""
        total: dict = {}
        for c in self:
            for k, v in c.tier_bytes().items():
                total[k] = total.get(k, 0) + v
        return total

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
