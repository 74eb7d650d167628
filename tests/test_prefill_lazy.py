"""What a prompt chunk leaves lazy is evaluated with the chunk: on accelerators the ring rows a
chunk's inserts journal (tiered.undo.ring_rows) wait in the layer's ``_later`` for a decode
step, and none comes during a prefill. Left there, each held the ring's whole buffer as of its
chunk: on an H200, 47 GiB of a 1M-token prefill of a Llama-3-8B. ``kernels="mlx"`` takes that
path on the CPU backend."""

from __future__ import annotations

import mlx.core as mx
from conftest import make_small_model

from tiered import TieredCache
from tiered.prefill import prefill


def test_a_prompt_chunk_leaves_nothing_waiting_for_a_decode_step():
    model = make_small_model("llama-gqa-d64", layers=2)
    cache = TieredCache.for_model(model, gpu_budget=0.25, compress_from=64, prefill_window=64,
                                  kernels="mlx")
    ids = [(i * 7919) % 4000 for i in range(1024)]
    waiting, journaled = [], []

    def on_chunk(done):
        layers = [c.compressed for c in cache if c.phase == "compressed"]
        waiting.append(sum(len(c._later) for c in layers))
        journaled.append(sum(len(e[2]) > 2 for c in layers for e in c.journal.entries
                             if e[1] == "append"))

    prefill(model, cache, ids, chunk=64, on_chunk=on_chunk)
    assert len(waiting) == 16 and sum(journaled[4:]) > 0  # the ring's inserts journal rows
    assert waiting == [0] * 16
    # and the cache still decodes as it would have
    y = mx.argmax(model(mx.array([[5]]), cache=cache)[:, -1], axis=-1)
    mx.eval(y)
