"""Per-layer counters that report() aggregates: selection sizes, resident hits, timings."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np


class Column:
    """The mean of one column of a lazy (rows, columns) device array, read when converted with
    ``float()`` (a device step's statistics: no reduction queued per step)."""

    __slots__ = ("array", "col")

    def __init__(self, array: mx.array, col: int):
        self.array, self.col = array, col

    def __float__(self) -> float:
        return float(np.asarray(self.array[:, self.col]).mean())


# Steps whose counters a layer keeps (the latest): each holds a small device array on the
# accelerator paths, read only when a report asks; a long generation kept them all.
KEEP_STEPS = 4096


def _steps() -> deque:
    return deque(maxlen=KEEP_STEPS)


@dataclass
class LayerStats:
    decode_steps: int = 0
    # per step, the latest KEEP_STEPS: offloaded tokens selected (per kv head, mean), live
    # tokens, the softmax mass on the resident set
    selected: deque = field(default_factory=_steps)
    live: deque = field(default_factory=_steps)
    resident_mass: deque = field(default_factory=_steps)
    peak_transient_bytes: int = 0  # accelerator bytes held during prefill (exact window)
    prefill_by_layer: bool = False  # prefilled layer by layer: its peak held alone, not with others
    phase_s: dict = field(default_factory=dict)  # decode-step phase -> seconds, summed over steps

    def record_phases(self, marks) -> None:
        """marks: [(phase, perf_counter() at its end), ...] after a start mark ("", t0)."""
        for (_, a), (name, b) in zip(marks, marks[1:]):
            self.phase_s[name] = self.phase_s.get(name, 0.0) + (b - a)

    def record_step(self, selected: float, live: int, resident_mass) -> None:
        """resident_mass may be a lazy MLX scalar (read when summarized: no sync per step)."""
        self.decode_steps += 1
        self.selected.append(selected if isinstance(selected, (mx.array, Column)) else float(selected))
        self.live.append(int(live))
        self.resident_mass.append(resident_mass)

    def summary(self) -> dict:
        """Over the latest KEEP_STEPS decode steps (``steps_summarized``)."""
        if not self.selected:
            return {"decode_steps": 0}
        sel = np.asarray([float(x) for x in self.selected])
        live = np.asarray(self.live, dtype=np.float64)
        return {
            "decode_steps": self.decode_steps,
            "steps_summarized": len(sel),
            "selected_mean": float(sel.mean()),
            "selected_p95": float(np.percentile(sel, 95)),
            "selected_fraction_mean": float((sel / np.maximum(live, 1)).mean()),
            "resident_hit_rate": float(np.mean([float(x) for x in self.resident_mass])),
        }
