"""Read-only views of :class:`tiered.options.config.TieredConfig` grouped by the idea each option
serves.

The flat keyword options stay the API (``TieredCache.for_model(model, tau=0.95, recent=128)``);
``config.selection``, ``config.heavy``... hand the options of one idea to the code of that idea,
under the same names, as a frozen dataclass built when asked for:

- ``selection``: tau-cumulative selection of offloaded tokens (HCAttention): tau,
  max_selected, min_selected, rescore, offloaded_min_selected, offloaded_tau,
  offloaded_max_selected;
- ``heavy``: heavy-hitter scores and their refresh (H2O): ema_alpha, refresh_every;
- ``resident``: the resident set's fixed parts, and what trim can give back: sinks, recent,
  undo_tokens;
- ``codec``: the key codec and how its codebooks are trained: key_codec, codebook_groups,
  codebook_size, codebook_per_group, affine_bits, affine_group_size, rotate, calibration,
  calibration_tokens, kmeans_iters, cache_dir;
- ``host``: host pages and the disk tier: host_dtype, host_keys, page_size, host_budget,
  memory_budget, disk_dir, disk_budget, keep_disk, verify_pages;
- ``prefill``: when a layer compresses, block-wise prefill: compress_from, prefill_window,
  anchor_tokens, prefill_select;
- ``layer_budget``: how the budget is spread over the layers (:mod:`tiered.planning.layer_planner`):
  planner, layer_profile, layer_weighting;
- ``decode``: how a decode step runs (the lookahead buffer, the device gather, kernels, CPU
  workers): lookahead, device_gather, kernels, kernel_threads, workers.

``gpu_budget``, ``method``, ``step`` and ``seed`` concern the cache as a whole and stay flat.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class SelectionOptions:
    """Per step and kv head, the smallest set of offloaded tokens whose softmax mass reaches
    ``tau``, at least ``min_selected`` and at most ``max_selected`` tokens (an int, or a
    fraction of the live tokens); ``rescore``: "exact" (host keys) or "approx" (codes).
    ``offloaded_min_selected``, ``offloaded_tau`` and ``offloaded_max_selected``: the floor, tau
    and cap of layers whose every value is on the host (:mod:`tiered.planning.layer_planner`;
    tau and cap where above ``tau`` and ``max_selected``)."""

    tau: float
    max_selected: int | float
    min_selected: int
    rescore: str
    offloaded_min_selected: int
    offloaded_tau: float
    offloaded_max_selected: int | float

    def cap(self, live: int, offloaded: bool = False) -> int:
        """The cap in tokens with ``live`` live tokens (``offloaded``: in a layer whose every
        value is on the host, the larger of the two caps)."""
        cap = _tokens(self.max_selected, live)
        return max(cap, _tokens(self.offloaded_max_selected, live)) if offloaded else cap


def _tokens(cap: int | float, live: int) -> int:
    return cap if isinstance(cap, int) else max(1, int(cap * live))


@dataclass(frozen=True)
class HeavyOptions:
    """Heavy hitters (H2O): each token's accumulated attention (EMA with ``ema_alpha``) and
    the resident set's promotions / demotions every ``refresh_every`` decode steps."""

    ema_alpha: float
    refresh_every: int

    @property
    def horizon(self) -> int:
        """Tokens appended before the resident set is sized again (its buffers are paid for
        ahead)."""
        return self.refresh_every + 1


@dataclass(frozen=True)
class ResidentOptions:
    """The resident set's fixed parts: the first ``sinks`` tokens and the ``recent`` newest;
    ``undo_tokens``: tokens trim() can give back exactly (:mod:`tiered.step.undo`)."""

    sinks: int
    recent: int
    undo_tokens: int


@dataclass(frozen=True)
class CodecOptions:
    """The key codec ("auto", "codebook", "affine") with its parameters, and how codebooks are
    trained: on the document ("self") or a text file, from ``calibration_tokens`` tokens,
    ``kmeans_iters`` iterations, cached under ``cache_dir``."""

    key_codec: str
    codebook_groups: int | None
    codebook_size: int | None
    codebook_per_group: bool | None
    affine_bits: int | None
    affine_group_size: int
    rotate: bool
    calibration: str
    calibration_tokens: int
    kmeans_iters: int
    cache_dir: str


@dataclass(frozen=True)
class HostOptions:
    """Host pages (``page_size`` tokens, values and, with ``host_keys``, keys in
    ``host_dtype``) within ``host_budget`` bytes (or what ``memory_budget`` leaves beside the
    accelerator tier); beyond it the disk tier in ``disk_dir``."""

    host_dtype: str
    host_keys: bool
    page_size: int
    host_budget: int | None
    memory_budget: int | None
    disk_dir: str | None
    disk_budget: int | None
    keep_disk: bool
    verify_pages: bool


@dataclass(frozen=True)
class PrefillOptions:
    """When a layer compresses (``compress_from``; by default once a compressed layout meets
    the budget), the exact window of a prompt, and block-wise prefill's anchor block."""

    compress_from: int | None
    prefill_window: int
    anchor_tokens: int
    prefill_select: int | None


@dataclass(frozen=True)
class LayerBudgetOptions:
    """How the budget is spread over the layers: ``planner`` "uniform" (every layer the same
    codec and resident set) or "layers" (by the model's layer profile, measured once and cached
    in cache_dir, or read from the file ``layer_profile``; ``layer_weighting`` is how the
    profile weighs layers)."""

    planner: str
    layer_profile: str | None
    layer_weighting: str


@dataclass(frozen=True)
class DecodeOptions:
    """How a decode step runs: the lookahead buffer, the device reading host pages itself
    (``device_gather``), the scoring kernels and the CPU threads and workers."""

    lookahead: bool
    device_gather: str
    kernels: str
    kernel_threads: int
    workers: int


def view(config, cls):
    """``cls`` built from the options of ``config`` that bear its field names."""
    return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


class Group:
    """A read-only attribute: the view ``cls`` of the config it is read from."""

    def __init__(self, cls):
        self.cls = cls

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, config, owner=None):
        if config is None:
            return self
        # Kept until the config changes (OptionGroups.__setattr__ drops them): the decode
        # step reads views every layer, and building one costs ~10 us (dataclasses.fields)
        views = config.__dict__.setdefault("_option_views", {})
        got = views.get(self.name)
        if got is None:
            got = views[self.name] = view(config, self.cls)
        return got

    def __set__(self, config, value):
        raise AttributeError(f"config.{self.name} is a read-only view: set the options it "
                             f"holds ({', '.join(f.name for f in dataclasses.fields(self.cls))})")


class OptionGroups:
    """The grouped views of :class:`tiered.options.config.TieredConfig` (see the module
    docstring)."""

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        self.__dict__.pop("_option_views", None)  # every view is built again from now on

    selection = Group(SelectionOptions)
    heavy = Group(HeavyOptions)
    resident = Group(ResidentOptions)
    codec = Group(CodecOptions)  # not "keys": an object with ``keys`` passes for a mapping
    host = Group(HostOptions)
    prefill = Group(PrefillOptions)
    layer_budget = Group(LayerBudgetOptions)
    decode = Group(DecodeOptions)


GROUPS = {name: g.cls for name, g in vars(OptionGroups).items() if isinstance(g, Group)}
UNGROUPED = ("gpu_budget", "method", "step", "seed")
