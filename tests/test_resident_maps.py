"""cpu.resident_maps.Swap against a per-head reference written with Python sets."""

import numpy as np
import pytest

from tiered.cpu.resident_maps import Swap


def _ids(rng, H, R, n, empty):
    tok = np.stack([rng.choice(n, R, replace=False) for _ in range(H)]).astype(np.int32)
    tok[rng.random(tok.shape) < empty] = -1
    return tok


@pytest.mark.parametrize("seed", range(6))
def test_swap_matches_a_set_reference(seed):
    rng = np.random.default_rng(seed)
    H, n = 3, 500
    Ro, Rn = rng.integers(0, 40, size=2)
    old = _ids(rng, H, Ro, n, 0.1)
    new = _ids(rng, H, Rn, n, 0.1)
    for h in range(H):  # keep about half of the old tokens (ids stay distinct per head)
        keep = [int(t) for t in old[h] if t >= 0 and rng.random() < 0.5][:Rn]
        fresh = [int(t) for t in new[h] if t not in set(old[h].tolist()) or t < 0]
        row = (keep + fresh)[:Rn]
        new[h] = rng.permutation(np.array(row + [-1] * (Rn - len(row)), np.int32))
    sw = Swap(old, new)
    for h in range(H):
        where = {int(t): j for j, t in enumerate(old[h]) if t >= 0}
        promoted = [int(t) for t in new[h] if t >= 0 and t not in where]
        kept = {int(t) for t in new[h] if t >= 0}
        demoted_slots = [j for j, t in enumerate(old[h]) if t >= 0 and t not in kept]
        assert list(sw.promoted[h, : sw.promoted_count[h]]) == promoted
        assert np.all(sw.promoted[h, sw.promoted_count[h]:] == -1)
        assert list(sw.demoted_slots[h, : sw.demoted_count[h]]) == demoted_slots
        assert list(sw.demoted[h, : sw.demoted_count[h]]) == [int(old[h, j]) for j in demoted_slots]
        assert np.all(sw.demoted[h, sw.demoted_count[h]:] == -1)
        # src: rows of concat(old rows, promoted rows) that hold each new token
        pool = list(old[h]) + promoted
        for j, t in enumerate(new[h]):
            if t >= 0:
                assert pool[sw.src[h, j]] == t
    # applying the flag changes to old's flags gives new's flags
    flags = np.zeros((H, n), np.uint8)
    for h in range(H):
        flags[h, old[h][old[h] >= 0]] = 1
    heads, toks, value = sw.flag_changes()
    flags[heads, toks] = value
    want = np.zeros((H, n), np.uint8)
    for h in range(H):
        want[h, new[h][new[h] >= 0]] = 1
    np.testing.assert_array_equal(flags, want)


def test_swap_leaves_its_scratch_clean():
    """A second swap over the same ids sees no stale entries from the first."""
    old = np.array([[5, 6, 7]], np.int32)
    Swap(old, np.array([[7, 8]], np.int32))
    sw = Swap(np.array([[8]], np.int32), np.array([[5, 8]], np.int32))
    assert sw.promoted.tolist() == [[5]]
    assert sw.src.tolist() == [[1, 0]]
    assert sw.demoted_count.tolist() == [0]


@pytest.mark.parametrize("seed", range(8))
def test_in_place_keeps_the_kept_slots_and_reaches_the_new_set(seed):
    """Swap.in_place: applying its entries to the old layout gives a layout holding exactly
    the new set, with every kept token (and the fixed slots) where it was and each slot
    written at most once apart from the padding (slot 0 rewritten as it is)."""
    rng = np.random.default_rng(100 + seed)
    H, n, fixed = 4, 300, int(rng.integers(1, 5))
    for _ in range(20):
        R = int(rng.integers(fixed + 1, 40))
        old = np.full((H, R), -1, np.int32)
        new = np.full((H, R), -1, np.int32)
        for h in range(H):
            old[h, :fixed] = new[h, :fixed] = np.arange(fixed)
            pool = rng.permutation(np.arange(fixed, n))
            k_old = int(rng.integers(0, R - fixed + 1))
            held = pool[:k_old]
            kept = held[rng.random(k_old) < 0.5]
            fresh = pool[k_old : k_old + R - fixed]
            row = np.concatenate([kept, fresh])[: int(rng.integers(len(kept), R - fixed + 1))]
            old[h, fixed + rng.choice(R - fixed, k_old, replace=False)] = held
            new[h, fixed + rng.choice(R - fixed, len(row), replace=False)] = row
        sw = Swap(old, new)
        slots, toks, kind, layout, promoted = sw.in_place(old, fixed)
        for h in range(H):
            got = old[h].copy()
            real = kind[h] != 2
            assert len(set(slots[h][real].tolist())) == real.sum()  # no slot written twice
            assert (slots[h][real] >= fixed).all() and (slots[h][~real] == 0).all()
            for s, t, k, i in zip(slots[h], toks[h], kind[h], range(slots.shape[1])):
                if k == 0:
                    assert t == promoted[h, i] >= 0  # entry i: promoted token i
                assert (k == 1) == (t < 0 and k != 2)
                got[s] = got[s] if k == 2 else t
            np.testing.assert_array_equal(got, layout[h])
            assert sorted(layout[h][layout[h] >= 0]) == sorted(new[h][new[h] >= 0])
            stay = np.isin(old[h], new[h]) & (old[h] >= 0)
            np.testing.assert_array_equal(layout[h][stay], old[h][stay])
