"""Lookahead decoding (MLX path): exact attention over the resident set and the buffer of the
previous step's selection, the options it refuses, and the buffer inside the budget."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import test_tiered_core as core
from test_tiered_core import _decode_logits, _prompt

import tiered
from tiered import TieredCache
from tiered.planning.planner import BudgetError

small = core.small  # the module-scoped small model (a fixture: one model per module)


def test_lookahead_attends_resident_and_previous_selection_exactly(small, monkeypatch):
    """Lookahead decoding (MLX path): after the first step, each layer's output is exact
    attention over its resident tokens and the buffer, and the buffer holds exactly the
    previous step's selection and its successors (outside the resident set), with the rows
    of the host pages. Checked against float64 numpy from the host store's float32 rows."""
    from tiered.layer import compressed as C
    from tiered.layer import lookahead as LA

    moves, steps = {}, []
    real_move, real_step = LA._spill_move, C.CompressedLayer._decode_lookahead

    def move(idx, count, res_tok, n, spill_tok, host, *heads):
        moves[id(host)] = (idx.copy(), count.copy(), res_tok.copy(), n)
        return real_move(idx, count, res_tok, n, spill_tok, host, *heads)

    def step(self, queries, scale, sinks):
        res = (np.array(self.res_tok), np.array(self.res_k.astype(mx.float32)),
               np.array(self.res_v.astype(mx.float32)))
        out = real_step(self, queries, scale, sinks)
        steps.append((self, np.array(queries.astype(mx.float32)), scale, np.array(
            out.astype(mx.float32)), res, np.array(self.spill_tok), np.array(
            self.spill_k.astype(mx.float32)), moves[id(self.parent.host)]))
        return out

    monkeypatch.setattr(LA, "_spill_move", move)
    monkeypatch.setattr(C.CompressedLayer, "_decode_lookahead", step)
    cache = TieredCache.for_model(small, kernels="mlx", lookahead=True, gpu_budget=0.5,
                                  max_selected=48, host_dtype="float32", page_size=64,
                                  recent=16, refresh_every=4, workers=2)
    _decode_logits(small, cache, _prompt(700, seed=3), 9)
    assert len(steps) == 3 * 8  # every step but the first, every layer
    spilled = 0
    for layer, q, scale, out, (res_tok, res_k, res_v), spill_tok, spill_k, mv in steps:
        idx, count, res_at_move, n_move = mv
        host = layer.parent.host
        H, Hq = res_tok.shape[0], q.shape[1]
        rep = Hq // H
        for h in range(H):
            res = res_tok[h][res_tok[h] >= 0]
            held = spill_tok[h][spill_tok[h] >= 0]
            sel = idx[h, : count[h]]
            want = set(sel.tolist()) | set((sel + 1).tolist())
            want = {j for j in want if j < n_move} - set(res_at_move[h].tolist())
            assert set(held.tolist()) == want and not set(held.tolist()) & set(res.tolist())
            spilled += len(held)
            slots = np.flatnonzero(spill_tok[h] >= 0)
            k_host = host.gather_rows("keys", 0, spill_tok[h][slots][None].repeat(H, 0))[h]
            assert np.array_equal(spill_k[h, slots], k_host)
            v_host = host.gather_rows("values", 0, held[None].repeat(H, 0))[h]
            keys = np.concatenate([res_k[h][res_tok[h] >= 0], k_host]).astype(np.float64)
            vals = np.concatenate([res_v[h][res_tok[h] >= 0], v_host]).astype(np.float64)
            for r in range(rep):
                s = keys @ (q[0, h * rep + r, 0].astype(np.float64) * scale)
                p = np.exp(s - s.max())
                ref = (p / p.sum()) @ vals
                np.testing.assert_allclose(out[0, h * rep + r, 0], ref, rtol=2e-4, atol=2e-5)
    assert spilled > 0
    cache.close()  # the host pages were read above: close gives them back


def test_lookahead_options_are_checked(small):
    with pytest.raises(ValueError, match="lookahead"):
        TieredCache.for_model(small, lookahead=True, method="hcattention")
    with pytest.raises(ValueError, match="lookahead"):
        TieredCache.for_model(small, lookahead=True, host_keys=False)
    with pytest.raises(ValueError, match="lookahead"):
        TieredCache.for_model(small, lookahead="yes")
    # 1/8 of this small model's cache leaves ~40 resident slots per head: too few to give
    # half to the buffer and keep the sinks, a recent window and some heavy hitters.
    cache = TieredCache.for_model(small, kernels="mlx", lookahead=True, gpu_budget=0.125,
                                  page_size=64, recent=16)
    with pytest.raises(BudgetError, match="lookahead=False"):
        _decode_logits(small, cache, _prompt(700, seed=2), 2)
    cache.close()


@pytest.mark.parametrize("budget", [0.5, 0.25])
def test_lookahead_buffer_fits_the_budget(small, budget):
    """The buffer comes out of the resident share: max_selected shrinks until the buffer
    takes at most half of the resident slots, and the accelerator bytes stay in budget."""
    cache = TieredCache.for_model(small, kernels="mlx", lookahead=True, gpu_budget=budget,
                                  max_selected=1024, page_size=64, recent=16)
    _decode_logits(small, cache, _prompt(700, seed=2), 20)
    cache.close()
    full = sum(c.full_cache_bytes() for c in cache)
    assert tiered.report_dict(cache)["bytes"]["accelerator"] <= budget * full
    for c in cache:
        layer = c.compressed
        slots = layer.plan.check(layer.n, horizon=layer.config.refresh_every + 1)
        assert layer.spill_k is not None and layer.spill_k.shape[1] <= slots // 2 + 1
