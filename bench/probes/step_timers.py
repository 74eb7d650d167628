"""Which calls a slow decode step spent its time in (issue 24: at 1M tokens on an H200, step
107 of 120 took 406 ms against a median of 37.6, nearly all of it in building the graph).

Every ``tiered`` function and ``mlx.core`` call is timed (``call_timers.CallTimers``,
inclusive wall time) and the totals are taken after each step, so a step's time splits by
call site; Python's garbage collector is timed too (``gc.callbacks``). The wrappers add host
time to every step: use it to find a slow step's cause, not to time steps.

    st = StepTimers()
    with st:
        for i in range(n):
            ...  # one decode step
            st.step()
    st.print_slow(times)
"""

from __future__ import annotations

import gc
import time

import numpy as np
from call_timers import CallTimers


class StepTimers:
    def __init__(self):
        self.timers = CallTimers()
        self.steps: list[dict[str, float]] = []  # per step: call site -> seconds
        self.gc_s: list[float] = []
        self._last: dict[str, float] = {}
        self._gc_total = 0.0
        self._gc_last = 0.0
        self._gc_t0 = None

    def _gc(self, phase, info):
        if phase == "start":
            self._gc_t0 = (time.perf_counter(), info.get("generation"))
        elif self._gc_t0 is not None:
            self._gc_total += time.perf_counter() - self._gc_t0[0]
            self._gc_t0 = None

    def __enter__(self):
        self.timers.__enter__()
        gc.callbacks.append(self._gc)
        self._last = dict(self.timers.total)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._gc)
        self.timers.__exit__(*exc)

    def step(self):
        """Close a step: its time per call site since the last one."""
        now = dict(self.timers.total)
        self.steps.append({k: v - self._last.get(k, 0.0) for k, v in now.items()
                           if v - self._last.get(k, 0.0) > 0})
        self._last = now
        self.gc_s.append(self._gc_total - self._gc_last)
        self._gc_last = self._gc_total

    def slow(self, times, factor: float = 1.4, top: int = 14, skip: int = 3) -> list[dict]:
        """The steps past the first ``skip`` slower than ``factor`` x the median, each with its
        largest call sites and the same sites' median over all steps (ms)."""
        med = float(np.median(times[skip:])) if len(times) > skip else float(np.median(times))
        typical = {}
        out = []
        for i, t in enumerate(times):
            if i < skip or t <= factor * med or i >= len(self.steps):
                continue
            sites = sorted(self.steps[i].items(), key=lambda kv: -kv[1])[:top]
            rows = []
            for key, s in sites:
                if key not in typical:
                    typical[key] = 1e3 * float(np.median(
                        [st.get(key, 0.0) for st in self.steps[skip:]]))
                rows.append({"call": key, "ms": 1e3 * s, "median_ms": typical[key]})
            out.append({"step": i, "ms": 1e3 * t, "median_step_ms": 1e3 * med,
                        "gc_ms": 1e3 * self.gc_s[i], "sites": rows})
        return out

    def print_slow(self, times, **kw) -> list[dict]:
        got = self.slow(times, **kw)
        gc_all = 1e3 * float(np.sum(self.gc_s))
        print(f"step timers: {len(got)} slow step(s); garbage collection {gc_all:.1f} ms in "
              f"{len(self.gc_s)} steps", flush=True)
        for s in got:
            print(f"step {s['step']}: {s['ms']:.1f} ms (median {s['median_step_ms']:.1f}), "
                  f"gc {s['gc_ms']:.1f} ms")
            for r in s["sites"]:
                print(f"  {r['ms']:9.2f} ms (median step {r['median_ms']:7.2f})  {r['call']}")
        return got
