"""Accelerator kernels against the machine: GB/s vs measured copy bandwidth, and scoring +
selection vs MLX's full-cache scaled_dot_product_attention decode.

Shapes are Llama-3-8B's attention (8 KV heads, 32 query heads, head_dim 128): codebook keys
with g = d/4 groups of 4 dims and c = 256 centroids (uint8 codes), affine 4-bit keys (group
64), fp16 K/V for the SDPA reference. Each kernel is first checked against its plain-MLX
reference on this device; then timed as the median of ``--reps`` launches after warm-up,
cycling through several input sets so that small sizes don't just measure the L2 cache.
Bytes counted: inputs read once plus outputs written once.

Helpers (bench/probes/): kernel_timing.py (the timings, the copy bandwidth, CUPTI device time)
and kernel_breakdown.py (the selection's launches alone, the persistent launch's phases).

    python bench/kernels.py --sizes 16384 131072 1048576     # on the accelerator machine
    python bench/kernels.py --sizes 16384 131072             # CPU backend: MLX references
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "probes"))  # helpers and probes

import common  # noqa: F401  (tiered before mlx)
from common import (RESULTS, figure, finish_axes, machine, md_table, save_figure,
                    write_results)

import mlx.core as mx
from kernel_breakdown import breakdown, passes_only, phase_rows
from kernel_timing import (C, D, G, H, HQ, REP, device_profile, measured_bandwidth, rel_err,
                           rotating, timed, timed_pipelined)

from tiered import metal
from tiered.metal import persistent


def bench_size(n: int, reps: int, bw: float, backend: str, batch: int) -> list[dict]:
    rows = []
    n_sets = max(1, min(8, (400 * 2**20) // (H * n * G + HQ * n * 4)))
    key = mx.random.key(n)
    q = mx.random.normal((HQ, D), key=key) * D**-0.5

    def row(kernel, fn, nbytes=None, check=None, **extra):
        t = timed(fn, reps=reps, warmup=3, batch=batch)
        t1 = timed(fn, reps=reps, warmup=3, batch=1)
        tp = timed_pipelined(fn, reps=reps, warmup=3, batch=batch)
        r = {"kernel": kernel, "n": n, "ms": 1e3 * t, "ms_synced": 1e3 * t1,
             "ms_pipelined": 1e3 * tp, "check": check, **extra}
        prof = device_profile(fn, reps=reps) if backend == "cuda" else None
        if prof is not None:
            r.update(prof)
        if nbytes is not None:
            r.update(gbs=nbytes / t / 1e9, of_copy=nbytes / t / 1e9 / bw,
                     of_copy_pipelined=nbytes / tp / 1e9 / bw)
            if prof is not None:
                r.update(gbs_device=nbytes / prof["device_ms"] / 1e6,
                         of_copy_device=nbytes / prof["device_ms"] / 1e6 / bw)
        rows.append(r)
        return r

    # ---- codebook scores -----------------------------------------------------------------
    codebook = mx.random.normal((H, 1, C, D // G))
    codes_sets = rotating(lambda i: mx.random.randint(0, C, (H, n, G), key=mx.random.key(i))
                          .astype(mx.uint8), n_sets)
    codes = codes_sets()
    check = rel_err(metal.codebook_scores(q, codebook, codes, n, rep=REP),
                    metal.codebook_scores_ops(q, codebook, codes, n, rep=REP))
    half = metal.codebook.LUT_HALF.get(backend, False)
    row(f"codebook scores (g=32, c=256, {'float16' if half else 'float32'} table)",
        lambda: metal.codebook_scores(q, codebook, codes_sets(), n, rep=REP),
        H * n * G + HQ * n * 4, check)
    # Host side of one call (argument checks, launch plan, graph node; nothing evaluated): a
    # floor under 'ms', which the device work does not overlap in these timings.
    build = [codes_sets() for _ in range(8)]
    t0 = time.perf_counter()
    for i in range(8 * reps):
        metal.codebook_scores(q, codebook, build[i % 8], n, rep=REP)
    rows.append({"kernel": "  codebook scores: host time per call (graph build only)", "n": n,
                 "ms": 1e3 * (time.perf_counter() - t0) / (8 * reps), "ms_synced": float("nan"),
                 "check": None})
    if half:
        check32 = rel_err(metal.codebook_scores(q, codebook, codes, n, rep=REP, lut_half=False),
                          metal.codebook_scores_ops(q, codebook, codes, n, rep=REP))
        row("codebook scores (g=32, c=256, float32 table)",
            lambda: metal.codebook_scores(q, codebook, codes_sets(), n, rep=REP, lut_half=False),
            H * n * G + HQ * n * 4, check32)

    # ---- affine scores (4-bit, group 64) ------------------------------------------------
    kf = mx.random.normal((H, n, D)).astype(mx.float16)
    wq, sc, bi = mx.quantize(kf, group_size=64, bits=4)
    mx.eval(wq, sc, bi)
    del kf
    ref = metal.affine_scores_ops(q, wq, sc, bi, n, rep=REP, group_size=64, bits=4)
    for use_kernel in ([True, False] if backend != "cpu" else [False]):
        got = metal.affine_scores(q, wq, sc, bi, n, rep=REP, group_size=64, bits=4,
                                  use_kernel=use_kernel)
        row("affine scores 4-bit" + (" (kernel)" if use_kernel else " (mx.quantized_matmul)"),
            lambda: metal.affine_scores(q, wq, sc, bi, n, rep=REP, group_size=64, bits=4,
                                        use_kernel=use_kernel),
            wq.nbytes + sc.nbytes + bi.nbytes + HQ * n * 4, rel_err(got, ref))
    del wq, sc, bi

    # ---- tau threshold and selection ----------------------------------------------------
    z = metal.codebook_scores(q, codebook, codes, n, rep=REP)
    mx.eval(z)
    m1, s1, th1 = metal.tau_threshold(z, n, 0.9)
    m2, s2, th2 = metal.tau_threshold_ops(z, n, 0.9)
    row("tau threshold (32 heads, 5-pass kernel)", lambda: metal.tau_threshold(z, n, 0.9),
        HQ * n * 4, rel_err(th1, th2))
    exclude = mx.zeros((H, n), mx.bool_)
    mx.eval(exclude)
    one_launch = backend == "cuda" and persistent.plan_grid(n, H, REP) is not None
    row("tau select (threshold + cap 2048)" + (", one persistent launch" if one_launch else ""),
        lambda: metal.tau_select(z, n, exclude, 0.9, 2048, 32), HQ * n * 4)
    if one_launch:
        with passes_only():
            row("tau select (threshold + cap 2048), separate launches",
                lambda: metal.tau_select(z, n, exclude, 0.9, 2048, 32), HQ * n * 4)

    # ---- H2O accumulator update: the decode step's fused pass, against its MLX ops -------
    stats = metal.tau_select(z, n, exclude, 0.9, 2048, 32, with_stats=True)
    acc = mx.random.uniform(shape=(H, n))
    mx.eval(stats.m, stats.s, acc)
    ref = metal.acc_update_ops(acc, z, stats.m, stats.s, n, REP, 0.95)
    for use_kernel in ([True, False] if backend != "cpu" else [False]):
        got = metal.acc_update(acc, z, stats.m, stats.s, n, REP, 0.95, use_kernel=use_kernel)
        row("H2O accumulator update" + (" (kernel, one pass)" if use_kernel else " (MLX ops)"),
            lambda: metal.acc_update(acc, z, stats.m, stats.s, n, REP, 0.95,
                                     use_kernel=use_kernel),
            HQ * n * 4 + 2 * H * n * 4, rel_err(got, ref))

    def fused():
        return persistent.codebook_select(q, codebook, codes_sets(), n, exclude, 0.9, 2048, 32,
                                          rep=REP)[1].sel

    def chain():
        if backend == "cpu":
            zz = metal.codebook_scores(q, codebook, codes_sets(), n, rep=REP)
            return metal.tau_select(zz, n, exclude, 0.9, 2048, 32)
        zz, zmax, _ = metal.codebook.codebook_scores_and_max(q, codebook, codes_sets(), n,
                                                            rep=REP, backend=backend)
        return metal.tau_select(zz, n, exclude, 0.9, 2048, 32, zmax=zmax)

    # ---- the reference: full-cache SDPA decode --------------------------------------------
    kv = mx.random.normal((1, H, n, D)).astype(mx.float16)
    vv = mx.random.normal((1, H, n, D)).astype(mx.float16)
    q16 = mx.random.normal((1, HQ, 1, D)).astype(mx.float16)
    mx.eval(kv, vv, q16)
    sdpa = row("mx.fast.scaled_dot_product_attention (full fp16 cache)",
               lambda: mx.fast.scaled_dot_product_attention(q16, kv, vv, scale=D**-0.5),
               kv.nbytes + vv.nbytes)
    if backend != "cpu":
        breakdown(row, q, codebook, codes, n, exclude, backend)
    one = one_launch and persistent.codebook_select(q, codebook, codes, n, exclude, 0.9, 2048,
                                                    32, rep=REP) is not None
    chains = []
    if one:
        chains.append(row("scores + selection (one persistent launch: codebook_select, cap "
                          "2048)", fused))
        phase_rows(rows, q, codebook, codes, n, exclude, reps)
    if one_launch:
        chains.append(row("scores + selection (codebook kernel + persistent selection, cap "
                          "2048)", chain))
        with passes_only():
            chains.append(row("scores + selection (codebook kernel + separate selection "
                              "launches, cap 2048)", chain))
    else:
        chains.append(row("scores + selection (codebook kernel + selection, cap 2048)", chain))
    for both in chains:
        both["speedup_vs_sdpa"] = sdpa["ms"] / both["ms"]
        both["speedup_vs_sdpa_synced"] = sdpa["ms_synced"] / both["ms_synced"]
        both["speedup_vs_sdpa_pipelined"] = sdpa["ms_pipelined"] / both["ms_pipelined"]
        if "device_ms" in both and "device_ms" in sdpa:
            both["speedup_vs_sdpa_device"] = sdpa["device_ms"] / both["device_ms"]
    del kv, vv
    mx.clear_cache()
    return rows


def _fmt(x, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def versus(r) -> str:
    """Share of the copy bandwidth, or speed-up over SDPA, by queued / pipelined / device time."""
    if "of_copy" in r:
        dev = r.get("of_copy_device")
        return (f"{100 * r['of_copy']:.0f}% / {100 * r['of_copy_pipelined']:.0f}% / "
                + ("n/a" if dev is None else f"{100 * dev:.0f}%"))
    if "speedup_vs_sdpa" in r:
        dev = r.get("speedup_vs_sdpa_device")
        return (f"{r['speedup_vs_sdpa']:.2f}x / {r['speedup_vs_sdpa_pipelined']:.2f}x / "
                + ("n/a" if dev is None else f"{dev:.2f}x") + " vs SDPA")
    return ""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[16384, 131072, 1048576])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8,
                   help="calls queued per evaluation in the throughput timing")
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    backend = metal.accelerator()
    args.name = args.name or f"kernels_{backend}"
    info = machine()
    bws = measured_bandwidth()
    bw = bws["copy"]
    print(f"backend {backend}; copy bandwidth {bw:.0f} GB/s ({bws['copy_how']}; all: "
          + ", ".join(f"{k} {v:.0f}" for k, v in bws["copies"].items())
          + f"); read-only sum {bws['read']:.0f} GB/s", flush=True)
    rows = []
    for n in args.sizes:
        for r in bench_size(n, args.reps, bw, backend, args.batch):
            rows.append(r)
            print(f"{n:>8} {r['kernel']:<62} {r['ms']:9.3f} ms ({r['ms_synced']:.3f} synced, "
                  f"{_fmt(r.get('ms_pipelined'))} pipelined, device {_fmt(r.get('device_ms'))}, "
                  f"{_fmt(r.get('launches'), 1)} launches) {versus(r)}"
                  + (f"  check {r['check']:.1e}" if r.get("check") is not None else ""),
                  flush=True)
    table = [[r["n"], r["kernel"], f"{r['ms']:.3f}",
              "" if math.isnan(r["ms_synced"]) else f"{r['ms_synced']:.3f}",
              _fmt(r.get("ms_pipelined")), _fmt(r.get("device_ms")), _fmt(r.get("launches"), 1),
              f"{r['gbs']:.0f}" if "gbs" in r else "", versus(r),
              "" if r.get("check") is None else f"{r['check']:.1e}"] for r in rows]
    md = (f"# Accelerator kernels\n\n`{info['command']}` on {info['platform']} (backend {backend}, "
          f"{info['device']}), {info['date']}. Copy bandwidth {bw:.0f} GB/s (read + write, "
          f"1 GiB, best of: " + ", ".join(f"{k} {v:.0f}" for k, v in bws["copies"].items())
          + f"); a read-only sum reached {bws['read']:.0f} GB/s. 'ms' is the median time per "
          f"call with {args.batch} calls queued per evaluation, the host building them before "
          f"the device runs them; 'synced' evaluates each call alone (adds a host round trip); "
          f"'pipelined' builds the next {args.batch} calls while the device runs the last ones "
          f"(mx.async_eval, as a decode loop does: about the larger of host and device time); "
          f"'device' is the GPU busy time per call, the summed durations of the kernels, fills "
          f"and copies that CUPTI recorded (torch.profiler), with their count in 'launches'. "
          f"GB/s uses 'ms'; 'of copy bw' gives the share of the copy bandwidth by 'ms', "
          f"'pipelined' and 'device'; speed-ups over SDPA are by the same three. "
          f"Llama-3-8B attention shape: {H} kv / {HQ} query heads, head_dim {D}.\n\n"
          + md_table(["tokens", "kernel", "ms", "ms synced", "ms pipelined", "ms device",
                      "launches", "GB/s", "of copy bw / speed-up (ms, pipelined, device)",
                      "rel. error vs reference"], table))
    split = [[r["n"], r["kernel"].strip(), name, f"{ms:.4f}", _fmt(r["names"].get(name), 1)]
             for r in rows if r.get("launches", 0) > 1 for name, ms in r["name_ms"].items()]
    if split:
        md += ("\n## Device time by launch\n\nFor the rows of more than one launch: device ms "
               "per call of each kernel, fill or copy (CUPTI names, cut at 60 characters), "
               "and how many of it one call runs.\n\n"
               + md_table(["tokens", "row", "launch", "device ms", "per call"], split))
    md += f"\n![kernels]({args.name}.png)\n"
    paths = write_results(args.name, {"machine": info, "backend": backend, "copy_gbs": bw,
                                      "batch": args.batch,
                                      "bandwidth": bws, "rows": rows}, md)
    plot(rows, os.path.join(RESULTS, f"{args.name}.png"), backend)
    print(md)
    print("wrote", *paths)


def plot(rows, path, backend):
    fig, ax = figure(size=(6.5, 4))
    for name in dict.fromkeys(r["kernel"] for r in rows):
        xs, ys = zip(*[(r["n"], r["ms"]) for r in rows if r["kernel"] == name])
        ax.plot(xs, ys, "o-", label=name)
    finish_axes(ax, xlabel="tokens", ylabel="ms (median)", title=f"kernels on {backend}",
                logy=True, legend=6)
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
