"""The per-layer caches of one model: ``TieredCache.for_model`` and :class:`TieredCacheList`.

``for_model`` gives each full-attention layer whose attention reaches mlx-lm's
``scaled_dot_product_attention`` a TieredCache, and keeps the model's own cache, with the
reason, for every other layer: sliding-window and SSM layers (their caches are not KVCache),
MLA layers (:func:`tiered.planning.contract.mla_reason`), a cache whose K/V other layers read whole
without routing attention through it (afm7's KV-reuse layers).
"""

from __future__ import annotations

import copy
import errno
import logging
import os
import sys

from mlx_lm.models.cache import KVCache

from .cpu.disk import DiskTierError, disk_room
from .metal import mlx_warm
from .options.config import TieredConfig
from .persistence import persist
from .planning.context import SharedContext
from .planning.contract import mla_reason
from .report import tier_totals
from .runtime import dispatch, integration
from .runtime._platform import bounded_malloc
from .runtime.integration import is_tiered

log = logging.getLogger("tiered")


def _layer_is_routable(layer, is_routed, installing: bool) -> bool:
    """Whether some module of this layer calls mlx-lm's scaled_dot_product_attention."""
    modules = {type(m).__module__ for _, m in layer.named_modules()} | {type(layer).__module__}
    users = [m for m in modules if hasattr(sys.modules.get(m), "scaled_dot_product_attention")]
    if not users:
        return False
    return not installing or any(is_routed(m) for m in users)


def _check_model(model):
    layers = getattr(model, "layers", None)
    if not callable(model) or layers is None:
        raise ValueError(
            f"Invalid model: expected an mlx-lm model (an mlx.nn.Module with .layers), got "
            f"{type(model).__name__}; pass the model, not the tokenizer "
            "(model, tokenizer = tiered.load())")
    return list(layers)


def _reused_whole(model, n_caches: int) -> dict[int, str]:
    """Caches whose full K/V other layers read without routing attention through them."""
    inner = getattr(model, "model", model)
    if getattr(inner, "kv_reuse_layers", None) or getattr(model, "kv_reuse_layers", None):
        return {n_caches - 1: "its keys and values are read whole by the KV-reuse layers"}
    return {}


class DiskOptionError(DiskTierError, ValueError):
    """disk_dir or disk_budget refused when the cache is made (a ValueError naming it)."""


def _check_disk_options(cfg) -> None:
    """The disk tier's directory is writable and holds disk_budget: a ValueError naming
    the option otherwise, before any work."""
    try:
        disk_room(cfg.disk_dir, cfg.disk_budget or 0)
    except DiskTierError as e:
        name, value = ("disk_budget", cfg.disk_budget) if (
            cfg.disk_budget and e.errno == errno.ENOSPC) else ("disk_dir", cfg.disk_dir)
        raise DiskOptionError(e.errno, f"Invalid {name}: {value!r} ({e.strerror})") from None


def for_model(cls, model, gpu_budget=0.125, *, install: bool = True, tokenizer=None,
              **config) -> "TieredCacheList":
    """One cache per layer of ``model``: TieredCache for full-attention KV layers.

    Layers whose own cache is something else (sliding-window ``RotatingKVCache``, SSM
    ``ArraysCache``...) or that cannot be tiered keep the cache the model makes for them, with
    the reason in ``describe()``. ``install=True`` routes mlx-lm attention to TieredCache (see
    :func:`tiered.install`). ``calibration="path/to/text"`` trains the key codebooks once on
    that text (``tokenizer`` is then needed unless the result is already in ``cache_dir``); the
    default ``"self"`` trains each layer's codebook on the document's own first keys.
    Unknown or invalid options raise ``ValueError`` naming them; a budget that no document
    length can meet raises :class:`tiered.planning.planner.BudgetError` here, before any work.
    """
    layers = _check_model(model)
    cfg = TieredConfig.from_kwargs(gpu_budget=gpu_budget, **config)
    if install:
        integration.install()
    if not cfg.exact:
        dispatch.share_streams()  # CUDA: decode steps dispatched from a second thread
        mlx_warm.start_for(model)  # CUDA: MLX's kernels compiled side by side
    base = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in layers]
    reused = _reused_whole(model, len(base))
    tiered, kept, reasons = [], [], {}
    for i, c in enumerate(base):
        layer = layers[i] if i < len(layers) else None
        if type(c) is not KVCache:
            reasons[i] = type(c).__name__
        elif layer is not None and not _layer_is_routable(layer, integration.is_routed, install):
            reasons[i] = "KVCache (attention not routable)"
        elif layer is not None and mla_reason(layer):
            reasons[i] = f"KVCache ({mla_reason(layer)})"
        elif i in reused:
            reasons[i] = f"KVCache ({reused[i]})"
        else:
            tiered.append(i)
    context = SharedContext(cfg, layers=len(tiered), model=model)
    context.tiered_layers = tiered
    context.tokenizer = tokenizer or getattr(model, "tiered_tokenizer", None)
    context.check_budget()
    if tiered and not cfg.exact and (cfg.host_budget is not None or cfg.disk_budget is not None
                                     or cfg.memory_budget is not None):
        _check_disk_options(cfg)
        bounded_malloc()  # freed temporaries go back to the system (runtime._platform)
    if cfg.calibration != "self" and not cfg.exact and tiered:
        context.calibrate_from_text(model, tokenizer or getattr(model, "tiered_tokenizer", None),
                                    tiered)
    caches = []
    for i, c in enumerate(base):
        if i in reasons:
            caches.append(c)
            kept.append((i, reasons[i]))
        else:
            caches.append(cls(cfg, layer=i, context=context))
    if not tiered:
        log.warning("tiered: no layer of %s can be tiered (%s); nothing is tiered",
                    type(model).__name__, sorted(set(reasons.values())))
    result = TieredCacheList(caches, config=cfg, tiered_layers=tiered, kept_layers=kept,
                             context=context)
    log.info("tiered: %s", result.describe())
    return result


def relink(caches, context=None, *, config=None, kept=None) -> "TieredCacheList":
    """Caches loaded layer by layer (each TieredCache with a context of its own) as one
    TieredCacheList whose tiered layers share ``context`` (a new one from the first layer's
    config when None): the plan, the CPU workers and the host budget are the model's again.
    ``config``: the options the layers run with from now on (a load's runtime overrides)."""
    tiered = [i for i, c in enumerate(caches) if is_tiered(c)]
    kept = kept if kept is not None else [
        (i, type(c).__name__) for i, c in enumerate(caches) if i not in tiered]
    if not tiered:
        return TieredCacheList(caches, config=config or TieredConfig(), tiered_layers=[],
                               kept_layers=kept)
    config = config or caches[tiered[0]].config
    ctx = context or SharedContext(config, layers=len(tiered))
    for i in tiered:
        c = caches[i]
        ctx.plan = ctx.plan or c.context.plan
        ctx.q_heads = ctx.q_heads or c.context.q_heads
        c.context, c.config = ctx, config
        if c.compressed is not None:
            c.compressed.config = config
        if c.host is not None:
            c.host.rebudget(ctx.host_budget, ctx.disk_budget, disk_dir=config.disk_dir)
    return TieredCacheList(caches, config=config, tiered_layers=tiered, kept_layers=kept,
                           context=ctx)


class TieredCacheList(list):
    """The per-layer caches of one model: a list, as ``mlx_lm.generate`` takes it, whose tiered
    layers share one context (the plan, the CPU workers, the host and disk budgets).

    ``tiered_layers`` / ``kept_layers``: which layers are TieredCache, and which keep the
    model's own cache and why (``describe()``). ``save(path, model)`` writes a directory (or
    one ``.safetensors`` file), :meth:`load` reads either back for the same model;
    ``report()`` (``tiered.report(cache)``) says what each tier holds; ``close()`` frees them.
    """

    def __init__(self, caches, *, config, tiered_layers, kept_layers, context=None):
        super().__init__(caches)
        self.config = config
        self.tiered_layers = list(tiered_layers)
        self.kept_layers = list(kept_layers)
        self.context = context
        if context is not None:
            context.bind(self)

    @property
    def plan(self):
        return self.context.plan if self.context is not None else None

    @property
    def scheduler(self):
        return self.context.get_scheduler() if self.context is not None else None

    def _tiered(self):
        return [c for c in self if is_tiered(c)]

    def __deepcopy__(self, memo):
        caches = [copy.deepcopy(c, memo) for c in self]
        ctx = memo.get(id(self.context)) if self.context is not None else None
        if ctx is None and self.context is not None:
            ctx = memo[id(self.context)] = self.context.copy()
        return TieredCacheList(caches, config=self.config, tiered_layers=self.tiered_layers,
                               kept_layers=self.kept_layers, context=ctx)

    def fork(self, **overrides) -> "TieredCacheList":
        """The same prefilled (exact-phase) cache under other options, e.g. another budget.

        Non-tiered layers are copied through their mlx-lm ``state``."""
        cfg = TieredConfig.from_kwargs(**{**self.config.to_dict(), **overrides})
        ctx = SharedContext(cfg, layers=len(self.tiered_layers))
        if self.context is not None:
            ctx.model_geometry = self.context.model_geometry
            ctx.q_heads = self.context.q_heads
            ctx.codebook_memo = self.context.codebook_memo  # same document: same codebooks
            ctx.codebooks = self.context.codebooks
            ctx.tiered_layers, ctx.model_ref = self.context.tiered_layers, self.context.model_ref
            ctx.tokenizer = self.context.tokenizer
            if (cfg.layer_profile, cfg.cache_dir) == (self.config.layer_profile,
                                                      self.config.cache_dir):
                ctx.layer_profile = self.context.layer_profile  # same file: no second read
        ctx.check_budget()
        caches = []
        for c in self:
            if is_tiered(c):
                caches.append(c.fork(cfg, ctx))
            else:
                caches.append(type(c).from_state(c.state) if not c.empty() else type(c)())
        return TieredCacheList(caches, config=cfg, tiered_layers=self.tiered_layers,
                               kept_layers=self.kept_layers, context=ctx)

    def settle(self):
        """Compress every layer that would compress at its next step (see TieredCache.settle)."""
        for c in self._tiered():
            c.settle()

    def save(self, path: str, model) -> str:
        """Persist this cache (after prefill): ask again without re-reading. A path ending in
        .safetensors is one file (mlx-lm's prompt-cache format with tiered's manifest; the
        cache must fit in RAM: :mod:`tiered.persistence.save_file`), any other a snapshot directory
        (:mod:`tiered.persistence.persist`, pages on the disk tier included)."""
        from .persistence import save_file

        if save_file.is_file(path):
            return save_file.save(self, path, model)
        return persist.save(self, path, model)

    @classmethod
    def load(cls, directory: str, model, **expect) -> "TieredCacheList":
        """A cache saved with :meth:`save` (a directory or one file; also a file mlx-lm's
        ``save_prompt_cache`` wrote); refuses another model or other options."""
        from .persistence import save_file

        if os.path.isfile(directory):
            loaded = save_file.load(directory, model, expect_config=expect or None)
        else:
            loaded = persist.load(directory, model, expect_config=expect or None)
        return relink(loaded.caches, loaded.context, config=loaded.config,
                      kept=loaded.kept_layers)

    def to_kvcache(self) -> list:
        """mlx-lm ``KVCache`` layers holding this exact-phase cache's keys and values."""
        out = []
        for c in self:
            if is_tiered(c):
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
        """Stop this cache's CPU workers and release its host pages and page files. Freeing
        pages is MLX work: it takes the lock saves and loads take (``persist.MLX_WORK``), one
        at a time with other threads' saves and loads."""
        with persist.MLX_WORK:
            if self.context is not None:
                self.context.close()
            for c in self._tiered():
                c.close()

    def describe(self) -> str:
        kept = ", ".join(f"{i}:{n}" for i, n in self.kept_layers) or "none"
        return (f"{len(self.tiered_layers)} of {len(self)} layers tiered "
                f"(budget {self.config.gpu_budget}, method {self.config.method}); kept: {kept}")

    def tier_bytes(self) -> dict:
        """Bytes per tier over every layer (see :func:`tiered.report.tier_totals`)."""
        return tier_totals(self)
