"""Passkey retrieval: tiered at one accelerator budget vs the full cache and a sliding window.

For each document (length x depth x seed) the prompt is prefilled once, exactly; the full
``KVCache`` and tiered (compressing at the first decode step) continue from that prefill.
mlx-lm's ``RotatingKVCache`` (window + 4 sinks) gets the same accelerator bytes as tiered's
budget and holds what its window keeps of the same prefill.

    python bench/passkey.py                       # 2k/4k/8k, depths 10-90%, 2 seeds, budget 1/8
    python bench/passkey.py --quick               # 2k only, 3 depths, 1 seed
"""

from __future__ import annotations

import argparse
import sys
import time

import common  # noqa: F401  (sets up tiered before mlx)
from common import (Timer, cache_bytes, continue_greedy, full_cache_bytes, machine, md_table,
                    rotating_from, shared_prefill, write_results)

import tiered
from tiered.planning.tasks import is_correct, passkey


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--budget", type=float, default=0.125)
    p.add_argument("--options", default="{}", help="TieredConfig options as JSON")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--name", default="passkey")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.depths, args.seeds = [2048], [0.1, 0.5, 0.9], [0]
    import json

    options = json.loads(args.options)
    model, tok = tiered.load()
    info = machine()
    rows, records = [], []
    t_start = time.perf_counter()
    total = len(args.lengths) * len(args.depths) * len(args.seeds)
    i = 0
    for n in args.lengths:
        for depth in args.depths:
            for seed in args.seeds:
                i += 1
                s = passkey(tok, n - 16, depth, seed=seed)  # leave room for the answer
                ids = tok.encode(s.prompt)
                rec = {"length": n, "tokens": len(ids), "depth": depth, "seed": seed,
                       "answer": s.answer}
                with Timer() as t:
                    base, last = shared_prefill(model, ids)
                rec["prefill_s"] = t.s
                # full cache
                full = base.to_kvcache()
                with Timer() as t:
                    out = continue_greedy(model, tok, full, last, 16)
                rec["full"] = {"text": out, "ok": is_correct(s.answer, out), "s": t.s,
                               "bytes": cache_bytes(full)}
                # tiered
                cache = base.fork(gpu_budget=args.budget, **options)
                with Timer() as t:
                    out = continue_greedy(model, tok, cache, last, 16)
                rep = tiered.report_dict(cache)
                budget_bytes = int(args.budget * full_cache_bytes(model, cache[0].offset))
                rec["tiered"] = {"text": out, "ok": is_correct(s.answer, out), "s": t.s,
                                 "bytes": rep["bytes"]["accelerator"], "budget_bytes": budget_bytes,
                                 "within_budget": rep["bytes"]["accelerator"] <= budget_bytes,
                                 "host_bytes": rep["bytes"]["host"],
                                 "selection": rep.get("selection", {}),
                                 "plan": rep.get("plan")}
                cache.close()
                # sliding window with the same accelerator bytes
                window = int(args.budget * (len(ids) + 16)) - 4
                rot = rotating_from(base, window)
                with Timer() as t:
                    out = continue_greedy(model, tok, rot, last, 16)
                rec["rotating"] = {"text": out, "ok": is_correct(s.answer, out), "s": t.s,
                                   "window": window, "bytes": cache_bytes(rot)}
                records.append(rec)
                print(f"[{i}/{total}] {n} tokens depth {depth:.0%} seed {seed}: key {s.answer} | "
                      f"full {rec['full']['text'].strip()[:12]!r} | tiered "
                      f"{rec['tiered']['text'].strip()[:12]!r} "
                      f"({rec['tiered']['bytes'] / 2**20:.1f}/{budget_bytes / 2**20:.1f} MiB) | "
                      f"rotating {rec['rotating']['text'].strip()[:12]!r} | "
                      f"{time.perf_counter() - t_start:.0f}s", flush=True)
    for n in args.lengths:
        sub = [r for r in records if r["length"] == n]
        rows.append([n, len(sub)] + [
            f"{100 * sum(r[m]['ok'] for r in sub) / len(sub):.0f}%" for m in ("full", "tiered", "rotating")
        ] + [f"{max(r['tiered']['bytes'] / r['tiered']['budget_bytes'] for r in sub):.3f}",
             all(r["tiered"]["within_budget"] for r in sub)])
    acc = {m: sum(r[m]["ok"] for r in records) / len(records) for m in ("full", "tiered", "rotating")}
    rows.append(["all", len(records)] + [f"{100 * acc[m]:.0f}%" for m in ("full", "tiered", "rotating")]
                + [f"{max(r['tiered']['bytes'] / r['tiered']['budget_bytes'] for r in records):.3f}",
                   all(r["tiered"]["within_budget"] for r in records)])
    header = ["tokens", "samples", "full KVCache", f"tiered @{args.budget}",
              f"RotatingKVCache @{args.budget}", "tiered bytes / budget (max)", "within budget"]
    md = (f"# Passkey retrieval\n\n`{info['command']}` on {info['platform']} ({info['backend']}, "
          f"{info['cpu_count']} cores), {info['date']}; wall time "
          f"{time.perf_counter() - t_start:.0f} s\n\n"
          f"Depths {args.depths}, seeds {args.seeds}; options {options or 'default'}.\n\n"
          + md_table(header, rows))
    data = {"machine": info, "args": vars(args), "accuracy": acc, "records": records}
    paths = write_results(args.name, data, md)
    print(md)
    print("wrote", *paths)
    return acc


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
