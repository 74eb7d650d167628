"""Block-wise prefill with retrieval (tiered.chunked): a prompt chunk past ``prefill_window``
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


def _host_vs_exact(model, select, host_keys=True):
    """Per layer, the largest difference between the host pages after a block-wise prefill
    and an exact prefill's keys and values (values only without host keys)."""
    ids = np.random.default_rng(5).integers(0, 1000, size=1200).tolist()
    ref = _prefill(model, tiered.TieredCache.for_model(model, 1.0), ids)
    got = _prefill(model, tiered.TieredCache.for_model(
        model, 0.25, prefill_window=256, anchor_tokens=128, compress_from=256, page_size=16,
        host_dtype="float32", prefill_select=select, host_keys=host_keys), ids)
    errs = []
    for a, b in zip(ref, got):
        assert b.phase == "compressed"
        n = b.host.length
        assert n > 900  # most of the prompt went block-wise past the window
        k_ref, v_ref = (np.array(x[0, :, :n], np.float32) for x in a.keys_and_values())
        err = np.abs(b.host.read("values", 0, 0, n) - v_ref).max()
        if host_keys:
            err = max(err, np.abs(b.host.read("keys", 0, 0, n) - k_ref).max())
        errs.append(float(err))
    got.close()
    return errs


def test_every_token_retrieved_gives_the_exact_prefills_keys_and_values(small):
    errs = _host_vs_exact(small, 100_000)
    assert max(errs) < 1e-3, errs


def test_without_retrieval_the_deeper_layers_differ(small):
    errs = _host_vs_exact(small, 0)
    assert errs[0] < 1e-3  # layer 0's keys come from the embeddings alone
    assert max(errs[1:]) > 1e-2, errs


def test_without_host_keys_retrieval_reads_the_codes_keys(small):
    """Values only on the host (the million-token layout): the retrieved tokens' keys are their
    codes' centroids, so every token retrieved brings the deeper layers' values closer to the
    exact prefill's than no retrieval does (not equal: the keys are approximate)."""
    with_codes = _host_vs_exact(small, 100_000, host_keys=False)
    without = _host_vs_exact(small, 0, host_keys=False)
    assert with_codes[0] < 1e-3 and without[0] < 1e-3
    assert all(a < 0.8 * b for a, b in zip(with_codes[1:], without[1:])), (with_codes, without)


@pytest.mark.parametrize("numpy_path", [True, False])
def test_decode_rows_are_the_codes_centroids(numpy_path):
    from tiered.keys import CodebookKeys

    rng = np.random.default_rng(1)
    H, c, ds, d, n = 2, 16, 4, 16, 40
    book = rng.normal(size=(H, d // ds, c, ds)).astype(np.float32)  # a codebook per group
    keys = CodebookKeys(H, book, 64, 64, numpy_path=numpy_path)
    x = rng.normal(size=(H, n, d)).astype(np.float32)
    keys.append(mx.array(x), 0)
    tok = np.array([[0, 7, 39], [3, 3, 21]])
    got = keys.decode_rows(tok)
    codes = np.array(keys.codes[:, :n]).astype(np.int64)
    for h in range(H):
        for j, t in enumerate(tok[h]):
            want = np.concatenate([book[h, i, codes[h, t, i]] for i in range(d // ds)])
            np.testing.assert_array_equal(got[h, j], want)
            # and each group's centroid is the nearest to the key's group
            for i in range(d // ds):
                dist = ((book[h, i] - x[h, t, i * ds:(i + 1) * ds]) ** 2).sum(axis=1)
                assert dist[codes[h, t, i]] <= dist.min() + 1e-5


def test_prefill_select_is_checked(small):
    with pytest.raises(ValueError, match="prefill_select"):
        tiered.TieredCache.for_model(small, 0.25, prefill_select=-1)
