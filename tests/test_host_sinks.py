"""The offloaded layout's host sinks and outliers: the first tokens, and the tokens whose codes
miss their keys the most, join every selection (issue 25)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tiered.runtime import ops
from tiered.step.keys import CodebookKeys


def test_host_sinks_join_the_selection_once_in_order():
    idx = np.array([[2, 7, 9, -1], [0, 5, -1, -1], [-1, -1, -1, -1]], np.int32)
    count = np.array([3, 2, 0], np.int32)
    out, got = ops.with_host_sinks(idx, count, 4)
    assert out.shape == (3, 8)
    assert got.tolist() == [6, 5, 4]
    assert out[0, :6].tolist() == [0, 1, 2, 3, 7, 9]
    assert out[1, :5].tolist() == [0, 1, 2, 3, 5]
    assert out[2, :4].tolist() == [0, 1, 2, 3]
    assert (out[0, 6:] == -1).all() and (out[2, 4:] == -1).all()
    for h in range(3):  # ascending, no repeats: what the gather kernels read
        row = out[h, : got[h]]
        assert (np.diff(row) > 0).all()


def test_host_sinks_leave_out_resident_tokens():
    idx = np.array([[6, -1]], np.int32)
    count = np.array([1], np.int32)
    exclude = np.zeros((1, 8), np.uint8)
    exclude[0, 1] = 1  # token 1 is resident: scored exactly on the accelerator already
    out, got = ops.with_host_sinks(idx, count, 3, exclude)
    assert out[0, : got[0]].tolist() == [0, 2, 6]


def test_host_outliers_join_the_selection_once_in_order():
    idx = np.array([[2, 7, 9, -1], [5, -1, -1, -1]], np.int32)
    count = np.array([3, 1], np.int32)
    extra = np.array([[1, 7, 12], [-1, 5, 30]], np.int32)  # 1: a sink; 7, 5: selected already
    out, got = ops.with_host_sinks(idx, count, 4, None, extra)
    assert out.shape == (2, 4 + 4 + 3)
    assert out[0, : got[0]].tolist() == [0, 1, 2, 3, 7, 9, 12]
    assert out[1, : got[1]].tolist() == [0, 1, 2, 3, 5, 30]
    assert (out[0, got[0]:] == -1).all() and (out[1, got[1]:] == -1).all()
    # a resident outlier stays out (attended from the resident set, not twice)
    flags = np.zeros((2, 40), np.uint8)
    flags[0, 12] = flags[1, 30] = 1
    out, got = ops.with_host_sinks(idx, count, 4, flags, extra)
    assert out[0, : got[0]].tolist() == [0, 1, 2, 3, 7, 9]
    assert out[1, : got[1]].tolist() == [0, 1, 2, 3, 5]


def _reference_worst(keys, book, codes, m):
    """Squared reconstruction error of every (head, token), one at a time; the m largest."""
    H, n, d = keys.shape
    ds = book.shape[3]
    err = np.zeros((H, n))
    for h in range(H):
        for t in range(n):
            for j in range(d // ds):
                c = book[h, j if book.shape[1] > 1 else 0, codes[h, t, j]]
                err[h, t] += ((keys[h, t, j * ds:(j + 1) * ds] - c) ** 2).sum()
    return [sorted(np.argsort(-err[h])[:m].tolist()) for h in range(H)]


@pytest.mark.parametrize("books", [1, 4])
def test_worst_coded_tokens_match_a_loop_reference(books):
    """The host outliers (tiered.layer.compressed.HOST_OUTLIERS): the tokens whose codes miss their
    keys the most, per head, as a loop over tokens finds them; a planted rare key is one."""
    rng = np.random.default_rng(books)
    H, n, d, g, c = 2, 60, 16, 4, 8
    book = rng.normal(size=(H, books, c, d // g)).astype(np.float32)
    keys = rng.normal(size=(H, n, d)).astype(np.float32)
    keys[1, 41] = 8.0  # far from every centroid
    for numpy_path in (True, False):
        store = CodebookKeys(H, book, 64, 8, numpy_path=numpy_path)
        store.append(mx.array(keys), 0)
        codes = np.array(store.codes[:, :n])
        got, err = store.worst_coded(mx.array(keys), 5)
        assert got.tolist() == _reference_worst(keys, book, codes, 5)
        assert 41 in got[1].tolist()
        # a later run of tokens: ids from where it was written, the same errors
        later, err2 = store.worst_coded(mx.array(keys[:, 30:]), 60, 30)
        assert later[:, 0].tolist() == [30, 30] and later.shape == (H, 30)
        np.testing.assert_allclose(err2[1, 41 - 30], err[1, got[1].tolist().index(41)],
                                   rtol=1e-5)


def test_worst_coded_in_blocks_is_one_pass_with_a_bounded_transient(monkeypatch):
    """CodebookKeys.worst_coded reads WORST_CODED_BLOCK tokens at a time: the same tokens and
    errors as one pass over them all, and numpy's peak allocation during the call stays near
    one block's, not the L tokens' (at a layer's compress the one pass took the process over
    its memory_budget)."""
    import tracemalloc

    from tiered.step import keys as keys_mod

    rng = np.random.default_rng(3)
    H, n, d, g, c = 3, 20000, 64, 16, 64
    book = rng.normal(size=(H, g, c, d // g)).astype(np.float32)
    keys = mx.array(rng.normal(size=(H, n, d)).astype(np.float32))
    store = CodebookKeys(H, book, n + 8, 8, numpy_path=True)
    store.append(keys, 0)
    peaks, got = {}, {}
    for block in (n, 1000, 777):
        monkeypatch.setattr(keys_mod, "WORST_CODED_BLOCK", block)
        tracemalloc.start()
        got[block] = store.worst_coded(keys, 128)
        peaks[block] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    for block in (1000, 777):
        assert got[block][0].tolist() == got[n][0].tolist()
        np.testing.assert_allclose(got[block][1], got[n][1], rtol=1e-5)
    # one pass: the codes (int64), the keys and their reconstruction (float32) of every token
    assert peaks[n] > H * n * (g * 8 + 2 * d * 4)
    assert peaks[1000] < peaks[n] / 8
