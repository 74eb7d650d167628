"""Host blocks allocated ahead: read and prepared on the block maker's thread, adopted in order,
their errors handed to the thread that needed the block (tiered.cpu.block_maker)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tiered.cpu.block_maker import MAKER
from tiered.cpu.memory_budget import HostBudget
from tiered.cpu.pages import HostStore


def _store(budget_blocks=100, **kw):
    store = HostStore(2, 8, page_size=8, dtype="float16", pages_per_block=2, keys=False,
                      budget=HostBudget(budget_blocks * 2 * 2 * 8 * 8 * 2), **kw)
    store.values.ahead = True
    return store


def _x(rng, n):
    return rng.normal(size=(1, 2, n, 8)).astype(np.float16)


def test_blocks_ahead_are_prepared_off_the_main_thread_and_read_back():
    rng = np.random.default_rng(0)
    store = _store()
    t = store.values
    seen = []

    def prepare(view):
        seen.append((threading.current_thread().name, view.ctypes.data, view.nbytes))

    t.prepare = prepare
    data = [_x(rng, 16) for _ in range(6)]  # 16 tokens: a block of 2 pages of 8 each
    for x in data:
        store.append(x)
    assert t._spare is not None
    t._spare.result()
    assert seen and all(name == "tiered-blocks" for name, _, _ in seen)
    assert all(n == t.block_bytes for _, _, n in seen)
    # every block adopted after the first carries the hook's mark; the addresses are the views'
    adopted = {int(a) for a in t.addrs}
    assert t.prepared and t.prepared <= adopted
    assert t.prepared <= {a for _, a, _ in seen}
    assert int(t.addrs[0]) not in t.prepared  # allocated on need, not ahead
    np.testing.assert_array_equal(store.read("values"), np.concatenate(data, axis=2)[0])
    used = store.values.budget.used
    assert used == t.nbytes + t.spare_bytes
    store.close()
    assert store.values.budget.used == 0


def test_a_failed_preparation_raises_where_the_block_is_needed_and_returns_its_bytes():
    rng = np.random.default_rng(1)
    store = _store()
    t = store.values
    first = _x(rng, 16)
    store.append(first)  # one block adopted, the next queued without a hook
    t._drop_spare()

    def prepare(view):
        raise RuntimeError("advice refused")

    t.prepare = prepare
    t.next_ahead()
    before = (store.length, len(t.blocks), t.budget.used)
    with pytest.raises(RuntimeError, match="advice refused"):
        store.append(_x(rng, 4))
    assert (store.length, len(t.blocks)) == before[:2]
    assert t.budget.used == before[2] - t.block_bytes  # the failed block's bytes are back
    t.prepare = None
    assert t._spare is None  # the failed one was taken, none queued after it
    x = _x(rng, 4)
    store.append(x)
    assert store.length == 20
    np.testing.assert_array_equal(store.read("values")[:, 16:], x[0])
    store.close()
    assert t.budget.used == 0


def test_the_maker_reads_blocks_queued_while_other_work_runs():
    """Many blocks queued at once come back in order, each its own buffer, NaN-filled."""
    import mlx.core as mx

    tickets = []
    for _ in range(12):
        arr = mx.full((4, 64), float("nan"), dtype=mx.float16, stream=mx.cpu)
        mx.async_eval(arr)
        tickets.append(MAKER.submit(arr))
    views = [t.result() for t in tickets]
    assert len({v.ctypes.data for v in views}) == 12
    assert all(np.isnan(v).all() for v in views)
