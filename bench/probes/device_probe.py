"""One process, one compression, every measure of the accelerator step (issue 24).

A 128k compression takes ~95 s on an H200, most of a device call's time; the separate
profilers (decode_speed, device_kernel_profile, device_host_profile, decode_rounds) each
compress again. This one compresses once and then, at the steady state (past --warmup steps):

- ms/token of --steps steps, split into queuing the graph and the final wait;
- GPU kernels per token, their summed device time and the time the GPU is busy (PyTorch's
  CUPTI profiler; MLX's CUDA graphs run independent kernels side by side, so the sum
  overstates it);
- the primitives of one token's graph by name (what MLX dispatches one by one);
- then, if --spy FILE is given, writes FILE.go and decodes for --spy-seconds more, for a
  py-spy attached from outside (see bench/probes/decode_rounds.py).

``--kv`` measures ``KVCache`` first the same way (no compression).

    python3 bench/probes/device_probe.py --model llama3-8b --context 131072 --kv
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # tiered before mlx
import mlx.core as mx
import numpy as np
from decode_setup import build_model, kv_caches, queued_steps, seed_kv, tiered_caches
from device_host_profile import graph_ops, print_ops
from device_kernel_profile import busy, profile
from tiered.runtime.dispatch import DISPATCHER


def measure(name, model, cache, args):
    y = mx.array([[1]])
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        y = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)[:, None]
        mx.eval(y)
    print(f"{name}: {args.warmup} warm-up steps in {time.perf_counter() - t0:.1f} s", flush=True)
    for r in range(args.repeats * args.rounds):
        label = set_toggle(args, r % args.rounds) if name != "KVCache" else ""
        d0 = (DISPATCHER.busy_s, DISPATCHER.wait_s)
        y, q, e = queued_steps(model, cache, y, args.steps)
        tot = 1e3 * (np.array(q) + np.array(e))
        print(f"{name}{label}: {np.median(tot):.2f} ms/token (median of {args.steps}; queue "
              f"{1e3 * np.median(q):.2f}, wait {1e3 * np.median(e):.2f}; slowest "
              f"{tot.max() / np.median(tot):.2f}x; dispatcher thread busy "
              f"{1e3 * (DISPATCHER.busy_s - d0[0]) / args.steps:.2f}, main thread waiting for "
              f"it {1e3 * (DISPATCHER.wait_s - d0[1]) / args.steps:.2f}: means)", flush=True)
    if args.spy and name != "KVCache":  # before the kernel profiler: CUPTI stays loaded
        open(args.spy + ".go", "w").close()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < args.spy_seconds:
            y = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)[:, None]
            mx.eval(y)
        time.sleep(2)
    # the kernels of each toggle value in turn (one profile where nothing is toggled)
    values = range(args.rounds) if name != "KVCache" else [None]
    for i in values if args.kernels else []:
        label = set_toggle(args, i) if i is not None else ""
        if label:  # a step at the new value first: what it compiles stays out of the profile
            mx.eval(model(y, cache=cache))
        spans = []
        kern = profile(model, cache, args.kernels, spans)
        if args.spans:
            import json
            tag = label.strip(" []").replace(", ", "_").replace("=", "-")
            with open(f"{args.spans}.{name}{'.' + tag if tag else ''}.json", "w") as f:
                json.dump(spans, f)
        n = sum(c for c, _ in kern.values()) / args.kernels
        t = sum(us for _, us in kern.values()) / args.kernels / 1e3
        print(f"{name}{label}: {n:.0f} kernels/token, {t:.2f} ms kernel time/token summed, "
              f"{busy(spans) / args.kernels / 1e3:.2f} ms with the GPU busy (overlaps "
              f"counted once)", flush=True)
        for k, (c, us) in sorted(kern.items(), key=lambda kv: -kv[1][1])[: args.top]:
            print(f"  {us / args.kernels / 1e3:8.3f} ms {c / args.kernels:6.1f}x  {k}")
    if not args.no_ops:
        print_ops(name, graph_ops(model, cache), len(model.layers))


def set_toggle(args, i: int) -> str:
    """Set every ``--toggle MODULE.ATTR=V1,V2,...`` to its i-th value; the round's label."""
    if not args.toggle:
        return ""
    return " [" + ", ".join(common.set_attribute(f"{path}={values[i]}")
                            for path, values in args.toggle_values) + "]"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b", choices=["llama3-8b-2l", "llama3-8b"])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--budget", type=float, default=0.125)
    ap.add_argument("--warmup", type=int, default=70)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kernels", type=int, default=3, help="steps under the kernel profiler")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--kv", action="store_true")
    ap.add_argument("--no-ops", action="store_true", help="skip counting the graph's primitives")
    ap.add_argument("--spy", default="")
    ap.add_argument("--spy-seconds", type=float, default=12)
    ap.add_argument("--option", action="append", default=[], metavar="NAME=INT",
                    help="a TieredCache.for_model option (integer), e.g. refresh_every=100000")
    ap.add_argument("--spans", default="", help="write the profiled kernels' (start, end, "
                    "name) in microseconds to SPANS.<method>.json")
    ap.add_argument("--toggle", action="append", default=[], metavar="MODULE.ATTR=V1,V2",
                    help="rounds cycle through these values of a module attribute; several "
                    "--toggle step in lockstep (the same number of values each)")
    args = ap.parse_args()
    args.toggle_values = [(t.partition("=")[0], t.partition("=")[2].split(",")) for t in args.toggle]
    counts = {len(v) for _, v in args.toggle_values}
    if len(counts) > 1:
        ap.error(f"every --toggle needs the same number of values, got {sorted(counts)}")
    args.rounds = counts.pop() if counts else 1
    options = dict(calibration_tokens=2048)
    for o in args.option:
        name, _, value = o.partition("=")
        options[name] = int(value)
    model, _ = build_model(args.model, mx.float16)
    seed = seed_kv(model, None, 2048)
    if args.kv:
        kv = kv_caches(seed, args.context)
        measure("KVCache", model, kv, dict_args(args, warmup=5))
        del kv
    cache = tiered_caches(model, seed, args.context, args.budget, options)
    print(f"tiered at {common.run_commit()} {options}: compressed at the first warm-up step",
          flush=True)
    measure("tiered", model, cache, args)
    cache.close()


def dict_args(args, **over):
    out = argparse.Namespace(**vars(args))
    for k, v in over.items():
        setattr(out, k, v)
    return out


if __name__ == "__main__":
    main()
