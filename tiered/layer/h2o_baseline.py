"""H2O-only: a resident set of sinks + heavy hitters + recent window, everything else evicted.

The "h2o" method of the runtime, the eviction baseline of the benchmarks: no key codes and no
host tier. At the end of the exact prefill the resident set is chosen from the attention the
last prompt queries pay (as ``tiered``'s is); afterwards each decode step attends exactly over
the resident set, accumulates the softmax weight of every resident token (EMA, averaged over
the GQA group), and a new token evicts the resident token with the lowest accumulator that is
neither a sink nor in the recent window. Evicted tokens are gone for good, so the physical
length ``n_resident`` stays below the RoPE position ``offset``, which keeps counting.

Arrays (accelerator): ``res_k``/``res_v`` (H, R, d), ``res_tok`` (H, R) int32 (-1: empty),
``acc`` (H, R) fp32. R grows with the budget as the document grows (fractional budgets).
"""

from __future__ import annotations

import weakref

import mlx.core as mx
import numpy as np

from ..planning.planner import Plan
from ..runtime import ops


class H2OBaselineLayer:
    """The compressed phase of a layer under method "h2o" (see the module docstring)."""

    def __init__(self, parent, plan: Plan):
        # weakly, as CompressedLayer.parent: no cycle with the TieredCache
        self.parent, self.plan, self.config = weakref.proxy(parent), plan, parent.config
        g = parent.geometry
        self.H, self.dk, self.dv, self.dtype = g.kv_heads, g.k_dim, g.v_dim, g.dtype
        self.S, self.W = plan.sinks, plan.recent
        self.n = 0  # tokens seen (the RoPE position of the next one)
        self.steps = 0
        self.scale = None

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_exact(cls, parent, plan: Plan, keys: mx.array, values: mx.array,
                   weights: np.ndarray):
        """weights (H, n): the initial accumulators (tiered.runtime.ops.h2o_seed)."""
        self = cls(parent, plan)
        n = keys.shape[2]
        self.n = n
        R = min(n, max(plan.check(n), 0))
        tok = np.full((self.H, R), -1, np.int32)
        S, W = min(self.S, n), min(self.W, max(R - min(self.S, n), 0))
        recent = np.arange(n - W, n)
        for h in range(self.H):
            keep = list(range(S)) + list(recent)
            heavy_n = R - len(keep)
            if heavy_n > 0:
                w = weights[h].copy()
                w[:S] = -np.inf
                w[n - W:] = -np.inf
                top = np.argpartition(-w, heavy_n - 1)[:heavy_n]
                keep += sorted(top.tolist())
            tok[h, : len(keep)] = np.array(sorted(keep), np.int32)
        idx = mx.array(np.maximum(tok, 0))[..., None]
        valid = mx.array(tok >= 0)[..., None]
        self.res_k = mx.where(valid, mx.take_along_axis(keys[0], idx, axis=1), 0).astype(self.dtype)
        self.res_v = mx.where(valid, mx.take_along_axis(values[0], idx, axis=1), 0).astype(self.dtype)
        acc = np.take_along_axis(weights, np.maximum(tok, 0), axis=1)
        self.acc = np.where(tok >= 0, acc, 0).astype(np.float32)
        self.res_tok = tok
        mx.eval(self.res_k, self.res_v)
        return self

    @property
    def R(self) -> int:
        return self.res_tok.shape[1]

    @property
    def nbytes(self) -> int:
        # res_tok and acc are accounted as accelerator state (int32 + fp32 per resident token)
        return self.res_k.nbytes + self.res_v.nbytes + self.res_tok.nbytes + self.acc.nbytes

    # ---- appends ---------------------------------------------------------------------------
    def _grow_to(self, R: int):
        extra = R - self.R
        if extra <= 0:
            return
        H = self.H
        self.res_k = mx.concatenate([self.res_k, mx.zeros((H, extra, self.dk), self.dtype)], 1)
        self.res_v = mx.concatenate([self.res_v, mx.zeros((H, extra, self.dv), self.dtype)], 1)
        self.res_tok = np.concatenate([self.res_tok, np.full((H, extra), -1, np.int32)], 1)
        self.acc = np.concatenate([self.acc, np.zeros((H, extra), np.float32)], 1)

    def _slot_for_new(self) -> np.ndarray:
        """(H,) slot per head for the next token: a free one, else evict the lowest
        accumulator outside the sinks and the recent window."""
        tok, n = self.res_tok, self.n
        slots = np.empty(self.H, np.int64)
        for h in range(self.H):
            free = np.flatnonzero(tok[h] < 0)
            if free.size:
                slots[h] = free[0]
                continue
            protected = (tok[h] < self.S) | (tok[h] >= n - self.W)
            score = np.where(protected, np.inf, self.acc[h])
            slots[h] = int(np.argmin(score))
        return slots

    def append(self, keys: mx.array, values: mx.array):
        L = keys.shape[2]
        try:
            R = min(self.n + L, self.plan.check(self.n + L))
        except ValueError:
            R = self.R
        self._grow_to(R)
        for i in range(L):
            slots = self._slot_for_new()
            idx = mx.array(slots.astype(np.int32))
            heads = mx.arange(self.H)
            self.res_k[heads, idx] = keys[0, :, i].astype(self.dtype)
            self.res_v[heads, idx] = values[0, :, i].astype(self.dtype)
            self.res_tok[np.arange(self.H), slots] = self.n
            self.acc[np.arange(self.H), slots] = 0.0
            self.n += 1
        mx.eval(self.res_k, self.res_v)
        return keys, values

    # ---- attention -------------------------------------------------------------------------
    def attention(self, queries, keys, values, *, scale, mask, sinks=None, update=True):
        """Exact attention over the resident set (``update=False``: a layer sharing this
        cache reads it, and the accumulators stay as they are)."""
        self.scale = scale
        L = queries.shape[2]
        H = self.H
        rep = queries.shape[1] // H
        tok = mx.array(self.res_tok)
        # Causal: query i of the chunk (position n - L + i) sees resident tokens <= its position.
        qpos = mx.arange(self.n - L, self.n)
        allowed = (tok[:, None, None, :] >= 0) & (tok[:, None, None, :] <= qpos[None, None, :, None])
        allowed = mx.broadcast_to(allowed, (H, rep, L, self.R)).reshape(1, H * rep, L, self.R)
        out = mx.fast.scaled_dot_product_attention(
            queries, self.res_k[None].astype(queries.dtype), self.res_v[None].astype(queries.dtype),
            scale=scale, mask=allowed, sinks=sinks,
        )
        if L == 1 and update:
            self._accumulate(queries, scale)
        return out

    def _accumulate(self, queries, scale):
        H = self.H
        q = (queries[0, :, 0, :].astype(mx.float32) * scale).reshape(H, -1, self.dk)
        s = q @ self.res_k.astype(mx.float32).swapaxes(-1, -2)
        s = mx.where(mx.array(self.res_tok >= 0)[:, None, :], s, -mx.inf)
        p = mx.softmax(s, axis=-1).mean(axis=1)
        alpha = self.config.ema_alpha
        self.acc = (alpha * self.acc + (1 - alpha) * np.array(p)).astype(np.float32)
        self.steps += 1
        self.parent.stats.record_step(0.0, self.n, 1.0)

    # ---- trim and persistence --------------------------------------------------------------
    def is_trimmable(self) -> bool:
        return False  # evicted tokens cannot come back

    def trim(self, n: int) -> int:
        return 0

    def state(self) -> dict:
        return {"kind": "h2o", "plan": self.plan.to_json(), "n": self.n, "steps": self.steps, "res_k": self.res_k,
                "res_v": self.res_v, "res_tok": mx.array(self.res_tok), "acc": mx.array(self.acc)}

    @classmethod
    def from_state(cls, parent, st):
        self = cls(parent, parent.context.adopt_plan(st["plan"]))
        self.n, self.steps = int(st["n"]), int(st["steps"])
        self.res_k, self.res_v = st["res_k"], st["res_v"]
        self.res_tok = np.array(st["res_tok"]).astype(np.int32)
        self.acc = np.array(st["acc"]).astype(np.float32)
        return self
