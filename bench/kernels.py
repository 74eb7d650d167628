"""Accelerator kernels against the machine: GB/s vs measured copy bandwidth, and scoring +
selection vs MLX's full-cache scaled_dot_product_attention decode.

Shapes are Llama-3-8B's attention (8 KV heads, 32 query heads, head_dim 128): codebook keys
with g = d/4 groups of 4 dims and c = 256 centroids (uint8 codes), affine 4-bit keys (group
64), fp16 K/V for the SDPA reference. Each kernel is first checked against its plain-MLX
reference on this device; then timed as the median of ``--reps`` launches after warm-up,
cycling through several input sets so that small sizes don't just measure the L2 cache.
Bytes counted: inputs read once plus outputs written once.

    python bench/kernels.py --sizes 16384 131072 1048576     # on the accelerator machine
    python bench/kernels.py --sizes 16384 131072             # CPU backend: MLX references
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import common  # noqa: F401  (tiered before mlx)
from common import (RESULTS, figure, finish_axes, machine, md_table, save_figure,
                    write_results)

import mlx.core as mx
import numpy as np

from tiered import metal

H, REP, D = 8, 4, 128
HQ = H * REP
G, C = D // 4, 256


def measured_bandwidth() -> dict:
    """Device memory bandwidth in GB/s over a 1 GiB buffer: ``copy`` (x + 0, bytes read +
    written), ``read`` (a sum: bytes read) and ``best`` of the two, the reference the kernels
    are held to (MLX's elementwise copy alone under-reads a GPU: its SDPA decode outran it)."""
    x = mx.random.uniform(shape=(256 * 2**20,))  # 1 GiB of fp32
    mx.eval(x)
    copy = 2 * x.nbytes / timed(lambda: x + 0, reps=10, warmup=2) / 1e9
    read = x.nbytes / timed(lambda: mx.sum(x), reps=10, warmup=2) / 1e9
    return {"copy": copy, "read": read, "best": max(copy, read)}


def copy_bandwidth() -> float:
    return measured_bandwidth()["best"]


def timed(fn, *, reps: int, warmup: int) -> float:
    """Median seconds of fn() evaluated, after warm-up."""
    for _ in range(warmup):
        mx.eval(fn())
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        out.append(time.perf_counter() - t)
    return float(np.median(out))


def rotating(make, count: int):
    """count independent input sets, used round-robin (defeats the L2 cache at small n)."""
    sets = [make(i) for i in range(count)]
    mx.eval(sets)
    state = {"i": 0}

    def next_set():
        state["i"] = (state["i"] + 1) % count
        return sets[state["i"]]

    return next_set


def rel_err(a, b) -> float:
    a, b = np.array(a, np.float64), np.array(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def bench_size(n: int, reps: int, bw: float, backend: str) -> list[dict]:
    rows = []
    n_sets = max(1, min(8, (400 * 2**20) // (H * n * G + HQ * n * 4)))
    key = mx.random.key(n)
    q = mx.random.normal((HQ, D), key=key) * D**-0.5

    # ---- codebook scores -----------------------------------------------------------------
    codebook = mx.random.normal((H, 1, C, D // G))
    codes_sets = rotating(lambda i: mx.random.randint(0, C, (H, n, G), key=mx.random.key(i))
                          .astype(mx.uint8), n_sets)
    codes = codes_sets()
    check = rel_err(metal.codebook_scores(q, codebook, codes, n, rep=REP),
                    metal.codebook_scores_ops(q, codebook, codes, n, rep=REP))
    t = timed(lambda: metal.codebook_scores(q, codebook, codes_sets(), n, rep=REP), reps=reps,
              warmup=3)
    nbytes = H * n * G + HQ * n * 4
    rows.append({"kernel": "codebook scores (g=32, c=256)", "n": n, "ms": 1e3 * t,
                 "gbs": nbytes / t / 1e9, "of_copy": nbytes / t / 1e9 / bw, "check": check})

    # ---- affine scores (4-bit, group 64) ------------------------------------------------
    kf = mx.random.normal((H, n, D)).astype(mx.float16)
    wq, sc, bi = mx.quantize(kf, group_size=64, bits=4)
    mx.eval(wq, sc, bi)
    del kf
    ref = metal.affine_scores_ops(q, wq, sc, bi, n, rep=REP, group_size=64, bits=4)
    for use_kernel in ([True, False] if backend != "cpu" else [False]):
        got = metal.affine_scores(q, wq, sc, bi, n, rep=REP, group_size=64, bits=4,
                                  use_kernel=use_kernel)
        t = timed(lambda: metal.affine_scores(q, wq, sc, bi, n, rep=REP, group_size=64, bits=4,
                                              use_kernel=use_kernel), reps=reps, warmup=3)
        nbytes = wq.nbytes + sc.nbytes + bi.nbytes + HQ * n * 4
        rows.append({"kernel": "affine scores 4-bit" + (" (kernel)" if use_kernel else
                                                        " (mx.quantized_matmul)"),
                     "n": n, "ms": 1e3 * t, "gbs": nbytes / t / 1e9, "of_copy": nbytes / t / 1e9 / bw,
                     "check": rel_err(got, ref)})
    del wq, sc, bi

    # ---- tau threshold and selection ----------------------------------------------------
    z = metal.codebook_scores(q, codebook, codes, n, rep=REP)
    mx.eval(z)
    m1, s1, th1 = metal.tau_threshold(z, n, 0.9)
    m2, s2, th2 = metal.tau_threshold_ops(z, n, 0.9)
    t = timed(lambda: metal.tau_threshold(z, n, 0.9), reps=reps, warmup=3)
    rows.append({"kernel": "tau threshold (32 heads)", "n": n, "ms": 1e3 * t,
                 "gbs": HQ * n * 4 / t / 1e9, "of_copy": HQ * n * 4 / t / 1e9 / bw,
                 "check": rel_err(th1, th2)})
    exclude = mx.zeros((H, n), mx.bool_)
    t_sel = timed(lambda: metal.tau_select(z, n, exclude, 0.9, 2048, 32), reps=reps, warmup=3)
    rows.append({"kernel": "tau select (threshold + cap 2048)", "n": n, "ms": 1e3 * t_sel,
                 "gbs": HQ * n * 4 / t_sel / 1e9, "of_copy": HQ * n * 4 / t_sel / 1e9 / bw,
                 "check": None})
    t_both = timed(lambda: metal.tau_select(
        metal.codebook_scores(q, codebook, codes_sets(), n, rep=REP), n, exclude, 0.9, 2048, 32),
        reps=reps, warmup=3)

    # ---- the reference: full-cache SDPA decode --------------------------------------------
    kv = mx.random.normal((1, H, n, D)).astype(mx.float16)
    vv = mx.random.normal((1, H, n, D)).astype(mx.float16)
    q16 = mx.random.normal((1, HQ, 1, D)).astype(mx.float16)
    mx.eval(kv, vv, q16)
    t_sdpa = timed(lambda: mx.fast.scaled_dot_product_attention(q16, kv, vv, scale=D**-0.5),
                   reps=reps, warmup=3)
    nbytes = kv.nbytes + vv.nbytes
    rows.append({"kernel": "mx.fast.scaled_dot_product_attention (full fp16 cache)", "n": n,
                 "ms": 1e3 * t_sdpa, "gbs": nbytes / t_sdpa / 1e9,
                 "of_copy": nbytes / t_sdpa / 1e9 / bw, "check": None})
    rows.append({"kernel": "scores + selection (one launch chain)", "n": n, "ms": 1e3 * t_both,
                 "speedup_vs_sdpa": t_sdpa / t_both, "check": None})
    del kv, vv
    mx.clear_cache()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[16384, 131072, 1048576])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    backend = metal.accelerator()
    args.name = args.name or f"kernels_{backend}"
    info = machine()
    bws = measured_bandwidth()
    bw = bws["best"]
    print(f"backend {backend}; memory bandwidth {bw:.0f} GB/s (copy {bws['copy']:.0f}, "
          f"read-only {bws['read']:.0f})", flush=True)
    rows = []
    for n in args.sizes:
        for r in bench_size(n, args.reps, bw, backend):
            rows.append(r)
            extra = (f"{r['gbs']:8.0f} GB/s ({100 * r['of_copy']:3.0f}% of bw)" if "gbs" in r
                     else f"{r['speedup_vs_sdpa']:.2f}x faster than SDPA")
            print(f"{n:>8} {r['kernel']:<55} {r['ms']:9.3f} ms {extra}"
                  + (f"  check {r['check']:.1e}" if r.get("check") is not None else ""), flush=True)
    table = [[r["n"], r["kernel"], f"{r['ms']:.3f}",
              f"{r['gbs']:.0f}" if "gbs" in r else "",
              f"{100 * r['of_copy']:.0f}%" if "of_copy" in r else f"{r['speedup_vs_sdpa']:.2f}x vs SDPA",
              "" if r.get("check") is None else f"{r['check']:.1e}"] for r in rows]
    md = (f"# Accelerator kernels\n\n`{info['command']}` on {info['platform']} (backend {backend}, "
          f"{info['device']}), {info['date']}. Memory bandwidth {bw:.0f} GB/s, the best of a "
          f"copy ({bws['copy']:.0f} GB/s, read + write) and a read-only sum ({bws['read']:.0f} "
          f"GB/s) over 1 GiB; the 'of bandwidth' column is against it. "
          f"Llama-3-8B attention shape: {H} kv / {HQ} query heads, head_dim {D}.\n\n"
          + md_table(["tokens", "kernel", "ms (median)", "GB/s", "of bandwidth / speed-up",
                      "rel. error vs reference"], table))
    md += f"\n![kernels]({args.name}.png)\n"
    paths = write_results(args.name, {"machine": info, "backend": backend, "copy_gbs": bw,
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
