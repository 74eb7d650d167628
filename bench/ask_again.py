"""Ask again: a passkey answer from a saved-and-loaded tiered cache equals the answer from the
cache that was saved (embedded model, 8k-token documents).

Each document is prefilled once into a TieredCache at ``--budget`` with a prefill window
shorter than the document, so the cache compresses during the prefill and the saved
directory holds everything the tiered state has: codes, codebooks, host pages, H2O
accumulators, the resident set. The cache is saved (``TieredCacheList.save``), the
original answers, then the directory is loaded into a fresh cache list
(``TieredCacheList.load``) that answers the same question: the two generations must match
token for token.

    python bench/ask_again.py            # 8k tokens, depths 10/50/90%
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import common  # noqa: F401  (tiered before mlx)
from common import continue_greedy, machine, md_table, write_results

import tiered
from tiered.prefill import prefill
from tiered.planning.tasks import is_correct, passkey


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    p.add_argument("--budget", type=float, default=0.125)
    p.add_argument("--prefill-window", type=int, default=4096)
    p.add_argument("--answer-tokens", type=int, default=12)
    p.add_argument("--name", default="ask_again")
    args = p.parse_args(argv)
    info = machine()
    model, tok = tiered.load()
    rows, records = [], []
    for depth in args.depths:
        sample = passkey(tok, args.tokens - 8, depth, seed=0)
        ids = tok.encode(sample.prompt)
        cache = tiered.TieredCache.for_model(model, gpu_budget=args.budget,
                                             prefill_window=args.prefill_window)
        t = time.perf_counter()
        prefill(model, cache, ids[:-1], chunk=512)
        prefill_s = time.perf_counter() - t
        d = tempfile.mkdtemp(prefix="tiered-ask-again-")
        try:
            t = time.perf_counter()
            cache.save(os.path.join(d, "cache"), model)
            save_s = time.perf_counter() - t
            size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)
            first = continue_greedy(model, tok, cache, ids[-1], args.answer_tokens)
            cache.close()
            t = time.perf_counter()
            loaded = tiered.TieredCacheList.load(os.path.join(d, "cache"), model)
            load_s = time.perf_counter() - t
            again = continue_greedy(model, tok, loaded, ids[-1], args.answer_tokens)
            loaded.close()
        finally:
            shutil.rmtree(d, ignore_errors=True)
        rec = {"depth": depth, "tokens": len(ids), "key": sample.answer, "first": first,
               "again": again, "same": first == again,
               "first_ok": is_correct(sample.answer, first),
               "again_ok": is_correct(sample.answer, again), "prefill_s": prefill_s,
               "save_s": save_s, "load_s": load_s, "saved_bytes": size}
        records.append(rec)
        print(f"depth {depth:.1f} key {sample.answer}: first {first!r} | loaded {again!r} | "
              f"same {rec['same']} (prefill {prefill_s:.0f}s, save {save_s:.1f}s, load "
              f"{load_s:.1f}s, {size / 2**20:.1f} MiB)", flush=True)
        rows.append([f"{depth:.0%}", sample.answer, repr(first), repr(again), rec["same"],
                     f"{rec['first_ok']} / {rec['again_ok']}", f"{size / 2**20:.1f}",
                     f"{save_s:.1f} / {load_s:.1f}"])
    md = (f"# Ask again\n\n`{info['command']}` on {info['platform']} ({info['backend']}, "
          f"{info['cpu_count']} cores), {info['date']}.\n\nEmbedded SmolLM2-135M, passkey in "
          f"{args.tokens} tokens, gpu_budget {args.budget}, prefill window "
          f"{args.prefill_window} (compressed during the prefill). Saved after the prefill; "
          "the original answers, then the loaded copy answers the same question.\n\n"
          + md_table(["depth", "key", "answer (saved cache)", "answer (loaded cache)", "same",
                      "correct (saved / loaded)", "saved MiB", "save / load s"], rows))
    write_results(args.name, {"machine": info, "args": vars(args), "records": records}, md)
    print(md)
    return 0 if all(r["same"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
