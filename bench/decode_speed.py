"""Decode speed at long contexts: mlx-lm KVCache, QuantizedKVCache (8-bit), the streaming-offload
baseline (bench/streaming_cache.py: the whole cache in host memory, uploaded every step) and
TieredCache.

All methods in one run, on the same model and backend. Long caches are built from real prefill
keys/values repeated: the model prefills ``--seed-tokens`` tokens (pydoc_data text for the
embedded model; random token ids for random-weight models), and each layer's K/V are tiled up
to the context length (RoPE positions repeat, which changes nothing for timing). Each method
then decodes ``--warmup`` steps (the first one compresses the tiered cache; its time is reported
apart) and ``--steps`` timed steps; the median ms/token is reported.

Bytes read per step are counted from the layout (attention state only, and the model weights
apart), and set against the machine's measured copy bandwidth; the floor column puts the same
bytes at the measured rates (device bytes and weights at the copy bandwidth; tiered's host bytes
at the read rate of the device path's own chunk gather from pinned host pages, measured here by
bench/probes/host_read_rate.py on CUDA, else at the host-to-device copy rate; the streaming
baseline's at the copy rate). "graph ms": the host time to build a token's graph (model call and
argmax, before evaluation), median over the timed steps.

``--attention realistic`` replaces the tiled keys by keys made so that tiered's tau selections
and resident hit rates follow what the embedded model shows on real text
(bench/probes/attention_workload.py, bench/attention_profile_embedded.json); each tiered run then
prints its selections per layer against the profile's.

    python bench/decode_speed.py                                  # embedded model, CPU
    python bench/decode_speed.py --model llama3-8b --contexts 4096 16384 65536 131072
    python bench/decode_speed.py --model llama3-8b-2l --contexts 16384 --methods tiered \
        --budgets 0.125 --attention realistic --steps 20 --warmup 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "probes"))  # helpers and probes

import common  # noqa: F401  (tiered before mlx)
from common import RESULTS, machine, write_results

import mlx.core as mx
import numpy as np
from attention_workload import RealisticKeys, query_scales, stats_summary
from decode_report import phase_table, plot, print_selection, selection_table, summary_md
from host_read_rate import host_read_rate
from streaming_cache import StreamingCache, host_copy_rate
from decode_setup import build_model, kv_caches, memory_bandwidth, seed_kv, tiered_caches

import tiered

def reset_counters(cache):
    """Drop the scheduler timings and step phases of the warm-up steps (the first compresses)."""
    if isinstance(cache, tiered.TieredCacheList):
        cache.scheduler.reset_timings()
        for c in cache:
            if hasattr(c, "stats"):
                c.stats.phase_s.clear()


def time_decode(model, cache, steps: int, warmup: int, loop: str = "plain", build_times=None,
                split=None):
    """(median ms/token, first-step seconds, all step times). Counters cover the timed steps.

    ``loop="plain"``: each token's graph is built, then evaluated, then the next one built;
    ``build_times`` (a list) gets each step's host time to build its graph: from the start of
    ``model(y)`` until the argmax of the logits is built, before ``mx.eval``.
    ``loop="generate"``: mlx-lm's own ``generate_step`` with greedy sampling, which builds
    token t + 1's graph while the device runs token t (one token ahead); a step's time is
    the time between two tokens coming out of it, as ``mlx_lm.generate`` users see it.
    ``split``: a bench/probes/host_split.py HostSplit, counting the timed steps' host time."""
    if loop == "generate":
        return _time_generate(model, cache, steps, warmup)
    y = mx.array([[1]])
    times = []
    for i in range(warmup + steps):
        if i == warmup:
            reset_counters(cache)
        if split is not None:
            split.on = i >= warmup
        t = time.perf_counter()
        logits = model(y, cache=cache)
        y = mx.argmax(logits[:, -1], axis=-1)[:, None]
        built = time.perf_counter()
        mx.eval(y)
        times.append(time.perf_counter() - t)
        if build_times is not None:
            build_times.append(built - t)
    return 1e3 * float(np.median(times[warmup:])), times[0], times


def _time_generate(model, cache, steps: int, warmup: int):
    from mlx_lm.generate import generate_step

    gen = generate_step(mx.array([1]), model, prompt_cache=cache, max_tokens=warmup + steps,
                        sampler=lambda logprobs: mx.argmax(logprobs, axis=-1))
    times = []
    t = time.perf_counter()
    for i, _ in enumerate(gen):
        now = time.perf_counter()
        times.append(now - t)
        t = now
        if i + 1 == warmup:
            reset_counters(cache)
    if len(times) != warmup + steps:
        raise RuntimeError(f"generate_step gave {len(times)} tokens, expected {warmup + steps}")
    return 1e3 * float(np.median(times[warmup:])), times[0], times


def attention_bytes(method: str, cache, n: int, geo) -> dict:
    """Bytes one decode step reads for attention (whole model), by tier."""
    L, H, Hq, d, b = geo.layers, geo.kv_heads, geo.q_heads, geo.k_dim, geo.dtype_bytes
    if method == "KVCache":
        return {"accelerator": L * H * n * 2 * d * b, "host": 0}
    if method == "streaming":  # every layer's whole cache over the link, then read by SDPA
        return {"accelerator": L * H * n * 2 * d * b, "host": L * H * n * 2 * d * b}
    if method.startswith("QuantizedKVCache"):
        per = d * 8 // 8 + 2 * (d // 64) * b  # 8-bit codes + scales and biases per group of 64
        return {"accelerator": L * H * n * 2 * per, "host": 0}
    acc, host = 0, 0
    for c in cache:
        layer = c.compressed
        if layer is None:
            continue
        codes = layer.keys.nbytes  # codes (+codebook) read once
        scores = Hq * n * 4 * 3  # exported scores: written, read by selection, read by H2O
        h2o = 0 if layer.heavy is None else H * n * 4 * 2 + H * n  # accumulator r/w + flags
        resident = layer.res_k.nbytes + layer.res_v.nbytes
        per_row = (d * (2 if c.config.rescore == "exact" else 1)) * 2  # fp16 host rows
        if layer.spill_k is not None and layer.spill_moves:  # lookahead: only moved rows
            acc += layer.spill_k.nbytes + layer.spill_v.nbytes
            host += int(layer.spill_rows_moved / layer.spill_moves * per_row)
        else:
            sel = np.mean([float(x) for x in list(c.stats.selected)[-5:]]) if c.stats.selected else 0
            host += int(sel * H * per_row)
        acc += codes + scores + h2o + resident
    return {"accelerator": int(acc), "host": int(host)}


def earlier_fits(path: str, n: int, budget: float) -> list[dict] | None:
    """The per-layer fits of the tiered run at context n and ``budget`` in an earlier result
    of this script (its JSON), or None where it has none."""
    with open(path) as f:
        records = json.load(f)["records"]
    for r in records:
        if (r.get("context") == n and r.get("method") == f"tiered@{budget}"
                and (r.get("attention") or {}).get("layers")):
            return r["attention"]["layers"]
    return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="embedded", choices=["embedded", "llama3-8b", "llama3-8b-2l"])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    p.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.125])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed-tokens", type=int, default=2048)
    p.add_argument("--calibration-tokens", type=int, default=2048)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--kernels", default=None, choices=["numba", "mlx"],
                   help="force the per-step path (default: numba on the CPU, mlx on GPUs)")
    p.add_argument("--methods", nargs="+", default=["KVCache", "QuantizedKVCache-8", "tiered"],
                   choices=["KVCache", "QuantizedKVCache-8", "streaming", "tiered",
                            "tiered+hostgather", "tiered+lookahead"])
    p.add_argument("--name", default=None)
    p.add_argument("--loop", default="plain", choices=["plain", "generate"],
                   help="plain: build a token, evaluate it, build the next; generate: mlx-lm's "
                   "generate_step (the next token built while the device runs this one)")
    p.add_argument("--host-split", action="store_true",
                   help="tiered: print the host time per layer of each piece of the decode "
                   "step (bench/probes/host_split.py) for the timed steps")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                   help="set a module attribute first, e.g. a switch that is off by default")
    p.add_argument("--attention", default="flat", choices=["flat", "realistic"],
                   help="flat: the seed K/V tiled (random weights: attention is flat, every "
                   "selection hits its cap); realistic: keys made so that selections follow the "
                   "embedded model's measured profile (bench/probes/attention_workload.py)")
    p.add_argument("--profile-layers", type=int, nargs="+", default=None, metavar="L",
                   help="realistic: the profile layers the model's layers follow, in turn "
                   "(default: the profile layer at the same relative depth)")
    p.add_argument("--fits-from", default=None, metavar="JSON",
                   help="realistic: take the keys' fits from an earlier result of this script "
                   "(its tiered runs' attention.layers at the same context and budget) instead "
                   "of fitting again")
    args = p.parse_args(argv)
    for s in args.set:
        print(f"set {common.set_attribute(s)}", flush=True)
    on_cpu = mx.default_device() == mx.cpu
    dtype = mx.float32 if on_cpu else mx.float16
    args.name = args.name or (f"decode_speed_{'cpu' if on_cpu else 'gpu'}_{args.model}"
                              + ("_realistic" if args.attention == "realistic" else ""))
    info = machine()
    model, tok = build_model(args.model, dtype)
    from tiered.planning.geometry import model_geometry

    geo = model_geometry(model, len(model.layers))
    bw = memory_bandwidth()
    weights = sum(v.nbytes for _, v in __import__("mlx.utils").utils.tree_flatten(model.parameters()))
    host_bw = host_copy_rate()
    host_read, host_src, host_detail = host_read_rate(copy_rate=host_bw)
    print(f"model {args.model}: {geo}, weights {weights / 1e9:.2f} GB; copy bandwidth {bw:.0f} GB/s,"
          f" host-to-device {host_bw:.1f} GB/s", flush=True)
    print(f"host reads priced at {host_read:.1f} GB/s: {host_src}", flush=True)
    seed = seed_kv(model, tok, args.seed_tokens)
    scales, workloads = None, {}
    if args.attention == "realistic":
        scales = query_scales(model, seed)
        print("realistic attention: scale x |q| per layer " + " ".join(
            f"{x['scale']:.2f}" for x in scales), flush=True)

    def workload(n, b):
        """The realistic keys at n tokens for budget b (fitted once), or None (flat)."""
        if args.attention != "realistic":
            return None
        if (n, b) not in workloads:
            t = time.perf_counter()
            fitted = earlier_fits(args.fits_from, n, b) if args.fits_from else None
            workloads[(n, b)] = RealisticKeys(model, seed, n, b, options,
                                              steps=args.warmup + args.steps,
                                              profile_layers=args.profile_layers, scales=scales,
                                              fitted=fitted)
            print(f"{n:>7} realistic keys {'taken from ' + args.fits_from if fitted else 'fitted'}"
                  f" for budget {b} in {time.perf_counter() - t:.1f}s", flush=True)
        return workloads[(n, b)]

    options = dict(calibration_tokens=args.calibration_tokens)
    if args.workers:
        options["workers"] = args.workers
    if args.kernels:
        options["kernels"] = args.kernels
    records = []
    for n in args.contexts:
        runs = []
        wb = workload(n, args.budgets[0])  # the baselines' keys (their speed does not need them)
        if "KVCache" in args.methods:
            runs.append(("KVCache", lambda: kv_caches(seed, n, workload=wb)))
        if "streaming" in args.methods:
            runs.append(("streaming", lambda: kv_caches(seed, n, StreamingCache, workload=wb)))
        if "QuantizedKVCache-8" in args.methods:
            runs.append(("QuantizedKVCache-8", lambda: [
                c.to_quantized(group_size=64, bits=8) for c in kv_caches(seed, n, workload=wb)]))
        if "tiered" in args.methods:
            for b in args.budgets:
                runs.append((f"tiered@{b}", lambda b=b: tiered_caches(
                    model, seed, n, b, options, workload(n, b))))
        if "tiered+hostgather" in args.methods:  # the CPU workers gather: a sync per layer
            for b in args.budgets:
                runs.append((f"tiered+hostgather@{b}", lambda b=b: tiered_caches(
                    model, seed, n, b, dict(options, device_gather="off"), workload(n, b))))
        if "tiered+lookahead" in args.methods:
            for b in args.budgets:
                runs.append((f"tiered+lookahead@{b}", lambda b=b: tiered_caches(
                    model, seed, n, b, dict(options, lookahead=True, kernels="mlx"),
                    workload(n, b))))
        for name, make in runs:
            t = time.perf_counter()
            cache = make()
            build_s = time.perf_counter() - t
            if isinstance(cache, tiered.TieredCacheList):
                cache.scheduler.reset_timings()
            builds = []
            split = None
            if args.host_split and isinstance(cache, tiered.TieredCacheList):
                from host_split import HostSplit
                split = HostSplit()
            try:
                ms, first_s, times = time_decode(model, cache, args.steps, args.warmup, args.loop,
                                                 build_times=builds, split=split)
            except RuntimeError as e:  # e.g. a quantized_matmul shape MLX's CUDA lacks
                print(f"{n:>7} {name:<20} failed: {e}", flush=True)
                records.append({"context": n, "method": name, "error": str(e)})
                del cache
                gc.collect()
                continue
            rec = {"context": n, "method": name, "ms_per_token": ms, "first_step_s": first_s,
                   "build_s": build_s, "step_ms": [1e3 * x for x in times],
                   "build_ms_per_token": 1e3 * float(np.median(builds[args.warmup:]))
                   if builds else None, "build_ms": [1e3 * x for x in builds]}
            if isinstance(cache, tiered.TieredCacheList):
                rep = tiered.report_dict(cache)
                rec["bytes_resident"] = rep["bytes"]
                rec["selection"] = rep.get("selection", {})
                rec["scheduler"] = rep.get("scheduler")
                rec["step_phases_ms"] = {k: 1e3 * v / args.steps
                                         for k, v in rep.get("step_phases_s", {}).items()}
                rec["within_budget"] = rep["bytes"]["accelerator"] <= rep.get("budget_bytes", 1 << 62)
                rec["selection_per_layer"] = stats_summary(cache)
                wl = workload(n, float(name.split("@")[1])) if "@" in name else None
                if wl is not None:
                    got = {x["layer"]: x for x in rec["selection_per_layer"]}
                    rec["attention"] = {
                        "workload": "realistic", "profile_context": wl.source_context,
                        "slots": wl.slots, "layers": [
                            dict(x, selected=got.get(x["layer"], {}).get("selected"),
                                 hit=got.get(x["layer"], {}).get("hit")) for x in wl.layers]}
            nb = attention_bytes(name.split("@")[0] if not name.startswith("tiered") else "tiered",
                                 cache, n, geo)
            rec["bytes_per_step"] = nb
            total = nb["accelerator"] + weights
            rec["bandwidth_fraction"] = total / (ms / 1e3) / 1e9 / bw
            rec["attention_floor_ms"] = 1e3 * (nb["accelerator"] + weights) / (bw * 1e9)
            # the same work's floor: device bytes at the copy bandwidth, host bytes at the rate
            # they can be read: tiered's at its chunk gather's (on CUDA; else the copy rate),
            # the streaming baseline's (whole copies) at the host-to-device copy rate
            rec["floor_ms"] = rec["attention_floor_ms"] + 1e3 * nb["host"] / (
                (host_bw if name == "streaming" else host_read) * 1e9)
            records.append(rec)
            sched = rec.get("scheduler") or {}
            print(f"{n:>7} {name:<20} {ms:9.1f} ms/token (first step {first_s:.1f}s, build "
                  f"{build_s:.1f}s) attn bytes {nb['accelerator'] / 1e6:.0f} MB dev + "
                  f"{nb['host'] / 1e6:.1f} MB host, {100 * rec['bandwidth_fraction']:.0f}% of copy "
                  f"bandwidth" + (f", overlap {sched.get('overlap_ratio'):.2f}"
                                  if sched.get("overlap_ratio") is not None else "")
                  + f", slowest step {max(times[args.warmup:]) * 1e3 / ms:.2f}x the median"
                  + (f", graph {rec['build_ms_per_token']:.1f} ms"
                     if rec["build_ms_per_token"] is not None else ""), flush=True)
            print_selection(rec)
            if split is not None:
                split.on = False
                rec["host_split"] = (split.report(args.steps, len(model.layers))
                                     + split.replay_alone())
                print("\n".join(rec["host_split"]), flush=True)
                split.unwrap()
            if isinstance(cache, tiered.TieredCacheList):
                cache.close()
            del cache
            gc.collect()
            mx.clear_cache()
    md = summary_md(records, args, info, geo, dtype, weights, bw, host_bw, host_read, host_src)
    md += phase_table(records, args)
    md += selection_table(records)
    md += f"\n![decode speed]({args.name}.png)\n"
    data = {"machine": info, "args": vars(args), "bandwidth_gbs": bw,
            "host_to_device_gbs": host_bw, "host_read_gbps": host_read,
            "host_read_source": host_src, "host_read_detail": host_detail,
            "attention": args.attention, "query_scales": scales, "weights_bytes": weights,
            "geometry": geo.__dict__, "records": records}
    paths = write_results(args.name, data, md)  # the figures first: a plot failure loses nothing
    try:
        plot(records, args, os.path.join(RESULTS, f"{args.name}.png"))
    except SystemExit as e:  # no matplotlib here: the tables are written, the plot is not
        print(f"no plot: {e}", flush=True)
    print(md)
    print("wrote", *paths)


if __name__ == "__main__":
    sys.exit(main())
