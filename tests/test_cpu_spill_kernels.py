"""The Numba lookahead buffer of tiered.cpu (kernels.spill_changes) against a reference of the
wanted set: the previous selection and its successors, outside the resident set."""

import numpy as np
import pytest

from tiered.cpu import kernels as K


def spill_wanted_reference(idx, count, res_tok, n, shift, C):
    """Per head: the selection, then its successors, minus resident tokens and tokens outside
    [0, n), in that order, first C kept (as spill_changes defines the wanted set)."""
    out = []
    for h in range(idx.shape[0]):
        res = set(res_tok[h][(res_tok[h] >= 0) & (res_tok[h] < n)].tolist())
        want = []
        for off in (0, 1) if shift else (0,):
            for j in idx[h, : count[h]].tolist():
                j += off
                if 0 <= j < n and j not in res and j not in want and len(want) < C:
                    want.append(j)
        out.append(set(want))
    return out


@pytest.mark.parametrize("shift", [True, False])
def test_spill_changes_tracks_selections_and_keeps_slots(shift):
    """Rounds of random selections (overlapping the previous one, as decode steps do): after
    each update the buffer holds exactly the wanted set, a token held before keeps its slot,
    and the returned changes replay the update on a copy of the old buffer."""
    rng = np.random.default_rng(7)
    H, cap, C, n = 3, 40, 70, 300  # C < 2 * cap: the cap on the wanted set is exercised
    spill = np.full((H, C), -1, np.int32)
    prev = [np.zeros(0, np.int64)] * H
    for step in range(25):
        n += 1
        idx = np.full((H, cap), -1, np.int32)
        count = rng.integers(0, cap + 1, H).astype(np.int32)
        for h in range(H):
            keep = rng.permutation(prev[h])[: count[h] // 2]
            fresh = rng.choice(n, count[h], replace=False)
            sel = np.unique(np.concatenate([keep, fresh]))[: count[h]]
            count[h] = len(sel)
            idx[h, : count[h]] = rng.permutation(sel)
            prev[h] = sel
        res_tok = np.full((H, 12), -1, np.int32)
        res_tok[:, :9] = rng.integers(0, n, (H, 9))
        old = spill.copy()
        slots, toks = K.spill_changes(idx, count, res_tok, n, spill, shift=shift)
        want = spill_wanted_reference(idx, count, res_tok, n, shift, C)
        replay = np.concatenate([old, np.full((H, 1), -1, np.int32)], axis=1)
        for h in range(H):
            held = spill[h][spill[h] >= 0]
            assert len(held) == len(set(held.tolist())) and set(held.tolist()) == want[h]
            for s in range(C):  # a wanted token held before stays where it was
                if old[h, s] in want[h]:
                    assert spill[h, s] == old[h, s]
            replay[h, slots[h]] = toks[h]
            assert np.all(slots[h][toks[h] >= 0] < C)
        assert np.array_equal(replay[:, :C], spill)
        assert np.all(replay[:, C] == -1)  # padding (slot C) only ever carries token -1


def test_spill_changes_rejects_bad_inputs():
    idx = np.zeros((2, 4), np.int32)
    spill = np.full((2, 8), -1, np.int32)
    res = np.zeros((2, 3), np.int32)
    with pytest.raises(ValueError, match="count"):
        K.spill_changes(idx, np.array([5, 0], np.int32), res, 10, spill)
    with pytest.raises(ValueError, match="res_tok"):
        K.spill_changes(idx, np.zeros(2, np.int32), np.zeros((3, 3), np.int32), 10, spill)
    with pytest.raises(ValueError, match="spill_tok"):
        K.spill_changes(idx, np.zeros(2, np.int32), res, 10, spill[:, ::2])
