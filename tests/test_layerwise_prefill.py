"""Layer-by-layer prefill equals the exact prefill, and leaves every layer compressed."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_small_model

import mlx.core as mx

import tiered
from tiered.layerwise_prefill import layerwise_prefill


@pytest.fixture(scope="module")
def small():
    return make_small_model("llama-gqa-d64", layers=3)


def test_same_keys_and_values_as_the_exact_prefill(small):
    ids = np.random.default_rng(0).integers(0, 1000, size=700).tolist()
    ref = tiered.TieredCache.for_model(small, 1.0)
    for i in range(0, len(ids), 256):
        small(mx.array(ids[i : i + 256])[None], cache=ref)
    got = tiered.TieredCache.for_model(small, 1.0)
    layerwise_prefill(small, got, ids, chunk=256)
    for a, b in zip(ref, got):
        assert a.offset == b.offset == len(ids)
        for x, y in zip(a.keys_and_values(), b.keys_and_values()):
            np.testing.assert_allclose(np.array(x), np.array(y), rtol=1e-5, atol=1e-5)
    # and the next token's logits
    nxt = mx.array([[5]])
    np.testing.assert_allclose(np.array(small(nxt, cache=ref)), np.array(small(nxt, cache=got)),
                               rtol=1e-4, atol=1e-4)


def test_a_layer_s_exact_buffers_are_allocated_once_for_its_pass(small, monkeypatch):
    """The pass knows the prompt's length: each layer's exact keys and values get room for it
    at once, not one growth (a copy of all that is held) per 256-token step."""
    from tiered import exact_phase

    grown = []
    real = exact_phase.mx.concatenate
    monkeypatch.setattr(exact_phase.mx, "concatenate",
                        lambda xs, *a, **k: (grown.append(len(xs)), real(xs, *a, **k))[1])
    ids = np.random.default_rng(1).integers(0, 1000, size=1000).tolist()
    got = tiered.TieredCache.for_model(small, 1.0)
    layerwise_prefill(small, got, ids, chunk=256)
    assert not grown
    assert all(c.offset == len(ids) and c.keys.shape[2] == len(ids) for c in got)


def test_every_layer_compresses_after_its_pass(small):
    ids = np.random.default_rng(1).integers(0, 1000, size=900).tolist()
    cache = tiered.TieredCache.for_model(small, 0.25, compress_from=256, prefill_window=4096)
    seen = []
    layerwise_prefill(small, cache, ids, chunk=300,
                      progress=lambda i, n: seen.append([c.phase for c in cache]))
    assert seen[0] == ["compressed", "exact", "exact"]  # one exact layer at a time
    assert [c.phase for c in cache] == ["compressed"] * 3
    small(mx.array([[7]]), cache=cache)
    rep = tiered.report_dict(cache)
    assert rep["bytes"]["accelerator"] <= rep["budget_bytes"]
    # the exact K/V held at once: one layer's, not every layer's
    peaks = [c.stats.peak_transient_bytes for c in cache]
    assert rep["prefill_by_layer"] and rep["peak_transient_accelerator_bytes"] == max(peaks) > 0
    assert "one layer's at a time" in tiered.report(cache) or (
        rep["peak_transient_accelerator_bytes"] <= rep["budget_bytes"])
    cache.close()


def test_tiered_run_chooses_the_prefill(small):
    """tiered run --prefill auto: layer by layer past prefill_window where the model allows
    it, chunk by chunk (exact) within it, in an exact cache, or where the model does not."""
    from tiered.commands.cli_prefill import prefill_choice

    assert prefill_choice("auto", small, 900, {"prefill_window": 512})[0] == "layers"
    assert prefill_choice("auto", small, 400, {"prefill_window": 512})[0] == "chunks"
    assert prefill_choice("auto", small, 900, {"prefill_window": 512,
                                               "gpu_budget": 1.0})[0] == "chunks"
    assert prefill_choice("chunks", small, 900, {"prefill_window": 512})[0] == "chunks"
    gemma = make_small_model("gemma3-mha-d64", layers=2)
    how, why = prefill_choice("auto", gemma, 900, {"prefill_window": 512})
    assert how == "chunks" and "supports" in why
    with pytest.raises(ValueError, match="supports"):
        prefill_choice("layers", gemma, 900, {})
    # a disk tier does not change the choice (a question chunk over pages on disk retrieves:
    # test_a_question_after_a_prefill_spilled_to_disk)
    assert prefill_choice("auto", small, 900, {"prefill_window": 512,
                                               "host_budget": "1MB"})[0] == "layers"
    # under memory_budget even a prompt within prefill_window: one layer's K/V at a time
    how, why = prefill_choice("auto", small, 400, {"prefill_window": 512, "memory_budget": "1MB"})
    assert how == "layers" and "memory_budget" in why


def test_a_question_after_a_prefill_spilled_to_disk(small, tmp_path):
    """A question fed as one chunk after a layer-by-layer prefill sees the same tokens whether
    the layers' pages are in RAM or on the disk tier (it once saw none of them on disk: the
    embedded model's 8k pass-key demo answered garbage)."""
    ids = np.random.default_rng(3).integers(0, 1000, size=900).tolist()
    question = mx.array(np.random.default_rng(4).integers(0, 1000, size=12))[None]
    logits = []
    for tier in ({}, {"host_budget": "64KB", "disk_dir": str(tmp_path)}):
        cache = tiered.TieredCache.for_model(small, 0.25, prefill_window=1024, page_size=16,
                                             host_dtype="float32", **tier)
        layerwise_prefill(small, cache, ids, chunk=256)
        assert all(c.phase == "compressed" for c in cache)
        assert bool(sum(c.host.disk_bytes for c in cache)) == bool(tier)
        logits.append(np.array(small(question, cache=cache)))
        cache.close()
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_refusals(small):
    cache = tiered.TieredCache.for_model(small, 0.25, prefill_window=100)
    with pytest.raises(ValueError, match="prefill_window"):
        layerwise_prefill(small, cache, list(range(200)))
    gemma = make_small_model("gemma3-mha-d64", layers=2)
    with pytest.raises(ValueError, match="supports"):
        layerwise_prefill(gemma, tiered.TieredCache.for_model(gemma, 1.0), list(range(10)))


def test_under_memory_budget_the_pass_and_the_cache_stay_within_it(small, tmp_path):
    """memory_budget: after every layer of the pass the host RAM the pages hold, the
    accelerator tier and the pass's working set (hidden states, a chunk's attention) add up to
    at most the budget; the score buffer shrinks to fit; afterwards nothing transient is
    counted and the buffer's cap is back."""
    ids = np.random.default_rng(3).integers(0, 1000, size=900).tolist()
    free = tiered.TieredCache.for_model(small, 0.25, prefill_window=1024, page_size=16,
                                        host_dtype="float32")
    layerwise_prefill(small, free, ids, chunk=256)
    b = tiered.report_dict(free)["bytes"]
    from tiered.cpu.attention import MAX_SCRATCH_BYTES, scratch_bytes
    from tiered.layerwise_prefill import _working_set
    from tiered.runtime.ops import on_cpu_backend

    # the working set at the chunk the pass will take at most (CPU: a bounded score buffer; GPU:
    # a smaller chunk): the host pages then get about half of what they need, the rest spills
    geo = free.context.model_geometry
    full = geo.full_bytes(len(ids))  # the plan's tier and one exact layer during its pass
    base = max(b["accelerator"], int(0.25 * full)) + full // geo.layers + b["host"] // 2
    chunk, scratch, total = (4096, 1 << 20, base) if on_cpu_backend() else (
        64, MAX_SCRATCH_BYTES, base)
    for _ in range(8):  # on the CPU the score buffer's cap is total // 16 (a fixed point)
        if on_cpu_backend():
            scratch = min(scratch_bytes(), max(1 << 20, total // 16))
        total = base + sum(_working_set(small, len(ids), chunk, 4, scratch)) + 1024
    free.close()
    cache = tiered.TieredCache.for_model(small, 0.25, prefill_window=1024, page_size=16,
                                         host_dtype="float32", memory_budget=total,
                                         disk_dir=str(tmp_path))
    shared = cache.context.host_budget
    seen = []

    def check(layer, layers):
        seen.append(shared.transient)
        assert shared.used + cache.context.accelerator_bytes() + shared.transient <= total, (
            shared.used, cache.context.accelerator_bytes(), shared.transient, total)

    stats = layerwise_prefill(small, cache, ids, chunk=4096, progress=check)
    assert min(seen) > 0 and shared.transient == 0
    if on_cpu_backend():  # the score buffer is bounded, and restored after
        assert stats["scratch_bytes"] < MAX_SCRATCH_BYTES == scratch_bytes()
    else:  # a GPU's attention holds a chunk's scores: the chunk shrinks
        assert stats["chunk"] < 4096 and stats["scratch_bytes"] == MAX_SCRATCH_BYTES
    b = tiered.report_dict(cache)["bytes"]
    assert b["disk"] > 0 and b["accelerator"] + b["host"] <= total
    cache.close()


def test_on_the_cpu_the_chunk_shrinks_only_where_the_pass_would_not_fit(small):
    """CPU backend: the pass's chunk halves (to 256 at least) while its working set and the
    accelerator tier's plan exceed the memory budget, and stays where they fit (each chunk
    copies the layer's keys and values: smaller chunks cost time)."""
    from tiered.layerwise_prefill import _within, _working_set
    from tiered.runtime.ops import on_cpu_backend

    if not on_cpu_backend():
        pytest.skip("the CPU backend's rule")
    n, plan = 8192, 20 << 20
    roomy = 1 << 34
    assert _within(small, n, 2048, roomy, 4, plan)[0] == 2048
    need = {c: sum(_working_set(small, n, c, 4, 1 << 20)) + plan for c in (2048, 1024, 512, 256)}
    assert need[2048] > need[1024] > need[512] > need[256]
    total = (need[512] + need[1024]) // 2  # fits 512, not 1024
    chunk, scratch = _within(small, n, 2048, total, 4, plan)
    assert chunk == 512 and sum(_working_set(small, n, chunk, 4, scratch)) + plan <= total
    # below what even 256 needs: 256, the smallest (the pass still runs)
    assert _within(small, n, 2048, need[256] // 2, 4, plan)[0] == 256
