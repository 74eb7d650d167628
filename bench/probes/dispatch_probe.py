"""The dispatcher thread against the main thread's hand-offs, on one cache (issue 24).

Builds the Llama-3-8B-shaped model and one tiered cache at --context (as decode_speed does),
times ``KVCache`` once for reference, then decodes in interleaved rounds, one mode per round:

- ``main``: every hand-off (``mx.async_eval`` every TIERED_ASYNC_EVERY layers) on the main
  thread, Python's default GIL switch interval (the code before tiered.runtime.dispatch);
- ``thread<k>[/<ms>]``: the dispatcher thread hands the graph over every k layers
  (tiered.runtime.dispatch), Python's GIL switch interval <ms> (default
  tiered.runtime.dispatch.SWITCH_INTERVAL_S);
- a suffix ``+native`` / ``+compiled``: a decode token's append takes the native in-place
  kernel (tiered.step.native_append) or the compiled MLX function;
- a suffix ``+nk`` / ``+mk``: custom kernels launch as native programs
  (tiered.metal.ptx_cache.NativeKernel) or through MLX's launch;
- a suffix ``+nd`` / ``+pd``: the dispatcher thread in C++ (metal/native_dispatch.cpp; Python's
  default GIL switch interval) or in Python.

Rounds alternate so that drift of the machine falls on every mode alike. Per mode: the median
ms/token over its rounds' steps, and how much of a step the model call (graph building, with
the hand-offs on the main thread) took.

    python3 bench/probes/dispatch_probe.py --model llama3-8b --context 131072
    python3 bench/probes/dispatch_probe.py --context 32768 --modes thread2+native thread2+compiled
    python3 bench/probes/dispatch_probe.py --context 32768 --modes thread2+native+nk thread2+native+mk
    python3 bench/probes/dispatch_probe.py --context 131072 --attention realistic \
        --fits-from results/decode_speed_gpu_llama3-8b_realistic.json --modes ...
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
import numpy as np
from decode_setup import build_model, kv_caches, seed_kv, tiered_caches
from million import decode_step

from tiered import TieredCache
from tiered.metal import ptx_cache
from tiered.runtime import dispatch
from tiered.step import device_step, native_append


def steps(model, cache, y, n):
    """n greedy steps (million.decode_step): the new y, each step's wall time and its model
    call's."""
    total, call = [], []
    for _ in range(n):
        y = decode_step(model, cache, y, total, call, [])
    return y, total, call


def set_mode(mode: str, cache=()) -> None:
    mode, *suffixes = mode.split("+")
    d = dispatch.DISPATCHER
    native_worker = "nd" in suffixes
    for append in suffixes:
        if append in ("nk", "mk"):
            ptx_cache.NATIVE = append == "nk"
            continue
        if append in ("nd", "pd"):
            dispatch.NATIVE = native_worker
            d._native_checked, d._native = False, None  # chosen again at the next submit
            continue
        native_append.ENABLED = append == "native"
        for c in cache:
            if isinstance(c, TieredCache) and c.compressed is not None:
                c.compressed._native = None  # decided again at the next append
    if mode == "main":
        dispatch._enabled = False
        device_step.ASYNC_EVERY = 4
        sys.setswitchinterval(0.005)
    else:  # thread<k>[/<switch interval in ms>]
        dispatch._enabled = True
        k, _, sw = mode.removeprefix("thread").partition("/")
        device_step.DISPATCH_EVERY = int(k)
        if native_worker:  # the C++ worker takes no GIL: the default interval
            sys.setswitchinterval(float(sw) / 1e3 if sw else 0.005)
        else:
            sys.setswitchinterval(float(sw) / 1e3 if sw else dispatch.SWITCH_INTERVAL_S)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--budget", type=float, default=0.125)
    p.add_argument("--modes", nargs="+", default=["main", "thread4", "thread2", "thread1"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=70)
    p.add_argument("--no-kv", action="store_true")
    p.add_argument("--attention", default="flat", choices=["flat", "realistic"],
                   help="as decode_speed.py: realistic keys (selections as the embedded model's)")
    p.add_argument("--fits-from", default=None, metavar="JSON",
                   help="realistic: the keys' fits of an earlier decode_speed.py result")
    args = p.parse_args(argv)
    if any(x in m for m in args.modes for x in ("+native", "+nk", "+nd")):
        os.environ["TIERED_NATIVE"] = "1"  # the launcher is opt-in (tiered.metal.native)
    model, tok = build_model(args.model, mx.float16)
    seed = seed_kv(model, tok, 2048)
    options = dict(calibration_tokens=2048)
    wl = None
    if args.attention == "realistic":
        from attention_workload import RealisticKeys, query_scales
        from decode_speed import earlier_fits

        fitted = earlier_fits(args.fits_from, args.context, args.budget) if args.fits_from else None
        wl = RealisticKeys(model, seed, args.context, args.budget, options,
                           steps=args.warmup + args.steps,
                           scales=query_scales(model, seed), fitted=fitted)
        print(f"realistic keys {'taken from ' + args.fits_from if fitted else 'fitted'}",
              flush=True)
    y = mx.array([[1]])
    if not args.no_kv:
        cache = kv_caches(seed, args.context, workload=wl)
        _, total, _ = steps(model, cache, y, 5 + args.steps)
        print(f"KVCache: {1e3 * np.median(total[5:]):.1f} ms/token", flush=True)
        del cache
        mx.clear_cache()
    t = time.perf_counter()
    cache = tiered_caches(model, seed, args.context, args.budget, options, wl)
    print(f"tiered cache built in {time.perf_counter() - t:.1f} s; shared stream: "
          f"{dispatch.on_shared_stream()}", flush=True)
    set_mode("main")
    y, total, _ = steps(model, cache, y, args.warmup)
    print(f"warm-up: {args.warmup} steps, last {1e3 * total[-1]:.1f} ms", flush=True)
    got = {m: ([], []) for m in args.modes}
    d = dispatch.DISPATCHER
    for r in range(args.rounds):
        for m in args.modes:
            set_mode(m, cache)
            y, _, _ = steps(model, cache, y, 2)
            busy, wait = d.busy_s, d.wait_s
            y, total, call = steps(model, cache, y, args.steps)
            got[m][0].extend(total)
            got[m][1].extend(call)
            native = sum(bool(getattr(c.compressed, "_native", False)) for c in cache
                         if isinstance(c, TieredCache) and c.compressed is not None)
            print(f"round {r} {m:<9} {1e3 * np.median(total):6.1f} ms/token "
                  f"(model call {1e3 * np.median(call):.1f}; per token: dispatcher busy "
                  f"{1e3 * (d.busy_s - busy) / args.steps:.1f}, main thread waiting for it "
                  f"{1e3 * (d.wait_s - wait) / args.steps:.1f}; native appends in {native} "
                  "layers)", flush=True)
    print("\nmode      ms/token  model call  slowest/median", flush=True)
    for m, (total, call) in got.items():
        med = np.median(total)
        print(f"{m:<8} {1e3 * med:9.1f} {1e3 * np.median(call):11.1f} "
              f"{max(total) / med:14.2f}x", flush=True)
    cache.close()


if __name__ == "__main__":
    main()
