"""MLX's memory limit follows the host tier's bytes (tiered.runtime.memory_limit).

On CUDA, MLX counts the host blocks (managed memory) in its active memory and serializes every
eval above its limit; tiered raises the limit by what the host budgets hold. The tracking is
forced on here (the CPU backend leaves the limit alone otherwise): a budget's reserve, charge
and release move the limit by their bytes, a limit the caller sets becomes the new base, a
budget dropped stops counting, and a real cache's host pages are counted while it holds them.
"""

from __future__ import annotations

import gc
import threading
import weakref

import mlx.core as mx
import numpy as np
import pytest
from tiered.cpu.memory_budget import HostBudget

from tiered.runtime import memory_limit

MB = 1 << 20


@pytest.fixture
def fresh(monkeypatch):
    """The module's state fresh, MLX's limit restored afterwards; yields the limit before."""
    before = mx.get_memory_limit()
    monkeypatch.setattr(memory_limit, "_budgets", weakref.WeakSet())
    monkeypatch.setattr(memory_limit, "_state", {"base": None, "set": None})
    yield before
    mx.set_memory_limit(before)


@pytest.fixture
def tracked(fresh, monkeypatch):
    """:func:`fresh`, tracking forced on."""
    monkeypatch.setattr(memory_limit, "applies", lambda: True)
    return fresh


def test_the_limit_moves_with_the_budgets_bytes(tracked):
    base = tracked
    a, b = HostBudget(100 * MB), HostBudget(None)
    memory_limit.track(a)
    memory_limit.track(b)
    assert mx.get_memory_limit() == base
    assert a.reserve(40 * MB)
    assert mx.get_memory_limit() == base + 40 * MB
    assert not a.reserve(70 * MB)  # refused: nothing counted
    assert mx.get_memory_limit() == base + 40 * MB
    b.charge(5 * MB)
    assert mx.get_memory_limit() == base + 45 * MB
    a.release(40 * MB)
    b.release(5 * MB)
    assert mx.get_memory_limit() == base
    assert memory_limit.host_bytes() == 0


def test_a_limit_the_caller_sets_becomes_the_base(tracked):
    a = HostBudget(None)
    memory_limit.track(a)
    a.reserve(8 * MB)
    mine = 3 << 30
    mx.set_memory_limit(mine)
    a.reserve(2 * MB)
    assert mx.get_memory_limit() == mine + 10 * MB
    assert memory_limit.base() == mine
    a.release(10 * MB)
    assert mx.get_memory_limit() == mine


def test_a_dropped_budget_stops_counting(tracked):
    base = tracked
    a = HostBudget(None)
    memory_limit.track(a)
    a.reserve(16 * MB)
    assert mx.get_memory_limit() == base + 16 * MB
    del a
    gc.collect()
    assert mx.get_memory_limit() == base


def test_an_update_while_the_lock_is_held_does_not_wait_for_itself(tracked):
    """A budget collected while update() holds the lock (a collection can run at any allocation)
    calls update() again in the same thread: it must not wait for itself."""
    a = HostBudget(None)
    memory_limit.track(a)
    got = []

    def nested():
        with memory_limit._lock:
            a.reserve(MB)  # its on_change runs update() here, the lock held
            got.append(mx.get_memory_limit())

    t = threading.Thread(target=nested, daemon=True)
    t.start()
    t.join(10)
    assert got == [tracked + MB]


def test_untracked_where_it_does_not_apply(fresh):
    before = fresh
    a = HostBudget(None)
    memory_limit.track(a, enabled=False)
    a.reserve(64 * MB)
    assert a.on_change is None and memory_limit.host_bytes() == 0
    assert mx.get_memory_limit() == before


def test_a_caches_host_pages_raise_the_limit_until_it_closes(tracked, tmp_path):
    from conftest import make_small_model

    from tiered import TieredCache
    from tiered.prefill import prefill

    base = tracked
    model = make_small_model("llama-gqa-d64", layers=2, seed=3)
    ids = np.random.default_rng(3).integers(10, 49000, 600).tolist()
    cache = TieredCache.for_model(model, gpu_budget=0.25, page_size=64, recent=16,
                                  prefill_window=256, disk_dir=str(tmp_path))
    prefill(model, cache, ids, chunk=200)
    mx.eval(model(mx.array([[7]]), cache=cache))
    held = cache.context.host_budget.used
    assert held > 0  # the compressed layers' pages are in RAM
    assert mx.get_memory_limit() == base + held
    cache.close()
    assert cache.context.host_budget.used == 0
    assert mx.get_memory_limit() == base
