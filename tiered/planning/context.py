"""What the layers of one model share: the plan, the key codebooks, the CPU workers."""

from __future__ import annotations

import hashlib
import os
import threading
import weakref

import mlx.core as mx
import numpy as np

from ..codecs import train_codebook
from ..cpu.memory_budget import HostBudget, SharedMemoryBudget
from ..runtime import dispatch, memory_limit, ops
from ..scheduler import Scheduler
from . import layout
from .geometry import Geometry, accelerator_bytes_ahead, model_geometry
from .planner import BudgetError, Plan
from .step_guard import StepGuard

# planner="auto": layer-aware below this fraction of the full cache. The two planners answered
# alike at 1/4 and 1/8 on 60 documents per task; at 1/16 the layer-aware one kept passkeys and
# needles inside the full cache's intervals where the uniform one lost 37 and 20 points
# (docs/accuracy-grid.md).
AUTO_LAYERS_BELOW = 0.125
# Where a layer's own codebook trains: faiss on the CPU backend, MLX on accelerators, unless
# TIERED_KMEANS names one ("faiss" or "mlx"; for measurements).
KMEANS = os.environ.get("TIERED_KMEANS") or None


class SharedContext:
    def __init__(self, config, *, layers: int, model=None):
        self.config = config
        self.layers = layers
        self.model_geometry = model_geometry(model, layers) if model is not None else None
        self.q_heads: int | None = None
        self.plan: Plan | None = None
        self.codebooks: dict[int, np.ndarray] | None = None  # from a calibration file
        # Self-calibrated codebooks by (layer, codec, sample digest): forks of one prefill
        # (one document, several budgets) train each codebook once.
        self.codebook_memo: dict = {}
        self._scheduler = None
        self._lock = threading.Lock()
        # layer index -> its compressed layer (lookahead decoding); weak: no cycle through the
        # context keeps a dropped cache (and its scheduler threads) alive
        self._lookahead = weakref.WeakValueDictionary()
        self._threshold = None  # (length,) once computed
        # planner="layers" (tiered.planning.layer_planner): a plan per model layer index, the
        # profile they come from, and where to measure it (the model, weakly; its tokenizer)
        self.layer_plans: dict[int, Plan] | None = None
        self.layer_profile = None
        self._auto_layers: bool | None = None  # planner="auto": decided at first use
        self.tiered_layers: list[int] | None = None
        self.model_ref = weakref.ref(model) if model is not None else None
        self.tokenizer = None
        self._caches = None  # weakref to the TieredCacheList (abort_step)
        self.steps = StepGuard()  # saves read the caches between steps (tiered.planning.step_guard)
        self.adopted = False  # a step switched its thread to the shared stream (dispatch)
        self.host_budget = (SharedMemoryBudget(config.memory_budget, self.accelerator_bytes)
                            if config.memory_budget is not None
                            else HostBudget(config.host_budget))
        memory_limit.track(self.host_budget)  # CUDA: host pages out of MLX's memory limit
        self.disk_budget = HostBudget(config.disk_budget) if config.disk_budget else None

    # ---- the steps of the model's layers ---------------------------------------------------
    def bind(self, caches) -> None:
        """The caches of the model (a TieredCacheList) this context serves, weakly."""
        self._caches = weakref.ref(caches)

    def _bound(self) -> list:
        caches = self._caches() if self._caches is not None else None
        return list(caches) if caches is not None else []

    def accelerator_bytes(self, n: int | None = None) -> int:
        """Accelerator bytes the caches this context serves hold now, or, where more, what a
        layer's plan will hold at the longest of them, or at n tokens (``memory_budget``'s
        other part: :func:`~tiered.planning.geometry.accelerator_bytes_ahead`)."""
        return accelerator_bytes_ahead(self._bound(), self.model_geometry, self.config, n)

    def bound_caches(self) -> list:
        """The caches this context serves (:meth:`bind`), [] when none are known."""
        return self._bound()

    def layers_to_step(self, layer) -> int:
        """Tiered layers that have not yet taken the step ``layer`` is taking (itself
        included): the ones at its offset. 1 when the caches are not known."""
        peers = [c for c in self._bound() if hasattr(c, "phase") and not c.closed]
        if not peers:
            return 1
        return sum(1 for c in peers if c.offset == layer.offset)

    def abort_step(self, layer, before: int, L: int) -> None:
        """A step of L tokens from ``before`` failed in ``layer``: every cache of the model that
        took it gives it back (trim), so the caller can run the same step again."""
        caches = self._bound() or [layer]
        for c in caches:
            if getattr(c, "offset", None) != before + L or not c.is_trimmable():
                continue
            try:
                c.trim(L)
            except Exception:  # noqa: BLE001  (keep rolling back the others)
                pass
            if hasattr(c, "_fresh"):
                c._fresh, c._new = False, None
        dispatch.eval_held(caches)  # on this thread: streams are per thread

    def end_step(self) -> None:
        """The model's step through these caches ended on this thread. A save waiting in
        another thread reads the caches next: what the step left lazy is evaluated here
        first (MLX streams are per thread: that thread could not evaluate it)."""
        if self.steps.others_waiting():
            dispatch.eval_held(self._bound())
        self.steps.leave()

    # ---- lookahead -------------------------------------------------------------------------
    def register_lookahead(self, layer: int, compressed):
        self._lookahead[layer] = compressed

    def next_lookahead_layer(self, layer: int):
        """The compressed layer whose spill move starts while ``layer`` decodes: the next one
        in model order, or the first (the next step's) after the last."""
        if len(self._lookahead) < 2:
            return None
        later = [i for i in self._lookahead if i > layer]
        return self._lookahead[min(later) if later else min(self._lookahead)]

    # ---- plan ------------------------------------------------------------------------------
    def geometry_for(self, layer) -> Geometry:
        """The budget's geometry from a layer's real keys (its batch counts as heads: the
        exact layout of B sequences holds B times the bytes)."""
        g = layer.geometry
        if self.model_geometry is not None and self.q_heads is None:
            q = self.model_geometry.q_heads
        else:
            q = self.q_heads or g.kv_heads
        return g.for_budget(self.layers, q)

    def check_budget(self):
        """Refuse, before any work, a budget no length can meet (model geometry known)."""
        geo = self.model_geometry
        if geo is None or self.layers == 0 or self.config.exact:
            return
        if self._layered():
            from . import layer_planner

            if layer_planner.feasible(geo, self.config, self.profile(), layout.MAX_TOKENS,
                                      self.config.heavy.horizon, self.tiered_layers):
                return
        if self.config.budget_fraction is not None:
            layout.check_fraction(geo, self.config)
        else:
            layout.layout_at(geo, self.config, 1)

    # ---- layer-aware plans (planner="layers") ---------------------------------------------
    def _layered(self) -> bool:
        """Whether the layer-aware planner plans this cache: planner="layers", or "auto" below
        AUTO_LAYERS_BELOW of the full cache with a layer profile at hand (decided once)."""
        cfg = self.config
        if cfg.exact or cfg.planner == "uniform":
            return False
        if cfg.planner == "layers":
            return True
        if self._auto_layers is None:
            self._auto_layers = self._auto_profile() is not None
        return self._auto_layers

    def _auto_profile(self):
        """planner="auto": the layer profile when the budget is a fraction below
        AUTO_LAYERS_BELOW and one is at hand without measuring (tiered.planning.layer_profile.
        find_profile), or a flat one where the uniform planner refuses the budget
        (tiered.planning.layer_profile.flat_fallback); else None (the uniform planner: measuring a
        profile takes minutes, asked for with planner="layers")."""
        frac = self.config.budget_fraction
        if frac is None or frac >= AUTO_LAYERS_BELOW:
            return None
        from .layer_profile import find_profile

        model = self.model_ref() if self.model_ref is not None else None
        prof = find_profile(model, self.config)
        if prof is None and model is not None:
            from .layer_profile import flat_fallback

            prof = flat_fallback(model, self.config, self.model_geometry)
        if prof is not None:
            self.layer_profile = prof
        return prof

    @property
    def planner(self) -> str:
        """The planner in use: "layers" or "uniform" (what "auto" chose)."""
        return "layers" if self._layered() else "uniform"

    def profile(self):
        """The model's layer profile (tiered.planning.layer_profile), loaded or measured once."""
        if self.layer_profile is None:
            from .layer_profile import get_profile, load_profile

            model = self.model_ref() if self.model_ref is not None else None
            if model is None:
                path = self.config.layer_profile
                prof = load_profile(path) if path else None
                if prof is None:
                    raise ValueError("planner='layers' needs the model (TieredCache.for_model) "
                                     "or layer_profile= naming an existing profile file")
                self.layer_profile = prof
            else:
                tok = self.tokenizer or getattr(model, "tiered_tokenizer", None)
                self.layer_profile = get_profile(model, tok, self.config)
        return self.layer_profile

    def _layer_plans_at(self, layer, n: int):
        from . import layer_planner

        return layer_planner.make_layer_plans(self.geometry_for(layer), self.config,
                                              self.profile(), n, self.config.heavy.horizon,
                                              self.tiered_layers)

    def _layered_layout(self, layer, n: int):
        """layout_at for planner="layers": (done, plan); not done: use the uniform ladder."""
        if self.layer_plans is not None:
            return True, self.layer_plans.get(layer.layer, self.plan)
        plans = self._layer_plans_at(layer, n)
        if plans is None:
            return False, None
        return True, plans.get(layer.layer)

    def layout_at(self, layer, n: int) -> Plan | None:
        """The layout of ``layer`` at n tokens (None: exact). Exact below a fraction's
        threshold (without compress_from) or within an absolute budget (before compress_from),
        whatever plan exists (a trimmed layer goes by this too); then the plan made once,
        where it holds n within a fraction (one made for a long document need not hold a
        short one: compressing with it would raise)."""
        cfg, plan, done = self.config, None, False
        if cfg.compress_from is None or n < cfg.compress_from:
            if cfg.budget_fraction is None:
                if layout.exact_fits(self.geometry_for(layer), cfg, n):
                    return None
            elif cfg.compress_from is None:
                t = self.threshold(layer)
                if t is None or n < t:
                    return None  # below the threshold (or in its sawtooth): exact
        if self._layered():
            done, plan = self._layered_layout(layer, n)
        if not done:
            if self.plan is None:
                return layout.layout_at(self.geometry_for(layer), cfg, n)
            plan = self.plan
        try:
            if plan is not None and cfg.budget_fraction is not None:
                plan.check(n, cfg.heavy.horizon)
        except BudgetError:
            return None
        return plan

    def threshold(self, layer) -> int | None:
        """First length at which the layer compresses (fractions: the compression threshold;
        absolute budgets: the first length the exact cache outgrows), computed once."""
        if self._threshold is None:
            self._threshold = (self._threshold_of(self.geometry_for(layer)),)
        return self._threshold[0]

    def _threshold_of(self, geo: Geometry) -> int | None:
        cfg = self.config
        if cfg.budget_fraction is None:
            return cfg.gpu_budget // max(geo.full_bytes(1), 1) + 1
        t = None
        if self._layered():
            from . import layer_planner

            t = layer_planner.threshold(geo, cfg, self.profile(), cfg.heavy.horizon,
                                        self.tiered_layers)
        return layout.compression_threshold(geo, cfg) if t is None else t  # the uniform ladder's

    def first_compressed_length(self) -> int | None:
        """The shortest sequence (prompt and generated tokens) that may hold a compressed
        layer, from the model's geometry before any token is seen (:meth:`threshold` without a
        layer); None: exact at every length (an exact configuration, no model geometry).
        Conservative: with ``compress_from`` the earlier of it and the threshold
        (tiered.commands.serve batches what is shorter in exact caches)."""
        geo, cfg = self.model_geometry, self.config
        if geo is None or cfg.exact or self.layers == 0:
            return None
        t = self._threshold_of(Geometry(self.layers, geo.kv_heads, geo.q_heads, geo.k_dim,
                                        geo.v_dim, geo.dtype_bytes))
        if cfg.compress_from is not None:
            t = cfg.compress_from if t is None else min(t, cfg.compress_from)
        return t

    def adopt_plan(self, text: str, layer: int | None = None) -> Plan:
        """The plan saved with a cache (a loaded cache keeps the parameters it was built with);
        a layer whose saved plan differs from the first one (layer-aware plans) keeps its own."""
        with self._lock:
            plan = Plan.from_json(text)
            if self.plan is None:
                self.plan = plan
            if layer is not None and plan != self.plan:
                self.layer_plans = self.layer_plans if self.layer_plans is not None else {}
                self.layer_plans[layer] = plan
                return plan
            return self.plan

    def plan_for(self, layer) -> Plan:
        """The model's plan, made at the first compression from the layer's real geometry."""
        with self._lock:
            if self._layered() and self.layer_plans is None:
                plans = self._layer_plans_at(layer, layer.offset)
                if plans is not None:
                    self.layer_plans = plans
                    self.plan = self.plan or plans.get(layer.layer)
            if self.layer_plans is not None and layer.layer in self.layer_plans:
                return self.layer_plans[layer.layer]
            if self.plan is None:
                plan = layout.layout_at(self.geometry_for(layer), self.config, layer.offset)
                if plan is None:
                    raise ValueError(f"layer {layer.layer} asked to compress at {layer.offset} "
                                     "tokens, where the exact layout is the one that fits")
                self.plan = plan
            return self.plan

    def copy(self) -> "SharedContext":
        """A context for an independent copy of the caches: same plan and codebooks (read
        only), its own workers, budgets and lookahead registry."""
        other = SharedContext(self.config, layers=self.layers)
        other.model_geometry, other.q_heads, other.plan = (self.model_geometry, self.q_heads,
                                                           self.plan)
        other.codebooks, other.codebook_memo = self.codebooks, self.codebook_memo
        other.layer_plans, other.layer_profile = self.layer_plans, self.layer_profile
        other.tiered_layers, other.model_ref = self.tiered_layers, self.model_ref
        other.tokenizer = self.tokenizer
        other._threshold = self._threshold
        return other

    # ---- codebooks -------------------------------------------------------------------------
    def calibrate_from_text(self, model, tokenizer, tiered_layers: list[int], progress=None):
        """Codebooks for every tiered layer from the keys the model makes on a text file
        (tiered.planning.text_calibration.calibrate_from_text)."""
        from .text_calibration import calibrate_from_text

        calibrate_from_text(self, model, tokenizer, tiered_layers, progress)

    def codebook_for(self, layer, keys: mx.array) -> np.ndarray:
        """This layer's codebook: from the calibration file, or trained on its own first keys."""
        plan = self.plan
        if self.layer_plans is not None:
            plan = self.layer_plans.get(layer.layer, plan)
        if self.codebooks is not None and layer.layer in self.codebooks:
            book = self.codebooks[layer.layer]
            if book.shape[1:] == ((plan.groups if plan.per_group else 1), plan.centroids,
                                  book.shape[3]) and book.shape[3] * plan.groups == keys.shape[3]:
                return book
        n = min(keys.shape[2], self.config.calibration_tokens)
        sample = np.ascontiguousarray(np.array(keys[0, :, :n, :].astype(mx.float32)))
        cfg = self.config
        prefix = (layer.layer, plan.groups, plan.centroids, plan.per_group, cfg.kmeans_iters,
                  cfg.seed)
        # The memo's key holds the sample's digest (~16 ms of SHA-1 per 16 MB sample on a
        # Llama-3-8B layer): read here only when an entry could match, else made on a thread
        # (hashlib lets go of the GIL) while the codebook trains.
        maybe = any(k[:len(prefix)] == prefix for k in self.codebook_memo)
        digest = _digest(sample) if maybe else None
        if digest is not None and prefix + (digest,) in self.codebook_memo:
            return self.codebook_memo[prefix + (digest,)]
        pending, box = None, []
        if digest is None:
            pending = threading.Thread(target=lambda: box.append(_digest(sample)),
                                       name="tiered-digest", daemon=True)
            pending.start()
        # One faiss thread: its OpenMP workers spin at barriers and stall beside other work.
        # On an accelerator every run of the layer is one batch of MLX ops (faiss ran
        # them one by one on the CPU: half of a 1M-token prefill's compression, H200)
        book = train_codebook(
            sample, groups=plan.groups, size=plan.centroids, per_group=plan.per_group,
            iters=cfg.kmeans_iters, seed=cfg.seed + layer.layer, threads=1,
            backend=KMEANS or ("faiss" if ops.on_cpu_backend() else "mlx"))
        if pending is not None:
            pending.join()
            digest = box[0] if box else _digest(sample)  # the thread failed: hash it here
        self.codebook_memo[prefix + (digest,)] = book
        return book

    # ---- workers ---------------------------------------------------------------------------
    def get_scheduler(self):
        with self._lock:
            if self._scheduler is None or self._scheduler.closed:
                self._scheduler = Scheduler(self.config.workers)
            return self._scheduler

    def close(self):
        with self._lock:
            s, self._scheduler = self._scheduler, None
        if s is not None:
            s.close()


def _digest(sample: np.ndarray) -> str:
    """The sample's SHA-1, read from its buffer (no copy)."""
    return hashlib.sha1(memoryview(sample).cast("B")).hexdigest()
