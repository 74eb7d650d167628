"""Accuracy against accelerator memory, with 95% confidence intervals (issue 25).

Embedded SmolLM2-135M (fp32 on the CPU backend: budgets are fractions of the fp32 KVCache).
Tasks, all offline, every document ~2k tokens (the model is weak past ~4k):

- passkey: a 5-digit key in filler (tiered.planning.tasks.passkey), random depth per document;
- needle: a made-up fact planted in pydoc_data.topics (tiered.planning.tasks.needle_in_text);
- kv: key-value retrieval, ~150 look-alike ``key: value`` lines, one asked
(tiered.planning.tasks_retrieval);
- facts: four planted facts of one template in real text, one asked
(tiered.planning.tasks_retrieval);
- ppl: perplexity of held-out pydoc tokens scored one by one after a 2k context, the compressed
  cache in the loop (the same tokens for every method: paired).

Methods: mlx-lm ``KVCache`` (full); tiered with the uniform planner (``planner="uniform"``; the
default, "auto", is this one at 1/8 and above and the layer-aware one below where a profile is at
hand) and with the layer-aware planner (``planner="layers"``); the two strongest baselines of
bench/memory_accuracy.py: this runtime's HCAttention configuration (codebook keys g = d/4, tau 0.9,
approximate weights, every value on the host) and mlx-lm's ``QuantizedKVCache`` (group 64, at the
widest of 4 / 2 bits that fits each budget). Every method continues from one shared exact prefill
per document. A cell whose cache held more bytes than its budget (a layout that did not compress)
counts as n/a.

Intervals: Wilson for accuracies; block bootstrap (32-token blocks) for perplexity, and for its
paired change against the full cache.

    python bench/accuracy_grid.py --quick              # 7.5 minutes on 2 cores (measured)
    python bench/accuracy_grid.py                      # the full grid (60 documents per task)

The full grid was not run here; from the quick run's times (45 s per retrieval document with
every cell, the shared prefill ~8 s of it; a 256-token perplexity document ~8 min) it takes
about 3.5 hours on 2 cores (240 retrieval documents ~3.0 h, 4 perplexity documents ~0.5 h).
It runs in slices (``--tasks``, ``--first-doc``, ``--docs``, ``--records``) merged by
``--summarize``:
    python bench/accuracy_grid.py --tasks kv --docs 20 --first-doc 40 --records part.jsonl
    python bench/accuracy_grid.py --summarize part1.jsonl part2.jsonl   # tables from records
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "probes"))  # helpers and probes

import common  # noqa: F401  (tiered before mlx)
from accuracy_report import EXTRA_METHODS, METHODS, write_report
from common import (RESULTS, Clock, cache_bytes, continue_greedy, corpus_tokens, full_cache_bytes,
                    machine, shared_prefill)

import mlx.core as mx

import tiered
from tiered.planning.planner import BudgetError
from tiered.planning.tasks import is_correct, needle_in_text, passkey
from tiered.planning.tasks_retrieval import kv_retrieval, planted_facts

BUDGETS = [0.25, 0.125, 0.0625, 0.03125]
TASKS = ["passkey", "needle", "kv", "facts", "ppl"]
GRIDS = {  # docs per retrieval task; ppl: (documents, context, scored tokens per document)
    "full": dict(docs=60, length=2048, ppl=(4, 2048, 256)),
    "quick": dict(docs=2, length=2048, ppl=(1, 2048, 32)),
}


def make_sample(task: str, tok, n: int, i: int):
    rng = random.Random(1_000_003 * i + len(task))
    if task == "passkey":
        return passkey(tok, n, round(rng.uniform(0.05, 0.95), 3), seed=i)
    if task == "needle":
        return needle_in_text(tok, n, round(rng.uniform(0.05, 0.95), 3), seed=i)
    if task == "kv":
        return kv_retrieval(tok, n, seed=i)
    if task == "facts":
        return planted_facts(tok, n, seed=i)
    raise ValueError(f"Invalid task: {task!r}")


def _leaves(model):
    from mlx.utils import tree_flatten

    return [(k, v) for k, v in tree_flatten(model.parameters())
            if mx.issubdtype(v.dtype, mx.floating) and k.endswith("norm.weight")]


def quantized(base, bits):
    return [c.to_quantized(group_size=64, bits=bits) for c in base.to_kvcache()]


def method_caches(base, budgets, methods):
    """(method, budget, cache or None, note) for every cell; None: the method cannot fit."""
    if "full" in methods:
        yield "full", 1.0, base.to_kvcache(), ""
    for b in budgets:
        for m in methods:
            if m == "full":
                continue
            if m == "quantized":
                bits = 4 if b >= 0.25 else 2 if b >= 0.125 else None
                if bits is None:
                    yield m, b, None, "no bit width fits (2-bit holds ~0.09 of the cache)"
                else:
                    yield m, b, quantized(base, bits), f"{bits}-bit"
                continue
            opts = dict(default=dict(), default_gather_off=dict(device_gather="off"),
                        # issue 58's candidate: offloaded layers select to 0.999 of the mass
                        otau999_cap3072=dict(offloaded_tau=0.999, max_selected=3072),
                        otau999_cap3072_off=dict(offloaded_tau=0.999, max_selected=3072,
                                                 device_gather="off"),
                        # 1/32's short documents: between the 64-centroid shared book the
                        # planner falls back to and the 256 one that does not fit
                        default_c128=dict(codebook_size=128),
                        # where 1/32 loses: offloaded layers select to their cap by the codes'
                        # ranking (tau 1), with a wider cap, and every token (the upper bound)
                        tau1=dict(offloaded_tau=1.0),
                        otau9999=dict(offloaded_tau=0.9999),
                        tau1c4k=dict(offloaded_tau=1.0, offloaded_max_selected=4096),
                        selall=dict(offloaded_tau=1.0, offloaded_min_selected=1 << 20,
                                    offloaded_max_selected=1 << 20),
                        tiered=dict(method="tiered", planner="uniform"),
                        hcattention=dict(method="hcattention", planner="uniform"),
                        tiered_layers=dict(method="tiered", planner="layers"))[m]
            try:
                yield m, b, base.fork(gpu_budget=b, **opts), ""
            except BudgetError as e:
                yield m, b, None, str(e).split(":")[-1].strip()


def plan_signature(cache, n: int):
    """For the HCAttention configuration (its resident set is one token whatever the budget):
    its plan without the budget, so that a budget whose plan equals one already run on this
    document is copied instead of run again (the run is deterministic). None: always run."""
    cfg = getattr(cache, "config", None)
    if cfg is None or cfg.method != "hcattention" or cfg.planner != "uniform":
        return None
    from tiered.planning import layout

    plan = layout.layout_at(cache.context.model_geometry, cfg, n)
    if plan is None:
        return None
    d = json.loads(plan.to_json())
    d.pop("budget"), d.pop("why")
    return json.dumps(d, sort_keys=True)


def _close(cache):
    if isinstance(cache, tiered.TieredCacheList):
        cache.close()


def _cell(method, budget, cache, full_bytes, note):
    rec = {"method": method, "budget": budget, "note": note}
    if cache is not None:
        used = cache_bytes(cache)
        rec.update(bytes=used, full_bytes=full_bytes, fraction=used / full_bytes,
                   within=method in ("full", "quantized") or used <= budget * full_bytes * 1.0001)
        if isinstance(cache, tiered.TieredCacheList):
            rep = tiered.report_dict(cache)
            rec["plan"] = rep.get("layer_plans", {}).get("summary") or rep.get("plan")
    return rec


def run_retrieval(model, tok, task, i, n, budgets, methods, log):
    s = make_sample(task, tok, n - 8, i)
    ids = tok.encode(s.prompt)
    t0 = time.perf_counter()
    base, last = shared_prefill(model, ids)
    prefill_s = time.perf_counter() - t0
    gen = len(tok.encode(" " + s.answer)) + 2
    full_bytes = full_cache_bytes(model, len(ids) + gen)
    out, seen = [], {}
    for method, budget, cache, note in method_caches(base, budgets, methods):
        rec = {"task": task, "doc": i, "tokens": len(ids), "depth": s.depth, "answer": s.answer}
        sig = plan_signature(cache, len(ids)) if cache is not None else None
        if cache is None:
            rec.update(method=method, budget=budget, ok=None, note=note)
        elif sig is not None and sig in seen:
            rec.update({k: v for k, v in seen[sig].items() if k not in ("budget", "note")},
                       budget=budget, note=f"same plan as budget {seen[sig]['budget']}: copied")
            rec["within"] = rec["bytes"] <= budget * rec["full_bytes"] * 1.0001
            _close(cache)
        else:
            t = time.perf_counter()
            text = continue_greedy(model, tok, cache, last, gen)
            rec.update(ok=is_correct(s.answer, text), text=text, s=time.perf_counter() - t)
            rec.update(_cell(method, budget, cache, full_bytes, note))
            _close(cache)
            if sig is not None:
                seen[sig] = rec
        out.append(rec)
    base.close()
    mark = {(r["method"], r["budget"]): ("-" if r["ok"] is None else "Y" if r["ok"] else "n")
            for r in out}
    log(f"{task} #{i} {len(ids)} tok depth {s.depth:.2f} '{s.answer}' prefill {prefill_s:.0f}s "
        f"| " + " ".join(f"{m}@{b}:{v}" for (m, b), v in mark.items()))
    return out


def run_ppl(model, tok, i, context, scored, budgets, methods, log):
    ids = corpus_tokens(tok, i, context + scored, 3000, 41000)
    ctx, cont = ids[:context], ids[context:]
    base, last = shared_prefill(model, ctx)
    full_bytes = full_cache_bytes(model, context + scored)
    out = []
    for method, budget, cache, note in method_caches(base, budgets, methods):
        rec = {"task": "ppl", "doc": i, "tokens": context, "scored": scored}
        if cache is None:
            rec.update(method=method, budget=budget, nll=None, note=note)
        else:
            t = time.perf_counter()
            nll = []
            for t_in, target in zip([last] + cont[:-1], cont):
                logits = model(mx.array([[t_in]]), cache=cache)[0, -1].astype(mx.float32)
                nll.append(float((mx.logsumexp(logits) - logits[target]).item()))
            rec.update(nll=nll, s=time.perf_counter() - t)
            rec.update(_cell(method, budget, cache, full_bytes, note))
            _close(cache)
            log(f"ppl #{i} {method}@{budget}: {math.exp(sum(nll) / len(nll)):.3f} "
                f"({rec['s']:.0f}s, {rec['fraction']:.3f} of the cache)")
        out.append(rec)
    base.close()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tasks", nargs="+", default=TASKS, choices=TASKS)
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS + EXTRA_METHODS)
    p.add_argument("--budgets", nargs="+", type=float, default=BUDGETS)
    p.add_argument("--docs", type=int, default=None, help="documents per retrieval task")
    p.add_argument("--first-doc", type=int, default=0)
    p.add_argument("--ppl-docs", type=int, default=None)
    p.add_argument("--ppl-context", type=int, default=None,
                   help="tokens of context before the scored ones (default 2048)")
    p.add_argument("--ppl-scored", type=int, default=None, help="tokens scored (default 256)")
    p.add_argument("--records", default=None, help="append records to this JSONL file as they come")
    p.add_argument("--summarize", nargs="+", default=None, metavar="JSONL",
                   help="no run: tables and plot from these record files")
    p.add_argument("--length", type=int, default=None,
                   help="tokens per retrieval document (default 2048)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="the model's and so the cache's dtype (default: float32 on the CPU "
                        "backend, float16 on GPUs); budgets are fractions of that cache")
    p.add_argument("--cache-limit-gb", type=float, default=None,
                   help="cap MLX's buffer cache (mx.set_cache_limit): processes side by side on "
                        "one GPU (10 of them on an 80 GB H100 ran out of memory without it)")
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    args.name = args.name or ("accuracy_grid_quick" if args.quick else "accuracy_grid")

    info = machine()  # with the commit (common.run_commit)
    if args.summarize:
        records, walls, runs = [], [], []
        for path in args.summarize:
            with open(path) as f:
                for line in f:
                    r = json.loads(line)
                    if r.get("kind") == "wall":
                        walls.append(r["wall_s"])
                    elif r.get("kind") == "run":
                        runs.append(f"{r['commit']} ({r['date']})")
                        info.update({k: r[k] for k in ("dtype", "length") if k in r})
                        if "device" in r:  # the records' machine, not this one
                            info["recorded_on"] = f"{r['device']} ({r.get('backend')})"
                    else:
                        records.append(r)
        info["runs"] = runs or ["records without a run header: " + ", ".join(args.summarize)]
        write_report(records, info, sum(walls), args, os.path.join(RESULTS, args.name))
        return 0
    grid = dict(GRIDS["quick" if args.quick else "full"])
    docs = args.docs if args.docs is not None else grid["docs"]
    n_ppl, context, scored = grid["ppl"]
    n_ppl = args.ppl_docs if args.ppl_docs is not None else n_ppl
    context = args.ppl_context or context
    scored = args.ppl_scored or scored
    if args.length:
        grid["length"] = args.length
    if args.cache_limit_gb is not None:
        mx.set_cache_limit(int(args.cache_limit_gb * 2**30))
    model, tok = tiered.load(dtype=getattr(mx, args.dtype) if args.dtype else None)
    info["dtype"] = str(next((p.dtype for _, p in _leaves(model)), "float32")).replace(
        "mlx.core.", "")
    info["length"] = grid["length"]
    if "ppl" in args.tasks:
        info["ppl_context"] = context
    clock = Clock()
    log = clock.log
    sink = open(args.records, "a") if args.records else None
    if sink:
        sink.write(json.dumps({"kind": "run", "commit": info["commit"], "command": info["command"],
                               "date": info["date"], "dtype": info["dtype"],
                               "backend": info["backend"], "device": info["device"],
                               "length": info["length"]}) + "\n")

    def keep(recs):
        if sink:
            for r in recs:
                sink.write(json.dumps(r) + "\n")
            sink.flush()
        return recs

    records = []
    # document by document, every task (a run cut short keeps every task's first documents)
    for i in range(args.first_doc, args.first_doc + docs):
        for task in [t for t in args.tasks if t != "ppl"]:
            records += keep(run_retrieval(model, tok, task, i, grid["length"], args.budgets,
                                          args.methods, log))
    if "ppl" in args.tasks:
        for i in range(args.first_doc, args.first_doc + n_ppl):
            records += keep(run_ppl(model, tok, i, context, scored, args.budgets, args.methods,
                                    log))
    wall = clock.elapsed()
    if sink:
        sink.write(json.dumps({"kind": "wall", "wall_s": wall}) + "\n")
        sink.close()
    write_report(records, info, wall, args, os.path.join(RESULTS, args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
