"""Which layout a layer takes at n tokens: exact, or a compressed plan that meets the budget.

The layout ladder, most faithful first:

1. exact: every token's full K and V on the accelerator (mlx-lm's ``KVCache``). Always the
   layout at ``gpu_budget=1.0``; for a fraction below 1 the layout *below the compression
   threshold*, the length under which no compressed layout meets the fraction (the fixed
   costs of codes and codebooks do not pay for few tokens); for an absolute budget, the layout
   while the full cache fits in it.
2. the method's own compressed plans (:func:`tiered.planning.planner.make_plan`: codebook or affine
   codes, resident set, host values), finest codes first;
3. for method "tiered", the HCAttention layout (codes, every value on the host): it needs no
   resident values, so it meets budgets the resident set cannot;
4. for an absolute budget only, H2O eviction with no heavy-hitter floor (sinks + recent window,
   heavy hitters as the budget allows): lossy, but it keeps any budget that can hold the sinks
   and a short window. A fraction never falls back to eviction: below its threshold the cache
   stays exact instead, and every token stays readable.

An absolute budget that no layout meets at n tokens is a :class:`BudgetError` naming the
smallest budget that works.
"""

from __future__ import annotations

import dataclasses

from ..options.config import format_bytes
from .geometry import Geometry
from .planner import MIN_HEAVY, BudgetError, Plan, make_plan

MAX_TOKENS = 1 << 24  # lengths searched for a fraction's compression threshold
STABLE_SPAN = 1024  # lengths past the threshold that must all fit (buffers grow in blocks of 256)


def _hcattention_layout(geometry: Geometry, config, n: int) -> Plan:
    cfg = dataclasses.replace(config, method="hcattention", key_codec="auto",
                              codebook_groups=None, lookahead=False)
    plan = make_plan(geometry, cfg, reference_tokens=n)
    return dataclasses.replace(plan, why="the resident set of the tiered layout does not fit: "
                               "every value lives on the host (HCAttention layout)")


def _eviction_layout(geometry: Geometry, config, n: int) -> Plan:
    plan = Plan(geometry=geometry, budget=config.gpu_budget, method="h2o", codec="none",
                step=config.step, sinks=config.sinks, recent=config.recent, min_heavy=0,
                why="no compressed layout with a host tier fits: H2O eviction (tokens leaving "
                "the resident set are gone)")
    plan.check(n, config.heavy.horizon)
    return plan


def _candidates(geometry: Geometry, config, n: int):
    """Compressed plans for n tokens in ladder order (each a callable that may raise)."""
    yield lambda: make_plan(geometry, config, reference_tokens=n)
    if config.method == "tiered":
        yield lambda: _hcattention_layout(geometry, config, n)
    if config.budget_fraction is None and config.method != "h2o":
        yield lambda: _eviction_layout(geometry, config, n)


def _plans_at_any_budget(geometry: Geometry, config, n: int):
    """The plans of :func:`_candidates`; where the budget refuses one, the layout make_plan
    would have picked at any budget (to measure what it needs)."""
    for make in _candidates(geometry, config, n):
        try:
            yield make()
        except BudgetError:
            try:
                yield make_plan(geometry, dataclasses.replace(config, gpu_budget=1.0),
                                reference_tokens=n)
            except BudgetError:
                continue  # no budget makes this layout hold n tokens: not a candidate


def exact_fits(geometry: Geometry, config, n: int) -> bool:
    """Whether the exact layout of n tokens is within the budget (absolute budgets), or is
    the layout the budget asks for (fractions >= 1)."""
    if config.budget_fraction is not None:
        return config.exact
    return geometry.full_bytes(n) <= config.gpu_budget


def compressed_plan(geometry: Geometry, config, n: int) -> Plan | None:
    """The first compressed layout of the ladder that holds n tokens, or None."""
    for make in _candidates(geometry, config, n):
        try:
            plan = make()
        except BudgetError:
            continue
        try:
            plan.check(n, config.heavy.horizon)
        except BudgetError:
            continue
        return plan
    return None


def layout_at(geometry: Geometry, config, n: int) -> Plan | None:
    """The layout for n tokens: None for exact, else the compressed plan.

    Raises BudgetError for an absolute budget that no layout meets at n tokens."""
    if config.exact:
        return None
    if config.compress_from is not None and n >= config.compress_from:
        return compressed_plan(geometry, config, n)
    if config.budget_fraction is None and exact_fits(geometry, config, n):
        return None
    plan = compressed_plan(geometry, config, n)
    if plan is None and config.budget_fraction is None:
        raise BudgetError(refusal(geometry, config, n))
    return plan


def refusal(geometry: Geometry, config, n: int) -> str:
    """Why no layout holds n tokens, with the smallest budget that would."""
    smallest = geometry.full_bytes(n)
    label = "the exact cache"
    for plan in _plans_at_any_budget(geometry, config, n):
        need = plan.smallest_bytes(n, config.heavy.horizon)
        if need < smallest:
            smallest, label = need, f"the {plan.method} layout ({plan.describe_codec()})"
    frac = smallest / max(geometry.full_bytes(n), 1)
    return (f"gpu_budget {config.gpu_budget!r} cannot hold {n} tokens in any layout: the "
            f"smallest budget that works at this length is {format_bytes(smallest)} "
            f"(gpu_budget='{format_bytes(smallest).replace(' ', '')}', {frac:.4f} of the full "
            f"cache), with {label}")


def compression_threshold(geometry: Geometry, config) -> int | None:
    """The length from which a fractional budget is met by a compressed layout (None: at no
    length up to MAX_TOKENS).

    Feasibility is not monotone near the threshold: the budget grows linearly with n while the
    buffers grow in blocks, so a layout that fits at n can miss at n + 1 when a block is added
    (a sawtooth). A binary search finds a feasible length; the threshold is then the first length
    from which every length of the next STABLE_SPAN fits, so a layer that reaches it compresses
    once and does not fall back into the sawtooth."""
    if config.exact or config.budget_fraction is None:
        return None
    if compressed_plan(geometry, config, MAX_TOKENS) is None:
        return None
    lo, hi = 0, MAX_TOKENS  # lo infeasible (or 0), hi feasible
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if compressed_plan(geometry, config, mid) is None:
            lo = mid
        else:
            hi = mid
    n = hi
    m = n
    while m < min(n + STABLE_SPAN, MAX_TOKENS):
        m += 1
        if compressed_plan(geometry, config, m) is None:
            n = m + 1  # a dip: start again after it
    return n


def check_fraction(geometry: Geometry, config) -> None:
    """Refuse, before any work, a fraction that no length can meet."""
    if config.exact or config.budget_fraction is None:
        return
    if compressed_plan(geometry, config, MAX_TOKENS) is not None:
        return
    best = min((plan.smallest_bytes(MAX_TOKENS) / geometry.full_bytes(MAX_TOKENS)
                for plan in _plans_at_any_budget(geometry, config, MAX_TOKENS)), default=None)
    raise BudgetError(
        f"gpu_budget {config.gpu_budget!r} is below what any compressed layout needs at any "
        f"length for this model with method {config.method!r}: the smallest fraction that works "
        f"(for long documents) is {best:.4f}")


__all__ = ["MAX_TOKENS", "MIN_HEAVY", "check_fraction", "compressed_plan",
           "compression_threshold", "exact_fits", "layout_at", "refusal"]
