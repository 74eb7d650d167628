"""tiered.layer.refresh_plan: a refresh's host side planned on a worker thread is the plan the
settle makes on the main thread, a plan whose inputs changed is dropped, and (on CUDA) a
decode with plans made ahead is the decode without them."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
from conftest import assert_same_state, make_small_model, settled_state

from tiered import TieredCache
from tiered.runtime import dispatch, uva
from tiered.layer import refresh_plan
from tiered.layer.heavy import ids_layout

needs_cuda = pytest.mark.skipif(not uva.available(),
                                reason="plans are made ahead where the dispatcher runs (CUDA)")


def _sets(rng, H, n, S, W, heavy_n, churn):
    """An old id map (sinks, ring, heavy) at n tokens and a new heavy choice replacing about
    ``churn`` of the heavy tokens."""
    old_heavy = np.stack([np.sort(rng.choice(np.arange(S, n - W), heavy_n, replace=False))
                          for _ in range(H)]).astype(np.int32)
    old = refresh_plan.layout(n, H, S, W, old_heavy)
    new_heavy = old_heavy.copy()
    for h in range(H):
        out = rng.random(heavy_n) < churn
        pool = np.setdiff1d(np.arange(S, n - W), old_heavy[h])
        new_heavy[h, out] = rng.choice(pool, int(out.sum()), replace=False)
        new_heavy[h] = np.sort(new_heavy[h])
    return old, new_heavy


@pytest.mark.parametrize("churn", [0.0, 0.1, 1.0])
def test_a_plan_made_on_the_worker_is_the_plan_made_here(churn):
    rng = np.random.default_rng(int(churn * 10))
    H, n, S, W, heavy_n = 4, 3000, 4, 64, 200
    old, new_heavy = _sets(rng, H, n, S, W, heavy_n, churn)
    done = threading.Event()
    lay = lambda ids: ids_layout(ids, H=H, count=heavy_n + 8, lo=S, hi=n - W, among=False)
    key = (n, H, S + W + heavy_n + 8, S, W)
    fut = refresh_plan.WORKER.submit(refresh_plan.plan, mx.array(new_heavy), done, lay, key,
                                     old, (S, W))
    assert not fut.done()  # it waits for the hand-off
    done.set()
    got = fut.result(timeout=60)
    tok = refresh_plan.layout(n, H, S, W, lay(new_heavy))
    assert got.key == key
    np.testing.assert_array_equal(got.tok, tok)
    ref = refresh_plan.in_place(old, tok, S + W, 8)  # 8 empty slots appended
    for a, b in zip(got.in_place.parts + [got.in_place.new, got.in_place.packed],
                    ref.parts + [ref.new, ref.packed]):
        np.testing.assert_array_equal(a, b)
    # the new map holds exactly the new choice; promoted = new minus old, per head
    for h in range(H):
        assert sorted(t for t in got.in_place.new[h] if t >= 0) == sorted(
            t for t in tok[h] if t >= 0)
        promoted = set(tok[h][S + W:].tolist()) - set(old[h].tolist()) - {-1}
        assert int(got.in_place.swap.promoted_count[h]) == len(promoted)


def test_a_plan_whose_hand_off_failed_is_none(monkeypatch):
    done = threading.Event()
    done.set()
    monkeypatch.setattr(dispatch.DISPATCHER, "_error", RuntimeError("failed"))
    fut = refresh_plan.WORKER.submit(refresh_plan.plan, mx.zeros((1, 1), mx.int32), done,
                                     None, (0, 1, 0, 0, 0), np.zeros((1, 0), np.int32), (0, 0))
    assert fut.result(timeout=60) is None


def test_the_worker_runs_in_order_and_passes_errors_on():
    order = []
    futs = [refresh_plan.WORKER.submit(order.append, i) for i in range(5)]
    bad = refresh_plan.WORKER.submit(lambda: 1 / 0)
    assert [f.result(timeout=60) for f in futs] == [None] * 5 and order == list(range(5))
    with pytest.raises(ZeroDivisionError):
        bad.result(timeout=60)
    assert refresh_plan.WORKER.submit(lambda: 7).result(timeout=60) == 7  # still running


@pytest.mark.accelerator
@needs_cuda
def test_refreshes_planned_ahead_decode_as_planned_at_the_settle(monkeypatch):
    """The same decode with refresh_plan.ENABLED off and on: the same outputs, resident sets
    and accumulators, and with it on the settles applied plans made on the worker."""
    from tiered.step import device_step
    from tiered.layer.resident import ResidentSet

    model = make_small_model("llama-gqa-d64", layers=4, seed=6)
    rng = np.random.default_rng(11)
    prompt, toks = rng.integers(10, 49000, 500).tolist(), rng.integers(10, 49000, 48).tolist()
    monkeypatch.setattr(device_step, "DISPATCH_EVERY", 1)
    used = []
    take = ResidentSet._take_ahead

    def counted(self, key):
        got = take(self, key)
        used.append(got is not None)
        return got

    monkeypatch.setattr(ResidentSet, "_take_ahead", counted)
    runs = []
    for on in (False, True):
        monkeypatch.setattr(refresh_plan, "ENABLED", on)
        used.clear()
        cache = TieredCache.for_model(model, gpu_budget=0.25, page_size=64, recent=16,
                                      device_gather="on", compress_from=1, refresh_every=4)
        assert dispatch.on_shared_stream()
        mx.eval(model(mx.array([prompt]), cache=cache))
        outs = []
        for t in toks:
            outs.append(model(mx.array([[t]]), cache=cache))
            mx.eval(outs[-1])
        runs.append(settled_state(cache, outs))
        assert (sum(used) > 0) == on
        cache.close()
    assert_same_state(*runs)
