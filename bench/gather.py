"""The CPU gather kernel alone: selected host rows -> a softmax partial, per layer and per row.

Times ``tiered.cpu.kernels.gather_partial`` (one thread, every kv head of one layer) on a paged
float16 host store of --tokens tokens filled with random rows, for the embedded model's shape
(3 kv / 9 query heads, head_dim 64) and Llama-3-8B's (8 kv / 32 query heads, head_dim 128).
Each repetition draws a fresh selection of --count tokens per kv head (sorted, as the
selection passes hand them over), so rows come from memory as in decode ('cold'); the same
selection run again right after gives 'warm' (rows in cache: the arithmetic alone). Two
modes: exact rescoring (key and value rows read: the accelerator path's default) and scores
handed over (value rows only). Median over --reps. With --threads, the layer's kv heads are
also split across that many Python threads, as the scheduler's workers split them (the
kernel releases the GIL): wall time per layer, cold.

    cd bench && python gather.py --name gather_cpu
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import common  # noqa: F401  (tiered before mlx)
import numpy as np

from tiered.cpu import kernels as K
from tiered.cpu.pages import HostStore

SHAPES = {"smollm2": (3, 3, 64), "llama3-8b": (8, 4, 128)}  # kv heads, rep, head_dim


def _store(H, d, n, rng, page_size):
    store = HostStore(H, d, page_size=page_size, dtype="float16", keys=True)
    step = 8192
    for start in range(0, n, step):
        rows = rng.standard_normal((1, H, min(step, n - start), d)).astype(np.float16)
        store.append(rows, rows)
    return store


def measure(shape: str, n: int, count: int, reps: int, page_size: int, threads=(),
            seed: int = 0) -> list:
    H, rep, d = SHAPES[shape]
    rng = np.random.default_rng(seed)
    store = _store(H, d, n, rng, page_size)
    args = K.host_store_args(store)
    q = (rng.standard_normal((H * rep, d)) * d**-0.5).astype(np.float32)
    z_slot = rng.standard_normal((H * rep, count)).astype(np.float32)
    counts = np.full(H, count, np.int32)
    o = np.zeros((H * rep, d), np.float32)
    lse = np.zeros(H * rep, np.float32)

    def gather(idx, exact, heads=None):
        K.gather_partial(q, None if exact else z_slot, idx, counts, rep, *args, exact, o, lse,
                         kv_heads=heads, z_by_slot=not exact)

    def run(idx, exact):
        t = time.perf_counter()
        gather(idx, exact)
        return time.perf_counter() - t

    out = []
    for mode, exact in (("exact rescoring (K + V rows)", True), ("scores given (V rows)", False)):
        run(np.zeros((H, count), np.int32), exact)  # compile / warm the code paths
        cold, warm = [], []
        for _ in range(reps):
            idx = _selection(rng, n, count, H)
            cold.append(run(idx, exact))
            warm.append(run(idx, exact))
        rows = H * count * (2 if exact else 1)
        row_bytes = rows * d * 2
        c, w = float(np.median(cold)), float(np.median(warm))
        out.append({"shape": shape, "tokens": n, "count": count, "mode": mode, "kv_heads": H,
                    "rep": rep, "head_dim": d, "rows": rows, "cold_ms": c * 1e3,
                    "warm_ms": w * 1e3, "cold_ns_per_row": c * 1e9 / rows,
                    "warm_ns_per_row": w * 1e9 / rows, "cold_gb_s": row_bytes / c / 1e9})
        print(f"{shape:>10} {n:>8} {mode:<30} cold {c * 1e3:7.3f} ms ({c * 1e9 / rows:6.1f} "
              f"ns/row)  warm {w * 1e3:7.3f} ms ({w * 1e9 / rows:6.1f} ns/row)", flush=True)
        for t in threads:
            out[-1][f"threads_{t}_ms"] = _threaded(t, H, gather, exact, n, count, reps, rng) * 1e3
            print(f"{'':>20}{t} threads: {out[-1][f'threads_{t}_ms']:.3f} ms per layer",
                  flush=True)
    return out


def _selection(rng, n, count, H):
    """count distinct tokens of n per kv head, ascending (H, count) int32."""
    return np.sort(np.stack([rng.choice(n, count, replace=False) for _ in range(H)]),
                   axis=1).astype(np.int32)


def _threaded(t, H, gather, exact, n, count, reps, rng) -> float:
    """Median wall seconds of one layer's gather with its kv heads split over t threads."""
    bounds = np.linspace(0, H, min(t, H) + 1).astype(int)
    parts = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    times = []
    with ThreadPoolExecutor(len(parts)) as pool:
        for _ in range(reps):
            idx = _selection(rng, n, count, H)
            t0 = time.perf_counter()
            list(pool.map(gather, [idx] * len(parts), [exact] * len(parts), parts))
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--count", type=int, default=2048, help="selected tokens per kv head")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--threads", type=int, nargs="*", default=[],
                   help="also time the layer split over this many threads (kv heads each)")
    p.add_argument("--name", default="gather_cpu")
    args = p.parse_args(argv)
    if not 1 <= args.count <= args.tokens:
        p.error(f"--count must be in [1, --tokens]; got {args.count}")
    rows = []
    for shape in args.shapes:
        rows += measure(shape, args.tokens, args.count, args.reps, args.page_size,
                        args.threads)
    info = common.machine()
    md = [
        "# CPU gather kernel",
        "",
        f"`{info['command']}` on {info['processor']}, {info['date']}. One thread, all kv heads "
        f"of one layer; float16 host store of {args.tokens} random tokens in pages of "
        f"{args.page_size}; {args.count} selected tokens per kv head, a fresh selection per "
        f"repetition (cold: rows from memory) and the same one again (warm: rows in cache). "
        f"Median of {args.reps}.",
        "",
        common.md_table(
            ["shape", "mode", "rows", "cold ms", "cold ns/row", "cold GB/s of rows", "warm ms",
             "warm ns/row"],
            [[r["shape"], r["mode"], r["rows"], f"{r['cold_ms']:.3f}",
              f"{r['cold_ns_per_row']:.1f}", f"{r['cold_gb_s']:.2f}", f"{r['warm_ms']:.3f}",
              f"{r['warm_ns_per_row']:.1f}"] for r in rows]),
        "",
    ]
    if args.threads:
        md += [
            "Wall ms per layer (cold) with the kv heads split over threads:",
            "",
            common.md_table(["shape", "mode"] + [f"{t} threads" for t in args.threads],
                            [[r["shape"], r["mode"]] + [f"{r[f'threads_{t}_ms']:.3f}"
                                                        for t in args.threads] for r in rows]),
        "",
    ]
    paths = common.write_results(args.name, {"machine": info, "args": vars(args), "rows": rows},
                                 "\n".join(md))
    print("wrote", *paths)


if __name__ == "__main__":
    main()
