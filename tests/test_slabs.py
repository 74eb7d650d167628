"""Host blocks carved from slabs (tiered.cpu.slabs; the unified-memory host tier of issue 61):
the slab geometry, budgets, and a store on slabs reading and writing as one on separate blocks."""

import mlx.core as mx
import numpy as np
import pytest
from tiered.cpu import HostStore
from tiered.cpu.memory_budget import HostBudget
from tiered.cpu.slabs import MAX_SLABS, SlabPool

pytestmark = pytest.mark.metal  # part of the Metal device step (python -m pytest -m metal)
SHAPE = (2, 3, 8, 4)  # pages per block, kv heads, page size, head_dim


def test_geometry_doubles_and_locates_every_block():
    pool = SlabPool(SHAPE, "float32", first=3)
    assert pool.ensure(40)
    assert pool.starts == [0, 3, 9, 21, 45]  # 3, 6, 12, 24 blocks
    seen = set()
    for b in range(pool.capacity):
        s, i = pool.locate(b)
        assert pool.starts[s] <= b < pool.starts[s + 1] and i == b - pool.starts[s]
        arr, view = pool.block(b)
        assert arr.shape == SHAPE and view.shape == SHAPE
        seen.add(view.ctypes.data)
    assert len(seen) == pool.capacity  # no two blocks share memory
    with pytest.raises(IndexError):
        pool.locate(pool.capacity)
    table = np.array(pool.table())
    assert table.shape == (MAX_SLABS + 1,)
    assert table.tolist() == [0, 3, 9, 21, 45] + [45] * (MAX_SLABS - 4)
    inputs = pool.inputs()
    assert len(inputs) == MAX_SLABS and all(x.size == 1 for x in inputs[4:])


def test_views_share_the_slab_memory():
    pool = SlabPool(SHAPE, "float16", first=2)
    pool.ensure(5)
    arr, view = pool.block(3)  # slab 1, its second block
    assert np.isnan(view).all()  # unwritten slots are NaN
    view[1, 2, 5] = np.arange(4)
    s, i = pool.locate(3)
    flat = np.array(pool.slabs[s]).reshape((-1,) + SHAPE)
    np.testing.assert_array_equal(flat[i, 1, 2, 5], np.arange(4))
    np.testing.assert_array_equal(np.array(arr)[1, 2, 5], np.arange(4))


def test_budget_limits_the_slabs():
    block_bytes = int(np.prod(SHAPE)) * 4
    budget = HostBudget(7 * block_bytes)
    pool = SlabPool(SHAPE, "float32", budget, first=4)
    assert pool.ensure(4) and budget.used == 4 * block_bytes
    assert pool.ensure(5)  # 8 wanted, 4 fit, then 2... the largest part the budget takes
    assert pool.capacity <= 7 and budget.used == pool.nbytes <= budget.limit
    while pool.ensure(pool.capacity + 1):
        pass
    assert pool.capacity == 7 and budget.used == 7 * block_bytes


def test_too_many_slabs_or_bad_dtype_refused():
    pool = SlabPool(SHAPE, "float32", first=1, max_slabs=2)
    assert pool.ensure(3) and not pool.ensure(4)
    with pytest.raises(ValueError, match="slab dtype"):
        SlabPool(SHAPE, "int8")
    with pytest.raises(ValueError, match="unified"):
        HostStore(3, 4, page_size=8, dtype="int8", unified=True)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_store_on_slabs_equals_store_on_blocks(dtype):
    rng = np.random.default_rng(3)
    stores = [HostStore(3, 16, value_dim=8, page_size=8, dtype=dtype, pages_per_block=2,
                        unified=u) for u in (False, True)]
    for n in [1] * 9 + [31, 70, 3]:
        k = rng.standard_normal((1, 3, n, 16)).astype(np.float32)
        v = rng.standard_normal((1, 3, n, 8)).astype(np.float32)
        for s in stores:
            s.append(v, k)
    ref, uni = stores
    assert uni.values.slabs is not None and len(uni.values.slabs.slabs) <= 4
    for name in ("keys", "values"):
        np.testing.assert_array_equal(uni.read(name), ref.read(name))
    tokens = rng.integers(0, ref.length, 40)
    np.testing.assert_array_equal(uni.gather("values", 0, 1, tokens),
                                  ref.gather("values", 0, 1, tokens))
    # every RAM block's view lies inside its slab
    t = uni.values
    for b, view in enumerate(t.views):
        s, i = t.slabs.locate(b)
        base = np.array(t.slabs.slabs[s], copy=False).ctypes.data
        assert view.ctypes.data == base + i * t.slabs.block_bytes
    # and the state round-trips into a store on slabs
    st = uni.state()
    back = HostStore.from_state(st)
    for name in ("keys", "values"):
        np.testing.assert_array_equal(back.read(name), ref.read(name))
    for s in stores + [back]:
        s.close()


def test_store_on_slabs_past_its_budget_goes_to_disk(tmp_path):
    rng = np.random.default_rng(4)
    block_bytes = 2 * 3 * 8 * 16 * 4
    budget = HostBudget(5 * block_bytes)
    store = HostStore(3, 16, page_size=8, dtype="float32", pages_per_block=2, keys=False,
                      budget=budget, disk_dir=str(tmp_path), unified=True)
    ref = HostStore(3, 16, page_size=8, dtype="float32", pages_per_block=2, keys=False)
    for _ in range(6):
        v = rng.standard_normal((1, 3, 40, 16)).astype(np.float32)
        store.append(v)
        ref.append(v)
    t = store.values
    assert t.disk_bytes > 0 and budget.used <= budget.limit
    assert budget.used == t.slabs.nbytes == t.nbytes
    np.testing.assert_array_equal(store.read("values"), ref.read("values"))
    store.close()
    ref.close()
    assert budget.used == 0
    mx.clear_cache()
