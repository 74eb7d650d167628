"""Wall time per call site, without a tracing profiler (issue 24): every function of
``mlx.core`` and of the ``tiered`` modules, and numpy's conversions, wrapped in a timer.

cProfile cannot see into MLX's nanobind functions (their time lands in the caller), so it
cannot say which MLX call waits for the device; these timers can (inclusive times: a function
that calls another counts the callee's time too).

    with CallTimers() as t:
        ...  # decode steps
    t.report(per=steps)
"""

from __future__ import annotations

import collections
import functools
import sys
import time
import types


class CallTimers:
    def __init__(self, packages=("tiered",), only=None):
        """``only``: the keys to time (e.g. ``{"mx.eval"}``), the others left unwrapped."""
        self.packages, self.only = packages, only
        self.total = collections.defaultdict(float)
        self.calls = collections.Counter()
        self._undo: list = []

    def _wrap(self, fn, key: str):
        total, calls, clock = self.total, self.calls, time.perf_counter

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                total[key] += clock() - t0
                calls[key] += 1

        timed.__wrapped_timer__ = True
        return timed

    def _patch(self, owner, name: str, fn, key: str):
        if getattr(fn, "__wrapped_timer__", False) or (self.only and key not in self.only):
            return
        self._undo.append((owner, name, owner.__dict__[name] if isinstance(owner, type)
                           else getattr(owner, name)))
        setattr(owner, name, self._wrap(fn, key))

    def __enter__(self):
        import mlx.core as mx
        import numpy as np

        for mod, prefix in ((mx, "mx."), (mx.fast, "mx.fast.")):
            for name in dir(mod):
                fn = getattr(mod, name)
                if callable(fn) and not isinstance(fn, type) and not name.startswith("_"):
                    self._patch(mod, name, fn, prefix + name)
        for name in ("array", "asarray", "ascontiguousarray"):
            self._patch(np, name, getattr(np, name), "np." + name)
        for modname, mod in list(sys.modules.items()):
            if not modname.split(".")[0] in self.packages or mod is None:
                continue
            for name, obj in list(vars(mod).items()):
                if isinstance(obj, types.FunctionType) and obj.__module__ == modname:
                    self._patch(mod, name, obj, f"{modname}.{name}")
                elif isinstance(obj, type) and obj.__module__ == modname:
                    for attr, fn in list(vars(obj).items()):
                        if isinstance(fn, types.FunctionType) and not attr.startswith("__"):
                            self._patch(obj, attr, fn, f"{modname}.{obj.__name__}.{attr}")
        return self

    def __exit__(self, *exc):
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)
        self._undo.clear()

    def report(self, per: int = 1, top: int = 40, min_ms: float = 0.05):
        """Print the call sites by inclusive time, in ms per ``per`` (e.g. per token)."""
        print(f"{'ms/token':>9} {'calls':>7}  call (inclusive wall time)")
        for key, t in sorted(self.total.items(), key=lambda kv: -kv[1])[:top]:
            ms = 1e3 * t / per
            if ms >= min_ms:
                print(f"{ms:9.3f} {self.calls[key] / per:7.1f}  {key}")

