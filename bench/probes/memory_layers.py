"""Per layer of a layer-by-layer prefill under ``memory_budget``: the process's anonymous memory
against what the budget accounts (issue 61: does the budget bound the process?).

Loads the embedded model, makes the pass-key demo document of N tokens, and runs
``tiered.layerwise_prefill`` with a quarter (or FRACTION) of the full cache as
``memory_budget``; after each layer prints the RssAnon peak since the previous layer above
what the loaded model held, the budget's accounting (planned accelerator tier, the pass's
working set, host pages), and the cache's tiers.

    python bench/probes/memory_layers.py 8192 [FRACTION]
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx

import tiered
from tiered.layerwise_prefill import layerwise_prefill
from tiered.planning import tasks
from tiered.planning.geometry import model_geometry

MIB = 1 << 20


def anon_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    frac = float(sys.argv[2]) if len(sys.argv) > 2 else 0.25
    model, tok = tiered.load()
    mx.eval(model.parameters())
    base = anon_mib()
    ids = tok.encode(tasks.passkey(tok, n, 0.17, seed=1).prompt)[:n]
    geo = model_geometry(model, len(model.model.layers))
    budget = int(frac * geo.full_bytes(len(ids)))
    with tempfile.TemporaryDirectory() as pages:
        cache = tiered.TieredCache.for_model(model, tokenizer=tok, gpu_budget=0.0625,
                                             memory_budget=budget, disk_dir=pages,
                                             prefill_window=len(ids))
        ctx, shared = cache.context, cache.context.host_budget
        print(f"{len(ids)} tokens, memory_budget {budget / MIB:.1f} MiB; the model "
              f"{base:.1f} MiB anonymous", flush=True)
        peak, done = [0.0], threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], anon_mib())
                time.sleep(0.02)

        threading.Thread(target=sample, daemon=True).start()

        def progress(layer, layers):
            b = tiered.report_dict(cache)["bytes"]
            counted = ctx.accelerator_bytes() + shared.transient + shared.used
            print(f"layer {layer:2d}: peak {peak[0] - base:7.1f} MiB above the model | counted "
                  f"{counted / MIB:7.1f} (working set {shared.transient / MIB:.1f}) | "
                  f"accelerator {b['accelerator'] / MIB:6.1f} host {b['host'] / MIB:6.1f} "
                  f"disk {b['disk'] / MIB:6.1f}", flush=True)
            peak[0] = 0.0

        stats = layerwise_prefill(model, cache, ids, progress=progress)
        done.set()
        print(f"chunk {stats['chunk']}, {stats['tokens_per_s']:.1f} tok/s")
        cache.close()


if __name__ == "__main__":
    main()
