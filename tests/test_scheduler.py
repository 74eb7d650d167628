"""Overlap scheduler: worker-count independence, errors, shutdown, concurrent generators."""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_small_model

import tiered
from tiered import TieredCache
from tiered.scheduler import Scheduler, split_heads


def _prompt(n, seed=0):
    return mx.array(np.random.default_rng(seed).integers(10, 49000, n))[None]


def _run(model, cache, prompt, steps=6):
    logits = model(prompt, cache=cache)[:, -1]
    out = []
    for _ in range(steps):
        y = mx.argmax(logits, axis=-1)[:, None]
        logits = model(y, cache=cache)[:, -1]
        out.append(np.array(logits.astype(mx.float32)))
    return np.concatenate(out)


@pytest.fixture(scope="module")
def small():
    return make_small_model("qwen2-gqa-d64", layers=2, seed=4)


def _tiered_threads():
    return [t for t in threading.enumerate() if t.name.startswith("tiered-cpu")]


@pytest.mark.parametrize("kernels", ["numba", "mlx"])
def test_results_identical_with_1_2_4_workers(small, kernels):
    prompt = _prompt(500)
    outs = []
    for workers in (1, 2, 4):
        cache = TieredCache.for_model(small, gpu_budget=0.25, workers=workers, page_size=64,
                                      recent=16, kernels=kernels, max_selected=256)
        outs.append(_run(small, cache, prompt))
        t = cache.scheduler.timings
        assert t.jobs >= 2 * 6 * min(workers, 2)  # every layer and step split across workers
        cache.close()
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


def test_worker_error_propagates_and_nothing_hangs():
    s = Scheduler(2)
    batch = s.batch(0)
    batch.submit(lambda: time.sleep(0.05))
    batch.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        batch.wait()
    ok = s.batch(1)
    ok.submit(lambda: 7)
    assert ok.wait() == [7]  # the pool survives a failed job
    s.close()


def test_gather_error_reaches_the_model_call(small, monkeypatch):
    cache = TieredCache.for_model(small, gpu_budget=0.25, page_size=64, recent=16)
    prompt = _prompt(300, seed=1)
    logits = small(prompt, cache=cache)[:, -1]
    small(mx.argmax(logits, axis=-1)[:, None], cache=cache)  # compress

    def boom(*args, **kwargs):
        raise RuntimeError("host page unreadable")

    from tiered.cpu import kernels

    monkeypatch.setattr(kernels, "gather_partial", boom)
    with pytest.raises(RuntimeError, match="host page unreadable"):
        mx.eval(small(mx.array([[3]]), cache=cache))
    cache.close()


def test_close_leaves_no_thread_running(small):
    before = len(_tiered_threads())
    cache = TieredCache.for_model(small, gpu_budget=0.25, workers=3, page_size=64, recent=16)
    _run(small, cache, _prompt(300, seed=2), steps=2)
    assert len(_tiered_threads()) > before
    cache.close()
    assert len(_tiered_threads()) == before
    s = Scheduler(2)
    b = s.batch()
    b.submit(lambda: 1)
    b.wait()
    s.close()
    s.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        s.batch().submit(lambda: 1)
    assert len(_tiered_threads()) == before


def test_two_generators_run_concurrently_and_correctly(small):
    """Two threads, each generating with its own cache, get what they get alone."""
    prompts = [_prompt(400, seed=10), _prompt(350, seed=11)]
    opts = dict(gpu_budget=0.25, page_size=64, recent=16, workers=2)
    alone = []
    for p in prompts:
        c = TieredCache.for_model(small, **opts)
        alone.append(_run(small, c, p))
        c.close()
    results, errors = [None, None], []

    def work(i):
        try:
            c = TieredCache.for_model(small, **opts)
            results[i] = _run(small, c, prompts[i])
            c.close()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for got, ref in zip(results, alone):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_split_heads_covers_every_head_once():
    for H in (1, 3, 8, 32):
        for w in (1, 2, 3, 4, 16):
            parts = split_heads(H, w)
            assert [h for r in parts for h in r] == list(range(H))
            assert len(parts) == min(H, w)


def test_overlap_is_measured(small):
    cache = TieredCache.for_model(small, gpu_budget=0.25, page_size=64, recent=16)
    _run(small, cache, _prompt(400, seed=3), steps=4)
    t = cache.scheduler.timings
    assert t.jobs > 0 and t.cpu_busy > 0
    assert 0.0 <= t.overlap_ratio <= 1.0
    summary = tiered.report_dict(cache)
    assert "scheduler" in summary and summary["scheduler"]["overlap_ratio"] == t.overlap_ratio
    cache.close()
