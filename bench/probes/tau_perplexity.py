"""Why the default loses perplexity where the HCAttention configuration does not (issue 25):
paired perplexity of held-out pydoc tokens scored one by one after a 2k exact prefill, for the
full cache, the default layout at several ``tau`` and the HCAttention configuration, all forked
from one exact prefill per document (as bench/accuracy_grid.py's ppl task).

    python bench/probes/tau_perplexity.py --docs 2 --scored 128 --taus 0.9 0.99
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)
from common import machine, shared_prefill
import mlx.core as mx

import tiered
from tiered.planning.tasks import topics_text


def nll_of(model, cache, last, cont) -> list[float]:
    out = []
    for t_in, target in zip([last] + cont[:-1], cont):
        logits = model(mx.array([[t_in]]), cache=cache)[0, -1].astype(mx.float32)
        out.append(float((mx.logsumexp(logits) - logits[target]).item()))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--scored", type=int, default=128)
    ap.add_argument("--budget", type=float, default=0.125)
    ap.add_argument("--taus", type=float, nargs="+", default=[0.9, 0.99])
    ap.add_argument("--out", default=None, help="also write the records to this JSON file")
    args = ap.parse_args()
    model, tok = tiered.load()
    text = topics_text()
    configs = [("full", None)] + [(f"tiered tau={t}", dict(method="tiered", tau=t))
                                   for t in args.taus]
    configs.append(("hcattention tau=0.9", dict(method="hcattention")))
    nll = {name: [] for name, _ in configs}
    for i in range(args.docs):
        start = 3000 + i * 41000  # the documents of accuracy_grid.py's ppl task
        ids = tok.encode(text[start : start + 8 * (args.context + args.scored)])
        ids = ids[: args.context + args.scored]
        ctx, cont = ids[: args.context], ids[args.context :]
        base, last = shared_prefill(model, ctx)
        for name, opts in configs:
            t = time.perf_counter()
            cache = base.to_kvcache() if opts is None else base.fork(gpu_budget=args.budget, **opts)
            got = nll_of(model, cache, last, cont)
            nll[name] += got
            print(f"doc {i} {name}: ppl {math.exp(sum(got) / len(got)):.3f} "
                  f"({time.perf_counter() - t:.0f}s)", flush=True)
            if isinstance(cache, tiered.TieredCacheList):
                cache.close()
        base.close()
    ref = nll["full"]
    rows = []
    for name, _ in configs:
        d = [a - b for a, b in zip(nll[name], ref)]
        rows.append(dict(config=name, ppl=math.exp(sum(nll[name]) / len(ref)),
                         delta_pct=100 * (math.exp(sum(d) / len(d)) - 1)))
        print(f"{name:24s} ppl {rows[-1]['ppl']:.3f}  paired change {rows[-1]['delta_pct']:+.2f}%")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(machine=machine(), args=vars(args), rows=rows, nll=nll), f, indent=1)


if __name__ == "__main__":
    main()
