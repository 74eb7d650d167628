"""The embedded model's attention on real text (issue 57): the profile that decode_speed.py's
``--attention realistic`` follows (bench/probes/attention_workload.py makes the keys).

``measure``: the embedded model (SmolLM2-135M, float32 here) reads real text (pydoc topics)
with a tiered cache at 1/8, then decodes the text's next tokens (teacher-forced); each
compressed layer's selections are recorded per step and kv head on tiered's CPU path: offloaded
tokens selected (tau 0.9) and the resident hit rate (the resident set's share of the attended
mass, tiered/runtime/stats.py's ``resident_mass``). Written to ``attention_profile_embedded.json``:

    python bench/probes/attention_profile.py measure            # 2k, 4k, 8k tokens, 32 steps
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from contextlib import contextmanager

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/
PROFILE = os.path.join(HERE, "attention_profile_embedded.json")


# ---- per-step selections, per kv head (the CPU path) ------------------------------------------


@contextmanager
def spy_selections():
    """{layer: [(count, hit) per step]}: each decode step's offloaded selection per kv head and
    resident hit rate (mean over its query heads of exp(lse_resident - lse)), caught at the CPU
    path's merge (tiered.layer.decode_paths.DecodePaths._finish)."""
    from tiered.layer.decode_paths import DecodePaths

    got: dict[int, list] = {}
    orig = DecodePaths._finish

    def finish(self, queries, o_r, lse_r, o_c, lse_c, count, sinks, t0):
        if self._update:
            lr = np.asarray(lse_r, np.float64).reshape(-1)
            lc = np.asarray(lse_c, np.float64).reshape(-1)
            lse = np.logaddexp(lr, lc)
            if sinks is not None:
                lse = np.logaddexp(lse, np.asarray(sinks, np.float64).reshape(-1))
            share = np.exp(lr - lse).reshape(len(count), -1).mean(axis=1)
            got.setdefault(self.parent.layer, []).append(
                (np.asarray(count, np.float64).copy(), share))
        return orig(self, queries, o_r, lse_r, o_c, lse_c, count, sinks, t0)

    DecodePaths._finish = finish
    try:
        yield got
    finally:
        DecodePaths._finish = orig


def distribution(steps: list) -> dict:
    """One layer's steps -> median and 10/90th percentiles of the per-kv-head samples, and of
    the steps' means over kv heads (what tiered's counters hold: ``step_mean_*``)."""
    pct = lambda x: [float(v) for v in np.nanpercentile(x, [10, 50, 90])]  # noqa: E731
    return {"selected_p10_p50_p90": pct(np.concatenate([c for c, _ in steps])),
            "hit_p10_p50_p90": pct(np.concatenate([h for _, h in steps])),
            "step_mean_selected_p10_p50_p90": pct([np.mean(c) for c, _ in steps]),
            "step_mean_hit_p10_p50_p90": pct([np.mean(h) for _, h in steps])}


def stats_summary(cache) -> list[dict]:
    """Per compressed layer, from its counters (any backend): median over the recorded steps
    of the offloaded tokens selected per kv head (mean over heads) and of the resident hit
    rate."""
    out = []
    for c in cache:
        st = getattr(c, "stats", None)
        if st is None or not st.selected or getattr(c, "compressed", None) is None:
            continue
        sel = np.array([float(x) for x in st.selected])
        hit = np.array([float(x) for x in st.resident_mass])
        out.append({"layer": c.layer, "steps": len(sel), "selected": float(np.median(sel)),
                    "hit": float(np.nanmedian(hit))})
    return out


# ---- the embedded model's profile -------------------------------------------------------------


def measure(contexts, steps: int, budget: float) -> dict:
    import mlx.core as mx

    import tiered
    from tiered.planning.tasks import topics_text

    model, tok = tiered.load()
    ids = tok.encode(topics_text())
    out = {}
    for n in contexts:
        if n + steps > len(ids):
            raise ValueError(f"the text has {len(ids)} tokens, fewer than {n + steps}")
        x = mx.array(ids[: n + steps])[None]
        cache = tiered.TieredCache.for_model(model, gpu_budget=budget)
        t = time.perf_counter()
        for i in range(0, n, 2048):  # mlx-lm's prefill step
            model(x[:, i : min(n, i + 2048)], cache=cache)
            mx.eval([c.state for c in cache])
        with spy_selections() as got:
            for i in range(n, n + steps):  # the text's next tokens, one decode step each
                mx.eval(model(x[:, i : i + 1], cache=cache))
        layers = {str(k): distribution(v) for k, v in sorted(got.items())}
        span = lambda key: [float(f(v[key][1] for v in layers.values()))  # noqa: E731
                            for f in (min, max)]
        out[str(n)] = {"layers": layers, "summary": {
            "selected_median_range_over_layers": span("selected_p10_p50_p90"),
            "hit_median_range_over_layers": span("hit_p10_p50_p90")},
            "report": {k: v for k, v in tiered.report_dict(cache).get("selection", {}).items()
                       if k != "per_layer"},
            "seconds": time.perf_counter() - t}
        print(f"{n} tokens: {len(layers)} compressed layers; per-layer medians: selected "
              f"{span('selected_p10_p50_p90')}, hit {span('hit_p10_p50_p90')} "
              f"({out[str(n)]['seconds']:.0f}s)", flush=True)
        cache.close()
    return out


# ---- keys that follow the profile ---------------------------------------------------------------

def profile_targets(path: str = PROFILE, context: int | None = None) -> tuple[int, list]:
    """(context, [(selected, hit)] per profile layer): the per-layer medians over steps of the
    step's mean over kv heads (what tiered's counters give on every backend), at ``context``
    (default: the longest measured)."""
    with open(path) as f:
        ctxs = json.load(f)["contexts"]
    n = str(context or max(int(k) for k in ctxs))
    layers = ctxs[n]["layers"]
    return int(n), [(layers[k]["step_mean_selected_p10_p50_p90"][1],
                     layers[k]["step_mean_hit_p10_p50_p90"][1]) for k in sorted(layers, key=int)]


# ---- command line ------------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="the embedded model's profile on real text")
    m.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    m.add_argument("--steps", type=int, default=32)
    m.add_argument("--budget", type=float, default=0.125)
    m.add_argument("--out", default=PROFILE)
    args = p.parse_args(argv)
    import common  # noqa: F401  (tiered before mlx)

    info = common.machine()
    prof = measure(args.contexts, args.steps, args.budget)
    data = {"command": info["command"], "commit": info["commit"], "date": info["date"],
            "backend": info["backend"], "model": "embedded (SmolLM2-135M, float32)",
            "text": "tiered.planning.tasks.topics_text() (pydoc topics), teacher-forced decode",
            "gpu_budget": args.budget, "steps": args.steps,
            "what": "per compressed layer, 10/50/90th percentiles over steps x kv heads of the "
                    "offloaded tokens selected per kv head (tau 0.9, floor 32, cap 2048) and of "
                    "the resident hit rate (the resident set's share of the attended mass, mean "
                    "over the kv head's query heads); step_mean_*: over steps of the step's mean "
                    "over kv heads (what tiered's counters record; the targets of "
                    "decode_speed.py --attention realistic)",
            "contexts": prof}
    text = re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]",
                  json.dumps(data, indent=1, default=float))  # a list of numbers on one line
    text = re.sub(r"(\d\.\d{4})\d+", r"\1", text)  # 4 decimals
    with open(args.out, "w") as f:
        f.write(text + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
