"""Heavy hitters' choice on the accelerator path (tiered.layer.heavy): the choice among resident ids
(``among``, computed on the device) against the host's masked choice (``allowed``)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tiered.step import undo
from tiered.layer.heavy import HeavyHitters


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


def _decode(model, cache, prompt, steps):
    logits = model(prompt, cache=cache)[:, -1]
    out = [logits]
    for _ in range(steps):
        logits = model(mx.argmax(logits, axis=-1)[:, None], cache=cache)[:, -1]
        out.append(logits)
    return mx.stack(out)


@pytest.mark.parametrize("kernels", ["numba", "mlx"])
def test_refresh_without_host_keys_is_skipped_only_where_it_keeps_the_set(monkeypatch,
                                                                          kernels):
    """Without host keys a refresh that keeps the sinks and the ring and does not shrink the
    slots is skipped (``refresh_keeps_all``). Wherever it is skipped, the refresh's own choice
    would have kept every heavy token (the invariant the skip rests on); and a decode that
    runs every refresh gives the same logits and, per head, the same resident tokens."""
    from conftest import make_small_model

    from tiered import TieredCache
    from tiered.layer.resident import ResidentSet

    model = make_small_model("llama-gqa-d64", layers=2, seed=3)
    prompt = mx.array(np.random.default_rng(21).integers(0, 49152, (1, 400)))
    opts = dict(gpu_budget=0.25, page_size=64, recent=16, host_keys=False, refresh_every=2,
                kernels=kernels)
    skipped = []
    keeps = ResidentSet.refresh_keeps_all

    def checked(self):
        if not keeps(self):
            return False
        R, S, W = self._refresh_layout(self.n, True)
        chosen = self._choose_heavy(R - S - W, self.n, S, W)
        held = self._res_tok_np[:, S + W :]
        for h in range(self.H):
            assert sorted(chosen[h][chosen[h] >= 0]) == sorted(held[h][held[h] >= 0])
        skipped.append(self.n)
        return True

    monkeypatch.setattr(ResidentSet, "refresh_keeps_all", checked)
    fast = TieredCache.for_model(model, **opts)
    a = _decode(model, fast, prompt, 40)
    assert len(skipped) >= 20
    monkeypatch.setattr(ResidentSet, "refresh_keeps_all", lambda self: False)
    full = TieredCache.for_model(model, **opts)
    b = _decode(model, full, prompt, 40)
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)
    for lf, lb in zip(fast, full):
        tf, tb = np.array(lf.compressed.res_tok), np.array(lb.compressed.res_tok)
        for h in range(tf.shape[0]):
            assert sorted(tf[h][tf[h] >= 0]) == sorted(tb[h][tb[h] >= 0])
    fast.close()
    full.close()


@pytest.mark.parametrize("kernels", ["numba", "mlx"])
def test_refresh_in_place_matches_a_rebuilt_layout(monkeypatch, kernels):
    """A refresh written into the old layout (ResidentSet._swap_in_place) holds the same
    tokens and gives the same logits as one that rebuilds the layout, and a trim back across
    refreshes (the undo journal) restores the same sets."""
    from mlx_lm.models.cache import trim_prompt_cache

    from conftest import make_small_model
    from tiered import TieredCache
    from tiered.layer import refresh_plan
    from tiered.layer.resident import ResidentSet

    model = make_small_model("llama-gqa-d64", layers=2, seed=5)
    prompt = mx.array(np.random.default_rng(8).integers(0, 49152, (1, 400)))
    opts = dict(gpu_budget=0.25, page_size=64, recent=16, refresh_every=2, kernels=kernels)
    calls = []
    in_place = ResidentSet._swap_in_place
    monkeypatch.setattr(ResidentSet, "_swap_in_place",
                        lambda self, *a: calls.append(1) or in_place(self, *a))
    fast = TieredCache.for_model(model, **opts)
    a = _decode(model, fast, prompt, 30)
    assert len(calls) >= 20
    monkeypatch.setattr(refresh_plan, "growth", lambda *a: None)
    full = TieredCache.for_model(model, **opts)
    b = _decode(model, full, prompt, 30)
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)

    def sets(cache):
        return [[sorted(t[t >= 0].tolist()) for t in np.array(c.compressed.res_tok)]
                for c in cache]

    assert sets(fast) == sets(full)
    for cache in (fast, full):
        trim_prompt_cache(cache, 9)
    assert sets(fast) == sets(full)
    fast.close()
    full.close()

