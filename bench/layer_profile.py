"""Which per-layer measure predicts the loss a compressed layer costs (issue 25, item 1).

Ground truth: the loss increase (nats per token, held-out positions of pydoc text) when only
layer l computes its attention as a compressed layer with the coarsest codes (codebook g = d/16,
tau 0.9, every value offloaded, exact rescoring), every other layer exact. Predictors, per
layer: KVmix's gradient norms of the K / V projection weights, gradient norms with respect to
the keys / values themselves, the attention entropy, and the forward-only proxy the layer-aware
planner uses (the layer's relative output error under that compression, on the clean forward).
Rank (Spearman) and linear (Pearson) correlations over the layers, and how many of the 5 layers
that cost the most each predictor ranks in its own top 5.

    python bench/layer_profile.py                    # measure (about 10 min on 2 cores)
    python bench/layer_profile.py --from prof.json   # a profile measured with measure_loss=True
    python bench/layer_profile.py --from results/layer_profile.json   # the kept result's profile

The result's JSON holds the profile it was computed from (its "profile" field).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import common  # noqa: F401  (tiered before mlx)
from common import RESULTS, figure, machine, md_table, save_figure

import numpy as np

import tiered
from tiered.planning.layer_profile import LayerProfile, measure


def read_profile(path: str) -> LayerProfile:
    """A profile file (tiered.planning.layer_profile), or a result of this script (its
    "profile")."""
    with open(path) as f:
        d = json.load(f)
    return LayerProfile.from_json(json.dumps(d.get("profile", d)), where=path)


def ranks(x):
    return np.argsort(np.argsort(x)).astype(float)


def predictors(p):
    err = np.asarray(p.output_error)[:, 0]
    out = {"output error (forward proxy)": err,
           "attention entropy (negated)": -np.asarray(p.entropy)}
    for name, v in (("KVmix grad norm W_k", p.grad_wk), ("KVmix grad norm W_v", p.grad_wv),
                    ("grad norm dL/dK", p.grad_k), ("grad norm dL/dV", p.grad_v)):
        if v is not None:
            out[name] = np.asarray(v)
    if p.grad_v is not None:
        out["grad norm dL/dV x output error"] = np.asarray(p.grad_v) * err
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--from", dest="source", default=None)
    ap.add_argument("--name", default="layer_profile")
    args = ap.parse_args(argv)
    info = machine()
    if args.source:
        prof = read_profile(args.source)
    else:
        model, tok = tiered.load()
        prof = measure(model, tok, measure_loss=True, progress=lambda m: print(m, flush=True))
    y = np.asarray(prof.loss_increase)
    top = set(np.argsort(-y)[:5])
    rows, table = [], {}
    for name, x in predictors(prof).items():
        rho = float(np.corrcoef(ranks(x), ranks(y))[0, 1])
        r = float(np.corrcoef(x, y)[0, 1])
        hit = len(top & set(np.argsort(-x)[:5]))
        table[name] = {"spearman": rho, "pearson": r, "top5": hit}
        rows.append([name, f"{rho:+.2f}", f"{r:+.2f}", f"{hit} of 5"])
    rows.sort(key=lambda row: -float(row[1]))
    md = (f"# Layer profile: which measure predicts the loss\n\n`{info['command']}` on "
          f"{info['platform']} ({info['cpu_count']} cores), {info['date']}, commit "
          f"`{info['commit']}`. Profile of {prof.model_id}: {prof.source}, tau {prof.tau}; "
          f"measured in {', '.join(f'{k} {v:.0f} s' for k, v in prof.seconds.items())}.\n\n"
          f"Ground truth: loss increase when only that layer is compressed (codebook "
          f"g={prof.groups[0]}, every value offloaded); base loss {prof.base_loss:.4f} nats; "
          f"largest increases: " + ", ".join(f"layer {i} {y[i]:+.4f}" for i in np.argsort(-y)[:5])
          + ".\n\n" + md_table(["predictor", "Spearman", "Pearson", "top-5 layers found"], rows)
          + f"\n![per layer]({args.name}.png)\n")
    with open(os.path.join(RESULTS, args.name + ".json"), "w") as f:
        json.dump({"machine": info, "profile": json.loads(prof.to_json()), "table": table}, f,
                  indent=1)
    with open(os.path.join(RESULTS, args.name + ".md"), "w") as f:
        f.write(md)
    fig, axes = figure(2, size=(12, 3.8))
    L = np.arange(prof.layers)
    axes[0].bar(L, y, color="grey")
    axes[0].set_title("loss increase when only this layer is compressed")
    axes[0].set_xlabel("layer")
    for name in ("output error (forward proxy)", "KVmix grad norm W_k", "KVmix grad norm W_v",
                 "attention entropy (negated)"):
        x = predictors(prof).get(name)
        if x is not None:
            axes[1].plot(L, (x - x.mean()) / (x.std() + 1e-12), "o-", ms=3, label=name)
    axes[1].plot(L, (y - y.mean()) / (y.std() + 1e-12), "k--", lw=2, label="loss increase")
    axes[1].set_title("per layer, standardised")
    axes[1].set_xlabel("layer")
    axes[1].legend(fontsize=7)
    save_figure(fig, os.path.join(RESULTS, args.name + ".png"))
    print(md)


if __name__ == "__main__":
    sys.exit(main())
