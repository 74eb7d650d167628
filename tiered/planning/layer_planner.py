"""Layer-aware planner: one budget, spent per layer where the layer profile says it matters.

The uniform planner (:func:`tiered.planning.planner.make_plan`) gives every layer the same codec and
resident set. This one (``TieredConfig(planner="layers")``) reads the model's layer profile
(:mod:`tiered.planning.layer_profile`) and, for n tokens:

1. starts every layer in the offloaded layout (HCAttention's: key codes + a resident flag on the
   accelerator, every value on the host, exact rescoring from host keys) with the coarsest codes;
2. refines codes where they buy the most predicted loss per byte: a multiple-choice knapsack
   solved greedily on ``weight[l] * error[l][g]`` (the profile's output error of layer l with g
   codebook groups, made non-increasing in g, times the layer's weight), until the budget or the
   finest codes are reached;
3. with what is left, moves layers (most predicted loss left first) to the resident layout (H2O
heavy
   hitters, sinks and a recent window in full precision on the accelerator) once a layer can
   hold a meaningful resident set (>= 2% of its tokens, as the uniform planner asks), and splits
   the rest among the resident layers.

Each layer's :class:`~tiered.planning.planner.Plan` carries its ``share`` of the per-layer budget;
the shares average at most 1, so the model stays within ``gpu_budget`` (``report()`` measures it).
Low budgets thus get the layout that answered best there (all values offloaded, finer codes
where the profile says so), and 1/32 of the cache works where the uniform ladder refuses it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .geometry import Geometry
from .planner import MIN_RECENT, Plan, capacity

PER_GROUP_SHARE = 0.1  # per-group codebooks when they take at most this part of a layer's budget
COARSE_CENTROIDS = 64  # the book of the layout below the coarsest (allocate)
# The WIDE_SHARE of offloaded layers whose codes err most (the profile's output error at their
# code; at least one) select WIDE_FACTOR x the offloaded cap, floor and cap: the codes' ranking
# there misses what the answer needs. At 1/32 of float16's bytes (float32 on the CPU, 6,144
# tokens, embedded model) a needle document lost in layers 18-19 came back when they selected
# every token; the four of 30 that err most at four groups are 10, 3, 18, 19
# (docs/accuracy-grid.md).
WIDE_SHARE = 2 / 15  # 4 of the embedded model's 30 layers, 4 of 32
WIDE_FACTOR = 4


def wide_count(layers: int) -> int:
    """How many offloaded layers of a model with this many tiered layers select wider."""
    return max(1, round(layers * WIDE_SHARE))


@dataclasses.dataclass
class _Option:
    groups: int
    per_group: bool
    centroids: int
    code_bytes: int
    codebook: int  # bytes per layer


def _options(geometry: Geometry, config, groups_list, layer_budget: float) -> list[_Option]:
    g = geometry
    out = []
    for groups in groups_list:
        per_group = config.codebook_per_group
        c_pg = config.codebook_size or 64
        book_pg = g.kv_heads * groups * c_pg * (g.k_dim // groups) * 4
        if per_group is None:
            per_group = book_pg <= PER_GROUP_SHARE * layer_budget
        c = config.codebook_size or (64 if per_group else 256)
        book = g.kv_heads * (groups if per_group else 1) * c * (g.k_dim // groups) * 4
        out.append(_Option(groups, bool(per_group), c, groups * (1 if c <= 256 else 2), book))
    return out


def allocate(geometry: Geometry, config, profile, n: int, horizon: int):
    """Per tiered layer: (option index, resident layout?, bytes given) at n tokens, or None
    when the budget cannot hold even the coarsest offloaded layout. See the module docstring.

    Every layer offloaded (1/32 at 2k tokens) keeps the shared books: per-group ones there
    (3f4a8e6) took about half of the budget, most layers fell from 8 to 4 code bytes per token,
    and key-value retrieval answered 8 of 24 documents against 12. The rare keys they were for
    join the selection from the host instead (tiered.layer.compressed.HOST_OUTLIERS; issue 25)."""
    g = geometry
    L = g.layers
    probe = Plan(geometry=g, budget=config.gpu_budget, method="tiered", codec="codebook",
                 step=config.step)
    total = probe.budget_bytes(n) - probe.workspace_bytes(n)
    groups_list = [x for x in profile.groups if g.k_dim % x == 0]
    if config.codebook_groups is not None:
        groups_list = [config.codebook_groups]
    opts = _options(g, config, groups_list, total / max(L, 1))
    cap = capacity(n + horizon, config.step)
    res_bytes = g.full_token_head_bytes + 4

    def offloaded(options):
        return np.array([g.kv_heads * (cap * (o.code_bytes + 1) + res_bytes) + o.codebook
                         for o in options], float)

    offl = offloaded(opts)
    if L * offl[0] > total and config.codebook_size is None:
        # the coarsest layout with a smaller shared book: where even it does not fit (1/32 of
        # a 16-bit cache at 6k tokens: the 256-centroid book is a third of a layer's bytes)
        o = opts[0]
        small = _Option(o.groups, False, COARSE_CENTROIDS, o.groups,
                        g.kv_heads * COARSE_CENTROIDS * (g.k_dim // o.groups) * 4)
        opts, offl = [small] + opts, offloaded([small] + opts)
    w = profile.weights(config.layer_weighting)
    # (a smaller book at the same groups is predicted no worse: it is taken only where nothing
    # else fits, and left for the finer layouts as soon as the bytes allow)
    err = np.array([[profile.error_at(i, o.groups) for o in opts] for i in range(L)])
    err = np.minimum.accumulate(err, axis=1)  # finer codes never predicted worse
    cost = w[:, None] * err
    choice = np.zeros(L, int)
    used = L * offl[0]
    if used > total:
        return None
    while True:  # greedy multiple-choice knapsack on loss saved per byte
        best, best_gain = None, 0.0
        for i in range(L):
            j = choice[i]
            if j + 1 >= len(opts):
                continue
            extra = offl[j + 1] - offl[j]
            if used + extra > total:
                continue
            gain = (cost[i, j] - cost[i, j + 1]) / max(extra, 1.0)
            if gain > best_gain or best is None:
                best, best_gain = i, gain
        if best is None:
            break
        used += offl[choice[best] + 1] - offl[choice[best]]
        choice[best] += 1
    given = offl[choice].copy()
    resident = np.zeros(L, bool)
    min_res = max(config.sinks + min(config.recent, MIN_RECENT) + 16, n // 50)
    left = total - used
    # exact residents where the most predicted loss remains (weight x error at its codes)
    for i in np.argsort(-cost[np.arange(L), choice], kind="stable"):
        o = opts[choice[i]]
        need = g.kv_heads * (cap * (o.code_bytes + 5) + min(min_res, n) * res_bytes) + o.codebook
        if need - given[i] <= left:
            left -= need - given[i]
            given[i], resident[i] = need, True
    # what is left: to the resident sets, else to every layer (no byte of it is spent by an
    # offloaded layer; it keeps the shares clear of rounding at the bound)
    pick = resident if resident.any() else np.ones(L, bool)
    given[pick] += left / pick.sum()
    return choice, resident, given, opts, total


def make_layer_plans(geometry: Geometry, config, profile, n: int, horizon: int,
                     tiered_layers: list[int] | None = None) -> dict[int, Plan] | None:
    """{model layer index: its Plan} at n tokens, or None when nothing fits (see allocate)."""
    layers = tiered_layers or list(range(geometry.layers))
    view = _ProfileView(profile, layers)
    got = allocate(geometry, config, view, n, horizon)
    if got is None:
        return None
    choice, resident, given, opts, total = got
    # shares are checked below against the same byte model that allocated them; a relative
    # 1e-9 keeps float rounding from refusing an allocation that fits exactly (it cannot buy a
    # resident token: that would take 1e-9 of the budget to reach the size of one)
    mean = total / geometry.layers / (1 + 1e-9)
    plans = {}
    offloaded_floor = config.offloaded_min_selected
    wide = widest_layers(view, opts, choice, resident)
    wide_cap = WIDE_FACTOR * config.selection.cap(n, True)
    for i, layer in enumerate(layers):
        o = opts[choice[i]]
        keep = bool(resident[i])
        floor = 0 if keep else offloaded_floor
        cap = wide_cap if i in wide else 0
        why = "layer-aware plan: " + (
            "resident layout (H2O set)" if keep else
            f"every value on the host, selection floor {floor}" if not cap else
            f"every value on the host, its codes among the {len(wide)} that err most: "
            f"{cap} tokens selected")
        plan = Plan(geometry=geometry, budget=config.gpu_budget, method="tiered",
                    codec="codebook", groups=o.groups, centroids=o.centroids,
                    per_group=o.per_group, code_bytes=float(o.code_bytes),
                    sinks=config.sinks, recent=config.recent if keep else 1,
                    step=config.step, keep_values_resident=keep, share=float(given[i] / mean),
                    min_selected=max(floor, cap), max_selected=cap, why=why)
        try:
            plan.check(n, horizon)
        except ValueError:
            return None
        plans[layer] = plan
    return plans


def widest_layers(view, opts, choice, resident) -> set[int]:
    """Indices (into the tiered layers) of the :func:`wide_count` offloaded layers whose codes
    err most by the profile (output error at the chosen code's groups)."""
    off = [i for i in range(len(choice)) if not resident[i]]
    err = [view.error_at(i, opts[choice[i]].groups) for i in off]
    return {off[j] for j in np.argsort(err)[::-1][:wide_count(len(choice))]}


class _ProfileView:
    """The profile's rows for the tiered layers, in their order."""

    def __init__(self, profile, layers):
        self.profile, self.layers = profile, list(layers)
        self.groups = profile.groups

    def weights(self, weighting):
        return self.profile.weights(weighting)[self.layers]

    def error_at(self, i, groups):
        return self.profile.error_at(self.layers[i], groups)


def feasible(geometry, config, profile, n, horizon, layers=None) -> bool:
    return make_layer_plans(geometry, config, profile, n, horizon, layers) is not None


_THRESHOLDS: dict = {}  # memo: forks of one prefill (one per budget) ask for the same one


def threshold(geometry, config, profile, horizon, layers=None, max_tokens: int = 1 << 24,
              span: int = 1024) -> int | None:
    """First length from which the layer plans fit (a fraction's compression threshold): a
    binary search, then every one of the next ``span`` lengths checked (feasibility is a
    sawtooth near the threshold, as in tiered.planning.layout.compression_threshold). ~1 s, memoized."""
    key = (geometry, config.gpu_budget, config.step, horizon, config.sinks, config.recent,
           config.codebook_groups, config.codebook_size, config.codebook_per_group,
           config.layer_weighting, id(profile), tuple(layers or ()), max_tokens, span)
    if key in _THRESHOLDS:
        return _THRESHOLDS[key]
    t = None
    if feasible(geometry, config, profile, max_tokens, horizon, layers):
        lo, hi = 0, max_tokens
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if feasible(geometry, config, profile, mid, horizon, layers):
                hi = mid
            else:
                lo = mid
        t = m = hi
        while m < min(t + span, max_tokens):
            m += 1
            if not feasible(geometry, config, profile, m, horizon, layers):
                t = m + 1  # a dip: start again after it
    _THRESHOLDS[key] = t
    return t
