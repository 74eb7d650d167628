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
from tiered.scheduler.pool import clip_intervals, union_length


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
    # Compare sets, not counts: a cache an earlier test left to the garbage collector may
    # stop its own workers while this test runs.
    before = set(_tiered_threads())
    cache = TieredCache.for_model(small, gpu_budget=0.25, workers=3, page_size=64, recent=16)
    _run(small, cache, _prompt(300, seed=2), steps=2)
    assert set(_tiered_threads()) - before
    cache.close()
    assert not set(_tiered_threads()) - before
    s = Scheduler(2)
    b = s.batch()
    b.submit(lambda: 1)
    b.wait()
    assert set(_tiered_threads()) - before
    s.close()
    s.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        s.batch().submit(lambda: 1)
    assert not set(_tiered_threads()) - before


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
    t0 = time.perf_counter()
    _run(small, cache, _prompt(400, seed=3), steps=4)
    elapsed = time.perf_counter() - t0
    t = cache.scheduler.timings
    assert t.jobs > 0 and t.cpu_busy > 0
    assert 0.0 <= t.overlap_ratio <= 1.0
    assert 0 < t.cpu_wall <= t.cpu_busy + 1e-9 and 0 <= t.hidden <= t.cpu_wall
    summary = tiered.report_dict(cache)
    assert "scheduler" in summary and summary["scheduler"]["overlap_ratio"] == t.overlap_ratio
    # Decode-step phases: every phase of the step's path, none negative, within the run.
    phases = summary["step_phases_s"]
    assert set(phases) in ({"sync", "select", "submit", "resident", "wait", "finish"},  # Numba
                           {"build", "sync", "submit", "resident", "wait", "finish"})  # MLX
    assert min(phases.values()) >= 0 and 0 < sum(phases.values()) <= elapsed
    cache.close()


def test_interval_union_and_clip():
    assert union_length([]) == 0.0
    assert union_length([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)
    assert union_length([(2.0, 3.0), (0.0, 10.0), (4.0, 5.0)]) == pytest.approx(10.0)
    assert union_length([(1.0, 2.0), (1.0, 2.0)]) == pytest.approx(1.0)
    assert clip_intervals([(0.0, 1.0), (2.0, 5.0), (6.0, 7.0)], 0.5, 3.0) == [(0.5, 1.0), (2.0, 3.0)]


def test_overlap_counts_parallel_jobs_once():
    """Four workers busy only while the caller waits hide nothing: summing the job durations
    would have called three quarters of that time hidden."""
    go = threading.Event()
    with Scheduler(4) as s:
        b = s.batch(0)
        for _ in range(4):
            b.submit(go.wait)
        timer = threading.Timer(0.1, go.set)
        timer.start()
        b.wait()
        timer.join()
        t = s.timings
        assert t.jobs == 4
        assert t.cpu_busy >= 4 * 0.09 and t.cpu_wall >= 0.09
        assert t.cpu_busy > 3 * t.cpu_wall  # parallel time counted once in cpu_wall
        assert t.overlap_ratio < 0.25


def test_overlap_is_one_when_jobs_finish_before_the_wait():
    with Scheduler(2) as s:
        b = s.batch(3)
        for _ in range(2):
            b.submit(time.sleep, 0.02)
        while not all(f.done() for f in b.futures):  # the caller's own work, then the wait
            time.sleep(0.005)
        b.wait(accelerator_seconds=0.05)
        t = s.timings
        assert t.overlap_ratio == pytest.approx(1.0)
        assert t.hidden == pytest.approx(t.cpu_wall) and t.cpu_wall >= 0.02
        assert t.per_layer[3]["cpu_wall"] == [pytest.approx(t.cpu_wall)]


def test_inline_jobs_are_never_hidden():
    with Scheduler(0) as s:
        b = s.batch(0)
        b.submit(time.sleep, 0.01)
        b.wait()
        assert s.timings.overlap_ratio == 0.0 and s.timings.waited >= 0.01
