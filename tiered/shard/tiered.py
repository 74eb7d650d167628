"""A rank's shard as a TieredCache layer (``ShardedCache.for_model(..., gpu_budget < 1)``).

While the document is read the shard stays exact (``prefill_window`` covers it): a chunk's
partial over it is computed from its exact keys (:func:`tiered.shard.merge.partial_attention`),
and the rank holding the chunk's tokens also passes them through the layer's own attention (its
H2O seed and compression decisions see them). Once compressed, every query is attended one at a
time: the rank holding its token appends it and decodes (the layer's decode step), the others
read their shard without changing it (``update=False``); each step leaves its log-sum-exp
(``last_lse``, the CPU-gather and numpy paths), which the merge over ranks needs."""

from __future__ import annotations

import mlx.core as mx

from ..cache import TieredCache


def local_caches(model, rank: int, bounds: list[int], document_tokens: int, gpu_budget,
                 options: dict):
    """This rank's TieredCacheList for its shard, or None at ``gpu_budget`` 1.0 (exact shards:
    a KVCache each)."""
    if isinstance(gpu_budget, (int, float)) and float(gpu_budget) == 1.0:
        if options:
            raise ValueError(f"ShardedCache: options {sorted(options)} need gpu_budget < 1.0 "
                             "(at 1.0 each rank holds its shard exact)")
        return None
    end = bounds[rank + 1] if rank + 1 < len(bounds) else document_tokens
    opts = dict(options)
    if opts.setdefault("device_gather", "off") != "off":
        raise ValueError("ShardedCache: device_gather must be 'off' (the device step does not "
                         "export the log-sum-exp the merge over ranks needs)")
    opts["prefill_window"] = max(int(opts.get("prefill_window") or 0), end - bounds[rank])
    caches = TieredCache.for_model(model, gpu_budget, **opts)
    if getattr(caches, "kept_layers", None):
        kept = caches.kept_layers
        caches.close()
        raise ValueError(f"ShardedCache: every layer must be tiered; kept: {kept}")
    for layer in caches:  # a chunk's partial over the rank's own shard reuses its log-sum-exp
        layer.export_lse = True
    return caches


def tiered_store(local, keys, values, first: int):
    """This rank's part of a step's new tokens (keys/values (1, H, n, d), at index ``first`` of
    the step's queries): stored now while the shard is exact, else kept for
    :func:`tiered_partial` to append one at a time. A prompt chunk that would compress the
    shard compresses it first (the chunk is then attended token by token, not block-wise)."""
    n = keys.shape[2]
    if (local.phase == "exact" and n > 1 and local.offset
            and local._compresses_at(local.offset + n, n)):
        local.settle()
    if local.phase == "exact":
        return ("exact", first, n, local.update_and_fetch(keys, values))
    return ("tokens", first, n, (keys, values))


def empty_partial(queries, dv: int):
    """(o, lse) of queries that see none of a shard: 0 and -inf."""
    _, Hq, L, _ = queries.shape
    return mx.zeros((1, Hq, L, dv), mx.float32), mx.full((1, Hq, L), -mx.inf, mx.float32)


def _lse(local, Hq: int) -> mx.array:
    lse = local.compressed.last_lse
    return mx.array(lse).astype(mx.float32).reshape(1, Hq, 1)


def tiered_partial(local, queries, waiting, *, scale: float, q_start: int, k_start: int):
    """(o, lse) of ``queries`` (1, Hq, L, d) at positions q_start.. over this rank's shard
    (positions k_start..), storing the step's tokens ``waiting`` (:func:`tiered_store`)."""
    from .merge import partial_attention

    Hq, L = queries.shape[1], queries.shape[2]
    dv = local.geometry.v_dim if local.geometry is not None else queries.shape[3]
    if waiting is not None and waiting[0] == "exact":
        _, first, n, (lk, lv) = waiting
        q = queries[:, :, first : first + n]
        out = local.attention(q, lk, lv, scale=scale, mask=None if n == 1 else "causal")
        if local.phase == "compressed":  # this decode step compressed the shard (n == 1)
            return out.astype(mx.float32), _lse(local, Hq)
        if local.last_exact_lse is not None and first == 0 and n == L:
            # the chunk's queries are all the step's (a rank reading its own shard): their
            # causal attention over the shard is the partial, with the log-sum-exp it exported
            return out.astype(mx.float32), mx.array(local.last_exact_lse)[None]
    if local.phase == "exact":
        if local.offset == 0:
            return empty_partial(queries, dv)
        k, v = local.keys_and_values()
        return partial_attention(queries, k, v, scale=scale, q_start=q_start, k_start=k_start)
    if local.head_perm is not None:
        raise ValueError("ShardedCache: a layer whose key heads are permuted is not supported")
    outs, lses = [], []
    for i in range(L):
        qi = queries[:, :, i : i + 1]
        if q_start + i < k_start:  # before this shard
            o, lse = empty_partial(qi, dv)
        elif waiting is not None and waiting[0] == "tokens" and (
                waiting[1] <= i < waiting[1] + waiting[2]):
            j = i - waiting[1]
            k, v = waiting[3]
            lk, lv = local.update_and_fetch(k[:, :, j : j + 1], v[:, :, j : j + 1])
            o = local.attention(qi, lk, lv, scale=scale, mask=None).astype(mx.float32)
            lse = _lse(local, Hq)
        else:  # the shard is before the query: read it, unchanged
            o = local.compressed.attention(qi, None, None, scale=scale, mask=None,
                                           update=False).astype(mx.float32)
            lse = _lse(local, Hq)
        outs.append(o)
        lses.append(lse)
    if L == 1:
        return outs[0], lses[0]
    return mx.concatenate(outs, axis=2), mx.concatenate(lses, axis=2)
