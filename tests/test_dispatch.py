"""tiered.runtime.dispatch: the dispatcher thread hands graphs to the device in order, raises what
fails where the caller waits, takes over what it cannot evaluate, and (on CUDA) decodes the
same tokens as the main thread's hand-offs."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from conftest import assert_same_state, make_small_model, settled_state

from tiered import TieredCache
from tiered.step import device_step
from tiered.runtime import dispatch, uva

needs_cuda = pytest.mark.skipif(not uva.available(),
                                reason="the dispatcher runs on CUDA (shared stream)")


def _chain(x, n):
    for i in range(n):
        x = x * 1.5 + i
    return x


@pytest.fixture(params=["python", "native"])
def worker(request):
    """A dispatcher whose worker thread is Python's or the native module's (C++, no GIL)."""
    d = dispatch.Dispatcher()
    if request.param == "native":
        native = request.getfixturevalue("native_asked")
        if native.compiler() is None or native.load() is None:
            pytest.skip(f"the native module did not build: {native.why_not()}")
        d._native, d._native_checked = native.load().Dispatch(), True
    return d


def test_dispatcher_evaluates_in_order_on_a_shared_stream(worker):
    d = worker
    s = mx.new_thread_unsafe_stream(mx.cpu)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((64, 64)).astype(np.float32) for _ in range(6)]
    with mx.stream(s):
        outs = []
        prev = mx.zeros((64, 64))
        for x in xs:  # each graph takes the previous one's output: order matters
            prev = _chain(mx.array(x) + prev, 20)
            outs.append(prev)
            d.submit([prev])
    d.drain()
    assert not d.busy and d.busy_s > 0
    ref = np.zeros((64, 64), np.float32)
    for x, got in zip(xs, outs):
        ref = x + ref
        for i in range(20):
            ref = ref * np.float32(1.5) + np.float32(i)
        np.testing.assert_allclose(np.array(got), ref, rtol=1e-5)


def test_an_error_on_the_thread_is_raised_by_drain(monkeypatch):
    d = dispatch.Dispatcher()
    d._native_checked = True  # the Python worker: its mx.async_eval is replaced below
    calls = []

    def failing(*arrays):
        calls.append(len(arrays))
        raise ValueError("kernel failed")

    monkeypatch.setattr(mx, "async_eval", failing)
    s = mx.new_thread_unsafe_stream(mx.cpu)
    with mx.stream(s):
        a = mx.ones((4,)) * 2
        d.submit([a])
        d.submit([a + 1])  # after the failure nothing more is handed over
    with pytest.raises(ValueError, match="kernel failed"):
        d.drain()
    assert calls == [1]
    d.drain()  # raised once: the dispatcher is usable again


def test_arrays_of_a_thread_local_stream_are_taken_by_the_main_thread(monkeypatch, caplog,
                                                                      worker):
    monkeypatch.setattr(dispatch, "_enabled", True)
    d = worker
    local = mx.new_stream(mx.cpu)  # usable on this thread only
    with mx.stream(local):
        a = _chain(mx.arange(8, dtype=mx.float32), 5)
        b = a * 2
    d.submit([a])
    d.submit([b])
    with caplog.at_level(logging.WARNING, logger="tiered"):
        d.drain()
    assert not dispatch.enabled()  # off for the process from then on
    assert "thread-local" in caplog.text
    ref = np.arange(8, dtype=np.float32)
    for i in range(5):
        ref = ref * np.float32(1.5) + np.float32(i)
    np.testing.assert_allclose(np.array(a), ref)
    np.testing.assert_allclose(np.array(b), 2 * ref)


def test_wrappers_wait_for_the_thread_first(monkeypatch):
    order = []
    monkeypatch.setattr(dispatch.DISPATCHER, "drain", lambda: order.append("drain"))
    monkeypatch.setattr(dispatch.DISPATCHER, "_queued", 1)
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: (order.append("eval"), real_eval(*a)))
    dispatch.eval(mx.ones((2,)))
    assert order == ["drain", "eval"]


@pytest.mark.accelerator
@needs_cuda
@pytest.mark.parametrize("kind", ["python", "native"])
def test_dispatched_steps_decode_as_the_main_thread(monkeypatch, kind):
    """Every layer handed over by the thread (DISPATCH_EVERY=1; the worker in Python or in C++)
    against every hand-off on the main thread: the same kernels in the same order, so the same
    outputs, pages and state."""
    from tiered.metal import native

    if kind == "native":
        monkeypatch.setenv("TIERED_NATIVE", "1")
        monkeypatch.setattr(native, "_state", {})
        assert native.cuda() is not None, native.why_not()
    monkeypatch.setattr(dispatch, "NATIVE", kind == "native")
    monkeypatch.setattr(dispatch.DISPATCHER, "_native", None)
    monkeypatch.setattr(dispatch.DISPATCHER, "_native_checked", False)
    model = make_small_model("llama-gqa-d64", layers=3, seed=4)
    rng = np.random.default_rng(5)
    prompt, toks = rng.integers(10, 49000, 400).tolist(), rng.integers(10, 49000, 40).tolist()
    monkeypatch.setattr(device_step, "ASYNC_EVERY", 1)
    monkeypatch.setattr(device_step, "DISPATCH_EVERY", 1)
    runs = []
    for on in (False, True):
        monkeypatch.setattr(dispatch, "_enabled", on)
        busy = dispatch.DISPATCHER.busy_s
        cache = TieredCache.for_model(model, gpu_budget=0.25, page_size=64, recent=16,
                                      device_gather="on", compress_from=1, host_keys=False)
        assert dispatch.on_shared_stream() == on
        mx.eval(model(mx.array([prompt]), cache=cache))
        outs = []
        for t in toks:
            outs.append(model(mx.array([[t]]), cache=cache))
            assert not dispatch.DISPATCHER.busy  # the last layer drained
            mx.eval(outs[-1])
        assert (dispatch.DISPATCHER.busy_s > busy) == on
        if on:
            assert (dispatch.DISPATCHER._native is not None) == (kind == "native")
        layers = [c for c in cache if isinstance(c, TieredCache)]
        runs.append((np.array(mx.concatenate(outs, axis=1)),
                     [c.host.read("values", 0, 0, c.host.length) for c in layers],
                     [np.array(c.compressed.heavy.acc) for c in layers]))
        cache.close()
    for x, y in zip(runs[0], runs[1]):
        for u, v in zip(x if isinstance(x, list) else [x], y if isinstance(y, list) else [y]):
            np.testing.assert_array_equal(u, v)


@pytest.mark.accelerator
@needs_cuda
def test_refreshes_applied_at_the_step_end_decode_as_at_the_next_append(monkeypatch):
    """cache.EARLY_SETTLE: a refresh applied at the end of the step that queued it (every
    layer: 1.0) against at the layer's next append (0): the same ids and the same device
    work, only built earlier, so the same outputs, resident sets and accumulators."""
    from tiered import cache as cache_mod

    model = make_small_model("llama-gqa-d64", layers=4, seed=6)
    rng = np.random.default_rng(7)
    prompt, toks = rng.integers(10, 49000, 500).tolist(), rng.integers(10, 49000, 48).tolist()
    runs = []
    for share in (0.0, 1.0):
        monkeypatch.setattr(cache_mod, "EARLY_SETTLE", share)
        cache = TieredCache.for_model(model, gpu_budget=0.25, page_size=64, recent=16,
                                      device_gather="on", compress_from=1, refresh_every=4)
        mx.eval(model(mx.array([prompt]), cache=cache))
        outs, due = [], 0
        for t in toks:
            outs.append(model(mx.array([[t]]), cache=cache))
            layers = [c for c in cache if isinstance(c, TieredCache)]
            due += sum(c.compressed._refresh_due for c in layers)
            mx.eval(outs[-1])
        assert (due > 0) == (share == 0.0)  # refreshes were queued; 1.0 applied each at once
        runs.append(settled_state(cache, outs))
        cache.close()
    assert_same_state(*runs)


def test_share_streams_puts_mlx_lm_generation_on_the_shared_stream(monkeypatch):
    """for_model's share_streams: the thread's default stream and mlx-lm's generation stream
    become the shared one (here a CPU stream standing in for CUDA's), and mlx-lm's greedy
    generation gives the same tokens on it."""
    import importlib
    import itertools

    from mlx_lm.generate import generate_step

    gen = importlib.import_module("mlx_lm.generate")
    model = make_small_model("llama-gqa-d64", layers=2, seed=3)
    prompt = mx.array(np.random.default_rng(1).integers(10, 49000, 40))

    def tokens():
        steps = itertools.islice(gen.generate_step(prompt, model), 12)
        return [int(t) for t, _ in steps]

    before = tokens()
    monkeypatch.setattr(dispatch, "_cuda", lambda: True)
    monkeypatch.setattr(dispatch, "_stream", None)
    monkeypatch.setattr(gen, "generation_stream", gen.generation_stream)
    for fn in vars(gen).values():
        if callable(fn) and getattr(fn, "__defaults__", None):
            monkeypatch.setattr(fn, "__defaults__", fn.__defaults__)
    default = mx.default_stream(mx.default_device())
    try:
        assert dispatch.share_streams()
        s = dispatch.stream()
        assert dispatch.on_shared_stream() and gen.generation_stream is s
        assert any(d is s for d in generate_step.__defaults__)
        assert tokens() == before
    finally:
        mx.set_default_stream(default)
