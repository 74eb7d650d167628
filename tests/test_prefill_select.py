"""Block-wise prefill with retrieval (tiered.layer.chunked): a prompt chunk past ``prefill_window``
also attends to the host tokens its last queries score highest on the compressed keys. With
every token retrieved the chunk sees what an exact prefill sees, so every layer's keys and
values on the host pages are the exact prefill's; without retrieval (HCAttention's anchor and
local blocks only) the deeper layers' are not."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_small_model

import mlx.core as mx

import tiered


@pytest.fixture(scope="module")
def small():
    return make_small_model("llama-gqa-d64", layers=3)


def _prefill(model, cache, ids, chunk=128):
    for i in range(0, len(ids), chunk):
        model(mx.array(ids[i : i + chunk])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def _host_vs_exact(model, select, **tier):
    ids = np.random.default_rng(5).integers(0, 1000, size=1200).tolist()
    ref = _prefill(model, tiered.TieredCache.for_model(model, 1.0), ids)
    got = _prefill(model, tiered.TieredCache.for_model(
        model, 0.25, prefill_window=256, anchor_tokens=128, compress_from=256, page_size=16,
        host_dtype="float32", prefill_select=select, **tier), ids)
    errs = []
    for a, b in zip(ref, got):
        assert b.phase == "compressed"
        n = b.host.length
        assert n > 900  # most of the prompt went block-wise past the window
        k_ref, v_ref = (np.array(x[0, :, :n], np.float32) for x in a.keys_and_values())
        errs.append(max(np.abs(b.host.read("keys", 0, 0, n) - k_ref).max(),
                        np.abs(b.host.read("values", 0, 0, n) - v_ref).max()))
    got.close()
    return errs


def test_every_token_retrieved_gives_the_exact_prefills_keys_and_values(small):
    errs = _host_vs_exact(small, 100_000)
    assert max(errs) < 1e-3, errs


def test_retrieval_reads_pages_on_the_disk_tier(small, tmp_path):
    # every page past a tiny host budget on disk: the chunks still retrieve (they once did not,
    # and a question asked after a layer-by-layer prefill lost its pass key)
    errs = _host_vs_exact(small, 100_000, host_budget="64KB", disk_dir=str(tmp_path))
    assert max(errs) < 1e-3, errs


def test_without_retrieval_the_deeper_layers_differ(small):
    errs = _host_vs_exact(small, 0)
    assert errs[0] < 1e-3  # layer 0's keys come from the embeddings alone
    assert max(errs[1:]) > 1e-2, errs


def test_prefill_select_is_checked(small):
    with pytest.raises(ValueError, match="prefill_select"):
        tiered.TieredCache.for_model(small, 0.25, prefill_select=-1)
