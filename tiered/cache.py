"""TieredCache: mlx-lm's cache contract over three tiers (accelerator, host pages, disk).

One ``TieredCache`` per attention layer. Models only call ``update_and_fetch``; attention is
routed to :meth:`TieredCache.attention` by :func:`tiered.install` (``for_model`` calls it).

Phases of a layer:

- ``exact``: every token's full K and V are resident on the accelerator (pre-allocated and grown
  in steps of ``config.step``), and attention is mlx-lm's exactly. Values (and keys) are also
  written behind to the host pages, so the layer can leave this phase without copying.
  A budget of 1.0 stays here for good; otherwise prefill stays here up to
  ``config.prefill_window`` tokens.
- ``compressed``: the accelerator keeps key codes for every token and full K/V for the resident
  set only; see :mod:`tiered.compressed`.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask

from tiered.cpu import HostStore

from . import ops
from .config import TieredConfig
from .context import SharedContext
from .stats import LayerStats

log = logging.getLogger("tiered")

STATE_VERSION = 1


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


class TieredCache(_BaseCache):
    """Tiered KV cache of one attention layer (see module docstring)."""

    def __init__(self, config: TieredConfig | None = None, *, layer: int = 0,
                 context: "SharedContext | None" = None):
        self.config = config or TieredConfig()
        self.layer = layer
        self.context = context or SharedContext(self.config, layers=1)
        self.offset = 0  # RoPE position: tokens seen, never reduced by eviction
        self.stats = LayerStats()
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
        self._compress_pending = False
        self._obs = None
        self._colmass = None  # exact phase: attention mass per key over the prefill (H2O seed)

    # ---- the mlx-lm cache contract ---------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append ``keys``/``values`` (B, H, L, d) and return what attention needs.

        Exact phase: the full keys and values so far, as ``KVCache`` returns them. Compressed
        phase: the new keys and values only; :meth:`attention` reads the tiers itself.
        Invalid input raises ``ValueError`` before anything is changed.
        """
        self._validate(keys, values)
        if self.phase == "compressed":
            self._require_routing()
            out = self.compressed.append(keys, values)
            self.offset += keys.shape[2]
            return out
        if self._should_compress(keys.shape[2]):
            # Compression needs the queries and the scale: it runs in attention(), right after.
            self._require_routing()
            self._compress_pending = True
        return self._append_exact(keys, values)

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
        elif keys.shape[0] != 1 and not self.config.exact:
            raise ValueError(
                f"Invalid batch size {keys.shape[0]}: a compressing TieredCache serves one "
                "sequence; use gpu_budget=1.0 for batched generation"
            )

    def _append_exact(self, keys, values):
        if self._geometry is None:
            self._geometry = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3],
                              keys.dtype)
        prev, n = self.offset, keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            B, H, _, dk = keys.shape
            steps = (self.config.step + n - 1) // self.config.step
            grow = steps * self.config.step
            new_k = mx.zeros((B, H, grow, dk), keys.dtype)
            new_v = mx.zeros((B, H, grow, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
        self.keys[..., prev : prev + n, :] = keys
        self.values[..., prev : prev + n, :] = values
        self.offset += n
        self._write_behind(keys, values)
        return self._exact_view()

    def _exact_view(self):
        if self.offset == self.keys.shape[2]:
            return self.keys, self.values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @property
    def state(self):
        """Arrays and scalars that :meth:`from_state` turns back into this cache.

        mlx-lm evaluates ``state`` after every prefill chunk and serializes it in
        ``save_prompt_cache``; nothing here copies host data.
        """
        st = {
            "version": STATE_VERSION,
            "config": json.dumps(self.config.to_dict()),
            "layer": self.layer,
            "layers": self.context.layers,
            "offset": self.offset,
            "phase": self.phase,
        }
        if self._geometry is None:
            return st
        B, H, dk, dv, dtype = self._geometry
        st["geometry"] = [B, H, dk, dv, str(dtype).split(".")[-1]]
        if self.phase == "exact":
            st["keys"], st["values"] = self._exact_view()
            if self._obs is not None:
                st["obs"] = self._obs  # the last queries: they seed the heavy hitters
            if self._colmass is not None:
                st["colmass"] = mx.array(self._colmass[:, : self.offset])
        else:
            self._flush()
            st["q_heads"] = self.context.q_heads
            if self.host is not None:
                st["host"] = self.host.state()
            st["compressed"] = self.compressed.state()
        return st

    @state.setter
    def state(self, st):
        if not isinstance(st, dict) or st.get("version") != STATE_VERSION:
            raise ValueError(
                "Invalid TieredCache state: not written by this version of tiered "
                f"(expected version {STATE_VERSION})"
            )
        config = TieredConfig.from_kwargs(**json.loads(st["config"]))
        self.__init__(config, layer=int(st["layer"]),
                      context=SharedContext(config, layers=int(st.get("layers", 1))))
        if "geometry" not in st:
            return
        B, H, dk, dv, dtype = st["geometry"]
        dtype = getattr(mx, dtype)
        if st["phase"] == "exact":
            self._append_exact(st["keys"].astype(dtype), st["values"].astype(dtype))
            self._obs = st.get("obs")
            if "colmass" in st:
                self._colmass = np.array(st["colmass"], np.float32)
        else:
            from .compressed import CompressedLayer

            self._geometry = (int(B), int(H), int(dk), int(dv), dtype)
            self.context.q_heads = int(st["q_heads"])
            if st["compressed"].get("kind") == "h2o":
                from .h2o import H2OLayer

                self.compressed = H2OLayer.from_state(self, st["compressed"])
            else:
                self.host = HostStore.from_state(st["host"])
                self.compressed = CompressedLayer.from_state(self, st["compressed"])
            self.phase = "compressed"
            self.offset = int(st["offset"])
        if self.offset != int(st["offset"]):
            raise ValueError("Invalid TieredCache state: offset does not match the stored tokens")

    @property
    def meta_state(self):
        return ""

    @meta_state.setter
    def meta_state(self, v):
        pass

    def is_trimmable(self) -> bool:
        return self.phase == "exact" or self.compressed.is_trimmable()

    def trim(self, n: int) -> int:
        n = min(self.offset, max(0, int(n)))
        if n == 0:
            return 0
        if self.phase == "compressed":
            n = self.compressed.trim(n)
            self.offset -= n
            return n
        self._flush()
        self.offset -= n
        if self.host is not None:
            self.host.truncate(self.offset)
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

    # ---- attention -------------------------------------------------------------------------
    def attention(self, queries, keys, values, *, scale, mask, sinks=None):
        """Attention for this layer; ``keys``/``values`` are what update_and_fetch returned."""
        if self._compress_pending:
            L = queries.shape[2]
            self.compress(queries, scale)
            # The new tokens are compressed too; attend to them from the compressed tiers.
            keys, values = keys[..., -L:, :], values[..., -L:, :]
        if self.phase == "exact":
            self._observe(queries)
            return ops.exact_attention(queries, keys, values, scale=scale, mask=mask,
                                       sinks=sinks, fast=self.config.exact is False,
                                       column_mass=self._column_mass(keys.shape[2]))
        return self.compressed.attention(queries, keys, values, scale=scale, mask=mask,
                                         sinks=sinks)

    def _column_mass(self, n: int):
        """The exported per-key attention mass buffer (H, >= n), or None when not needed."""
        if self.config.exact or self._geometry is None or self._geometry[0] != 1:
            return None
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
        w = max(self.config.recent, 16)
        q = queries[..., -w:, :]
        if self._obs is None or q.shape[2] >= w:
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

    def _flush(self):
        if not self._pending:
            return
        if self.compressed is not None:  # a lookahead move reading these pages finishes first
            self.compressed.spill_join()
        B, H, dk, dv, _ = self._geometry
        if self.host is None:
            cfg = self.config
            self.host = HostStore(
                H, dk, value_dim=dv, page_size=cfg.page_size, dtype=cfg.host_dtype,
                keys=cfg.host_keys, batch=B, budget=self.context.host_budget,
                disk_dir=cfg.disk_dir, keep_disk=cfg.keep_disk,
                disk_budget=self.context.disk_budget, name=f"layer{self.layer}",
            )
        ks = [k for k, _ in self._pending]
        vs = [v for _, v in self._pending]
        k = ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=2)
        v = vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=2)
        k, v = _to_numpy(k), _to_numpy(v)
        self._pending.clear()
        self._pending_tokens = 0
        self.host.append(v, k if self.config.host_keys else None)

    def tier_bytes(self) -> dict:
        """Bytes per tier, measured from the arrays this layer holds. ``transient``: the part of
        "accelerator" that only prefill holds (the exact window of a compressing cache, or the
        block-wise anchor + local blocks); bounded, reported apart from the steady state."""
        acc = transient = 0
        if self.phase == "exact":
            if self.keys is not None:
                acc = self.keys.nbytes + self.values.nbytes
                transient = 0 if self.config.exact else acc
        else:
            acc = self.compressed.nbytes
            transient = getattr(self.compressed, "prefill_bytes", 0)
        host = self.host.nbytes if self.host is not None else 0
        disk = self.host.disk_bytes if self.host is not None else 0
        return {"accelerator": acc, "transient": transient, "host": host, "disk": disk}

    def full_cache_bytes(self) -> int:
        """Bytes mlx-lm's KVCache would hold for this layer's tokens (the budget reference)."""
        if self._geometry is None:
            return 0
        B, H, dk, dv, dtype = self._geometry
        return B * H * (dk + dv) * dtype.size * self.offset

    def _should_compress(self, n_new: int) -> bool:
        """Leave the exact phase at the first decode step, or when prefill outgrows its window."""
        if self.config.exact:
            return False
        return n_new == 1 or self.offset + n_new > self.config.prefill_window

    def compress(self, queries: mx.array, scale: float):
        """Exact phase -> compressed phase: codes for every token, resident set, host pages."""
        from .compressed import CompressedLayer

        self._compress_pending = False
        self._flush()
        keys, values = self._exact_view()
        self.stats.peak_transient_bytes = max(self.stats.peak_transient_bytes,
                                              self.keys.nbytes + self.values.nbytes)
        self.context.q_heads = queries.shape[1]
        plan = self.context.plan_for(self)
        obs = self._obs
        if obs is None or obs.shape[2] == 0:
            obs = queries[..., -self.config.recent:, :]
        rep = queries.shape[1] // self._geometry[1]
        seed = ops.h2o_seed(obs[0] if obs is not None else None, keys[0], scale,
                            self._colmass, rep)
        self._colmass = None
        if plan.codec == "none":
            from .h2o import H2OLayer

            self.compressed = H2OLayer.from_exact(self, plan, keys, values, seed)
            self.host = None  # H2O-only: no host tier; what leaves the resident set is gone
            self._pending.clear()
            self._pending_tokens = 0
        else:
            codebook = self.context.codebook_for(self, keys) if plan.codec == "codebook" else None
            self.compressed = CompressedLayer.from_exact(self, plan, codebook, keys, values,
                                                         seed, scale, chunk=queries.shape[2])
        self.phase = "compressed"
        self.keys = self.values = None
        self._obs = None

    def _require_routing(self):
        from .integration import is_installed

        if not is_installed():
            raise RuntimeError(
                "this TieredCache holds compressed keys, so attention must be routed to it: call "
                "tiered.install() (TieredCache.for_model does) before running the model"
            )

    def fork(self, config: TieredConfig, context: SharedContext) -> "TieredCache":
        """A copy of this exact-phase layer under another config (one prefill, many methods)."""
        if self.phase != "exact":
            raise ValueError("only a cache still in its exact phase can be forked")
        other = TieredCache(config, layer=self.layer, context=context)
        if self._geometry is None:
            return other
        self._flush()
        other._geometry = self._geometry
        k, v = self._exact_view()
        other.keys, other.values = k[..., :, :], v[..., :, :]  # new array objects
        other.offset = self.offset
        other.host = HostStore.from_state(self.host.state()) if self.host is not None else None
        other._obs = self._obs
        other._colmass = None if self._colmass is None else self._colmass.copy()
        return other

    def __repr__(self) -> str:
        return (f"TieredCache(layer={self.layer}, phase={self.phase}, offset={self.offset}, "
                f"budget={self.config.gpu_budget})")

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def for_model(cls, model, gpu_budget: float | int | str = 0.125, *, install: bool = True,
                  tokenizer=None, **config) -> "TieredCacheList":
        """One cache per layer of ``model``: TieredCache for full-attention KV layers.

        Layers whose own cache is something else (sliding-window ``RotatingKVCache``, SSM
        ``ArraysCache``...) keep the cache the model makes for them. ``install=True`` routes
        mlx-lm attention to TieredCache (see :func:`tiered.install`).
        ``calibration="path/to/text"`` trains the key codebooks once on that text (``tokenizer``
        is then needed unless the result is already in ``cache_dir``); the default ``"self"``
        trains each layer's codebook on the document's own first keys.
        Unknown options raise ``ValueError`` naming them.
        """
        cfg = TieredConfig.from_kwargs(gpu_budget=gpu_budget, **config)
        from .integration import install as do_install
        from .integration import is_routed

        if install:
            do_install()
        base = model.make_cache() if hasattr(model, "make_cache") else [
            KVCache() for _ in model.layers
        ]
        layers = list(model.layers)
        caches, tiered, kept = [], [], []
        for i, c in enumerate(base):
            routable = i >= len(layers) or _layer_is_routable(layers[i], is_routed, install)
            if type(c) is KVCache and routable:
                tiered.append(i)
        context = SharedContext(cfg, layers=len(tiered), model=model)
        context.check_model_budget()
        if cfg.calibration != "self" and not cfg.exact and tiered:
            context.calibrate_from_text(model, tokenizer or getattr(model, "tiered_tokenizer", None),
                                        tiered)
        for i, c in enumerate(base):
            routable = i >= len(layers) or _layer_is_routable(layers[i], is_routed, install)
            if i in tiered:
                caches.append(cls(cfg, layer=i, context=context))
            else:
                caches.append(c)
                kept.append((i, type(c).__name__ if routable or type(c) is not KVCache
                             else "KVCache (attention not routable)"))
        if not tiered:
            log.warning("tiered: no layer of %s has a full-attention KVCache; nothing is tiered",
                        type(model).__name__)
        result = TieredCacheList(caches, config=cfg, tiered_layers=tiered, kept_layers=kept,
                                 context=context)
        log.info("tiered: %s", result.describe())
        return result


def _layer_is_routable(layer, is_routed, installing: bool) -> bool:
    """Whether some module of this layer calls mlx-lm's scaled_dot_product_attention."""
    modules = {type(m).__module__ for _, m in layer.named_modules()} | {type(layer).__module__}
    users = [m for m in modules if hasattr(sys.modules.get(m), "scaled_dot_product_attention")]
    if not users:
        return False
    return not installing or any(is_routed(m) for m in users)


def _to_numpy(x: mx.array) -> np.ndarray:
    if x.dtype == mx.bfloat16:
        x = x.astype(mx.float32)
    return np.array(x)


class TieredCacheList(list):
    """The per-layer caches of one model, as ``mlx_lm.generate`` expects, plus shared facts."""

    def __init__(self, caches, *, config, tiered_layers, kept_layers, context=None):
        super().__init__(caches)
        self.config = config
        self.tiered_layers = list(tiered_layers)
        self.kept_layers = list(kept_layers)
        self.context = context

    @property
    def plan(self):
        return self.context.plan if self.context is not None else None

    @property
    def scheduler(self):
        return self.context.get_scheduler() if self.context is not None else None

    def fork(self, **overrides) -> "TieredCacheList":
        """The same prefilled (exact-phase) cache under other options, e.g. another budget.

        Non-tiered layers are copied through their mlx-lm ``state``."""
        cfg = TieredConfig.from_kwargs(**{**self.config.to_dict(), **overrides})
        ctx = SharedContext(cfg, layers=len(self.tiered_layers))
        if self.context is not None:
            ctx.model_geometry = self.context.model_geometry
            ctx.codebook_memo = self.context.codebook_memo  # same document: same codebooks
            ctx.codebooks = self.context.codebooks
        tokens = max((c.offset for c in self if isinstance(c, TieredCache)), default=0)
        ctx.check_model_budget(reference_tokens=tokens or 4096)  # at the length it will compress
        caches = []
        for c in self:
            if isinstance(c, TieredCache):
                caches.append(c.fork(cfg, ctx))
            else:
                caches.append(type(c).from_state(c.state) if not c.empty() else type(c)())
        return TieredCacheList(caches, config=cfg, tiered_layers=self.tiered_layers,
                               kept_layers=self.kept_layers, context=ctx)

    def save(self, directory: str, model) -> str:
        """Persist this cache (after prefill) to ``directory``: ask again without re-reading."""
        from .persist import save

        return save(self, directory, model)

    @classmethod
    def load(cls, directory: str, model, **expect) -> "TieredCacheList":
        """A cache saved with :meth:`save`; refuses another model or other options."""
        from .persist import load

        return load(directory, model, expect_config=expect or None)

    def to_kvcache(self) -> list:
        """mlx-lm ``KVCache`` layers holding this exact-phase cache's keys and values."""
        out = []
        for c in self:
            if isinstance(c, TieredCache):
                if c.phase != "exact":
                    raise ValueError("to_kvcache needs a cache still in its exact phase")
                kv = KVCache()
                if not c.empty():
                    k, v = c._exact_view()
                    kv.update_and_fetch(k, v)
                out.append(kv)
            else:
                out.append(type(c).from_state(c.state) if not c.empty() else type(c)())
        return out

    def close(self):
        """Stop this cache's CPU workers and release its host pages and page files."""
        if self.context is not None:
            self.context.close()
        for c in self:
            if isinstance(c, TieredCache) and c.host is not None:
                c.host.close()

    def describe(self) -> str:
        kept = ", ".join(f"{i}:{n}" for i, n in self.kept_layers) or "none"
        return (f"{len(self.tiered_layers)} of {len(self)} layers tiered "
                f"(budget {self.config.gpu_budget}, method {self.config.method}); kept: {kept}")

    def tier_bytes(self) -> dict:
        total = {"accelerator": 0, "transient": 0, "host": 0, "disk": 0}
        for c in self:
            if isinstance(c, TieredCache):
                for k, v in c.tier_bytes().items():
                    total[k] += v
            else:
                total["accelerator"] += getattr(c, "nbytes", 0)
        return total
