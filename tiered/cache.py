"""TieredCache: mlx-lm's cache contract over three tiers (accelerator, host pages, disk).

One ``TieredCache`` per attention layer. Models only call ``update_and_fetch``; attention is
routed to :meth:`TieredCache.attention` by :func:`tiered.install` (``for_model`` calls it).

Phases of a layer:

- ``exact``: every token's full K and V on the accelerator, pre-allocated and grown in steps as
  mlx-lm's ``KVCache`` grows them, and nothing else of K/V anywhere: attention is mlx-lm's,
  bit for bit. A budget of 1.0 stays here for good; a smaller budget stays here while no
  compressed layout meets it (:mod:`tiered.layout`), and for a batch of several sequences.
- ``compressed``: the accelerator keeps key codes for every token and full K/V for the resident
  set only; every value (and key) is on the host (:mod:`tiered.compressed`). The layer moves
  here at a decode step, or when a prompt outgrows ``prefill_window`` (or an absolute budget),
  once the layout pays: its K/V go to the host pages in one pass.

``report()`` says per layer which phase it is in and why (``layout_note``).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from tiered.cpu import HostStore

from . import contract, device_decode, layer_state, ops
from .config import TieredConfig
from .context import SharedContext
from .planner import BudgetError
from .stats import LayerStats

log = logging.getLogger("tiered")

HOST_COPY_TOKENS = 4096  # tokens per pass when the exact K/V move to the host pages
MAX_PAGES_PER_BLOCK = 16  # host pages per allocation, at most


def _check_kv(name: str, x: Any) -> None:
    if not isinstance(x, mx.array):
        raise ValueError(f"Invalid {name}: expected an mlx.core.array, got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(
            f"Invalid shape of {name}: expected (batch, kv_heads, tokens, head_dim), "
            f"got {tuple(x.shape)}"
        )
    if not mx.issubdtype(x.dtype, mx.floating):
        raise ValueError(f"Invalid dtype of {name}: expected a floating dtype, got {x.dtype}")


def _to_numpy(x: mx.array) -> np.ndarray:
    if x.dtype == mx.bfloat16:
        x = x.astype(mx.float32)
    return np.array(x)


class TieredCache(_BaseCache):
    """Tiered KV cache of one attention layer (see module docstring)."""

    @property
    def step(self) -> int:
        """Tokens by which the exact phase grows its buffers (KVCache's ``step``)."""
        return self.config.step

    def __init__(self, config: TieredConfig | None = None, *, layer: int = 0,
                 context: "SharedContext | None" = None):
        self.config = config or TieredConfig()
        self.layer = layer
        self.context = context or SharedContext(self.config, layers=1)
        self.offset = 0  # RoPE position: tokens seen, never reduced by eviction
        self.stats = LayerStats()
        self.exact_reason: str | None = None  # why this layer never compresses (permanent)
        self.head_perm: np.ndarray | None = None  # query order for tiled keys (contract)
        self.closed = False
        self._reset_storage()

    @property
    def plan(self):
        return self.context.plan

    @property
    def scheduler(self):
        return self.context.get_scheduler()

    def _reset_storage(self):
        self.phase = "exact"
        self.keys = None  # exact phase: (B, H, capacity, dk)
        self.values = None
        self.host: HostStore | None = None
        self._pending: list[tuple[mx.array, mx.array]] = []  # write-behind queue
        self._pending_tokens = 0
        self._geometry = None  # (B, H, dk, dv, dtype)
        self.compressed = None  # tiered.compressed.CompressedLayer once compressed
        self._obs = None  # the last queries before compression (they seed the heavy hitters)
        self._colmass = None  # attention mass per key over the prompt (H2O seed)
        self._scale = None  # the attention scale the model uses
        self._fresh = False  # update_and_fetch since the last attention call
        self._returned = None  # shapes update_and_fetch returned last
        self._new = None  # the keys/values update_and_fetch stored last
        self._finite_checks: list = []  # GPU path: queued door checks (see _door)
        self._finite_bad = None  # device path: the first non-finite position, lazily

    # ---- the mlx-lm cache contract ---------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append ``keys``/``values`` (B, H, L, d) and return what attention needs.

        Exact phase: the full keys and values so far, as ``KVCache`` returns them. Compressed
        phase: the new keys and values only; :meth:`attention` reads the tiers itself.
        Invalid input, and an absolute budget no layout meets, raise before anything changes.
        """
        self._require_open()
        self._validate(keys, values)
        L, before, first = keys.shape[2], self.offset, self._geometry is None
        try:
            if self.phase == "compressed":
                self._require_routing()
                self._check_room(L)
                self._preflight(L)
                self._door(keys, values)
                out = self.compressed.append(keys, values)
                self.offset += L
            else:
                if not self.config.exact and self.exact_reason is None:
                    self._require_routing()  # it may compress at any step: attention must reach it
                if first:
                    self._geometry = (keys.shape[0], keys.shape[1], keys.shape[3],
                                      values.shape[3], keys.dtype)
                self._check_room(L)
                self._preflight(L)
                out = self._append_exact(keys, values)
        except BaseException:
            if first and self.offset == before:
                self._geometry = None
            self.context.abort_step(self, before, L)  # the step is applied whole or not at all
            raise
        # attention reads the new tokens once (contract check, compression of a chunk); the
        # reference goes right after, so the chunk's K/V are not held past the layer
        self._fresh = True
        self._new = None if (self.config.exact or self.exact_reason) else (keys, values)
        self._returned = (tuple(out[0].shape), tuple(out[1].shape))
        return out

    def keys_and_values(self):
        """Every token's keys and values (B, H, n, d), as ``KVCache.keys_and_values`` (layers
        sharing this cache read it: gemma3n, afm7). Exact phase: a view of the buffers.
        Compressed phase: a lazy view of the host pages (nothing is read unless evaluated;
        attention routed to this cache ignores it)."""
        self._require_open()
        if self._geometry is None:
            return None, None
        if self.phase == "exact":
            return self._exact_view()
        if self.host is None:
            raise ValueError(f"layer {self.layer} evicts tokens (method 'h2o'): its full keys "
                             "and values no longer exist")
        self._flush()
        _, _, _, _, dtype = self._geometry
        return (self.host.lazy_tokens("keys").astype(dtype)[None],
                self.host.lazy_tokens("values").astype(dtype)[None])

    def _validate(self, keys, values):
        _check_kv("keys", keys)
        _check_kv("values", values)
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"Invalid shape of values: expected {tuple(keys.shape[:3])} + (head_dim,) to "
                f"match keys, got {tuple(values.shape)}"
            )
        if keys.dtype != values.dtype:
            raise ValueError(f"Invalid dtype of values: {values.dtype} differs from keys {keys.dtype}")
        if keys.shape[2] == 0:
            raise ValueError("Invalid shape of keys: zero tokens")
        if self._geometry is not None:
            B, H, dk, dv, dtype = self._geometry
            got = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3])
            if got != (B, H, dk, dv):
                raise ValueError(
                    f"Invalid shape of keys/values: this cache holds batch={B}, kv_heads={H}, "
                    f"head_dim={dk}/{dv}; got keys {tuple(keys.shape)}, values "
                    f"{tuple(values.shape)}"
                )
            if keys.dtype != dtype:
                raise ValueError(f"Invalid dtype of keys: this cache holds {dtype}, got {keys.dtype}")

    def _door(self, keys, values):
        """Non-finite keys or values never enter the compressed tiers (one NaN key would make
        every score of its head NaN): a ValueError naming the layer, before anything changes.
        On the CPU backend the check is immediate (the arrays are read anyway); on a GPU it is
        queued with the step and read where the tokens reach the host (a sync of its own per
        layer and token would cost more than the step: see issue 24)."""
        ok = mx.isfinite(keys).all() & mx.isfinite(values).all()
        if ops.on_cpu_backend():
            if not ok.item():
                raise ValueError(self._non_finite(self.offset, keys.shape[2]))
        else:
            self._finite_checks.append((self.offset, keys.shape[2], ok))

    def _non_finite(self, start: int, L: int) -> str:
        return (f"layer {self.layer}: non-finite keys or values (NaN or Inf) at tokens "
                f"[{start}, {start + L}); the compressed tiers refuse them (an fp16 overflow in "
                "the model, or damaged weights?)")

    def _check_finite_queued(self):
        """The GPU path's queued checks (see _door), read when the tokens reach the host."""
        checks, self._finite_checks = self._finite_checks, []
        for start, L, ok in checks:
            if not ok.item():
                raise ValueError(self._non_finite(start, L))
        bad, self._finite_bad = self._finite_bad, None
        if bad is not None and bad.item() < device_decode.NO_BAD:
            raise ValueError(self._non_finite(bad.item(), 1))

    def _check_room(self, L: int):
        """An absolute budget: some layout must hold offset + L tokens (BudgetError before the
        step otherwise; fractions always have the exact layout to fall back on)."""
        if self.config.budget_fraction is not None:
            return
        n = self.offset + L
        if self.phase == "compressed":
            plan = self.compressed.plan
            if plan.codec == "none":
                return  # eviction: the resident set never grows past the budget
            plan.check(n, self.config.refresh_every + 1)
        else:
            self.context.layout_at(self, n)  # raises BudgetError when nothing fits

    def _exact_capacity(self, need: int, grow: int) -> int:
        """Capacity of the exact buffers: mlx-lm's steps, clipped to an absolute budget."""
        if self.config.budget_fraction is not None:
            return grow
        geo = self.context.geometry_for(self)
        fits = int(self.config.gpu_budget // max(geo.full_bytes(1), 1))
        return max(need, min(grow, fits))

    def _append_exact(self, keys, values):
        prev, n = self.offset, keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            B, H, _, dk = keys.shape
            steps = (self.config.step + n - 1) // self.config.step
            size = self._exact_capacity(prev + n, prev + steps * self.config.step) - prev
            new_k = mx.zeros((B, H, size, dk), keys.dtype)
            new_v = mx.zeros((B, H, size, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
        self.keys[..., prev : prev + n, :] = keys
        self.values[..., prev : prev + n, :] = values
        self.offset += n
        return self._exact_view()

    def _exact_view(self):
        if self.offset == self.keys.shape[2]:
            return self.keys, self.values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @property
    def state(self):
        """(keys, values, meta, arrays), as mlx-lm's caches keep arrays and scalars in
        ``state``: keys/values are the exact K/V (exact phase) or the resident set's
        (compressed); ``meta`` a JSON string; ``arrays`` the rest by name. See
        :mod:`tiered.layer_state`."""
        return layer_state.state_of(self)

    @state.setter
    def state(self, st):
        layer_state.restore(self, st)

    @property
    def meta_state(self):
        return layer_state.meta_of(self)

    @meta_state.setter
    def meta_state(self, v):
        pass  # everything needed is in ``state`` (mlx-lm 0.32 saves only ``state``)

    def is_trimmable(self) -> bool:
        return self.phase == "exact" or self.compressed.is_trimmable()

    def trim(self, n: int) -> int:
        n = min(self.offset, max(0, int(n)))
        if n == 0:
            return 0
        if n == self.offset and self.phase == "compressed":  # back to empty: a fresh start
            self._drop_tiers()
            return n
        if self.phase == "compressed":
            n = self.compressed.trim(n)
            self.offset -= n
            return n
        self.offset -= n
        if self._colmass is not None:  # the trimmed tokens' mass goes; fed again, it comes back
            self._colmass[:, self.offset :] = 0
        if self._obs is not None:  # the trimmed queries leave the observation window
            keep = self._obs.shape[2] - n
            self._obs = self._obs[..., :keep, :] if keep > 0 else None
        return n

    def size(self) -> int:
        return self.offset

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    def empty(self) -> bool:
        return self._geometry is None

    @property
    def nbytes(self) -> int:
        """Accelerator-tier bytes of this layer (what mlx-lm's cache accounting sees)."""
        return self.tier_bytes()["accelerator"]

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """mlx-lm's ``kv_bits`` path. A layer in the exact phase is a KVCache and quantizes as
        one (the result is mlx-lm's ``QuantizedKVCache``, which is no longer tiered: a warning
        says so); a compressed layer is refused, with the options that do the same job."""
        self._require_open()
        if self._geometry is not None and self.phase != "exact":
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
        if self._geometry is not None:
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
            if not isinstance(c, TieredCache):  # mlx-lm's caches merge as KVCache.merge does
                views.append(c)
                continue
            c._require_open()
            if c._geometry is not None and (c.phase != "exact" or c._geometry[0] != 1):
                raise ValueError(
                    f"layer {c.layer} holds {c.offset} tokens compressed: batched generation "
                    "(BatchGenerator) merges caches, which only exact-phase TieredCaches "
                    "can join; generate one sequence at a time, or use mlx-lm's own caches "
                    "for batches")
            views.append(c._as_kvcache())
        return BatchKVCache.merge(views)

    def extract(self, idx: int):
        """The cache of sequence ``idx`` (a TieredCache holds one: idx 0, an independent copy)."""
        B = 1 if self._geometry is None else self._geometry[0]
        if B != 1 or idx != 0:
            raise ValueError(f"Invalid idx {idx}: this TieredCache holds {B} sequence(s); "
                             "extract works on single-sequence caches (idx 0)")
        return copy.deepcopy(self)

    def __deepcopy__(self, memo):
        ctx = memo.get(id(self.context))
        if ctx is None:
            ctx = memo[id(self.context)] = self.context.copy()
        other = TieredCache(self.config, layer=self.layer, context=ctx)
        layer_state.restore(other, layer_state.state_of(self), context=ctx)
        other.stats = copy.deepcopy(self.stats, memo)
        memo[id(self)] = other
        return other

    # ---- attention -------------------------------------------------------------------------
    def attention(self, queries, keys, values, *, scale, mask, sinks=None):
        """Attention for this layer; ``keys``/``values`` are what update_and_fetch returned
        (or, for a layer sharing this cache, what keys_and_values returned: that call reads
        the tiers without changing them). If it fails, every layer of the model that took this
        step's tokens gives them back (the step is applied whole or not at all)."""
        self._require_open()
        fresh = self._fresh
        try:
            return self._attention(queries, keys, values, scale, mask, sinks)
        except BaseException:
            if fresh:
                L = queries.shape[2]
                self.context.abort_step(self, self.offset - L, L)
            raise

    def _attention(self, queries, keys, values, scale, mask, sinks):
        fresh, self._fresh = self._fresh, False
        new, self._new = self._new, None
        L = queries.shape[2]
        if self.phase == "exact":
            if fresh:
                self._check_contract(queries, keys, values, mask, new)
                self._scale = scale
                if self._wants_compression(L):
                    self.compress(queries, scale, chunk=L)
            if self.phase == "exact":
                return self._exact_attention(queries, keys, values, scale, mask, sinks, fresh)
        new_k, new_v = new if fresh else (None, None)
        q = queries if self.head_perm is None else queries[:, mx.array(self.head_perm)]
        out = self.compressed.attention(q, new_k, new_v, scale=scale, mask=mask, sinks=sinks,
                                        update=fresh)
        return out if self.head_perm is None else out[:, mx.array(np.argsort(self.head_perm))]

    def _check_contract(self, queries, keys, values, mask, new):
        """Whether this layer may ever compress (see :mod:`tiered.contract`); ``new``: the
        keys/values the update stored."""
        if self.exact_reason is not None or self.config.exact:
            return
        why = contract.violation(queries, keys, values, mask, self._returned)
        if why is None and keys.shape[1] != self._geometry[1]:
            perm = contract.head_order(keys, new[0], queries.shape[1])
            if perm is None:
                why = (f"attention reads {keys.shape[1]} key heads that are not copies of the "
                       f"{self._geometry[1]} stored ones")
            elif self.head_perm is None:
                self.head_perm = perm
        if why is None and self._geometry[0] != 1:
            why = f"batch of {self._geometry[0]} sequences: compression serves one"
        if why is not None:
            self.exact_reason = why
            self._obs = self._colmass = None
            log.warning("tiered: layer %d stays exact (full cache): %s", self.layer, why)

    def _wants_compression(self, L: int) -> bool:
        return self._compresses_at(self.offset, L)

    def _compresses_at(self, n: int, L: int) -> bool:
        """Whether an exact layer holding n tokens (this step's L included) compresses now:
        at a decode step, or a prompt beyond prefill_window (or the absolute budget), once a
        compressed layout holds n tokens within the budget."""
        if self.config.exact or self.exact_reason is not None or self._geometry[0] != 1:
            return False
        absolute = self.config.budget_fraction is None
        full = self.context.geometry_for(self).full_bytes(n) / max(self.context.layers, 1)
        if not (L == 1 or n > self.config.prefill_window or
                (absolute and full > self.config.gpu_budget / max(self.context.layers, 1))):
            return False
        return self.context.layout_at(self, n) is not None

    def _bookkeeping(self, n: int) -> bool:
        """Whether to record what the H2O seed needs (the last queries, the prompt's attention
        mass): only when this layer may compress within the observation window."""
        if self.config.exact or self.exact_reason is not None or self._geometry[0] != 1:
            return False
        t = self.context.threshold(self)
        return t is not None and n + self._obs_window() >= t

    def _obs_window(self) -> int:
        return max(self.config.recent, 16)

    def _exact_attention(self, queries, keys, values, scale, mask, sinks, fresh):
        perm = self.head_perm
        if perm is not None and fresh:  # the stored heads, queries grouped to match them
            queries = queries[:, mx.array(perm)]
            keys, values = self._exact_view()
        colmass = None
        if fresh and self._bookkeeping(self.offset):
            self._observe(queries)
            colmass = self._column_mass(keys.shape[2])
        out = ops.exact_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks,
                                  fast=not self.config.exact, column_mass=colmass)
        if perm is not None and fresh:
            out = out[:, mx.array(np.argsort(perm))]
        return out

    def _column_mass(self, n: int):
        """The exported per-key attention mass buffer (H, >= n)."""
        H = self._geometry[1]
        if self._colmass is None or self._colmass.shape[1] < n:
            grown = np.zeros((H, max(n, 2 * (0 if self._colmass is None else
                                             self._colmass.shape[1]))), np.float32)
            if self._colmass is not None:
                grown[:, : self._colmass.shape[1]] = self._colmass
            self._colmass = grown
        return self._colmass

    def _observe(self, queries):
        """Keep the last queries of the exact phase: they seed the resident set (SnapKV-style)."""
        w = self._obs_window()
        q = queries[..., -w:, :]
        if self._obs is None or q.shape[2] >= w or self._obs.shape[-1] != q.shape[-1]:
            self._obs = q
        else:
            self._obs = mx.concatenate([self._obs, q], axis=2)[..., -w:, :]

    # ---- tiers -----------------------------------------------------------------------------
    def _write_behind(self, keys, values):
        """Queue new tokens for the host pages; flushed once they are surely evaluated."""
        self._pending.append((keys, values))
        self._pending_tokens += keys.shape[2]
        if self._pending_tokens >= self.config.page_size:
            self._flush()

    def _flush_until(self, n: int):
        """Make sure tokens [0, n) are on the host (older ones than the recent ring)."""
        if self.host is None or self.host.length < n:
            self._flush()

    def _new_host(self, n: int = 0) -> HostStore:
        """Host pages for this layer; blocks sized to the tokens it holds now (a power of two
        of pages, up to 16): a short context does not take 16 pages per layer."""
        B, H, dk, dv, _ = self._geometry
        cfg = self.config
        pages = max(1, -(-n // cfg.page_size))
        ppb = min(MAX_PAGES_PER_BLOCK, 1 << (pages - 1).bit_length())
        return HostStore(
            H, dk, value_dim=dv, page_size=cfg.page_size, dtype=cfg.host_dtype,
            keys=cfg.host_keys, batch=B, pages_per_block=ppb, budget=self.context.host_budget,
            disk_dir=cfg.disk_dir, disk_budget=self.context.disk_budget,
            name=f"layer{self.layer}",
        )

    def _flush(self):
        """The write-behind queue into the host pages, all or nothing (a full disk tier leaves
        the queue and the pages as they were)."""
        if not self._pending:
            return
        if self.compressed is not None and hasattr(self.compressed, "spill_join"):
            self.compressed.spill_join()  # a lookahead move reading these pages finishes first
        self._check_finite_queued()
        if self.host is None:
            self.host = self._new_host()
        ks = [k for k, _ in self._pending]
        vs = [v for _, v in self._pending]
        k = ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=2)
        v = vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=2)
        k, v = _to_numpy(k), _to_numpy(v)
        self.host.append(v, k if self.config.host_keys else None)
        self._pending.clear()
        self._pending_tokens = 0

    def _drop_pending_after(self, n: int) -> None:
        """Trim the write-behind queue and the host pages to the first n tokens."""
        host_len = self.host.length if self.host is not None else 0
        keep = max(0, n - host_len)
        kept, total = [], 0
        for k, v in self._pending:
            take = min(k.shape[2], keep - total)
            if take <= 0:
                break
            kept.append((k[..., :take, :], v[..., :take, :]))
            total += take
        self._pending, self._pending_tokens = kept, total
        if self.host is not None and host_len > n:
            self.host.truncate(n)

    def _host_bytes_for(self, L: int) -> int:
        """Host bytes (RAM or disk) this layer allocates for a step of L tokens."""
        if self.phase == "compressed":
            if self.host is None:
                return 0
            return self.host.bytes_to_append(self._pending_tokens + L)
        if not self._compresses_at(self.offset + L, L):
            return 0  # stays exact: nothing goes to the host
        return self._new_host(self.offset + L).bytes_to_append(self.offset + L)

    def _preflight(self, L: int):
        """DiskTierError before anything changes when the host budget and the disk tier
        cannot take what every tiered layer writes at this step (the first layer of a step
        checks for all of them: the same geometry, the same tokens)."""
        ctx = self.context
        if ctx.host_budget.limit is None:
            return  # no host budget: no disk tier
        from .cpu.disk import disk_room

        need = self._host_bytes_for(L)
        if need == 0:
            return
        layers = ctx.layers_to_step(self)
        room = max(0, ctx.host_budget.limit - ctx.host_budget.used)
        to_disk = max(0, need * layers - room)
        if to_disk:
            disk_room(self.config.disk_dir, to_disk, ctx.disk_budget)

    def _to_host(self, keys: mx.array, values: mx.array):
        """The exact phase's K/V into fresh host pages, a few thousand tokens per pass (the
        host holds nothing of the exact phase: leaving it is the one copy)."""
        n = keys.shape[2]
        host = self._new_host(n)
        try:
            for i in range(0, n, HOST_COPY_TOKENS):
                k = _to_numpy(keys[..., i : i + HOST_COPY_TOKENS, :])
                v = _to_numpy(values[..., i : i + HOST_COPY_TOKENS, :])
                if not (np.isfinite(k).all() and np.isfinite(v).all()):
                    raise ValueError(self._non_finite(i, k.shape[2]))
                host.append(v, k if self.config.host_keys else None)
        except BaseException:
            host.close()  # nothing half-made stays: the layer is still exact
            raise
        self.host = host

    def tier_bytes(self) -> dict:
        """Bytes per tier, measured from the arrays this layer holds. ``transient``: the part of
        "accelerator" that only prefill holds (the exact window of a compressing cache, or the
        block-wise anchor + local blocks); bounded, reported apart from the steady state.
        ``bookkeeping``: host bytes of the H2O seed statistics kept near compression."""
        acc = transient = 0
        if self.phase == "exact":
            if self.keys is not None:
                acc = self.keys.nbytes + self.values.nbytes
                transient = 0 if (self.config.exact or self.exact_reason) else acc
        else:
            acc = self.compressed.nbytes
            transient = getattr(self.compressed, "prefill_bytes", 0)
        host = self.host.nbytes if self.host is not None else 0
        disk = self.host.disk_bytes if self.host is not None else 0
        book = (0 if self._colmass is None else self._colmass.nbytes) + (
            0 if self._obs is None else self._obs.nbytes)
        return {"accelerator": acc, "transient": transient, "host": host, "disk": disk,
                "bookkeeping": book}

    def full_cache_bytes(self) -> int:
        """Bytes mlx-lm's KVCache would hold for this layer's tokens (the budget reference)."""
        if self._geometry is None:
            return 0
        B, H, dk, dv, dtype = self._geometry
        return B * H * (dk + dv) * dtype.size * self.offset

    @property
    def layout_note(self) -> str:
        """Which layout this layer is in, and why (for report())."""
        if self.phase == "compressed":
            plan = self.compressed.plan
            return plan.why or f"compressed ({plan.method})"
        if self.config.exact:
            return "exact: gpu_budget 1.0"
        if self.exact_reason:
            return f"exact: {self.exact_reason}"
        if self._geometry is None:
            return "empty"
        t = self.context.threshold(self)
        if self.config.budget_fraction is None:
            return (f"exact: the full cache fits gpu_budget {self.config.gpu_budget} up to "
                    f"{t - 1} tokens" if t else "exact")
        if t is None:
            return "exact: no compressed layout meets this budget at any length"
        return (f"exact: below {t} tokens no compressed layout meets gpu_budget "
                f"{self.config.gpu_budget} (codes and codebooks cost more than they save)")

    def compress(self, queries: mx.array | None, scale: float, chunk: int = 0):
        """Exact phase -> compressed phase: codes for every token, resident set, host pages.

        queries: this step's queries (or None: the observed ones seed the resident set);
        chunk > 1: the last ``chunk`` tokens are a prompt chunk still to be attended."""
        from .compressed import CompressedLayer

        keys, values = self._exact_view()
        self.stats.peak_transient_bytes = max(self.stats.peak_transient_bytes,
                                              self.keys.nbytes + self.values.nbytes)
        if queries is not None:
            self.context.q_heads = queries.shape[1]
        plan = self.context.plan_for(self)
        obs = self._obs
        if obs is None or obs.shape[2] == 0:
            obs = None if queries is None else queries[..., -self.config.recent:, :]
        Hq = obs.shape[1] if obs is not None else self._geometry[1]
        rep = Hq // self._geometry[1]
        seed = ops.h2o_seed(obs[0] if obs is not None else None, keys[0], scale,
                            self._colmass, rep)
        # All or nothing: a failure (disk tier full, non-finite K/V) leaves the layer exact.
        if plan.codec == "none":
            from .h2o import H2OLayer

            compressed = H2OLayer.from_exact(self, plan, keys, values, seed)
        else:
            self._to_host(keys, values)
            try:
                codebook = (self.context.codebook_for(self, keys) if plan.codec == "codebook"
                            else None)
                compressed = CompressedLayer.from_exact(self, plan, codebook, keys, values,
                                                        seed, scale, chunk=chunk)
            except BaseException:
                self.host.close()
                self.host = None
                raise
        self.compressed = compressed
        self._colmass = self._obs = None
        self.phase = "compressed"
        self.keys = self.values = None

    def settle(self):
        """Compress now if this layer would at its next step (before a save: the saved tiers
        are then codes and host pages, not the exact K/V)."""
        if (self.phase == "exact" and self._geometry is not None and self._scale is not None
                and not self.closed and self._wants_compression(1)):
            self._require_routing()
            self.compress(None, self._scale)

    def _require_routing(self):
        from .integration import is_installed

        if not is_installed():
            raise RuntimeError(
                "this TieredCache holds compressed keys, so attention must be routed to it: call "
                "tiered.install() (TieredCache.for_model does) before running the model"
            )

    def _require_open(self):
        if self.closed:
            raise ValueError(f"TieredCache layer {self.layer} was closed; make a new cache "
                             "(TieredCache.for_model) or load a saved one")

    def _drop_tiers(self):
        """Forget every token (trim to 0): the layer is as new, its budgets given back."""
        if self.compressed is not None and hasattr(self.compressed, "spill_join"):
            self.compressed.spill_join()
        if self.host is not None:
            self.host.close()
        geometry = self._geometry
        self._reset_storage()
        self._geometry = geometry
        self.offset = 0

    def close(self):
        """Release this layer's host pages and page files; using it afterwards is an error."""
        if self.host is not None:
            self.host.close()
        self.closed = True

    def fork(self, config: TieredConfig, context: SharedContext) -> "TieredCache":
        """A copy of this exact-phase layer under another config (one prefill, many methods)."""
        if self.phase != "exact":
            raise ValueError("only a cache still in its exact phase can be forked")
        other = TieredCache(config, layer=self.layer, context=context)
        if self._geometry is None:
            return other
        other._geometry = self._geometry
        k, v = self._exact_view()
        other.keys, other.values = k[..., :, :], v[..., :, :]  # new array objects
        other.offset = self.offset
        other._obs, other._scale, other._returned = self._obs, self._scale, self._returned
        other.head_perm, other.exact_reason = self.head_perm, self.exact_reason
        other._colmass = None if self._colmass is None else self._colmass.copy()
        return other

    def __repr__(self) -> str:
        if not hasattr(self, "config"):
            return "TieredCache(uninitialized)"
        return (f"TieredCache(layer={self.layer}, phase={self.phase}, offset={self.offset}, "
                f"budget={self.config.gpu_budget})")

    @classmethod
    def for_model(cls, model, gpu_budget: float | int | str = 0.125, *, install: bool = True,
                  tokenizer=None, **config):
        """One cache per layer of ``model``: see :func:`tiered.cache_list.for_model`."""
        from .cache_list import for_model

        return for_model(cls, model, gpu_budget, install=install, tokenizer=tokenizer, **config)


def __getattr__(name):  # TieredCacheList moved to tiered.cache_list; old imports keep working
    if name == "TieredCacheList":
        from .cache_list import TieredCacheList

        return TieredCacheList
    raise AttributeError(name)
