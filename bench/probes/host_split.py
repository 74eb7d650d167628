"""Where a decode token's host time goes in tiered's device path, per layer (issue 57).

Wraps the functions a compressed layer's decode step passes through with wall-clock timers
(inclusive: a function's figure holds its callees') and the compiled replays (the append's
``_body``, the step's ``_chain``) with their own, then prints microseconds per layer and token.
The timers cost ~0.3 us a call. Used by ``bench/decode_speed.py --host-split`` (timed steps
only) and on its own with the zero kernels of bench/probes/device_python_local.py:

    python bench/probes/host_split.py --layers 32 --context 16384 --steps 40

``--dispatcher`` hands the layers to tiered's dispatcher thread as on CUDA (refreshes then
planned ahead on their worker, as there); that thread evaluates the fake kernels' graph on the
same two cores, so the main thread's figures include its share of them.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)

PIECES = [  # (label, "module:qualified name"), outermost first
    ("update_and_fetch", "tiered.cache:TieredCache.update_and_fetch"),
    ("  CompressedLayer.append", "tiered.layer.compressed:CompressedLayer.append"),
    ("    device_append.append", "tiered.step.device_append:append"),
    ("      replay: append", "replay:_body"),
    ("attention", "tiered.cache:TieredCache.attention"),
    ("  device_step.decode", "tiered.step.device_step:decode"),
    ("    device_compiled.step", "tiered.step.device_compiled:step"),
    ("      replay: step", "replay:_chain"),
    ("    _finish", "tiered.step.device_step:_finish"),
    ("      _end_step", "tiered.layer.decode_paths:DecodePaths._end_step"),
    ("      dispatch.submit", "tiered.runtime.dispatch:submit"),
    ("  _attention", "tiered.cache:TieredCache._attention"),
    ("  _settle_early (last layer)", "tiered.cache:TieredCache._settle_early"),
    ("  dispatch.drain", "tiered.runtime.dispatch:drain"),
    ("  end_step (last layer)", "tiered.planning.context:SharedContext.end_step"),
    ("settle (a refresh applied)", "tiered.layer.resident:ResidentSet.settle"),
    ("  prepare_refresh", "tiered.layer.resident:ResidentSet.prepare_refresh"),
]


class HostSplit:
    """Timers around :data:`PIECES`; ``on`` gates them (warm-up steps are not counted)."""

    def __init__(self):
        self.total = collections.defaultdict(float)
        self.calls = collections.Counter()
        self.on = False
        self._undo = []  # (owner, attribute, original)
        self.last = {}  # body name -> (compiled function, arguments) of its last timed call
        self._wrap_replays()
        for _, spec in PIECES:
            if not spec.startswith("replay:"):
                self._wrap(spec)

    def _timed(self, spec, fn):
        def timed(*a, **k):
            if not self.on:
                return fn(*a, **k)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.total[spec] += time.perf_counter() - t
                self.calls[spec] += 1
        timed.__wrapped__ = fn
        return timed

    def _wrap(self, spec: str):
        mod, name = spec.split(":")
        owner = importlib.import_module(mod)
        *path, attr = name.split(".")
        for p in path:
            owner = getattr(owner, p)
        self._undo.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, self._timed(spec, getattr(owner, attr)))

    def _wrap_replays(self):
        from tiered.step import device_compiled

        plain = device_compiled.compiled

        wrapped = {}  # compiled function -> its timed wrapper, made once (not per call)

        def compiled(functions, key, body, limit):
            fn = plain(functions, key, body, limit)
            got = wrapped.get(fn)
            if got is None:
                timed = self._timed("replay:" + body.__name__, fn)

                def got(*a, _fn=fn, _timed=timed, _name=body.__name__):
                    if self.on:
                        self.last[_name] = (_fn, a)
                    return _timed(*a)
                wrapped[fn] = got
            return got

        self._undo.append((device_compiled, "compiled", plain))
        device_compiled.compiled = compiled

    def unwrap(self):
        """Put every wrapped function back."""
        for owner, attr, fn in reversed(self._undo):
            setattr(owner, attr, fn)
        self._undo.clear()

    def replay_alone(self, reps: int = 50) -> list[str]:
        """Each compiled function's last call replayed ``reps`` times on its evaluated
        arguments, nothing else running: the replay's own cost, against its cost in the step."""
        import mlx.core as mx

        out = []
        for name, (fn, args) in self.last.items():
            mx.eval([a for a in args if isinstance(a, mx.array)])
            fn(*args)
            t = time.perf_counter()
            for _ in range(reps):
                fn(*args)
            us = 1e6 * (time.perf_counter() - t) / reps
            out.append(f"replay alone: {name:<26} {us:8.1f} us/call")
        self.last.clear()
        import sys
        import threading

        names = sorted(t.name for t in threading.enumerate())
        out.append(f"Python threads: {len(names)} ({', '.join(names)}); switch interval "
                   f"{1e6 * sys.getswitchinterval():.0f} us")
        return out

    def report(self, tokens: int, layers: int) -> list[str]:
        """Lines: microseconds per layer and token of each piece, and calls per layer."""
        out = []
        for label, spec in PIECES:
            if self.calls[spec]:
                us = 1e6 * self.total[spec] / (tokens * layers)
                out.append(f"{label:<34} {us:8.1f} us/layer  ({self.calls[spec] / (tokens * layers):.2f}"
                           " calls/layer)")
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--async-eval", action="store_true",
                    help="keep mx.async_eval (the dispatcher thread evaluates the zero kernels' "
                    "graph on the CPU beside the main thread)")
    ap.add_argument("--dispatcher", action="store_true",
                    help="hand the layers to the dispatcher thread as on CUDA (its shared "
                    "stream on the CPU device; refreshes then planned ahead on the worker): "
                    "its evaluations and the main thread's drains are not counted")
    args = ap.parse_args()
    import mlx.core as mx
    import numpy as np
    from device_python_local import fake_device_model

    from tiered.runtime import dispatch

    if args.dispatcher:
        dispatch._cuda = lambda: True  # the dispatcher's shared stream, here on the CPU
    model, cache = fake_device_model(args.layers, args.context,
                                     no_async=not (args.async_eval or args.dispatcher))
    if args.dispatcher:
        mx.set_default_stream(dispatch.stream())  # as tiered's integration makes mlx-lm's
    split = HostSplit()
    in_eval = [0.0]
    plain_eval = dispatch.eval

    def timed_eval(*arrays):  # the fake kernels' zeros computed on the CPU: not host work
        t = time.perf_counter()
        plain_eval(*arrays)
        in_eval[0] += time.perf_counter() - t

    dispatch.eval = timed_eval
    plain_drain = dispatch.drain

    def timed_drain(*a, **k):  # the main thread waiting for the dispatcher's evaluations
        t = time.perf_counter()
        plain_drain(*a, **k)
        in_eval[0] += time.perf_counter() - t

    if args.dispatcher:
        dispatch.drain = timed_drain
    y = mx.array([[1]])
    less = []
    for i in range(3 + args.steps):
        split.on = i >= 3
        in_eval[0] = 0.0
        t = time.perf_counter()
        logits = model(y, cache=cache)
        less.append(time.perf_counter() - t - in_eval[0])
        y = mx.argmax(logits[:, -1], axis=-1)[:, None]
        mx.eval(y)
    print(f"graph building less evaluations: {1e3 * float(np.median(less[3:])):.2f} ms/token "
          f"({args.layers} layers, {args.context} tokens, zero kernels)")
    print("\n".join(split.report(args.steps, args.layers) + split.replay_alone()))
    cache.close()


if __name__ == "__main__":
    main()
