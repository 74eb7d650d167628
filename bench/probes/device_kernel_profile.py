"""Which GPU kernels one decode step launches, and their device time (issue 24).

MLX has no CUDA profiler of its own; PyTorch's (CUPTI) records every kernel of the process,
MLX's included. Runs --steps decode steps of a Llama-3-8B-shaped model at --context tokens
under the profiler, for KVCache and tiered, and prints per method: kernels per step, summed
kernel time per step, and the kernels by total time.

    python bench/probes/device_kernel_profile.py --model llama3-8b-2l --context 131072
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
from decode_setup import build_model, device_profile_args, kv_caches, seed_kv, tiered_caches
from decode_speed import time_decode


def cuda_kernels(fn, spans: list | None = None):
    """{kernel name: [launches, summed microseconds]} of every CUDA kernel that ``fn()`` runs
    (MLX's included: CUPTI sees the process); ``spans`` (a list) also gets each kernel's
    (start, end, name), times in microseconds."""
    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile

    torch.cuda.init()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
    kern = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            k = kern[ev.name[:90]]
            k[0] += 1
            k[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            if spans is not None:
                spans.append((ev.time_range.start, ev.time_range.end, ev.name[:60]))
    return kern


def busy(spans) -> float:
    """Microseconds covered by the union of (start, end) spans."""
    total, end = 0.0, -float("inf")
    for a, b, *_ in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def print_gaps(spans, steps: int, top: int = 12, least_us: float = 50.0):
    """Where the GPU waited (for the host, mostly): idle gaps of at least ``least_us`` between
    kernels, per step, the longest with the kernels either side."""
    spans = sorted(spans)
    gaps, end, last = [], -float("inf"), None
    for a, b, name in spans:
        if last is not None and a - end >= least_us:
            gaps.append((a - end, last, name))
        if b > end:
            end, last = b, name
    total = sum(g for g, _, _ in gaps)
    print(f"GPU idle in gaps of >= {least_us:.0f} us: {total / steps / 1e3:.2f} ms per step, "
          f"{len(gaps) / steps:.1f} gaps per step", flush=True)
    for g, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"  {g / 1e3:7.3f} ms after {before} | before {after}")


def profile(model, cache, steps: int, spans: list | None = None):
    """:func:`cuda_kernels` of ``steps`` decode steps."""
    def decode():
        y = mx.array([[1]])
        for _ in range(steps):
            y = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)[:, None]
            mx.eval(y)

    return cuda_kernels(decode, spans)


def main():
    ap = argparse.ArgumentParser()
    device_profile_args(ap, 4)
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--methods", nargs="+", default=["KVCache", "tiered"])
    ap.add_argument("--warmup", type=int, default=3,
                    help="decode steps before profiling (70: past the recent ring)")
    ap.add_argument("--no-host-keys", action="store_true",
                    help="values only on the host (approximate rescoring, as million.py runs)")
    args = ap.parse_args()
    model, _ = build_model(args.model, mx.float16)
    seed = seed_kv(model, None, 2048)
    for method in args.methods:
        if method == "KVCache":
            cache = kv_caches(seed, args.context)
        else:
            cache = tiered_caches(model, seed, args.context, args.budget,
                                  dict(calibration_tokens=2048, host_keys=not args.no_host_keys))
        ms, _, _ = time_decode(model, cache, 6, args.warmup)
        spans = []
        kern = profile(model, cache, args.steps, spans)
        n = sum(c for c, _ in kern.values()) / args.steps
        t = sum(us for _, us in kern.values()) / args.steps / 1e3
        print(f"\n== {method} {args.model} {args.context}: {ms:.2f} ms/token wall; "
              f"{n:.0f} kernels/step, {t:.2f} ms kernel time/step, "
              f"{busy(spans) / args.steps / 1e3:.2f} ms with the GPU busy", flush=True)
        print_gaps(spans, args.steps)
        rows = sorted(kern.items(), key=lambda kv: -kv[1][1])[: args.top]
        for name, (c, us) in rows:
            print(f"{us / args.steps / 1e3:8.3f} ms {c / args.steps:6.1f}x  {name}")
        if hasattr(cache, "close"):
            cache.close()
        del cache


if __name__ == "__main__":
    main()
