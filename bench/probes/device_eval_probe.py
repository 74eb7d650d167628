"""What MLX's hand-off to the GPU costs (issue 24): host microseconds per queued operation, and
where a tiered decode step's evaluations wait.

1. Encode cost: a chain of --ops operations on a tiny array (MLX ops, then a custom kernel),
   timed as Python building the graph, ``mx.async_eval`` returning, and the final wait.
2. A Llama-3-8B-shaped model at --context tokens: every ``mx.async_eval`` / ``mx.eval`` call of
   --steps tiered decode steps, timed one by one with its caller, and the Python between calls.

    python bench/probes/device_eval_probe.py --model llama3-8b --context 131072
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
import numpy as np
from decode_setup import build_model, device_profile_args, seed_kv, tiered_caches
from decode_speed import time_decode

_ADD = r"""
    const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < a_shape[0] * a_shape[1]) b[i] = a[i] + 1.0f;
"""


def encode_cost(n: int):
    x = mx.zeros((8, 128))
    mx.eval(x)
    kern = mx.fast.cuda_kernel(name="probe_add", input_names=["a"], output_names=["b"],
                               source=_ADD) if mx.cuda.is_available() else None
    ops = {"mx add": lambda y: y + 1.0}
    if kern is not None:
        ops["custom kernel"] = lambda y: kern(
            inputs=[y], output_shapes=[y.shape], output_dtypes=[y.dtype], grid=(1024, 1, 1),
            threadgroup=(256, 1, 1))[0]
    for name, op in ops.items():
        for _ in range(2):  # the first pass compiles
            t0 = time.perf_counter()
            y = x
            for _ in range(n):
                y = op(y)
            t1 = time.perf_counter()
            mx.async_eval(y)
            t2 = time.perf_counter()
            mx.eval(y)
            t3 = time.perf_counter()
        us = 1e6 / n
        print(f"{name}: {n} ops; build {us * (t1 - t0):.2f} us/op, async_eval "
              f"{us * (t2 - t1):.2f} us/op, then waiting {us * (t3 - t2):.2f} us/op", flush=True)


class EvalTrace:
    """Every mx.async_eval / mx.eval call: (kind, caller, start, seconds)."""

    def __init__(self):
        self.calls: list = []

    def __enter__(self):
        self._orig = mx.async_eval, mx.eval

        def wrap(fn, kind):
            def timed(*a, **k):
                f = sys._getframe(1)
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self.calls.append((kind, f"{f.f_code.co_filename.split('/')[-1]}:"
                                       f"{f.f_code.co_name}:{f.f_lineno}", t0,
                                       time.perf_counter() - t0))
            return timed

        mx.async_eval, mx.eval = wrap(self._orig[0], "async_eval"), wrap(self._orig[1], "eval")
        return self

    def __exit__(self, *exc):
        mx.async_eval, mx.eval = self._orig


def trace_steps(model, cache, steps: int):
    y = mx.array([[1]])
    for s in range(steps):
        with EvalTrace() as tr:
            t0 = time.perf_counter()
            y = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)[:, None]
            mx.eval(y)
            wall = time.perf_counter() - t0
        by = collections.defaultdict(lambda: [0, 0.0, 0.0])
        for kind, site, _, sec in tr.calls:
            b = by[(kind, site)]
            b[0] += 1
            b[1] += sec
            b[2] = max(b[2], sec)
        inside = sum(c[3] for c in tr.calls)
        print(f"step {s}: {1e3 * wall:.1f} ms wall, {len(tr.calls)} eval calls taking "
              f"{1e3 * inside:.1f} ms, Python outside them {1e3 * (wall - inside):.1f} ms")
        for (kind, site), (cnt, tot, mx_) in sorted(by.items(), key=lambda kv: -kv[1][1]):
            print(f"    {kind:10s} {cnt:3d} calls {1e3 * tot:7.2f} ms (max {1e3 * mx_:6.2f})  {site}")
        longest = sorted(tr.calls, key=lambda c: -c[3])[:6]
        print("    longest: " + ", ".join(f"#{tr.calls.index(c)} {1e3 * c[3]:.2f} ms {c[1]}"
                                         for c in longest), flush=True)


def main():
    ap = argparse.ArgumentParser()
    device_profile_args(ap, 3)
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--every", type=int, nargs="*", default=[],
                    help="also time async_eval every k layers (0: only at the token's end)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="decode steps before timing (past the recent ring: tokens leave it)")
    args = ap.parse_args()
    encode_cost(args.ops)
    model, _ = build_model(args.model, mx.float16)
    seed = seed_kv(model, None, 2048)
    cache = tiered_caches(model, seed, args.context, args.budget, dict(calibration_tokens=2048))
    ms, _, _ = time_decode(model, cache, 5, args.warmup)
    print(f"tiered: {ms:.2f} ms/token (median of 5)")
    from tiered.step import device_step
    for every in args.every:  # layers per hand-off to the device, same cache, back to back
        device_step.ASYNC_EVERY = every
        ms, _, _ = time_decode(model, cache, 8, 2)
        print(f"tiered, async_eval every {every} layers: {ms:.2f} ms/token (median of 8)",
              flush=True)
    device_step.ASYNC_EVERY = 1
    trace_steps(model, cache, args.steps)
    cache.close()


if __name__ == "__main__":
    main()
