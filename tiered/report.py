"""report(cache): what each tier holds, measured from the arrays, and what selection did.

:class:`LayerReport` measures one TieredCache layer (its methods are the cache's);
:func:`report_dict` and :func:`report` add up the layers of a model's cache."""

from __future__ import annotations

import numpy as np

from .options.config import format_bytes
from .runtime.integration import is_tiered

TIERS = ("accelerator", "transient", "host", "disk", "bookkeeping")


class LayerReport:
    """Methods of :class:`tiered.cache.TieredCache` (see the module docstring)."""

    def accelerator_bytes(self) -> int:
        """The accelerator tier's bytes of :meth:`tier_bytes`, without reading the host."""
        if self.phase == "exact":
            return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes
        return self.compressed.nbytes

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
        book = self._colmass_nbytes() + (0 if self._obs is None else self._obs.nbytes)
        return {"accelerator": acc, "transient": transient, "host": host, "disk": disk,
                "bookkeeping": book}

    def full_cache_bytes(self) -> int:
        """Bytes mlx-lm's KVCache would hold for this layer's tokens (the budget reference)."""
        if self.geometry is None:
            return 0
        return self.geometry.full_bytes(self.offset)

    @property
    def step_note(self) -> str | None:
        """Which decode step this layer runs, and why not the device step where it does not
        (None: not compressed, attended as mlx-lm's KVCache is)."""
        c = self.compressed if self.phase == "compressed" else None
        if c is None:
            return None
        if not hasattr(c, "numpy_path"):  # method="h2o": mlx-lm's attention over kept tokens
            return f"{type(c).__name__}: attention over the tokens it keeps"
        if c.numpy_path:
            return "CPU backend: Numba kernels over the host pages"
        if c._tables is not None:
            how = "compiled" if c._compile_ok else "op by op"
            append = ("appends in place (TIERED_NATIVE=1)" if c._native else
                      "appends compiled" if c._compile_ok else "appends op by op")
            return (f"device step (CUDA): selected chunks read from the host pages in place, "
                    f"no host round trip; {how}, {append}")
        host = c.parent.host
        if host is not None and host.values.slabs is not None \
                and self.config.device_gather != "off":
            from .step import unified_step

            why = unified_step.supported(c)
            if why is None:
                return ("device step (one memory): selected chunks read from host pages on "
                        "slabs, kernel inputs in place; no host round trip, op by op")
        if c.steps == 0:
            return "no decode step yet"
        if self.config.device_gather == "off":
            why = "device_gather='off'"
        else:
            from .step import device_decode

            why = device_decode.supported(c) or "not decided"
        return f"one sync a layer, CPU workers gather the selected rows (not the device step: {why})"

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
        if self.geometry is None:
            return "empty"
        t = self.context.threshold(self)
        if self.config.budget_fraction is None:
            return (f"exact: the full cache fits gpu_budget {self.config.gpu_budget} up to "
                    f"{t - 1} tokens" if t else "exact")
        if t is None:
            return "exact: no compressed layout meets this budget at any length"
        return (f"exact: below {t} tokens no compressed layout meets gpu_budget "
                f"{self.config.gpu_budget} (codes and codebooks cost more than they save)")


def tier_totals(caches) -> dict:
    """Bytes per tier of a list of caches: a tiered layer's :meth:`LayerReport.tier_bytes`,
    any other cache's ``nbytes`` (mlx-lm's caches) counted on the accelerator."""
    total = dict.fromkeys(TIERS, 0)
    for c in caches:
        if is_tiered(c):
            for k, v in c.tier_bytes().items():
                total[k] += v
        else:
            total["accelerator"] += int(getattr(c, "nbytes", 0) or 0)
    return total


def _ranges(ids) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            out.append(f"{start}-{x}" if x != start else f"{x}")
            start = None
    return ", ".join(out)


def layer_plan_lines(plans: dict) -> list[str]:
    """Lines for report() of the layer-aware planner's plans (tiered.planning.layer_planner): layers
    grouped by codec and layout."""
    groups: dict[tuple, list[int]] = {}
    for layer, p in sorted(plans.items()):
        groups.setdefault((p.describe_codec(), p.keep_values_resident), []).append(layer)
    lines = []
    for (codec, keep), ids in groups.items():
        shares = [plans[i].share for i in ids]
        lines.append(f"layers {_ranges(ids)}: keys as {codec}; "
                     + ("resident layout (H2O)" if keep else "every value on the host")
                     + f"; budget share {min(shares):.2f}-{max(shares):.2f}")
    return lines


def shared_memory() -> str | None:
    """Where the accelerator tier lives in the host's memory: "the CPU backend" (MLX's CPU
    device), "unified memory" (Metal), else None (a GPU's own memory)."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return "the CPU backend"
    if mx.metal.is_available():
        return "unified memory"
    return None


_BY_LAYER = ", one layer's at a time"


def _peak_transient(layers) -> int:
    """The prefill's exact K/V held at once: every layer's together (chunk by chunk), or the
    largest layer's (layer by layer: tiered.layerwise_prefill)."""
    peaks = [c.stats.peak_transient_bytes for c in layers]
    if layers and all(c.stats.prefill_by_layer for c in layers):
        return max(peaks)
    return sum(peaks)


def report_dict(caches) -> dict:
    """Figures of a list of caches (``TieredCache.for_model`` output, or a loaded one)."""
    layers = [c for c in caches if is_tiered(c)]
    per_tier = tier_totals(caches)
    tokens = max((c.offset for c in layers), default=0)
    full = sum(c.full_cache_bytes() for c in layers)
    out = {
        "layers": len(caches),
        "tiered_layers": len(layers),
        "tokens": tokens,
        "bytes": per_tier,
        "full_cache_bytes": full,
        "accelerator_fraction": per_tier["accelerator"] / full if full else None,
        "phases": sorted({c.phase for c in layers}),
        "peak_transient_accelerator_bytes": _peak_transient(layers),
        "prefill_by_layer": bool(layers) and all(c.stats.prefill_by_layer for c in layers),
        # the accelerator and host tiers in one memory (MLX's CPU backend, Apple's unified
        # memory): what the process holds is their sum
        "shared_memory": shared_memory(),
        "accelerator_and_host_bytes": per_tier["accelerator"] + per_tier["host"],
    }
    cfg = layers[0].config if layers else None
    if cfg is not None and cfg.memory_budget is not None:
        held = per_tier["accelerator"] + per_tier["host"]
        out["memory_budget"] = {"bytes": cfg.memory_budget, "held": held,
                                "within": held <= cfg.memory_budget}
    notes: dict[str, list[int]] = {}
    for c in layers:
        notes.setdefault(c.layout_note, []).append(c.layer)
    out["layouts"] = {note: ids for note, ids in notes.items()}
    steps: dict[str, list[int]] = {}
    for c in layers:
        if (note := c.step_note) is not None:
            steps.setdefault(note, []).append(c.layer)
    if steps:
        out["decode_steps"] = steps
    kept = getattr(caches, "kept_layers", None)
    if kept:
        out["kept_layers"] = [list(x) for x in kept]
    plan = getattr(caches, "plan", None) or (layers[0].plan if layers else None)
    if plan is not None:
        out["plan"] = plan.explain()
        budget = plan.budget_bytes(tokens) if hasattr(plan, "budget_bytes") else None
        if budget is not None:
            out["budget_bytes"] = budget
    ctx = getattr(caches, "context", None)
    if ctx is not None and hasattr(ctx, "planner"):
        out["planner"] = {"asked": ctx.config.planner, "used": ctx.planner}
    if ctx is not None and getattr(ctx, "layer_plans", None):
        out["layer_plans"] = {"summary": layer_plan_lines(ctx.layer_plans), "per_layer": {
            i: {"codec": p.describe_codec(), "resident_layout": p.keep_values_resident,
                "share": p.share, "why": p.why} for i, p in sorted(ctx.layer_plans.items())}}
    sched = ctx._scheduler if ctx is not None else None
    if sched is not None and sched.timings.jobs:
        out["scheduler"] = sched.timings.summary()
    phases: dict = {}
    for c in layers:
        for k, v in c.stats.phase_s.items():
            phases[k] = phases.get(k, 0.0) + v
    if phases:
        # Host-side wall time of the decode steps of all layers, by phase (see compressed.py).
        out["step_phases_s"] = phases
    sel = [c.stats.summary() for c in layers]
    steps = [s for s in sel if s.get("decode_steps")]
    if steps:
        out["selection"] = {
            "decode_steps": steps[0]["decode_steps"],
            "selected_mean": float(np.mean([s["selected_mean"] for s in steps])),
            "selected_p95": float(np.max([s["selected_p95"] for s in steps])),
            "selected_fraction_mean": float(np.mean([s["selected_fraction_mean"] for s in steps])),
            "resident_hit_rate": float(np.mean([s["resident_hit_rate"] for s in steps])),
            "per_layer": [
                {"layer": c.layer, "mean": s.get("selected_mean"), "p95": s.get("selected_p95"),
                 "resident_hit_rate": s.get("resident_hit_rate")}
                for c, s in zip(layers, sel)
                if s.get("decode_steps")
            ],
        }
    return out


def report(caches) -> str:
    """A readable summary: bytes per tier, tokens selected per layer, resident hit rate."""
    d = report_dict(caches)
    b = d["bytes"]
    lines = [
        f"tiered cache: {d['tiered_layers']} of {d['layers']} layers tiered, "
        f"{d['tokens']} tokens, phase {'/'.join(d['phases']) or 'empty'}",
        f"  accelerator {format_bytes(b['accelerator'])}"
        + (" (exact: what mlx-lm's KVCache holds)" if d["phases"] == ["exact"] else
           f" ({100 * d['accelerator_fraction']:.1f}% of the full cache "
           f"{format_bytes(d['full_cache_bytes'])})" if d["accelerator_fraction"] is not None else "")
        + f" | host {format_bytes(b['host'])} | disk {format_bytes(b['disk'])}",
    ]
    peak = d["peak_transient_accelerator_bytes"]
    by_layer = d.get("prefill_by_layer", False)
    if "budget_bytes" in d and "compressed" in d["phases"]:
        ok = b["accelerator"] <= d["budget_bytes"]
        lines.append(f"  budget {format_bytes(d['budget_bytes'])}: the cache "
                     f"{'within' if ok else 'OVER'} it"
                     + (f"; the prefill's transient peak {format_bytes(peak)} was above it (the "
                        f"prompt's exact K/V before it compressed{_BY_LAYER if by_layer else ''})"
                        if peak > d["budget_bytes"] else ""))
    elif peak:
        lines.append(f"  prefill transient peak (accelerator) {format_bytes(peak)}")
    if d["shared_memory"]:
        lines.append(f"  on {d['shared_memory']} the accelerator and host tiers share one "
                     f"memory: {format_bytes(d['accelerator_and_host_bytes'])} together (the "
                     f"full cache: {format_bytes(d['full_cache_bytes'])})")
    if "memory_budget" in d:
        m = d["memory_budget"]
        lines.append(f"  memory budget {format_bytes(m['bytes'])}: accelerator and host RAM "
                     f"together {format_bytes(m['held'])}, {'within' if m['within'] else 'OVER'}"
                     f" it; disk {format_bytes(b['disk'])}")
    if d["bytes"].get("bookkeeping"):
        lines.append(f"  H2O seed statistics {format_bytes(d['bytes']['bookkeeping'])} (the last "
                     "queries and the prompt's attention per key, kept near compression only)")
    for note, ids in d.get("layouts", {}).items():
        which = "all tiered layers" if len(ids) == d["tiered_layers"] else f"layers {_ranges(ids)}"
        lines.append(f"  {which}: {note}")
    for note, ids in d.get("decode_steps", {}).items():
        which = "all tiered layers" if len(ids) == d["tiered_layers"] else f"layers {_ranges(ids)}"
        lines.append(f"  decode step, {which}: {note}")
    if "layer_plans" in d and any(c != "exact" for c in d["phases"]):
        asked = d.get("planner", {}).get("asked", "layers")
        lines.append(f"  plan: layer-aware (planner='{asked}'), by the model's layer profile:")
        lines += [f"    {line}" for line in d["layer_plans"]["summary"]]
    elif "plan" in d and any(c != "exact" for c in d["phases"]):
        why = ""
        if d.get("planner", {}).get("asked") == "auto":
            why = (" (planner='auto': uniform at 1/8 and above, or where no layer profile is at "
                   "hand; planner='layers' measures one)")
        lines.append(f"  plan: {d['plan']}{why}")
    if "selection" in d:
        s = d["selection"]
        lines.append(
            f"  selection over {s['decode_steps']} decode steps: {s['selected_mean']:.1f} "
            f"offloaded tokens/kv-head mean (p95 {s['selected_p95']:.0f}, "
            f"{100 * s['selected_fraction_mean']:.1f}% of live), resident hit rate "
            f"{100 * s['resident_hit_rate']:.1f}%"
        )
    if "scheduler" in d:
        t = d["scheduler"]
        lines.append(
            f"  CPU workers: {t['jobs']} jobs, busy {t['cpu_busy_s']:.3f}s (wall "
            f"{t['cpu_wall_s']:.3f}s), caller waited {t['waited_s']:.3f}s, overlap ratio "
            f"{t['overlap_ratio']:.2f}"
        )
    return "\n".join(lines)
