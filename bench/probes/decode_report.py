"""The tables, per-layer selection lines and plot of bench/decode_speed.py's results."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import numpy as np
from common import figure, finish_axes, md_table, save_figure


PHASES = {  # decode-step phases (tiered/layer/decode_paths.py, tiered/step/device_decode.py), as the tables and plots name them
    "spill": "lookahead: finish this layer's buffer move (wait for its worker, upload) and start the next layer's",
    "build": "queue scores + selection (host)",
    "sync": "wait for the device (scores, selection, and the layers before)",
    "select": "scores + selection (Numba)",
    "submit": "selection to host + submit gathers",
    "resident": "resident partial (launch / compute)",
    "wait": "wait for the CPU gathers",
    "finish": "merge + H2O refresh",
}


def print_selection(rec):
    """A tiered run's selections per layer (its counters): one line, and with the realistic
    workload one per layer against the profile's median and the fit's simulation."""
    sel = rec.get("selection_per_layer")
    if not sel:
        return
    s = [x["selected"] for x in sel]
    h = [x["hit"] for x in sel]
    print(f"        selection (median over steps, per layer): offloaded tokens/kv head "
          f"{min(s):.0f}-{max(s):.0f}, resident hit rate {min(h):.3f}-{max(h):.3f}", flush=True)
    for x in (rec.get("attention") or {}).get("layers", []):
        if x.get("selected") is None:
            continue
        print(f"        layer {x['layer']:>2} (profile layer {x['profile_layer']:>2}): selected "
              f"{x['selected']:6.0f} (profile {x['target_selected']:6.0f}, fit "
              f"{x['sim_selected']:6.0f}),"
              f" hit {x['hit']:.3f} (profile {x['target_hit']:.3f}, fit {x['sim_hit']:.3f}); "
              f"tau_a {x['tau_a']:.2f} tau_b {x['tau_b']:.2f}", flush=True)


def selection_table(records) -> str:
    """The realistic workload's selections per layer against the profile's medians."""
    rows = []
    for r in records:
        for x in (r.get("attention") or {}).get("layers", []):
            if x.get("selected") is None:
                continue
            rows.append([r["context"], r["method"], x["layer"], x["profile_layer"],
                         f"{x['selected']:.0f}", f"{x['target_selected']:.0f}",
                         f"{x['selected'] / max(x['target_selected'], 1) - 1:+.0%}",
                         f"{x['hit']:.3f}", f"{x['target_hit']:.3f}",
                         f"{x['hit'] / x['target_hit'] - 1:+.1%}"])
    if not rows:
        return ""
    header = ["context", "method", "layer", "profile layer", "selected", "profile", "off by",
              "hit rate", "profile", "off by"]
    return ("\n## Selections against the profile (realistic attention)\n\nMedian over the "
            "recorded steps (warm-up included) of the offloaded tokens selected per kv head (mean "
            "over heads) and of the resident hit rate, per layer; the profile's per-layer medians "
            "(bench/attention_profile_embedded.json, its longest context).\n\n"
            + md_table(header, rows) + "\n")


def phase_table(records, args) -> str:
    rows = []
    for r in records:
        ph = r.get("step_phases_ms")
        if not ph:
            continue
        sched = r.get("scheduler") or {}
        attn = sum(ph.values())
        rows.append([r["context"], r["method"], f"{r['ms_per_token']:.1f}", f"{attn:.1f}",
                     *(f"{ph.get(k, 0.0):.1f}" if k in ph else "" for k in PHASES),
                     f"{1e3 * sched.get('cpu_wall_s', 0) / args.steps:.1f}"
                     if sched.get("cpu_wall_s") is not None else ""])
    if not rows:
        return ""
    header = ["context", "method", "ms/token", "in tiered attention", *PHASES, "CPU gather wall"]
    legend = "; ".join(f"**{k}**: {v}" for k, v in PHASES.items())
    return ("\n## Where a token's time goes (ms per token, summed over layers)\n\n"
            "Host wall time inside the tiered attention of every layer, by phase, mean over the "
            "timed steps; the rest of ms/token is the model outside attention (queued work the "
            "next sync waits for shows up under sync). CPU gather wall: time with at least one "
            f"gather job running (the scheduler's union of job intervals). {legend}.\n\n"
            + md_table(header, rows) + "\n")


def plot(records, args, path):
    phased = [r for r in records if r.get("step_phases_ms")]
    fig, axes = figure(2 if phased else 1, size=(12, 4) if phased else (6, 4))
    ax = axes[0] if phased else axes
    for name in dict.fromkeys(r["method"] for r in records):
        pts = [(r["context"], r["ms_per_token"]) for r in records
               if r["method"] == name and "error" not in r]
        if not pts:
            continue
        xs, ys = zip(*pts)
        ax.plot(xs, ys, "o-", label=name, lw=2 if name.startswith("tiered") else 1)
    finish_axes(ax, xlabel="context (tokens)", ylabel="ms / token (median)",
                title=f"decode speed, {args.model}", logy=True)
    if phased:
        ax = axes[1]
        labels = [f"{r['context'] // 1024}k {r['method'].replace('tiered', 't')}" for r in phased]
        bottom = np.zeros(len(phased))
        for k in PHASES:
            vals = np.array([r["step_phases_ms"].get(k, 0.0) for r in phased])
            if vals.any():
                ax.bar(labels, vals, bottom=bottom, label=k)
                bottom += vals
        rest = np.array([max(0.0, r["ms_per_token"] - b) for r, b in zip(phased, bottom)])
        ax.bar(labels, rest, bottom=bottom, label="outside tiered attention", color="lightgray")
        ax.tick_params(axis="x", labelrotation=30)
        finish_axes(ax, xlabel="context, method", ylabel="ms / token",
                    title="where a tiered token's time goes", logx=False)
    save_figure(fig, path)


def summary_md(records, args, info, geo, dtype, weights, bw, host_bw, host_read, host_src) -> str:
    """The results' first section: the command and machine, then one row per context and
    method (ms/token, graph ms, floor, speed-up against ``KVCache``, bytes, first step)."""
    rows = []
    for n in args.contexts:
        sub = {r["method"]: r for r in records if r["context"] == n}
        base = sub.get("KVCache", {}).get("ms_per_token")
        for name, r in sub.items():
            if "error" in r:
                rows.append([n, name, "fails: " + r["error"][:90], "", "", "", "", "", "", "", "",
                             ""])
                continue
            sched = r.get("scheduler") or {}
            timed = r["step_ms"][args.warmup:]
            rows.append([n, name, f"{r['ms_per_token']:.1f}", f"{np.mean(timed):.1f}",
                         f"{r['build_ms_per_token']:.1f}"
                         if r.get("build_ms_per_token") is not None else "",
                         f"{r['floor_ms']:.1f}" if "floor_ms" in r else "",
                         f"{base / r['ms_per_token']:.2f}x" if base else "",
                         f"{r['bytes_per_step']['accelerator'] / 1e6:.0f}",
                         f"{r['bytes_per_step']['host'] / 1e6:.1f}",
                         f"{100 * r['bandwidth_fraction']:.0f}%",
                         f"{sched['overlap_ratio']:.2f}" if sched.get("overlap_ratio") is not None else "",
                         f"{r['first_step_s']:.1f}"])
    header = ["context", "method", "ms/token (median)", "mean (incl. refresh steps)", "graph ms",
              "floor ms (same bytes)",
              "speed-up vs KVCache",
              "attention MB/step (device)", "MB/step (host gather)",
              "of copy bandwidth (incl. weights)", "overlap ratio", "first step s"]
    md = (f"# Decode speed\n\n`{info['command']}` on {info['platform']} ({info['backend']}, "
          f"{info['device']}, {info['cpu_count']} cores), {info['date']}.\n\n"
          f"Model: {args.model} ({geo.layers} layers, {geo.q_heads} q / {geo.kv_heads} kv heads, "
          f"head_dim {geo.k_dim}, {dtype}), weights {weights / 1e9:.2f} GB; measured copy "
          f"bandwidth {bw:.0f} GB/s, host-to-device copy {host_bw:.1f} GB/s, host reads "
          f"{host_read:.1f} GB/s: {host_src} (the floor column: weights and device bytes at the "
          f"first, tiered's host bytes at the last, the streaming baseline's at the copy rate). "
          + (f"Long caches: real prefill K/V of {args.seed_tokens} tokens tiled to each context."
             if args.attention == "flat" else
             f"Long caches: real prefill values of {args.seed_tokens} tokens tiled to each "
             "context, keys made so that tiered's selections follow the embedded model's profile "
             "on real text (bench/probes/attention_workload.py; the baselines hold the same keys).")
          + f" Median of {args.steps} steps after {args.warmup} warm-up "
          f"steps (the first compresses the tiered cache); "
          + ("mlx-lm's generate_step, one token built ahead while the device runs the last: a "
             "step is the time between two tokens" if args.loop == "generate" else
             "each token built, then evaluated") + ". graph ms: host time to build a token's "
          "graph (model call and argmax, before evaluation), median.\n\n"
          + md_table(header, rows))
    return md
