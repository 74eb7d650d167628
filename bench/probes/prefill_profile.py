"""Where a long prefill's chunks go on an accelerator (issue 24: 1M-token prefill >= 20k tok/s).

Builds the cache as bench/million.py does (budget 0.125, values only on the host, block-wise
prefill past --prefill-window), prefills --warm tokens of the document (past the compression),
then, at the steady state:

- the wall time of each of --chunks chunks, split by whether the chunk grew the host pages
  (a new host block per layer) or not;
- the GPU kernels of --kernel-chunks chunks (PyTorch's CUPTI profiler): kernels per chunk,
  their summed time, the time the GPU is busy, and the kernels by total time;
- the floor for the same tokens: the model's body over one chunk with a fresh mlx-lm cache
  (the weights' GEMMs and attention within the chunk, nothing of tiered's).

Each --chunk size gets its own cache. --marks DIR touches DIR/chunks.go when the timed chunks
start (bench/probes/spy_phases.sh attaches py-spy then).

    python3 bench/probes/prefill_profile.py --model llama3-8b \
        --tokens-file ../.device/million_tokens.npz
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from device_kernel_profile import busy, cuda_kernels
from call_timers import CallTimers
from million import build_model

import tiered
from tiered import host_tier
from tiered.prefill import prefill


def floor_ms(model, ids, reps: int = 3) -> float:
    """One chunk through the model's body with a fresh mlx-lm cache, median of reps."""
    from mlx_lm.models.cache import make_prompt_cache

    body = model.model
    x = mx.array(ids)[None]
    times = []
    for _ in range(reps + 1):
        c = make_prompt_cache(model)
        t = time.perf_counter()
        mx.eval(body(x, cache=c))
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times[1:]))


def graph_ops(model, cache, ids, path="/tmp/chunk.dot"):
    """Prints the primitives of one chunk's graph by name (MLX dispatches each one)."""
    from device_host_profile import dot_ops

    body = model.model
    outs = [body(mx.array(ids)[None], cache=cache)]
    for c in cache:  # what lazy_arrays() returns, without its flush (that reads the door)
        outs += c.pending_device_work()
        if c.compressed is not None:
            outs += [a for _, a in tree_flatten(c.compressed.state()) if isinstance(a, mx.array)]
    mx.export_to_dot(path, *outs)
    mx.eval(outs)
    mx.eval([c.lazy_arrays() for c in cache])
    ops = dot_ops(path)
    print(f"  one chunk's graph: {sum(ops.values())} primitives; by name: "
          + ", ".join(f"{k} {v}" for k, v in ops.most_common()), flush=True)


# --timers: host wall time per chunk in these calls (inclusive), split as the chunk times are
TIMED = {"mx.eval", "mx.async_eval", "tiered.cpu.host_tensor.HostTensor.grow",
         "tiered.cpu.block_alloc.block_ahead", "tiered.cpu.block_alloc.alloc_block",
         "tiered.runtime.uva.advise_host", "tiered.step.device_decode.DeviceTables.addrs",
         "tiered.step.device_decode.DeviceTables.pages", "tiered.prefill._finish",
         "tiered.runtime.dispatch.Dispatcher.wait_handed",
         "tiered.runtime.dispatch.Dispatcher.drain"}


def _print_timers(split):
    keys = sorted({k for rows in split.values() for r in rows for k in r})
    for grew, rows in split.items():
        if rows:
            cells = ", ".join(f"{k.split('.', 2)[-1]} {np.mean([r.get(k, 0) for r in rows]):.1f}"
                              for k in keys)
            print(f"  host ms per chunk that {'grew' if grew else 'did not grow'} the pages "
                  f"(mean of {len(rows)}): {cells}", flush=True)


def _window(model, cache, part, chunk) -> tuple[float, dict]:
    """ms per chunk over ``part`` and every call site's inclusive ms per chunk."""
    n = len(part) // chunk
    with CallTimers() as timers:
        t = time.perf_counter()
        prefill(model, cache, part, chunk=chunk)
        ms = 1e3 * (time.perf_counter() - t) / n
    return ms, {k: 1e3 * v / n for k, v in timers.total.items()}


def compare_windows(model, cache, ids, at: int, chunk: int, args) -> int:
    """--compare-at: every call site timed over --chunks chunks here and again from
    --compare-at tokens on (untimed prefill in between); the sites whose time per chunk grew
    the most. The timers slow both windows alike."""
    n = args.chunks * chunk
    ms_a, a = _window(model, cache, ids[at: at + n], chunk)
    t = time.perf_counter()
    prefill(model, cache, ids[at + n: args.compare_at], chunk=chunk)
    print(f"  (untimed prefill to {args.compare_at} tokens: {time.perf_counter() - t:.1f} s)",
          flush=True)
    ms_b, b = _window(model, cache, ids[args.compare_at: args.compare_at + n], chunk)
    print(f"  all call sites timed: {ms_a:.1f} ms per chunk at {at} tokens, {ms_b:.1f} at "
          f"{args.compare_at}; the sites that grew most (ms per chunk, inclusive):", flush=True)
    for k in sorted(set(a) | set(b), key=lambda k: a.get(k, 0) - b.get(k, 0))[: args.top]:
        print(f"  {a.get(k, 0):8.2f} -> {b.get(k, 0):8.2f}  {k}", flush=True)
    return args.compare_at + n


def run(model, ids, chunk, args):
    cache = tiered.TieredCache.for_model(
        model, gpu_budget=args.budget, host_budget=args.host_budget, disk_dir=args.disk_dir,
        host_dtype="float16", host_keys=False, prefill_window=args.prefill_window,
        anchor_tokens=chunk)
    t = time.perf_counter()
    warm = ids[: args.warm]
    ends = [t]
    with CallTimers() if args.warm_timers else contextlib.nullcontext() as wt:
        prefill(model, cache, warm, chunk=chunk,
                on_chunk=lambda done: ends.append(time.perf_counter()))
    print(f"chunk {chunk}: {len(warm)} warm-up tokens in {time.perf_counter() - t:.1f} s "
          "(compiles and the compression included)", flush=True)
    if wt is not None:
        print("  warm-up chunks (s): " + " ".join(f"{b - a:.2f}" for a, b in zip(ends, ends[1:])))
        print("  warm-up call sites, all timed (inclusive s):")
        for k, v in sorted(wt.total.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {v:8.2f} s {wt.calls[k]:7d}x  {k}", flush=True)
    at = args.warm
    if args.graph:
        graph_ops(model, cache, ids[at: at + chunk])
        at += chunk
    if args.marks:
        os.makedirs(args.marks, exist_ok=True)
        open(os.path.join(args.marks, "chunks.go"), "w").close()
    timers = CallTimers(only=TIMED) if args.timers else None
    snap = (lambda: dict(timers.total)) if timers else dict
    marks = [(time.perf_counter(), cache.tier_bytes()["host"], snap())]
    with timers or contextlib.nullcontext():
        prefill(model, cache, ids[at: at + args.chunks * chunk], chunk=chunk,
                on_chunk=lambda done: marks.append((time.perf_counter(),
                                                    cache.tier_bytes()["host"], snap())))
    at += args.chunks * chunk
    grew, flat, split = [], [], {True: [], False: []}
    for (t0, h0, s0), (t1, h1, s1) in zip(marks, marks[1:]):
        (grew if h1 > h0 else flat).append(1e3 * (t1 - t0))
        split[h1 > h0].append({k: 1e3 * (v - s0.get(k, 0.0)) for k, v in s1.items()})
    mean = (sum(grew) + sum(flat)) / max(1, len(grew) + len(flat))
    for name, xs in (("grew the host pages", grew), ("did not", flat)):
        if xs:
            print(f"  {len(xs)} chunks that {name}: median {np.median(xs):.1f} ms "
                  f"(min {min(xs):.1f}, max {max(xs):.1f})", flush=True)
    print(f"  mean {mean:.1f} ms per chunk = {1e3 * chunk / mean:,.0f} tok/s", flush=True)
    if timers:
        _print_timers(split)
    if args.compare_at:
        at = compare_windows(model, cache, ids, at, chunk, args)
    if args.kernel_chunks:
        spans = []
        part = ids[at: at + args.kernel_chunks * chunk]
        kern = cuda_kernels(lambda: prefill(model, cache, part, chunk=chunk), spans)
        n = args.kernel_chunks
        print(f"  kernels: {sum(c for c, _ in kern.values()) / n:.0f} per chunk, "
              f"{sum(us for _, us in kern.values()) / n / 1e3:.1f} ms summed, "
              f"{busy(spans) / n / 1e3:.1f} ms with the GPU busy", flush=True)
        for k, (c, us) in sorted(kern.items(), key=lambda kv: -kv[1][1])[: args.top]:
            print(f"  {us / n / 1e3:8.2f} ms {c / n:7.1f}x  {k}")
    print(f"  floor: the body over one chunk with a fresh mlx-lm cache "
          f"{floor_ms(model, ids[:chunk]):.1f} ms", flush=True)
    cache.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama3-8b", choices=["llama3-8b", "llama3-8b-2l"])
    p.add_argument("--tokens-file", required=True, help="bench/million.py --write-tokens output")
    p.add_argument("--chunk", type=int, nargs="+", default=[2048])
    p.add_argument("--warm", type=int, default=24576, help="tokens before the timed chunks")
    p.add_argument("--chunks", type=int, default=8, help="timed chunks")
    p.add_argument("--kernel-chunks", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--budget", type=float, default=0.125)
    p.add_argument("--host-budget", default="80GB")
    p.add_argument("--disk-dir", default="/tmp/pages")
    p.add_argument("--prefill-window", type=int, default=16384)
    p.add_argument("--pages-per-block", type=int, default=None,
                   help="host pages per allocated block, at most (default: tiered's)")
    p.add_argument("--graph", action="store_true",
                   help="print one chunk's primitives by name (before the timed chunks)")
    p.add_argument("--marks", default=None)
    p.add_argument("--compare-at", type=int, default=None,
                   help="time every call site over --chunks chunks after the warm-up and "
                        "again from this many tokens on; print the sites that grew")
    p.add_argument("--warm-timers", action="store_true",
                   help="time every call site over the warm-up (compression and first uses)")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                   help="set a module attribute first, e.g. a switch under test")
    p.add_argument("--timers", action="store_true",
                   help="host time in the allocation, advice, evaluation calls per chunk")
    args = p.parse_args(argv)
    for s_ in args.set:
        print(f"set {common.set_attribute(s_)}", flush=True)
    if args.pages_per_block:
        host_tier.MAX_PAGES_PER_BLOCK = args.pages_per_block
    model, _ = build_model(args.model, None, tokenizer=False)
    vocab = model.args.vocab_size  # the 2-layer slice's is 4096 (ids past it crash MLX)
    ids = [i % vocab for i in np.load(args.tokens_file)["ids"].tolist()]
    need = (max(args.warm, args.compare_at or 0)
            + (2 * args.chunks + args.kernel_chunks + 1) * max(args.chunk))
    if need > len(ids):
        p.error(f"the document has {len(ids)} tokens; these settings need {need}")
    print(f"model {args.model}; host blocks of at most {host_tier.MAX_PAGES_PER_BLOCK} pages",
          flush=True)
    for chunk in args.chunk:
        run(model, ids, chunk, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
