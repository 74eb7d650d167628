"""The methods, tables, acceptance checks and plot of bench/accuracy_grid.py, from its records."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import numpy as np
from ci import ppl_summary, wilson
from common import figure, finish_axes, md_table, save_figure

# the grid's methods (bench/accuracy_grid.py imports them from here)
METHODS = ["full", "tiered", "tiered_layers", "hcattention", "quantized"]
# on request: tiered as configured by default (planner="auto"), on the device path and on the
# CPU-gather path (device_gather="off": the path Metal and MLX's CPU backend run)
EXTRA_METHODS = ["default", "default_gather_off", "otau999_cap3072", "otau999_cap3072_off",
                 "default_c128", "selall", "tau1", "tau1c4k", "otau9999"]
LABELS = {"full": "KVCache (full)", "tiered": "tiered (uniform planner)",
          "default": "tiered (default: planner='auto')",
          "default_gather_off": "tiered (default), CPU-gather path",
          "otau999_cap3072": "tiered (default), offloaded_tau 0.999, max_selected 3072",
          "otau999_cap3072_off": "the same, CPU-gather path",
          "default_c128": "tiered (default), codebooks of 128 centroids",
          "tau1": "tiered (default), offloaded layers select to their cap",
          "tau1c4k": "tiered (default), offloaded layers select to a cap of 4096",
          "selall": "tiered (default), every token selected",
          "otau9999": "tiered (default), offloaded layers select to tau 0.9999",
          "tiered_layers": "tiered (layer-aware planner)",
          "hcattention": "HCAttention config (this runtime)",
          "quantized": "QuantizedKVCache (4 / 2-bit)"}
TASK_NAMES = {"passkey": "passkey (%)", "needle": "needle in text (%)",
              "kv": "key-value retrieval (%)", "facts": "planted facts in text (%)",
              "ppl": "perplexity"}


def summarize(records):
    """{task: {(method, budget): cell}}; a retrieval cell: k, n, acc, lo, hi (%), fraction
    (max bytes / full), over (documents whose cache exceeded the budget), oks ({doc: ok});
    a ppl cell: ppl_summary() (paired against the full cache on the same documents) and
    fraction. A document recorded twice for one method and budget (overlapping slices of
    one grid) counts once: its first record."""
    by, seen = {}, set()
    for r in records:
        key = (r["task"], r["method"], r["budget"], r["doc"])
        if key in seen:
            continue
        seen.add(key)
        by.setdefault(r["task"], {}).setdefault((r["method"], r["budget"]), []).append(r)
    out = {}
    for task, cells in by.items():
        out[task] = {}
        ref = {r["doc"]: r for r in cells.get(("full", 1.0), []) if r.get("nll")}
        for key, rs in cells.items():
            done = [r for r in rs if r.get("bytes") is not None]
            over = sum(1 for r in done if not r.get("within", True))
            frac = max((r["fraction"] for r in done), default=None)
            note = next((r.get("note") for r in rs if r.get("note")), "")
            if not done or over:
                out[task][key] = {"na": True, "over": over, "fraction": frac, "note": note,
                                  "n": len(rs)}
                continue
            if task == "ppl":
                docs = sorted(r["doc"] for r in done if r["doc"] in ref)
                mine = {r["doc"]: r for r in done}
                nll = np.concatenate([mine[d]["nll"] for d in docs]) if docs else np.zeros(0)
                base = np.concatenate([ref[d]["nll"] for d in docs]) if docs else None
                cell = ppl_summary(nll, base if key != ("full", 1.0) else None)
            else:
                k, n = sum(bool(r["ok"]) for r in done), len(done)
                lo, hi = wilson(k, n)
                cell = {"k": k, "n": n, "acc": 100 * k / n, "lo": 100 * lo, "hi": 100 * hi,
                        "oks": {r["doc"]: bool(r["ok"]) for r in done}}
            cell.update(fraction=frac, note=note, na=False)
            out[task][key] = cell
    return out


def _fmt(task, c):
    if c is None:
        return ""
    if c["na"]:
        return "over budget" if c["over"] else "n/a"
    if task == "ppl":
        s = f"{c['ppl']:.2f} [{c['ppl_lo']:.2f}, {c['ppl_hi']:.2f}]"
        if "rel" in c:
            s += f" Δ {100 * c['rel']:+.1f}% [{100 * c['rel_lo']:+.1f}, {100 * c['rel_hi']:+.1f}]"
        return s + f" ({c['fraction']:.3f})"
    return f"{c['acc']:.0f}% [{c['lo']:.0f}, {c['hi']:.0f}] n={c['n']} ({c['fraction']:.3f})"


def paired_points(full, c):
    """(points, n): c's accuracy minus the full cache's on the documents both answered."""
    docs = sorted(set(full.get("oks", {})) & set(c.get("oks", {})))
    if not docs:
        return None, 0
    diff = sum(c["oks"][d] for d in docs) - sum(full["oks"][d] for d in docs)
    return 100 * diff / len(docs), len(docs)


def acceptance(table, budgets):
    """Issues 25 and 58: at 0.0625 inside the full cache's 95% interval and ppl <= +1%; at
    0.03125 within 5 points of the full cache on the documents both answered (paired), ppl
    <= +3%."""
    rows = []
    for m in ("tiered", "tiered_layers", "default", "default_gather_off", "otau999_cap3072",
              "otau999_cap3072_off", "tau1"):
        for b, pts, ppl_max in ((0.0625, None, 1.0), (0.03125, 5.0, 3.0)):
            if b not in budgets:
                continue
            for task, cells in table.items():
                full, c = cells.get(("full", 1.0)), cells.get((m, b))
                if full is None or c is None or full.get("na"):
                    continue
                if c["na"]:
                    rows.append([m, b, task, "n/a", "", "no"])
                    continue
                if task == "ppl":
                    ok = 100 * c["rel"] <= ppl_max
                    rows.append([m, b, task, f"{100 * c['rel']:+.2f}%", f"<= +{ppl_max:g}%",
                                 "yes" if ok else "no"])
                else:
                    if pts is None:
                        ok = full["lo"] <= c["acc"] <= full["hi"]
                        got, need = f"{c['acc']:.0f}%", f"in [{full['lo']:.0f}, {full['hi']:.0f}]"
                    else:
                        d, n = paired_points(full, c)
                        if d is None:  # no document in common: against the full cache's figure
                            d, n = c["acc"] - full["acc"], c["n"]
                        ok = d >= -pts
                        got = f"{c['acc']:.0f}% ({d:+.1f} points, {n} paired)"
                        need = f">= -{pts:g} points"
                    rows.append([m, b, task, got, need, "yes" if ok else "no"])
    return rows


def markdown(table, info, wall, args, budgets):
    lines = ["# Accuracy against accelerator memory (95% intervals)\n",
             f"`{info['command']}` on {info['platform']} ({info['backend']}, {info['cpu_count']} "
             f"cores), {info['date']}, commit `{info['commit']}`; wall time {wall / 60:.1f} min."
             + (f" Records from the runs at {'; '.join(info['runs'])}." if info.get("runs") else "")
             + (f" Recorded on {info['recorded_on']}." if info.get("recorded_on") else "")
             + "\n",
             f"Embedded SmolLM2-135M-Instruct in {info.get('dtype', 'float32')}: budgets are "
             f"fractions of the {info.get('dtype', 'float32')} `KVCache`"
             + (f", documents of {info['length']} tokens" if info.get("length") else "")
             + (f" (perplexity: {info['ppl_context']} tokens of context)"
                if info.get("ppl_context") else "")
             + ". Cells: accuracy [95% Wilson interval] over n documents, and in brackets "
             "the most accelerator bytes the cache held, as a fraction of the full cache. "
             "Perplexity: [95% block-bootstrap interval], Δ = paired change against the full "
             "cache on the same tokens. `n/a`: the method cannot fit the budget; `over budget`: "
             "its cache held more than the budget (it did not compress).\n"]
    for task in [t for t in TASK_NAMES if t in table]:
        header = ["method"] + [f"budget {b}" for b in budgets] + ["own size"]
        rows = []
        cells = table[task]
        for m in [m for m in _methods() if any(k[0] == m for k in cells)]:
            if m == "full":
                rows.append([LABEL(m)] + [""] * len(budgets) + [_fmt(task, cells.get((m, 1.0)))])
            elif any((m, b) in cells for b in budgets):
                rows.append([LABEL(m)] + [_fmt(task, cells.get((m, b))) for b in budgets] + [""])
        lines.append(f"## {TASK_NAMES[task]}\n\n" + md_table(header, rows))
    acc = acceptance(table, budgets)
    if acc:
        lines.append("## Acceptance (issues 25 and 58)\n\n" + md_table(
            ["method", "budget", "task", "measured", "needed", "met"], acc))
    lines.append(f"\n![accuracy vs budget]({args.name}.png)\n")
    return "\n".join(lines)


def _methods():
    return METHODS + EXTRA_METHODS


def LABEL(m):
    return LABELS[m]


def plot(table, budgets, path):
    tasks = [t for t in TASK_NAMES if t in table]
    fig, axes = figure(len(tasks), size=(4.3 * len(tasks), 3.9))
    axes = np.atleast_1d(axes)
    for ax, task in zip(axes, tasks):
        cells = table[task]
        full = cells.get(("full", 1.0))
        key = ("ppl", "ppl_lo", "ppl_hi") if task == "ppl" else ("acc", "lo", "hi")
        if full and not full["na"]:
            ax.axhspan(full[key[1]], full[key[2]], color="grey", alpha=0.2,
                       label="KVCache (full), 95% CI")
            ax.axhline(full[key[0]], color="grey", lw=1)
        for j, m in enumerate(m for m in _methods() if m != "full"):
            pts = [(b * (1 + 0.04 * (j - 1.5)), cells[(m, b)]) for b in budgets
                   if (m, b) in cells and not cells[(m, b)]["na"]]
            if not pts:
                continue
            xs = [x for x, _ in pts]
            ys = np.array([c[key[0]] for _, c in pts])
            err = np.clip(np.array([[c[key[0]] - c[key[1]] for _, c in pts],
                                    [c[key[2]] - c[key[0]] for _, c in pts]]), 0, None)
            ax.errorbar(xs, ys, yerr=err, fmt="o-", capsize=3, label=LABEL(m),
                        lw=2 if m == "tiered_layers" else 1)
        finish_axes(ax, xlabel="gpu_budget (fraction of the full cache)",
                    title=TASK_NAMES[task] + (" (lower is better)" if task == "ppl" else ""),
                    legend=6 if ax is axes[0] else None, logy=task == "ppl")
    save_figure(fig, path)


def write_report(records, info, wall, args, stem):
    budgets = sorted({r["budget"] for r in records if r["method"] != "full"}, reverse=True)
    table = summarize(records)
    md = markdown(table, info, wall, args, budgets)
    data = {"machine": info, "wall_s": wall, "budgets": budgets, "records": records,
            "table": {t: {f"{m}@{b}": c for (m, b), c in d.items()} for t, d in table.items()},
            "acceptance": acceptance(table, budgets)}
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1, default=str)
    with open(stem + ".md", "w") as f:
        f.write(md)
    try:
        plot(table, budgets, stem + ".png")
    except ImportError as e:  # matplotlib is an optional extra
        print("no plot:", e)
    print(md)
    print("wrote", stem + ".json", stem + ".md", stem + ".png")
