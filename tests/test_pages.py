"""Paged host store: round trips across pages, the CSR page table, truncation, persistence."""

import mlx.core as mx
import numpy as np
import pytest

from tiered.cpu import HostStore

TOL = {"float32": 0, "float16": 1e-3, "int8": 1.5e-2}


def _data(rng, B, H, L, d):
    return rng.standard_normal((B, H, L, d)).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("chunks", [[1] * 40, [31, 33, 1, 70], [300]])
def test_append_read_round_trip(dtype, chunks):
    rng = np.random.default_rng(0)
    store = HostStore(3, 16, value_dim=8, page_size=32, dtype=dtype, pages_per_block=2)
    ks, vs = [], []
    for n in chunks:
        k, v = _data(rng, 1, 3, n, 16), _data(rng, 1, 3, n, 8)
        store.append(v, k)
        ks.append(k)
        vs.append(v)
    k, v = np.concatenate(ks, axis=2)[0], np.concatenate(vs, axis=2)[0]
    assert store.length == k.shape[1]
    tol = TOL[dtype] * (np.abs(k).max() if dtype == "int8" else 1)
    np.testing.assert_allclose(store.read("keys"), k, atol=tol, rtol=TOL[dtype])
    np.testing.assert_allclose(store.read("values"), v, atol=tol, rtol=TOL[dtype])
    tokens = rng.integers(0, store.length, 50)
    np.testing.assert_allclose(store.gather("values", 0, 2, tokens), v[2, tokens],
                               atol=tol, rtol=TOL[dtype])
    # Blocks hold whole pages; the page table covers exactly the tokens written.
    pt = store.page_table()
    n_pages = -(-store.length // 32)
    assert pt.indptr.tolist() == [0, n_pages]
    assert pt.last_page_len[0] == store.length - (n_pages - 1) * 32
    assert len(set(pt.indices.tolist())) == n_pages


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_gather_rows_all_heads_as_stored(dtype):
    """gather_rows (the refresh's upload path) returns each head's rows exactly as stored
    (int8: dequantized, as gather does), -1 as zeros, for a sequence whose pages are not
    contiguous (a truncated and regrown second sequence)."""
    rng = np.random.default_rng(3)
    store = HostStore(3, 16, value_dim=8, page_size=8, dtype=dtype, pages_per_block=2, batch=2)
    store.append(_data(rng, 2, 3, 45, 8), _data(rng, 2, 3, 45, 16))
    store.truncate(20)
    store.append(_data(rng, 2, 3, 37, 8), _data(rng, 2, 3, 37, 16))
    tokens = rng.integers(0, store.length, (3, 30)).astype(np.int32)
    tokens[1, 5:] = -1
    for b in (0, 1):
        for kind, d in (("keys", 16), ("values", 8)):
            rows = store.gather_rows(kind, b, tokens)
            assert rows.shape == (3, 30, d)
            assert rows.dtype == (np.float32 if dtype == "int8" else np.dtype(dtype))
            for h in range(3):
                keep = tokens[h] >= 0
                np.testing.assert_array_equal(rows[h, keep].astype(np.float32),
                                              store.gather(kind, b, h, tokens[h, keep]))
                assert not rows[h, ~keep].any()
    with pytest.raises(IndexError):
        store.gather_rows("keys", 0, np.full((3, 1), store.length, np.int32))
    with pytest.raises(ValueError, match="Invalid shape of tokens"):
        store.gather_rows("keys", 0, tokens[:2])


def test_unwritten_slots_are_nan():
    store = HostStore(2, 4, page_size=8, dtype="float16", keys=False, pages_per_block=4)
    store.append(np.ones((1, 2, 3, 4), np.float32))
    blk = store.values.views[0]
    assert np.isnan(blk[0, :, 3:]).all() and np.isnan(blk[1:]).all()


def test_truncate_frees_pages_and_reuses_them():
    rng = np.random.default_rng(1)
    store = HostStore(2, 4, page_size=4, dtype="float32", keys=False, pages_per_block=2)
    v = _data(rng, 1, 2, 18, 4)
    store.append(v)
    store.truncate(6)
    assert store.length == 6 and len(store.logical_pages()) == 2
    w = _data(rng, 1, 2, 5, 4)
    store.append(w)
    expected = np.concatenate([v[0, :, :6], w[0]], axis=1)
    np.testing.assert_array_equal(store.read("values"), expected)
    assert store.values.capacity_pages == 6  # freed pages were reused, nothing new allocated
    with pytest.raises(ValueError, match="Invalid length"):
        store.truncate(99)


def test_logical_pages_are_kept_until_the_pages_change(monkeypatch):
    """logical_pages returns the same array while the pages stay (the device path compares
    it by identity), and the page list as it is after an append, a truncate followed by an
    append of the same page count, and an append that failed part-way."""
    rng = np.random.default_rng(6)
    store = HostStore(2, 4, page_size=4, dtype="float32", keys=False, pages_per_block=2)
    store.append(_data(rng, 1, 2, 10, 4))
    a = store.logical_pages()
    assert store.logical_pages() is a and a.tolist() == store._pages[0]
    store.append(_data(rng, 1, 2, 1, 4))  # same page: same array
    assert store.logical_pages() is a
    store.append(_data(rng, 1, 2, 2, 4))  # a new page
    b = store.logical_pages()
    assert b is not a and b.tolist() == store._pages[0] and len(b) == 4
    store.truncate(4)  # one page left; the freed ones come back in another order
    store.append(_data(rng, 1, 2, 9, 4))
    c = store.logical_pages()
    assert len(c) == len(b) and c.tolist() == store._pages[0] != b.tolist()
    before, length = list(store._pages[0]), store.length

    def fail(*args):
        raise OSError("disk tier full")

    monkeypatch.setattr(store, "_new_page", fail)
    with pytest.raises(OSError):
        store.append(_data(rng, 1, 2, 9, 4))  # fills the last page, then fails
    assert store._pages[0] == before and store.length == length
    assert store.logical_pages().tolist() == before


def test_logical_pages_views_stay_as_returned_while_pages_are_added():
    """The page ids come from a buffer extended in place: every array handed out keeps the
    pages it had (kernels may still hold it), and each new one is the page list as it is,
    across the buffer's regrowth and after a truncate."""
    rng = np.random.default_rng(7)
    store = HostStore(1, 2, page_size=2, dtype="float32", keys=False, pages_per_block=4)
    seen = []
    for n in (3, 1, 6, 20, 40, 2):
        store.append(_data(rng, 1, 1, n, 2))
        arr = store.logical_pages()
        assert arr.dtype == np.int64 and arr.tolist() == store._pages[0]
        seen.append((arr, arr.tolist()))
    store.truncate(7)
    store.append(_data(rng, 1, 1, 30, 2))
    assert store.logical_pages().tolist() == store._pages[0]
    assert all(arr.tolist() == ids for arr, ids in seen)


def test_batch_rows_are_separate():
    rng = np.random.default_rng(2)
    store = HostStore(2, 4, page_size=4, dtype="float32", batch=3)
    v, k = _data(rng, 3, 2, 9, 4), _data(rng, 3, 2, 9, 4)
    store.append(v, k)
    for b in range(3):
        np.testing.assert_array_equal(store.read("values", b), v[b])
        np.testing.assert_array_equal(store.read("keys", b), k[b])
    pt = store.page_table()
    assert pt.indptr.tolist() == [0, 3, 6, 9]


def test_state_round_trip_copies():
    rng = np.random.default_rng(3)
    store = HostStore(2, 8, page_size=16, dtype="int8", pages_per_block=2)
    store.append(_data(rng, 1, 2, 40, 8), _data(rng, 1, 2, 40, 8))
    clone = HostStore.from_state(store.state())
    np.testing.assert_array_equal(clone.read("values"), store.read("values"))
    np.testing.assert_array_equal(clone.read("keys"), store.read("keys"))
    clone.append(_data(rng, 1, 2, 1, 8), _data(rng, 1, 2, 1, 8))
    assert store.length == 40  # the clone owns its memory
    assert all(isinstance(b, mx.array) for b in store.state()["values"])


def test_bad_input_is_rejected():
    store = HostStore(2, 4, page_size=4, dtype="float32")
    with pytest.raises(ValueError, match="Invalid shape of values"):
        store.append(np.zeros((1, 3, 2, 4), np.float32), np.zeros((1, 3, 2, 4), np.float32))
    with pytest.raises(ValueError, match="needs keys"):
        store.append(np.zeros((1, 2, 2, 4), np.float32))
    with pytest.raises(ValueError, match="host dtype"):
        HostStore(2, 4, dtype="int4")
    assert store.length == 0


@pytest.mark.parametrize("ahead", [False, True, "pooled"])
def test_spills_to_append_says_when_the_budget_moves_a_block_to_disk(tmp_path, ahead):
    """HostStore.spills_to_append foretells each append: True exactly when the append moves a
    block to the disk tier (the host budget spent), with or without blocks allocated ahead,
    and with the budget spent on the process's block pool first (keys and values of one
    shape share its blocks)."""
    from tiered.cpu.block_maker import POOL
    from tiered.cpu.memory_budget import HostBudget

    block = 2 * 2 * 8 * 8 * 2  # pages_per_block x H x page_size x d x fp16, per tensor
    store = HostStore(2, 8, page_size=8, dtype="float16", pages_per_block=2,
                      budget=HostBudget(5 * block), disk_dir=str(tmp_path))
    for t in store.tensors:
        t.ahead = bool(ahead)
    POOL.release()
    if ahead == "pooled":
        store.plan_pool(1000)
        assert POOL.top_up(100) == 5  # the whole budget, in the pool
    rng = np.random.default_rng(0)
    x = lambda n: rng.normal(size=(1, 2, n, 8)).astype(np.float16)  # noqa: E731
    said = []
    for n in (16, 5, 11, 16, 1, 30, 2, 16, 16):
        predicted = store.spills_to_append(n)
        before = store.disk_bytes
        store.append(x(n), x(n))
        said.append(predicted)
        assert predicted == (store.disk_bytes > before), (n, said)
    assert said[0] is False and said[-1] is True
    POOL.release()
    store.close()
