"""Budget planner: gpu_budget -> key codec parameters and resident-set sizes.

Accelerator bytes of one tiered layer holding n tokens, per KV head (measured the same way by
``CompressedLayer.nbytes``):

- per live token ("fixed"): key codes + an fp32 H2O score accumulator + a 1-byte resident flag;
- per resident token: full K and V in the model's dtype + an int32 token id;
- per layer: the codebook, plus buffers grown in steps of ``config.step`` tokens (slack);
- once, for the layer being computed: the exported scores (Hq x n fp32) -- workspace.

The reference ("full cache") is what mlx-lm's KVCache holds: n * H * (dk + dv) * dtype bytes.
The planner picks the most accurate codec whose fixed cost leaves room for a useful resident set,
then gives the rest of the budget to the resident set (sinks + recent window + heavy hitters).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..options.config import format_bytes
from .geometry import Geometry

CODE_GROUP_CHOICES = (4, 8, 16)  # dims per codebook group, most accurate first
MIN_HEAVY = 16  # a resident set must hold at least this many heavy hitters to be worth it
MIN_RECENT = 16  # the recent window shrinks to this for short documents before a refusal


class BudgetError(ValueError):
    """The budget cannot be met; the message says the smallest budget that works."""


@dataclass
class Plan:
    """Concrete parameters for a budget. Sizes are per layer and KV head."""

    geometry: Geometry
    budget: float | int  # fraction, or absolute bytes
    method: str
    codec: str  # "codebook" | "affine" | "none"
    groups: int = 0  # codebook g
    centroids: int = 0  # codebook c
    per_group: bool = False
    affine_bits: int = 0
    affine_group_size: int = 32
    code_bytes: float = 0.0  # per token and head
    sinks: int = 4
    recent: int = 64
    step: int = 256
    keep_values_resident: bool = True  # hcattention: False (every value on the host)
    min_heavy: int = MIN_HEAVY  # heavy hitters a resident set must hold (0: sinks + recent only)
    why: str = ""  # why the layout ladder chose this layout (tiered.planning.layout), for report()
    # this layer's part of the per-layer budget (the layer-aware planner,
    # tiered.planning.layer_planner,
    # gives each layer its own; they average at most 1 over the layers, so the model's total
    # stays within gpu_budget); 1.0: every layer alike
    share: float = 1.0
    # this layer's selection floor when above the config's min_selected (the layer-aware
    # planner's offloaded layers: config.offloaded_min_selected); 0: the config's
    min_selected: int = 0
    # this layer's selection cap when above the config's (the layer-aware planner's offloaded
    # layers whose codes err most select this many tokens, floor and cap); 0: the config's
    max_selected: int = 0

    # ---- persistence ----------------------------------------------------------------------
    def to_json(self) -> str:
        import dataclasses
        import json

        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        import json

        d = json.loads(text)
        d["geometry"] = Geometry(**d["geometry"])
        return cls(**d)

    # ---- byte model ---------------------------------------------------------------------
    @property
    def use_h2o(self) -> bool:
        """Whether an H2O accumulator ranks tokens for the resident set (not in hcattention)."""
        return self.keep_values_resident

    @property
    def fixed_token_bytes(self) -> float:
        """Accelerator bytes per live token and KV head outside the resident set."""
        if self.codec == "none":
            return 0.0
        # codes + resident flag (+ fp32 H2O accumulator)
        return self.code_bytes + 1 + (4 if self.use_h2o else 0)

    @property
    def resident_token_bytes(self) -> int:
        g = self.geometry
        acc = 4 if self.codec == "none" else 0  # h2o keeps accumulators for residents only
        return g.full_token_head_bytes + 4 + acc

    def codebook_bytes(self) -> int:
        if self.codec != "codebook":
            return 0
        g = self.geometry
        n_books = self.groups if self.per_group else 1
        return g.kv_heads * n_books * self.centroids * (g.k_dim // self.groups) * 4

    def workspace_bytes(self, n: int) -> int:
        """Exported scores of one layer (Hq x n fp32), counted once for the whole model."""
        if self.codec == "none":
            return 0
        return self.geometry.q_heads * _capacity(n, self.step) * 4

    def budget_bytes(self, n: int) -> int:
        g = self.geometry
        if isinstance(self.budget, float):
            return int(self.budget * g.full_bytes(n))
        return int(self.budget)

    def resident_capacity(self, n: int, horizon: int = 0) -> int:
        """Resident tokens per layer and KV head that fit the budget at n live tokens.

        horizon: tokens that may be appended before the resident set is sized again; buffers
        that grow in steps meanwhile are paid for now, so the bound holds until then."""
        g = self.geometry
        cap = _capacity(n + horizon, self.step)
        per_layer = (self.budget_bytes(n) - self.workspace_bytes(n)) / g.layers * self.share
        per_layer -= self.codebook_bytes()
        per_head = per_layer / g.kv_heads - self.fixed_token_bytes * cap
        r = int(per_head // self.resident_token_bytes)
        if not self.keep_values_resident:
            # every value lives on the host; only the newest tokens wait on the accelerator
            r = min(r, self.recent) if r >= min(self.recent, n) else r
        return max(0, min(r, n))

    def minimum_resident(self) -> int:
        if not self.keep_values_resident:
            return self.recent
        return self.sinks + min(self.recent, MIN_RECENT) + self.min_heavy

    def recent_window(self, resident: int) -> int:
        """The recent window for a resident set of this size: the configured one, shrunk (not
        below MIN_RECENT) so that MIN_HEAVY heavy hitters still fit."""
        if not self.keep_values_resident:
            return min(self.recent, resident)
        room = resident - self.sinks - self.min_heavy
        return max(min(self.recent, room), min(self.recent, MIN_RECENT))

    def check(self, n: int, horizon: int = 0) -> int:
        """Resident capacity at n tokens, or BudgetError with the smallest budget that works."""
        r = self.resident_capacity(n, horizon)
        need = min(self.minimum_resident(), n)
        if r < need:
            raise BudgetError(self._refusal(n, horizon))
        return r

    def smallest_bytes(self, n: int, horizon: int = 0) -> int:
        """Accelerator bytes this layout needs at n tokens with its smallest resident set."""
        g = self.geometry
        need = min(self.minimum_resident(), n)
        return int(
            g.layers * g.kv_heads
            * (self.fixed_token_bytes * _capacity(n + horizon, self.step)
               + need * self.resident_token_bytes)
            + g.layers * self.codebook_bytes() + self.workspace_bytes(n)
        )

    def _refusal(self, n: int, horizon: int = 0) -> str:
        smallest = self.smallest_bytes(n, horizon)
        frac = smallest / self.geometry.full_bytes(max(n, 1))
        where = (f"{frac:.4f} of the full cache" if frac <= 1 else
                 f"more than the full cache itself ({frac:.2f}x): at this length the exact "
                 "cache is the smaller layout")
        return (
            f"gpu_budget {self.budget!r} cannot hold {n} tokens with method {self.method!r} "
            f"(codec {self.describe_codec()}): the smallest budget that works at this length is "
            f"{format_bytes(smallest)} ({where})"
        )

    def describe_codec(self) -> str:
        if self.codec == "codebook":
            return (f"codebook g={self.groups} c={self.centroids}"
                    f"{' per-group' if self.per_group else ''}, {self.code_bytes:g} B/token/head")
        if self.codec == "affine":
            return (f"affine {self.affine_bits}-bit group {self.affine_group_size}, "
                    f"{self.code_bytes:g} B/token/head")
        return "none (resident set only)"

    def explain(self, n: int | None = None) -> str:
        g = self.geometry
        parts = [
            f"method {self.method}, keys as {self.describe_codec()}",
            f"full cache {g.full_token_head_bytes} B/token/head ({g.layers} layers x "
            f"{g.kv_heads} kv heads)",
        ]
        if self.codec != "none":
            parts.append(f"fixed {self.fixed_token_bytes:g} B/token/head "
                         f"({100 * self.fixed_token_bytes / g.full_token_head_bytes:.1f}%)")
        if n:
            r = self.resident_capacity(n)
            if self.keep_values_resident:
                parts.append(f"resident {r} tokens/head at {n} tokens ({self.sinks} sinks, "
                             f"{self.recent} recent, rest heavy hitters)")
            else:
                parts.append(f"every value on the host ({r} newest token(s) resident)")
        return "; ".join(parts)


def capacity(n: int, step: int) -> int:
    """Tokens an accelerator buffer holds when it holds n: grown in steps of the larger of
    ``step`` and n/16 (a power of two), so slack stays under 6.25% and a million-token prefill
    reallocates O(log n) times, not O(n / step)."""
    q = step
    while q * 32 <= n:
        q *= 2
    return max(step, -(-n // q) * q)


_capacity = capacity


def make_plan(geometry: Geometry, config, *, reference_tokens: int = 4096) -> Plan:
    """Pick codec parameters for ``config`` at ``geometry``; raise BudgetError if impossible.

    reference_tokens: a length at which a fractional budget is checked up front (fractions
    scale with n; absolute budgets are checked again as the cache grows).
    """
    method = config.method
    horizon = config.refresh_every + 1  # the resident set is sized for the steps until a refresh
    common = dict(geometry=geometry, budget=config.gpu_budget, method=method, step=config.step,
                  sinks=config.sinks, recent=config.recent)
    if method == "h2o":
        plan = Plan(codec="none", **common)
        plan.check(reference_tokens, horizon)
        return plan
    if method == "hcattention":
        common.update(recent=1, sinks=0)
    keep = method != "hcattention"
    d = geometry.k_dim
    codec = config.key_codec if config.key_codec != "auto" else "codebook"
    if codec == "affine":
        bits = config.affine_bits or 2
        gs = min(config.affine_group_size, d)
        code_bytes = d * bits / 8 + 2 * (d / gs) * geometry.dtype_bytes
        plan = Plan(codec="affine", affine_bits=bits, affine_group_size=gs,
                    code_bytes=code_bytes, keep_values_resident=keep, **common)
        plan.check(reference_tokens, horizon)
        return plan
    # Per-group codebooks with 64 centroids: same code bytes as one shared codebook of 256, but
    # rare keys (a needle's digits) get centroids of their own; measured on SmolLM2 passkeys
    # at 8k: the retrieval layer's output error fell from 0.79 to 0.013. Their size (g x the
    # shared one) only pays off when it is a small part of the budget: auto picks them when
    # they take at most 10% of a layer's share at this length.
    per_group_options = ([config.codebook_per_group] if config.codebook_per_group is not None
                         else [True, False])
    for i, per_group in enumerate(per_group_options):
        last = i == len(per_group_options) - 1
        c = config.codebook_size or (64 if per_group else 256)
        try:
            plan = _codebook_plan(geometry, config, common, per_group, c, keep, method,
                                  reference_tokens, horizon)
        except BudgetError:
            if last:
                raise
            continue
        layer_budget = plan.budget_bytes(reference_tokens) / geometry.layers
        if last or plan.codebook_bytes() <= 0.1 * layer_budget:
            return plan
    return plan


def _codebook_plan(geometry, config, common, per_group, c, keep, method, reference_tokens,
                   horizon) -> Plan:
    d = geometry.k_dim
    code_elem = 1 if c <= 256 else 2
    if config.codebook_groups is not None:
        if d % config.codebook_groups:
            raise ValueError(
                f"Invalid codebook_groups: {config.codebook_groups} does not divide head_dim {d}"
            )
        choices = [config.codebook_groups]
    elif method == "hcattention":
        choices = [d // 4]  # the published configuration: g = d / 4
    else:
        choices = [d // dims for dims in CODE_GROUP_CHOICES if d % dims == 0]
    last_error = None
    for g in choices:
        plan = Plan(codec="codebook", groups=g, centroids=c, per_group=per_group,
                    code_bytes=g * code_elem, keep_values_resident=keep, **common)
        try:
            r = plan.check(reference_tokens, horizon)
        except BudgetError as e:
            last_error = e
            continue
        # Prefer finer codes only while they leave a meaningful resident set (>= 2% of tokens).
        if not keep or r >= max(plan.minimum_resident(), reference_tokens // 50) or g == choices[-1]:
            return plan
    if last_error is not None:
        raise last_error
    return plan
