"""The Numba gather with partial attention of tiered.cpu (host pages read in place) against a
float64 reference read through HostStore.gather, and the merge of two partials."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tiered.cpu import HostStore
from tiered.cpu import kernels as K
from tiered.runtime.primitives import merge_partials


# ---- reference ----------------------------------------------------------------------------------
def partial_reference(store, b, q, z, tokens, qh, k, rescore):
    """(o, lse) of softmax attention of query head qh over tokens, read with HostStore.gather."""
    if len(tokens) == 0:
        return np.zeros(store.value_dim), -np.inf
    V = store.gather("values", b, k, tokens).astype(np.float64)
    if rescore:
        w = store.gather("keys", b, k, tokens).astype(np.float64) @ q[qh].astype(np.float64)
    else:
        w = z[qh, tokens].astype(np.float64)
    mx = w.max()
    e = np.exp(w - mx)
    return e @ V / e.sum(), mx + np.log(e.sum())


# ---- (c) gather + partial attention -------------------------------------------------------------
def _store(dtype, H, d, dv, n, rng, page_size=16, pages_per_block=4):
    """A 2-sequence store whose sequence 1 has non-contiguous pages across several blocks; part
    of it truncated and re-appended so freed pages come back in reverse order."""
    store = HostStore(H, d, value_dim=dv, page_size=page_size, dtype=dtype, keys=True, batch=2,
                      pages_per_block=pages_per_block)

    def append(L):
        store.append(rng.standard_normal((2, H, L, dv)).astype(np.float32),
                     rng.standard_normal((2, H, L, d)).astype(np.float32))

    append(n // 2 + 3)
    store.truncate(max(0, n // 2 - 2 * page_size))
    append(n - store.length)
    assert store.length == n
    return store


def _selection(H, n, cap_alloc, rng, empty_head=True):
    idx = np.full((H, cap_alloc), -1, np.int32)
    count = np.zeros(H, np.int32)
    for k in range(H):
        cnt = 0 if (empty_head and k == H - 1) else int(rng.integers(1, min(n, cap_alloc) + 1))
        idx[k, :cnt] = np.sort(rng.choice(n, cnt, replace=False))
        count[k] = cnt
    return idx, count


def _run_partial(store, b, q, z, idx, count, rep, rescore, kv_heads=None, o=None, lse=None,
                 native_half=True):
    Hq = idx.shape[0] * rep
    o = np.full((Hq, store.value_dim), np.nan, np.float32) if o is None else o
    lse = np.full(Hq, np.nan, np.float32) if lse is None else lse
    return K.gather_partial(q, z, idx, count, rep, *K.host_store_args(store, b), rescore, o, lse,
                            kv_heads=kv_heads, native_half=native_half)


@pytest.mark.parametrize("dtype", ["float16", "float16-table", "float32", "int8"])
@pytest.mark.parametrize("rep,d", [(1, 64), (3, 128), (4, 64)])
@pytest.mark.parametrize("rescore", [False, True])
@pytest.mark.parametrize("n", [1, 33, 4099])
def test_gather_partial(dtype, rep, d, rescore, n):
    """float16-table: decoded through F16_TO_F32 even where the hardware converts."""
    dtype, native_half = dtype.split("-")[0], not dtype.endswith("-table")
    rng = np.random.default_rng(n + rep + d)
    H, dv = 3, d if rep != 4 else 96
    store = _store(dtype, H, d, dv, n, rng, page_size=16 if n < 4099 else 128)
    q = (rng.standard_normal((H * rep, d)) / np.sqrt(d)).astype(np.float32)
    z = (rng.standard_normal((H * rep, n + 5)) * 2).astype(np.float32)
    idx, count = _selection(H, n, 300, rng)
    for b in (0, 1):
        o, lse = _run_partial(store, b, q, z, idx, count, rep, rescore, native_half=native_half)
        for qh in range(H * rep):
            k = qh // rep
            o_ref, lse_ref = partial_reference(store, b, q, z, idx[k, :count[k]], qh, k, rescore)
            np.testing.assert_allclose(o[qh], o_ref, rtol=1e-4, atol=2e-5)
            np.testing.assert_allclose(lse[qh], lse_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size,pages_per_block", [(16, 4), (24, 4), (16, 3), (24, 5)])
def test_gather_partial_any_page_geometry(page_size, pages_per_block):
    """Token rows are located by shifts when page size and pages per block are powers of two,
    by division otherwise: both agree with the reference."""
    rng = np.random.default_rng(page_size * pages_per_block)
    H, rep, d, n = 2, 3, 64, 700
    store = _store("float16", H, d, d, n, rng, page_size=page_size,
                   pages_per_block=pages_per_block)
    q = (rng.standard_normal((H * rep, d)) / np.sqrt(d)).astype(np.float32)
    idx, count = _selection(H, n, 200, rng, empty_head=False)
    for b in (0, 1):
        o, lse = _run_partial(store, b, q, None, idx, count, rep, True)
        for qh in range(H * rep):
            k = qh // rep
            o_ref, lse_ref = partial_reference(store, b, q, None, idx[k, :count[k]], qh, k, True)
            np.testing.assert_allclose(o[qh], o_ref, rtol=1e-4, atol=2e-5)
            np.testing.assert_allclose(lse[qh], lse_ref, rtol=1e-5, atol=1e-5)


def test_gather_partial_kv_subsets_from_threads():
    """Workers each take some kv heads; together they equal one call; other rows untouched."""
    rng = np.random.default_rng(2)
    H, rep, d, n = 4, 3, 64, 2048
    store = _store("float16", H, d, d, n, rng, page_size=64)
    q = rng.standard_normal((H * rep, d)).astype(np.float32)
    z = rng.standard_normal((H * rep, n)).astype(np.float32)
    idx, count = _selection(H, n, 512, rng, empty_head=False)
    o_all, lse_all = _run_partial(store, 0, q, z, idx, count, rep, True)
    o_noz, _ = _run_partial(store, 0, q, None, idx, count, rep, True)  # rescoring needs no z
    np.testing.assert_array_equal(o_noz, o_all)
    o_one, lse_one = _run_partial(store, 0, q, z, idx, count, rep, True, kv_heads=(1, 3))
    assert np.isnan(o_one[:rep]).all() and np.isnan(lse_one[3 * rep:]).all()
    np.testing.assert_array_equal(o_one[rep:3 * rep], o_all[rep:3 * rep])
    o = np.full_like(o_all, np.nan)
    lse = np.full_like(lse_all, np.nan)
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            list(pool.map(lambda k: _run_partial(store, 0, q, z, idx, count, rep, True,
                                                 kv_heads=(k, k + 1), o=o, lse=lse), range(H)))
            np.testing.assert_array_equal(o, o_all)
            np.testing.assert_array_equal(lse, lse_all)


def test_gather_partial_scores_by_slot_equal_scores_by_token():
    """An accelerator ships only the selected tokens' scores (z_by_slot): same result as the
    full score row indexed by token id."""
    rng = np.random.default_rng(5)
    H, rep, d, n = 3, 3, 64, 1500
    store = _store("float16", H, d, d, n, rng, page_size=64)
    z = rng.standard_normal((H * rep, n)).astype(np.float32)
    idx, count = _selection(H, n, 400, rng)
    zslot = np.full((H * rep, 400), np.nan, np.float32)
    for qh in range(H * rep):
        k = qh // rep
        zslot[qh, : count[k]] = z[qh, idx[k, : count[k]]]
    o_id, lse_id = _run_partial(store, 0, None, z, idx, count, rep, False)
    o = np.full_like(o_id, np.nan)
    lse = np.full_like(lse_id, np.nan)
    K.gather_partial(None, zslot, idx, count, rep, *K.host_store_args(store, 0), False, o, lse,
                     z_by_slot=True)
    np.testing.assert_array_equal(o, o_id)
    np.testing.assert_array_equal(lse, lse_id)


def test_gather_partial_rejects_bad_inputs():
    rng = np.random.default_rng(0)
    store = _store("float32", 2, 64, 64, 40, rng)
    idx, count = _selection(2, 40, 8, rng)
    q, z = np.zeros((2, 64), np.float32), np.zeros((2, 40), np.float32)
    bad = idx.copy()
    bad[0, 0] = 10**6
    with pytest.raises(IndexError):
        _run_partial(store, 0, q, z, bad, count, 1, False)
    args = list(K.host_store_args(store, 0))
    args[0] = args[0].copy()
    args[0][-1] = 10**6  # a page id past the allocated blocks
    with pytest.raises(IndexError):
        K.gather_partial(q, z, idx, count, 1, *args, False, np.zeros((2, 64), np.float32),
                         np.zeros(2, np.float32))
    with pytest.raises(IndexError):  # a token past the scores' width
        _run_partial(store, 0, q, z[:, :idx.max()], idx, count, 1, False)
    with pytest.raises(ValueError, match="Invalid shape of o_out"):
        _run_partial(store, 0, q, z, idx, count, 1, False, o=np.zeros((2, 32), np.float32))
    with pytest.raises(ValueError, match="Invalid count"):
        _run_partial(store, 0, q, z, idx, np.array([9, 1], np.int32), 1, False)


@pytest.mark.parametrize("split", ["random", "empty_a", "empty_b", "both_empty"])
@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_merge_partials_equals_union(split, dtype):
    rng = np.random.default_rng(len(split))
    H, rep, d, n = 2, 3, 64, 600
    store = _store(dtype, H, d, d, n, rng)
    q = (rng.standard_normal((H * rep, d)) / 8).astype(np.float32)
    z = rng.standard_normal((H * rep, n)).astype(np.float32)
    union, counts = _selection(H, n, 256, rng, empty_head=False)
    if split == "both_empty":
        counts[:] = 0
    in_a = [{"random": rng.random(c) < 0.5, "empty_a": np.zeros(c, bool),
             "empty_b": np.ones(c, bool), "both_empty": np.zeros(c, bool)}[split]
            for c in counts]
    parts = []
    for side in (True, False):
        idx = np.full_like(union, -1)
        count = np.zeros(H, np.int32)
        for k in range(H):
            mine = union[k, :counts[k]][in_a[k] == side]
            idx[k, :mine.size] = mine
            count[k] = mine.size
        parts.append(_run_partial(store, 0, q, z, idx, count, rep, True))
    o, lse = merge_partials(*parts[0], *parts[1])
    for qh in range(H * rep):
        k = qh // rep
        tok = union[k, :counts[k]]
        o_ref, lse_ref = partial_reference(store, 0, q, z, tok, qh, k, True)
        np.testing.assert_allclose(o[qh], o_ref, rtol=1e-4, atol=2e-5)
        np.testing.assert_allclose(lse[qh], lse_ref, rtol=1e-5, atol=1e-5)
    assert np.isfinite(o).all()
