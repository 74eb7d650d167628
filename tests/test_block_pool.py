"""Host blocks allocated before a long prompt (tiered.cpu.block_maker.BlockPool): taken by the
tensors that grow into them, within the host budget, the rest given back; a prefill that
fills the pool leaves the same cache as one that does not."""

from __future__ import annotations

import numpy as np
import pytest

from tiered.cpu import block_alloc, host_tensor
from tiered.cpu.block_maker import POOL
from tiered.cpu.memory_budget import HostBudget
from tiered.cpu.pages import HostStore


def _store(budget_blocks=100, keys=False):
    nbytes = 2 * 2 * 8 * 8 * 2  # a block: 2 pages of 2 heads x 8 tokens x 8 dims, float16
    store = HostStore(2, 8, page_size=8, dtype="float16", pages_per_block=2, keys=keys,
                      budget=HostBudget(budget_blocks * nbytes))
    for t in store.tensors:
        t.ahead = True
    return store


@pytest.fixture(autouse=True, params=[0, 16384], ids=["exact", "padded"])
def _empty_pool(request, monkeypatch):
    """Every test with blocks asked as they are and asked longer (CUDA's PAD_BYTES)."""
    monkeypatch.setattr(block_alloc, "PAD_BYTES", request.param)
    monkeypatch.setattr(block_alloc, "PAD_MIN_BYTES", 0)
    POOL.release()
    yield
    POOL.release()


def _x(rng, n):
    return rng.normal(size=(1, 2, n, 8)).astype(np.float16)


def test_a_store_grows_into_the_pool_and_the_rest_goes_back():
    rng = np.random.default_rng(0)
    store = _store(keys=True)
    assert store.blocks_to_hold(100) == 7  # 13 pages of 8 tokens, 2 pages a block
    assert store.plan_pool(100) == 14  # keys and values
    assert POOL.planned() == 14 and POOL.held_bytes() == 0  # made by top_up
    queued = POOL.top_up(100)
    assert queued == 14 and POOL.planned() == 0
    b = store.values.budget
    block = store.values.block_bytes
    assert b.used == 14 * block and POOL.held_bytes() == 14 * block
    data = [_x(rng, 20) for _ in range(5)]  # 100 tokens
    for x in data:
        store.append(x, x)
    for t in store.tensors:
        assert len(t.blocks) == 7
    assert POOL.held_bytes() == 0  # every block queued was taken
    # none allocated beside them but the one each tensor keeps ahead once the pool is empty
    assert b.used == store.nbytes + sum(t.spare_bytes for t in store.tensors)
    np.testing.assert_array_equal(store.read("values"), np.concatenate(data, axis=2)[0])
    np.testing.assert_array_equal(store.read("keys"), np.concatenate(data, axis=2)[0])
    # more than the prompt: the pool is empty, the store allocates (and keeps one ahead)
    store.append(_x(rng, 20), _x(rng, 20))
    assert len(store.values.blocks) == 8
    assert b.used == store.nbytes + sum(t.spare_bytes for t in store.tensors)
    store.close()
    assert b.used == 0


def test_a_padded_block_is_its_first_elements_and_counts_as_its_size():
    store = _store()
    x = _x(np.random.default_rng(5), 40)
    store.append(x)
    t = store.values
    assert all(v.shape == t.block_shape for v in t.views)
    assert [int(a) for a in t.addrs] == [v.ctypes.data for v in t.views]
    assert t.nbytes == len(t.blocks) * t.block_bytes
    from tiered.cpu.block_alloc import shaped

    for blk, view in zip(t.blocks, t.views):
        np.testing.assert_array_equal(np.array(shaped(blk, t.block_shape)), view)
    state = t.state("v")
    assert all(a.shape == t.block_shape for a in state["v"])
    np.testing.assert_array_equal(store.read("values"), x[0])
    store.close()
    assert t.budget.used == 0


def test_the_pool_stops_at_the_host_budget_and_releases_what_was_not_taken():
    store = _store(budget_blocks=5)
    assert store.plan_pool(1000) == 63
    assert POOL.top_up(1000) == 5  # the budget holds 5; the rest of the plan is dropped
    assert POOL.planned() == 0
    b = store.values.budget
    assert b.used == b.limit
    assert not store.spills_to_append(16)
    assert store.spills_to_append(6 * 16)  # past the pool and the budget: the disk tier
    store.append(_x(np.random.default_rng(1), 16))
    # one block adopted, the next one ahead taken from the pool too
    assert store.values.spare_bytes == store.values.block_bytes
    assert POOL.held_bytes() == 3 * store.values.block_bytes
    assert POOL.release() == 3 * store.values.block_bytes
    assert b.used == store.nbytes + store.values.spare_bytes
    store.close()
    assert b.used == 0


def test_blocks_of_another_shape_or_budget_are_not_taken():
    a, other = _store(), _store()
    a.plan_pool(32)
    POOL.top_up(100)
    assert a.values.pooled_bytes and not other.values.pooled_bytes  # another budget
    other.append(_x(np.random.default_rng(2), 16))
    assert POOL.held_bytes() == a.values.pooled_bytes == 2 * a.values.block_bytes
    wide = HostStore(2, 16, page_size=8, dtype="float16", pages_per_block=2, keys=False,
                     budget=a.values.budget)
    wide.values.ahead = True
    assert not wide.values.pooled_bytes
    for s in (a, other, wide):
        s.close()


def test_top_up_keeps_at_most_pending_blocks_filling():
    """Blocks still filling (their ticket not done) hold top_up back; each one read lets
    another be made, within the budget."""
    import mlx.core as mx

    from tiered.cpu.block_maker import Ticket

    made = []

    def make():
        made.append(Ticket(mx.zeros((4,)), None))
        return made[-1]

    budget = HostBudget(100)
    assert POOL.plan((4,), "float16", 10, 8, budget, make) == 10
    assert POOL.top_up(3) == 3 and POOL.top_up(3) == 0
    made[0].done.set()
    assert POOL.top_up(3) == 1
    for t in made:
        t.done.set()
    assert POOL.top_up(3) == 3
    assert POOL.planned() == 3 and budget.used == 7 * 8
    assert POOL.take((4,), "float16", budget) is made[0]
    for t in made:
        t.done.set()  # release waits for the maker to let go of each block
    assert POOL.release() == 6 * 8
    assert POOL.planned() == 0 and budget.used == 8  # the one taken stays reserved


def test_tensors_not_allocating_ahead_queue_nothing():
    store = HostStore(2, 8, page_size=8, dtype="float16", pages_per_block=2, keys=False,
                      budget=HostBudget(None))
    store.values.ahead = False
    assert store.plan_pool(100) == 0 and POOL.held_bytes() == 0
    int8 = HostStore(2, 8, page_size=8, dtype="int8", pages_per_block=2, keys=False)
    int8.values.ahead = True
    assert int8.plan_pool(100) == 0


def test_a_layer_pools_the_blocks_its_compression_and_prompt_take(monkeypatch):
    """After a first chunk, an exact layer queues the blocks of the store it makes when it
    compresses; the rest of the prompt takes every one of them, and the next token's logits
    are those of a cache built without the pool."""
    import mlx.core as mx
    from conftest import make_small_model

    from tiered import TieredCache

    monkeypatch.setattr(host_tensor, "AHEAD", True)  # tensors allocate ahead, as on CUDA
    model = make_small_model("llama-gqa-d64", layers=2)
    ids = [(i * 7919) % 4000 for i in range(1024)]
    chunk = 64

    def run(pool: bool):
        cache = TieredCache.for_model(model, gpu_budget=0.25, compress_from=64,
                                      prefill_window=128, kernels="mlx", page_size=16)
        x = mx.array(ids)[None]
        queued = []
        for start in range(0, len(ids), chunk):
            model(x[:, start: start + chunk], cache=cache)
            mx.eval([c.state for c in cache])
            if start == 0 and pool:
                queued = [c.plan_host_pool(len(ids) - chunk, chunk) for c in cache]
                assert POOL.top_up(1000) == sum(queued)
        logits = model(mx.array([[5]]), cache=cache)
        mx.eval(logits)
        return cache, queued, np.array(logits)

    cache, queued, got = run(True)
    assert all(q > 0 for q in queued)
    for c, q in zip(cache, queued):
        assert c.host is not None
        held = sum(len(t.blocks) for t in c.host.tensors)
        assert held >= q  # the store grew into every block queued for it
        assert c.host.blocks_to_hold(len(ids)) == 0
    assert POOL.held_bytes() == 0
    _, _, want = run(False)
    np.testing.assert_array_equal(got, want)


def test_keys_and_values_share_the_pool_when_the_disk_tier_is_foretold(tmp_path):
    """One pooled block serves one of keys and values: with no room beside it, the other
    tensor's block goes to disk, and spills_to_append says so (counting the pool once per
    shape, not once per tensor)."""
    nbytes = 2 * 2 * 8 * 8 * 2
    store = HostStore(2, 8, page_size=8, dtype="float16", pages_per_block=2, keys=True,
                      budget=HostBudget(nbytes), disk_dir=str(tmp_path))
    for t in store.tensors:
        t.ahead = True
    store.plan_pool(16)
    assert POOL.top_up(10) == 1  # the budget holds one block
    assert store.spills_to_append(8)
    x = _x(np.random.default_rng(6), 8)
    store.append(x, x)
    assert store.disk_bytes > 0
    np.testing.assert_array_equal(store.read("values"), x[0])
    np.testing.assert_array_equal(store.read("keys"), x[0])
    store.close()
