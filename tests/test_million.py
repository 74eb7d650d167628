"""Bounded-memory prefill: a 100k-token synthetic prompt on a tiny random model."""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import _get_classes

import tiered
from tiered.prefill import current_rss_bytes, prefill


def tiny_model():
    cfg = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
               num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-5,
               vocab_size=1000, rope_theta=10000.0, tie_word_embeddings=True,
               max_position_embeddings=1 << 20)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(cfg))
    mx.eval(model.parameters())
    return model


def test_memory_stays_flat_over_a_100k_prefill(tmp_path):
    n, chunk = 100_000, 2048
    model = tiny_model()
    ids = np.random.default_rng(0).integers(0, 1000, n).tolist()
    host_budget = 4 * 2**20
    cache = tiered.TieredCache.for_model(model, gpu_budget=0.125, host_budget=host_budget,
                                         disk_dir=str(tmp_path), prefill_window=8192,
                                         anchor_tokens=chunk, page_size=256)
    # Full exact K/V of 100k tokens would be 100k x 2 layers x 1 kv head x (32 + 32) x 4 B.
    full = n * 2 * 64 * 4
    gc.collect()
    base = current_rss_bytes()
    rss, acc, transient, spilled = [], [], [], []

    def sample(done):
        tb = cache.tier_bytes()
        rss.append(current_rss_bytes() - base)
        acc.append((done, tb["accelerator"] - tb["transient"]))
        spilled.append(tb["disk"] > 0)
        transient.append(tb["transient"])
        assert tb["host"] <= host_budget

    stats = prefill(model, cache, ids, chunk=chunk, on_chunk=sample)
    assert stats["tokens"] == n
    tb = cache.tier_bytes()
    assert all(c.phase == "compressed" for c in cache)
    assert tb["disk"] > 0 and tb["host"] <= host_budget
    # the steady accelerator tier stays within its (growing) budget once past the exact window
    for done, a in acc:
        if done > 8192:
            assert a <= 0.125 * done * 2 * 64 * 4, (done, a)
    # the prefill working set is bounded: exact window first, then anchor + two chunks
    assert max(transient[len(transient) // 2 :]) <= 2 * 64 * 4 * (chunk + 2 * chunk)
    # Process memory is flat after the one-time costs of compressing (kernels, k-means, the
    # block-wise retrieval's kernels) and of the first spill to the disk tier: from the first
    # chunk past the window with pages on disk to the end it grows by the accelerator tier's
    # growth plus a small slack, while keeping the prompt's K/V would add full / 2 over that span.
    first = next(i for i, (done, _) in enumerate(acc) if done > 8192 + chunk and spilled[i])
    grew = rss[-1] - rss[first]
    tier_grew = acc[-1][1] - acc[first][1]
    slack = 12 * 2**20
    assert grew <= tier_grew + slack < full * (n - acc[first][0]) / n, (grew, tier_grew, full)
    cache.close()


def test_prefill_loop_leaves_the_cache_as_evaluating_state_does():
    """tiered.prefill evaluates each chunk's lazy arrays without building ``state``
    (``lazy_arrays``); mlx-lm evaluates ``state``. Both loops give the same cache: the same
    logits after, and the same arrays in ``state``."""
    from mlx.utils import tree_flatten

    model = tiny_model()
    ids = np.random.default_rng(3).integers(0, 1000, 6000).tolist()
    opts = dict(gpu_budget=0.25, prefill_window=2048, anchor_tokens=512, page_size=64)
    ours = tiered.TieredCache.for_model(model, **opts)
    prefill(model, ours, ids, chunk=512)
    theirs = tiered.TieredCache.for_model(model, **opts)
    x = mx.array(ids)[None]
    for i in range(0, len(ids), 512):
        model.model(x[:, i : i + 512], cache=theirs)
        mx.eval([c.state for c in theirs])
    assert all(c.phase == "compressed" for c in ours)
    q = mx.array([[7, 8, 9]])
    np.testing.assert_allclose(np.array(model(q, cache=ours)), np.array(model(q, cache=theirs)),
                               rtol=1e-5, atol=1e-5)
    for a, b in zip(ours, theirs):
        fa, fb = tree_flatten(a.state[3]), tree_flatten(b.state[3])
        assert [k for k, _ in fa] == [k for k, _ in fb]
        for (k, va), (_, vb) in zip(fa, fb):
            if isinstance(va, mx.array) and va.size:
                np.testing.assert_array_equal(np.array(va), np.array(vb), err_msg=k)


@pytest.mark.parametrize("at", [700, 3000, 5990])  # exact window, a middle chunk, the last
def test_a_non_finite_prompt_token_stops_the_prefill(at):
    """A token whose keys are non-finite stops tiered.prefill with the door's ValueError naming
    the first layer, wherever it lies: on accelerators the chunks are queued one ahead and a
    chunk's checks are read after the next one is queued, the last chunk's before returning."""
    model = tiny_model()
    emb = model.model.embed_tokens.weight
    emb[999] = float("inf")  # the token's hidden state, then its keys, are not finite
    mx.eval(emb)
    ids = np.random.default_rng(4).integers(0, 998, 6000).tolist()
    ids[at] = 999
    cache = tiered.TieredCache.for_model(model, gpu_budget=0.25, prefill_window=2048,
                                         anchor_tokens=512, page_size=64)
    with pytest.raises(ValueError, match="layer 0: non-finite keys or values"):
        prefill(model, cache, ids, chunk=512)
    cache.close()
