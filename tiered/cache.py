"""TieredCache: mlx-lm's cache contract over three tiers (accelerator, host pages, disk).

One ``TieredCache`` per attention layer. Models only call ``update_and_fetch``; attention is
routed to :meth:`TieredCache.attention` by :func:`tiered.install` (``for_model`` calls it).

Phases of a layer:

- ``exact``: every token's full K and V on the accelerator, pre-allocated and grown in steps as
  mlx-lm's ``KVCache`` grows them, and nothing else of K/V anywhere: attention is mlx-lm's,
  bit for bit. A budget of 1.0 stays here for good; a smaller one while no compressed layout
  meets it (:mod:`tiered.planning.layout`), and for a batch of several sequences.
- ``compressed``: the accelerator keeps key codes for every token and full K/V for the resident
  set only; every value (and key) is on the host (:mod:`tiered.layer.compressed`). It moves here
  at a decode step, or when a prompt outgrows ``prefill_window`` (or an absolute budget), once
  the layout pays: its K/V go to the host pages in one pass.

``report()`` says per layer which phase it is in and why (``layout_note``). The class is
assembled by topic: the exact phase and the move to compression (:mod:`tiered.exact_phase`),
the host tier (:mod:`tiered.host_tier`), the rest of mlx-lm's protocol
(:mod:`tiered.cache_protocol`), what the tiers hold (:class:`tiered.report.LayerReport`); the
contract of ``update_and_fetch`` and attention is :mod:`tiered.planning.contract`.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from . import cache_list
from .cache_protocol import CacheProtocol
from .cpu import HostStore
from .exact_phase import ExactPhase
from .host_tier import HostTier
from .layer import trim
from .options.config import TieredConfig
from .persistence import layer_state
from .planning import contract
from .planning.context import SharedContext
from .planning.geometry import Geometry
from .report import LayerReport
from .runtime import dispatch, steady_gc
from .runtime.integration import is_installed, loadable
from .runtime.stats import LayerStats
from .step import device_append

# The share of tiered layers whose refresh (queued at a step's end, device path) applies at the
# end of the same step, not at the layer's next append (H200, 128k, device_probe.py --toggle:
# 0.5 faster than 0 in 6 of 7 paired rounds, by 1.1 ms/token on average).
EARLY_SETTLE = 0.5
log = logging.getLogger("tiered")


@loadable  # tiered.install() registers it where mlx-lm's load_prompt_cache looks
class TieredCache(ExactPhase, HostTier, CacheProtocol, LayerReport, _BaseCache):
    """The KV cache of one attention layer over three tiers (accelerator, host pages, disk):
    exact (full K/V, equal to ``KVCache``) until a compressed layout meets ``gpu_budget``, then
    key codes for every token, a resident set's K/V, every value on the host; see the module
    docstring. Keys and values are (batch, kv_heads, tokens, head_dim); made by :meth:`for_model`,
    options in :class:`TieredConfig`."""

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
        self.geometry: Geometry | None = None  # set by the first keys
        self.compressed = None  # tiered.layer.compressed.CompressedLayer once compressed
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
        L, before, first = keys.shape[2], self.offset, self.geometry is None
        if self._first_layer():
            self.context.steps.enter()  # a save in another thread reads between steps
            self.context.adopted = dispatch.adopt_stream(keys, values)
        if not self._beside_dispatch():
            dispatch.drain()
        contract.check_update(keys, values, self.geometry)
        try:
            if self.phase == "compressed":
                self._require_routing()
                self._check_room(L)
                self._preflight(L)
                self._door(keys, values)
                if L == 1:  # a decode step: the collector's walk of all objects out of it
                    steady_gc.freeze_once()
                out = self.compressed.append(keys, values)
                self.offset += L
            else:
                if not self.config.exact and self.exact_reason is None:
                    self._require_routing()  # it may compress at any step: attention must reach it
                if first:
                    self.geometry = Geometry.of_tensors(keys, values)
                self._check_room(L)
                self._preflight(L)
                out = self._append_exact(keys, values)
        except BaseException:
            dispatch.drain_quietly()
            if first and self.offset == before:
                self.geometry = None
            self.context.abort_step(self, before, L)  # the step is applied whole or not at all
            self.context.steps.leave()
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
        dispatch.drain()
        if self.geometry is None:
            return None, None
        if self.phase == "exact":
            return self._exact_view()
        if self.host is None:
            raise ValueError(f"layer {self.layer} evicts tokens (method 'h2o'): its full keys "
                             "and values no longer exist")
        self.flush()
        dtype = self.geometry.dtype
        return (self.host.lazy_tokens("keys").astype(dtype)[None],
                self.host.lazy_tokens("values").astype(dtype)[None])

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
            plan.check(n, self.config.heavy.horizon)
        else:
            self.context.layout_at(self, n)  # raises BudgetError when nothing fits

    @property
    def state(self):
        """(keys, values, meta, arrays), as mlx-lm's caches keep arrays and scalars in
        ``state``: keys/values are the exact K/V (exact phase) or the resident set's
        (compressed); ``meta`` a JSON string; ``arrays`` the rest by name. See
        :mod:`tiered.persistence.layer_state`."""
        return layer_state.state_of(self)

    @state.setter
    def state(self, st):
        layer_state.restore(self, st)

    def lazy_arrays(self, door: bool = True, flush: bool = True) -> list:
        """The arrays a prompt chunk leaves lazy (``state``'s, without building it; see
        :func:`tiered.persistence.layer_state.lazy_arrays`); ``door=False`` leaves the door's checks
        queued (:meth:`take_door`), ``flush=False`` the write-behind queue."""
        return layer_state.lazy_arrays(self, door, flush)

    @property
    def meta_state(self):
        return layer_state.meta_of(self)

    @meta_state.setter
    def meta_state(self, v):
        pass  # everything needed is in ``state`` (mlx-lm 0.32 saves only ``state``)

    def is_trimmable(self) -> bool:
        return self.phase == "exact" or self.compressed.is_trimmable()

    def trim(self, n: int) -> int:
        """Give back the last n tokens (any int: clipped to [0, offset]), all or nothing; a
        compressed layer trimmed below its threshold is exact again (:mod:`tiered.layer.trim`)."""
        return trim.trim_layer(self, n)

    def size(self) -> int:
        return self.offset

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    def empty(self) -> bool:
        return self.geometry is None

    @property
    def nbytes(self) -> int:
        """Accelerator-tier bytes of this layer (what mlx-lm's cache accounting sees)."""
        return self.tier_bytes()["accelerator"]

    # ---- attention -------------------------------------------------------------------------
    def attention(self, queries, keys, values, *, scale, mask, sinks=None):
        """Attention for this layer; ``keys``/``values`` are what update_and_fetch returned
        (or, for a layer sharing this cache, what keys_and_values returned: that call reads
        the tiers without changing them). If it fails, every layer of the model that took this
        step's tokens gives them back (the step is applied whole or not at all)."""
        self._require_open()
        fresh = self._fresh
        if self.context.adopted:  # this thread's first step on the shared stream (see above)
            self.context.adopted = False
            mx.eval(queries)
        if not (fresh and self._beside_dispatch()):
            dispatch.drain()
        try:
            out = self._attention(queries, keys, values, scale, mask, sinks)
            if self._last_layer():  # mlx-lm reads the token next: nothing left on the thread
                dispatch.drain()
                if fresh and self._beside_dispatch():
                    if EARLY_SETTLE:
                        self._settle_early()
                    device_append.make_next_columns()
                self.context.end_step()
            return out
        except BaseException:
            dispatch.drain_quietly()
            if fresh:
                L = queries.shape[2]
                self.context.abort_step(self, self.offset - L, L)
            self.context.steps.leave()
            raise

    def _beside_dispatch(self) -> bool:
        """Whether this layer's step may be built while the dispatcher thread hands earlier
        work to the device: the device path of a compressed layer, whose evaluations all go
        through tiered.runtime.dispatch (which waits for the thread) and whose reads of device
        arrays follow them. Any other step waits for the thread first."""
        return self.phase == "compressed" and bool(getattr(self.compressed, "on_device", False))

    def _settle_early(self) -> None:
        """Apply now the refreshes queued this step by the first EARLY_SETTLE of the tiered
        layers (:meth:`~tiered.layer.resident.ResidentSet.settle`) rather than at their next append:
        the device still runs this step's last layers, and those layers' ids are computed."""
        tiered = self.context.tiered_layers or list(range(self.context.layers))
        early = set(tiered[: max(1, round(len(tiered) * EARLY_SETTLE))])
        for c in self.context.bound_caches():
            layer = getattr(c, "compressed", None)
            if (getattr(c, "layer", None) in early and layer is not None
                    and getattr(layer, "_refresh_due", False)):
                layer.settle()

    def _first_layer(self) -> bool:
        """Whether this is the model's first tiered layer (a step starts here)."""
        tiered = self.context.tiered_layers
        return self.layer == (tiered[0] if tiered else 0)

    def _last_layer(self) -> bool:
        """Whether this is the model's last tiered layer (the end of a step's dispatch)."""
        tiered = self.context.tiered_layers
        return self.layer == (tiered[-1] if tiered else self.context.layers - 1)

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
        """Whether this layer may ever compress (see :mod:`tiered.planning.contract`); ``new``: the
        keys/values the update stored."""
        if self.exact_reason is not None or self.config.exact:
            return
        why = contract.violation(queries, keys, values, mask, self._returned)
        if why is None and keys.shape[1] != self.geometry.kv_heads:
            perm = contract.head_order(keys, new[0], queries.shape[1])
            if perm is None:
                why = (f"attention reads {keys.shape[1]} key heads that are not copies of the "
                       f"{self.geometry.kv_heads} stored ones")
            elif self.head_perm is None:
                self.head_perm = perm
        if why is None and self.geometry.batch != 1:
            why = f"batch of {self.geometry.batch} sequences: compression serves one"
        if why is not None:
            self.exact_reason = why
            self._obs = self._colmass = None
            log.warning("tiered: layer %d stays exact (full cache): %s", self.layer, why)

    # ---- life cycle ------------------------------------------------------------------------
    def settle(self):
        """Compress now if this layer would at its next step. Saves do not: a layer still
        exact is saved exact, and compresses after loading where it would have unsaved."""
        if (self.phase == "exact" and self.geometry is not None and self._scale is not None
                and not self.closed and self._wants_compression(1)):
            self._require_routing()
            self.compress(None, self._scale)

    def _require_routing(self):
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
        geometry = self.geometry
        self._reset_storage()
        self.geometry = geometry
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
        if self.geometry is None:
            return other
        other.geometry = self.geometry
        k, v = self._exact_view()
        other.keys, other.values, other.offset = k[..., :, :], v[..., :, :], self.offset
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
        return cache_list.for_model(cls, model, gpu_budget, install=install, tokenizer=tokenizer,
                                    **config)

