"""Per layer of a layer-by-layer prefill under ``memory_budget``: the anonymous memory its
compress takes above what the process held when it began (issue 61: the last layer's jump).

Loads the embedded model, makes the pass-key demo document of N tokens (seed 1, 17% depth),
runs ``tiered.layerwise_prefill`` with a quarter of the full cache as ``memory_budget`` and
prints, for each layer's settle: RssAnon above the loaded model at its start, its peak during
the host copy, the codebook, ``CompressedLayer.from_exact`` (the worst-coded search of the
layers that keep every value on the host included) and the whole settle (sampled every 2 ms).

    python bench/probes/compress_memory.py 8192 [WORST_CODED_BLOCK]
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
from tiered import exact_phase, host_tier
from tiered.layerwise_prefill import layerwise_prefill
from tiered.planning import context, tasks
from tiered.planning.geometry import model_geometry

from memory_layers import anon_mib


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    if len(sys.argv) > 2:  # tokens a pass of the worst-coded search reads (one pass: 1e9)
        from tiered.step import keys
        keys.WORST_CODED_BLOCK = int(float(sys.argv[2]))
    model, tok = tiered.load()
    mx.eval(model.parameters())
    base = anon_mib()
    ids = tok.encode(tasks.passkey(tok, n, 0.17, seed=1).prompt)[:n]
    budget = int(0.25 * model_geometry(model, len(model.model.layers)).full_bytes(len(ids)))
    peak, done, parts = [0.0], threading.Event(), []

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon_mib())
            time.sleep(0.002)

    def timed(label, fn):
        def run(*a, **k):
            start, peak[0] = anon_mib() - base, 0.0
            try:
                return fn(*a, **k)
            finally:
                parts.append(f"{label} +{peak[0] - base - start:5.1f}")
        return run

    host_tier.HostTier._to_host = timed("host copy", host_tier.HostTier._to_host)
    context.SharedContext.codebook_for = timed("codebook", context.SharedContext.codebook_for)
    exact_phase.CompressedLayer.from_exact = timed(
        "from_exact", exact_phase.CompressedLayer.from_exact)
    threading.Thread(target=sample, daemon=True).start()
    with tempfile.TemporaryDirectory() as pages:
        cache = tiered.TieredCache.for_model(model, tokenizer=tok, gpu_budget=0.0625,
                                             memory_budget=budget, disk_dir=pages,
                                             prefill_window=len(ids))
        print(f"{len(ids)} tokens, memory_budget {budget / (1 << 20):.1f} MiB; MiB above the "
              "model (RssAnon) at the settle's start, then each part's peak above that start")
        for i, c in enumerate(cache):
            def settle(plain=c.settle, i=i):
                parts.clear()
                start, peak[0] = anon_mib() - base, 0.0
                out = plain()
                whole = peak[0] - base - start
                print(f"layer {i:2d}: start {start:6.1f} | settle +{whole:5.1f} | "
                      + " | ".join(parts), flush=True)
                return out
            c.settle = settle
        layerwise_prefill(model, cache, ids)
        done.set()
        cache.close()


if __name__ == "__main__":
    main()
