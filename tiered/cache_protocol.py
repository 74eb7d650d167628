"""The parts of mlx-lm's cache protocol beyond a single sequence's decode: ``kv_bits``
(``to_quantized``), batching (``merge``, ``extract``) and ``copy.deepcopy``."""

from __future__ import annotations

import copy
import logging

from .persistence import layer_state

log = logging.getLogger("tiered")


class CacheProtocol:
    """Methods of :class:`tiered.cache.TieredCache` (see the module docstring)."""

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """mlx-lm's ``kv_bits`` path. A layer in the exact phase is a KVCache and quantizes as
        one (the result is mlx-lm's ``QuantizedKVCache``, which is no longer tiered: a warning
        says so); a compressed layer is refused, with the options that do the same job."""
        self._require_open()
        if self.geometry is not None and self.phase != "exact":
            raise ValueError(
                f"kv_bits={bits}: layer {self.layer} is compressed ({self.offset} tokens); a "
                "TieredCache quantizes through its own options, not mlx-lm's QuantizedKVCache: "
                "keys are already compressed to codes, and host values can be 8-bit "
                "(host_dtype='int8'); drop kv_bits, or use mlx-lm's own cache for kv_bits")
        if self.exact_reason is None and not self.config.exact:
            log.warning("kv_bits=%d: layer %d leaves tiered for mlx-lm's QuantizedKVCache "
                        "(exact phase, %d tokens): it will not compress", bits, self.layer,
                        self.offset)
        return self._as_kvcache().to_quantized(group_size=group_size, bits=bits)

    def _as_kvcache(self):
        """An exact-phase layer as mlx-lm's KVCache over the same buffers (no copy)."""
        from mlx_lm.models.cache import KVCache

        kv = KVCache()
        if self.geometry is not None:
            kv.keys, kv.values = self._exact_view()
            kv.offset = self.offset
        return kv

    @classmethod
    def merge(cls, caches):
        """mlx-lm's batching (BatchGenerator merges one cache per sequence): layers still in
        the exact phase merge into mlx-lm's ``BatchKVCache`` (the batch then runs exact, as it
        would with ``KVCache``); a compressed layer cannot join a batch and is refused."""
        from mlx_lm.models.cache import BatchKVCache

        views = []
        for c in caches:
            if not isinstance(c, CacheProtocol):  # mlx-lm's caches merge as KVCache.merge does
                views.append(c)
                continue
            c._require_open()
            if c.geometry is not None and (c.phase != "exact" or c.geometry.batch != 1):
                raise ValueError(
                    f"layer {c.layer} holds {c.offset} tokens compressed: batched generation "
                    "(BatchGenerator) merges caches, which only exact-phase TieredCaches "
                    "can join; generate one sequence at a time, or use mlx-lm's own caches "
                    "for batches")
            views.append(c._as_kvcache())
            if not c.config.exact and not getattr(c.context, "warned_batch", False):
                c.context.warned_batch = True  # once per model's cache, not per layer
                log.warning("batched generation: the tiered cache joins mlx-lm's BatchKVCache "
                            "and runs exact (the full cache, no compression); generate one "
                            "sequence at a time to keep gpu_budget")
        return BatchKVCache.merge(views)

    def extract(self, idx: int):
        """The cache of sequence ``idx`` (a TieredCache holds one: idx 0, an independent copy)."""
        B = 1 if self.geometry is None else self.geometry.batch
        if B != 1 or idx != 0:
            raise ValueError(f"Invalid idx {idx}: this TieredCache holds {B} sequence(s); "
                             "extract works on single-sequence caches (idx 0)")
        return copy.deepcopy(self)

    def __deepcopy__(self, memo):
        ctx = memo.get(id(self.context))
        if ctx is None:
            ctx = memo[id(self.context)] = self.context.copy()
        other = type(self)(self.config, layer=self.layer, context=ctx)
        layer_state.restore(other, layer_state.state_of(self), context=ctx)
        other.stats = copy.deepcopy(self.stats, memo)
        memo[id(self)] = other
        return other
