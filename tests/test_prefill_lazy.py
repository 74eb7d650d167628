"""What a prompt chunk leaves lazy is evaluated with the layer's state: on accelerators a
decode token's journaled ring rows (tiered.step.undo.ring_rows) wait in the layer's ``_later`` for
its step, but no step comes during a prompt. Left there, each chunk's held the ring's whole
buffer as of its chunk: on an H200, 47 GiB of a 1M-token prefill of a Llama-3-8B. So a chunk's
rows are tied to the ring instead, and evaluating the state evaluates them, whether tiered's
prefill or mlx-lm's own prompt loop (``mx.eval([c.state for c in cache])``) drives it.
``kernels="mlx"`` takes the accelerators' path on the CPU backend."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import make_small_model

from tiered import TieredCache
from tiered.prefill import prefill


def _mlx_lm_loop(model, cache, ids, chunk, on_chunk):
    x = mx.array(ids)[None]
    for start in range(0, len(ids), chunk):
        model(x[:, start: start + chunk], cache=cache)
        mx.eval([c.state for c in cache])  # mlx-lm's generate_step evaluates this per chunk
        on_chunk(start + chunk)


@pytest.mark.parametrize("driver", ["tiered", "mlx-lm"])
def test_a_prompt_chunk_leaves_nothing_waiting_for_a_decode_step(driver):
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

    if driver == "tiered":
        prefill(model, cache, ids, chunk=64, on_chunk=on_chunk)
    else:
        _mlx_lm_loop(model, cache, ids, 64, on_chunk)
    assert len(waiting) == 16 and sum(journaled[4:]) > 0  # the ring's inserts journal rows
    assert waiting == [0] * 16
    # and the cache still decodes, and gives a chunk back exactly through its journal
    y = mx.argmax(model(mx.array([[5]]), cache=cache)[:, -1], axis=-1)
    mx.eval(y)
