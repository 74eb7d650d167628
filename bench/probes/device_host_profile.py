"""Host side of a device decode step (issue 24): how long Python takes to queue a token's
graph, how long the eval then takes, and which Python functions the queuing spends on
(cProfile), on a Llama-3-8B-shaped model at --context tokens.

    python bench/probes/device_host_profile.py --model llama3-8b-2l --context 131072
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
import numpy as np
from decode_setup import build_model, device_profile_args, kv_caches, seed_kv, tiered_caches
from decode_speed import time_decode


def split_times(model, cache, steps):
    """Median (queue ms, eval ms) per token: building the forward graph, then evaluating it."""
    y = mx.array([[1]])
    q, e = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(y, cache=cache)
        y = mx.argmax(logits[:, -1], axis=-1)[:, None]
        t1 = time.perf_counter()
        mx.eval(y)
        t2 = time.perf_counter()
        q.append(t1 - t0)
        e.append(t2 - t1)
    return 1e3 * float(np.median(q)), 1e3 * float(np.median(e))


def graph_ops(model, cache, path="/tmp/step.dot"):
    """Primitives in one token's graph, by name (each one is dispatched by MLX at eval)."""
    from tiered.step import device_step
    was = device_step.ASYNC_EVERY, device_step.DISPATCH_EVERY
    device_step.ASYNC_EVERY = device_step.DISPATCH_EVERY = 0  # the whole token unevaluated
    try:
        y = mx.argmax(model(mx.array([[1]]), cache=cache)[:, -1], axis=-1)
        mx.export_to_dot(path, y)
        mx.eval(y)
    finally:
        device_step.ASYNC_EVERY, device_step.DISPATCH_EVERY = was
    return dot_ops(path)


def dot_ops(path: str):
    """Primitives by name in a graph written by ``mx.export_to_dot``."""
    import collections
    import re
    return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', open(path).read()))


def print_ops(name, ops, layers):
    total = sum(ops.values())
    print(f"{name}: {total} primitives per token, {total / layers:.1f} per layer; by name: "
          + ", ".join(f"{k} {v}" for k, v in ops.most_common()), flush=True)


def main():
    ap = argparse.ArgumentParser()
    device_profile_args(ap, 10)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--sort", default="tottime", help="pstats key (tottime, cumulative)")
    ap.add_argument("--dump", default="", help="also write the cProfile stats to this file")
    args = ap.parse_args()
    model, _ = build_model(args.model, mx.float16)
    seed = seed_kv(model, None, 2048)
    kv = kv_caches(seed, args.context)
    time_decode(model, kv, 3, 2)
    print("KVCache: queue %.2f ms, eval %.2f ms" % split_times(model, kv, args.steps))
    layers = len(model.layers)
    print_ops("KVCache", graph_ops(model, kv), layers)
    del kv
    cache = tiered_caches(model, seed, args.context, args.budget, dict(calibration_tokens=2048))
    from tiered.step import device_step
    for _ in range(3):
        print_ops("tiered", graph_ops(model, cache), layers)
    for flag in (1, 0, 1):
        device_step.ASYNC_EVERY = flag
        ms, _, _ = time_decode(model, cache, 5, 3)
        print(f"tiered (async_eval per layer: {flag}): {ms:.2f} ms/token; queue %.2f ms, "
              "eval %.2f ms" % split_times(model, cache, args.steps), flush=True)
    from call_timers import CallTimers
    y = mx.array([[1]])
    with CallTimers() as timers:
        for _ in range(args.steps):
            y = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)[:, None]
            mx.eval(y)
    timers.report(per=args.steps, top=args.top)
    prof = cProfile.Profile()
    y = mx.array([[1]])
    prof.enable()
    for _ in range(args.steps):
        y = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)[:, None]
        mx.eval(y)
    prof.disable()
    if args.dump:
        prof.dump_stats(args.dump)
    st = pstats.Stats(prof)
    st.sort_stats(args.sort).print_stats(args.top)
    cache.close()


if __name__ == "__main__":
    main()
