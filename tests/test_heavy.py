"""Heavy hitters' choice on the accelerator path (tiered.heavy): the choice among resident ids
(``among``, computed on the device) against the host's masked choice (``allowed``)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tiered import undo
from tiered.heavy import HeavyHitters


def _hitters(H: int, n: int, seed: int) -> HeavyHitters:
    rng = np.random.default_rng(seed)
    hh = HeavyHitters(H, n + 64, alpha=0.9, numpy_path=False)
    hh.set(0, rng.permutation(H * n).reshape(H, n).astype(np.float32) / (H * n))  # no ties
    return hh


def _resident(H: int, R: int, n: int, seed: int) -> np.ndarray:
    """(H, R) distinct token ids per head, some slots empty (-1)."""
    rng = np.random.default_rng(seed)
    tok = np.stack([rng.choice(n, R, replace=False) for _ in range(H)]).astype(np.int32)
    tok[rng.random(tok.shape) < 0.15] = -1
    return tok


@pytest.mark.parametrize("count", [1, 7, 40, 200])
def test_top_among_resident_ids_equals_masked_choice(count):
    H, n, R, lo, hi = 3, 500, 120, 4, 470
    hh = _hitters(H, n, seed=count)
    tok = _resident(H, R, n, seed=count + 1)
    allowed = undo.resident_mask(tok, hi)[:, lo:]
    want = hh.top(count, lo, hi, allowed)
    got = hh.top(count, lo, hi, among=mx.array(tok))
    np.testing.assert_array_equal(got, want)
    # every chosen id is resident, in [lo, hi), and at most the number of candidates
    for h in range(H):
        ids = got[h][got[h] >= 0]
        cand = tok[h][(tok[h] >= lo) & (tok[h] < hi)]
        assert set(ids.tolist()) <= set(cand.tolist())
        assert len(ids) == min(count, len(cand))


def test_prefetched_choice_is_read_only_for_the_same_candidates():
    H, n, R, lo, hi, count = 2, 300, 80, 2, 280, 30
    hh = _hitters(H, n, seed=5)
    tok = mx.array(_resident(H, R, n, seed=6))
    want_among = hh.top(count, lo, hi, among=tok)
    want_all = hh.top(count, lo, hi)
    assert not np.array_equal(want_among, want_all)  # the candidates matter here
    hh.prefetch(count, lo, hi, tok)
    np.testing.assert_array_equal(hh.top(count, lo, hi, among=tok), want_among)
    hh.prefetch(count, lo, hi)  # queued without candidates: a choice among them recomputes
    np.testing.assert_array_equal(hh.top(count, lo, hi, among=tok), want_among)
    hh.prefetch(count, lo, hi, tok)  # and the other way round
    np.testing.assert_array_equal(hh.top(count, lo, hi), want_all)


def test_among_is_refused_on_the_numpy_path():
    hh = HeavyHitters(2, 64, alpha=0.9, numpy_path=True)
    with pytest.raises(ValueError, match="among"):
        hh.top(4, 0, 32, among=mx.zeros((2, 8), mx.int32))
