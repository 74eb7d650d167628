"""The compressed phase of one layer: codes for every token, full K/V for a resident set.

Accelerator tier (MLX arrays, all ``(H, capacity, ...)`` grown in steps):

- ``codes`` (H, cap, g) uint8/uint16: product-quantized keys of every live token;
- ``acc`` (H, cap) fp32: H2O accumulator (EMA of softmax weight, averaged over the GQA group);
- ``flags`` (H, cap) uint8: 1 where a token is resident;
- resident set ``res_k``/``res_v`` (H, R, d) in the model dtype and ``res_tok`` (H, R) int32:
  slots ``[0, S)`` sinks, ``[S, S+W)`` a ring of the W most recent tokens, ``[S+W, R)`` heavy
  hitters (per KV head). Empty slots hold token id -1.

Host tier: :class:`tiered.cpu.HostStore` with every token's values (and keys).

A decode step (one query): exact scores and the partial over the resident set on the
accelerator; approximate scores of every token from the codes; tau-cumulative selection of the
offloaded tokens that matter; their values gathered and summed on CPU workers (approximate or
exactly rescored weights); the two partials merged exactly; H2O accumulators updated and, every
``refresh_every`` steps, heavy hitters promoted from the host (and demoted) to follow attention.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from . import ops
from .planner import Plan


def _np(a: mx.array) -> np.ndarray:
    """Zero-copy numpy view of an evaluated MLX array (CPU memory)."""
    mx.eval(a)
    return np.array(a, copy=False)


def _zeros(shape, dtype, fill=0):
    a = mx.full(shape, fill, dtype=dtype) if fill else mx.zeros(shape, dtype=dtype)
    mx.eval(a)
    return a


class CompressedLayer:
    def __init__(self, parent, plan: Plan, codebook: np.ndarray, capacity: int):
        self.parent = parent
        self.config = parent.config
        self.plan = plan
        B, H, dk, dv, dtype = parent._geometry
        self.H, self.dk, self.dv, self.dtype = H, dk, dv, dtype
        self.codebook = mx.array(codebook.astype(np.float32))
        self._codebook_np = _np(self.codebook)
        self.code_dtype = mx.uint8 if plan.centroids <= 256 else mx.uint16
        self.n = 0  # live tokens
        self.steps = 0  # decode steps since compression
        self.scale = None
        self._alloc(capacity)
        S, W = plan.sinks, plan.recent
        self.S, self.W = S, W
        self.R = 0
        self.res_k = self.res_v = self.res_tok = None

    # ---- storage ---------------------------------------------------------------------------
    def _alloc(self, capacity):
        H, g = self.H, self.plan.groups
        self.codes = _zeros((H, capacity, g), self.code_dtype)
        self.acc = _zeros((H, capacity), mx.float32) if self.plan.use_h2o else None
        self.flags = _zeros((H, capacity), mx.uint8)
        self._views()

    def _views(self):
        self._codes_np = _np(self.codes)
        self._flags_np = _np(self.flags)
        self._acc_np = _np(self.acc) if self.acc is not None else None

    @property
    def capacity(self) -> int:
        return self.codes.shape[1]

    def _grow(self, need: int):
        if need <= self.capacity:
            return
        step = self.plan.step
        cap = -(-need // step) * step
        old = (self._codes_np, self._flags_np, self._acc_np)
        self._alloc(cap)
        n = self.n
        self._codes_np[:, :n] = old[0][:, :n]
        self._flags_np[:, :n] = old[1][:, :n]
        if old[2] is not None:
            self._acc_np[:, :n] = old[2][:, :n]

    def _set_resident(self, res_k, res_v, res_tok):
        self.res_k, self.res_v = res_k, res_v
        self.res_tok = res_tok
        self._res_tok_np = _np(self.res_tok)
        self.R = res_tok.shape[1]

    @property
    def nbytes(self) -> int:
        arrays = [self.codes, self.flags, self.codebook]
        if self.acc is not None:
            arrays.append(self.acc)
        if self.res_k is not None:
            arrays += [self.res_k, self.res_v, self.res_tok]
        return sum(a.nbytes for a in arrays)

    # ---- construction from the exact phase -------------------------------------------------
    @classmethod
    def from_exact(cls, parent, plan: Plan, codebook: np.ndarray, keys: mx.array,
                   values: mx.array, obs_queries: mx.array | None, scale: float):
        """Compress ``keys``/``values`` (1, H, n, d) of the exact phase."""
        n = keys.shape[2]
        step = plan.step
        self = cls(parent, plan, codebook, -(-n // step) * step)
        self.scale = scale
        k32 = np.ascontiguousarray(_np(keys[0].astype(mx.float32)))
        self._codes_np[:, :n] = ops.encode(k32, self._codebook_np)
        self.n = n
        # Heavy hitters seeded from the last prefill queries (SnapKV-style observation window).
        if self.acc is not None and obs_queries is not None:
            self._acc_np[:, :n] = ops.observed_weights(
                _np(obs_queries[0].astype(mx.float32)), k32, scale
            )
        self._rebuild_resident(keys[0], values[0])
        return self

    def _resident_layout(self, n: int) -> int:
        """Resident slots per head at n tokens (sinks + ring + heavy)."""
        if not self.plan.keep_values_resident:
            return min(self.W, n)
        return min(max(self.plan.check(n, horizon=self.config.refresh_every + 1), 0), n)

    def _choose_heavy(self, count: int, n: int, S: int, W: int) -> np.ndarray:
        """(H, count) token ids of the top accumulators outside sinks and the recent ring."""
        H = self.H
        out = np.full((H, count), -1, np.int32)
        lo, hi = min(S, n), max(n - W, 0)
        if count <= 0 or hi <= lo:
            return out
        acc = self._acc_np[:, lo:hi]
        k = min(count, hi - lo)
        top = np.argpartition(-acc, k - 1, axis=1)[:, :k] if k < hi - lo else np.tile(
            np.arange(hi - lo), (H, 1))
        out[:, :k] = np.sort(top, axis=1) + lo
        return out

    def _rebuild_resident(self, keys: mx.array | None = None, values: mx.array | None = None):
        """Lay out sinks, recent ring and heavy hitters; K/V from ``keys``/``values`` (H, n, d)
        when given (exact phase), else from the current resident set and the host."""
        n, H = self.n, self.H
        if keys is None:
            self.parent._flush()  # tokens leaving the ring are read back from the host
        R = self._resident_layout(n)
        W = min(self.plan.recent_window(R), n)
        S = min(self.S, n) if self.plan.keep_values_resident else 0
        if not self.plan.keep_values_resident:
            W = R
        ring = np.full((H, W), -1, np.int32)
        for t in range(max(0, n - W), n):
            ring[:, t % W] = t
        sinks = np.tile(np.arange(S, dtype=np.int32), (H, 1))
        heavy_n = max(R - S - W, 0)
        heavy = self._choose_heavy(heavy_n, n, S, W) if self.acc is not None else np.full(
            (H, heavy_n), -1, np.int32)
        tok = np.concatenate([sinks, ring, heavy], axis=1).astype(np.int32)
        res_k, res_v = self._fetch_kv(tok, keys, values)
        self.S_eff, self.W_eff = S, W
        self._set_resident(res_k, res_v, mx.array(tok))
        flags = self._flags_np
        flags[:, : self.n] = 0
        for h in range(H):
            valid = tok[h][tok[h] >= 0]
            flags[h, valid] = 1

    def _fetch_kv(self, tok: np.ndarray, keys, values):
        """Full K/V (H, R, d) for token ids ``tok`` (-1: zeros), in the model dtype."""
        H, R = tok.shape
        safe = np.maximum(tok, 0)
        if keys is not None:
            idx = mx.array(safe)[..., None]
            k = mx.take_along_axis(keys, idx, axis=1)
            v = mx.take_along_axis(values, idx, axis=1)
        else:
            k, v = self._gather_known(safe)
        valid = mx.array(tok >= 0)[..., None]
        k = mx.where(valid, k, 0).astype(self.dtype)
        v = mx.where(valid, v, 0).astype(self.dtype)
        mx.eval(k, v)
        return k, v

    def _gather_known(self, tok: np.ndarray):
        """K/V (H, R, d) for token ids: from the current resident set where they are there
        already (no host traffic), the rest gathered from the host pages."""
        host = self.parent.host
        k = np.zeros((self.H, tok.shape[1], self.dk), np.float32)
        v = np.zeros((self.H, tok.shape[1], self.dv), np.float32)
        old_tok = self._res_tok_np if self.res_tok is not None else None
        res_k = np.array(self.res_k.astype(mx.float32)) if old_tok is not None else None
        res_v = np.array(self.res_v.astype(mx.float32)) if old_tok is not None else None
        for h in range(self.H):
            need = np.ones(tok.shape[1], bool)
            if old_tok is not None:
                order = np.argsort(old_tok[h], kind="stable")
                sorted_old = old_tok[h][order]
                pos = np.clip(np.searchsorted(sorted_old, tok[h]), 0, len(sorted_old) - 1)
                hit = (sorted_old[pos] == tok[h]) & (tok[h] >= 0)
                slot = order[pos[hit]]
                k[h, hit], v[h, hit] = res_k[h, slot], res_v[h, slot]
                need = ~hit
            if need.any():
                ids = tok[h, need]
                k[h, need] = host.gather("keys", 0, h, ids)
                v[h, need] = host.gather("values", 0, h, ids)
        return mx.array(k), mx.array(v)

    # ---- appends ---------------------------------------------------------------------------
    def append(self, keys: mx.array, values: mx.array):
        """New tokens (1, H, L, d): codes, recent ring, write-behind to the host."""
        L = keys.shape[2]
        n0 = self.n
        self._grow(n0 + L)
        k32 = np.ascontiguousarray(_np(keys[0].astype(mx.float32)))
        self._codes_np[:, n0 : n0 + L] = ops.encode(k32, self._codebook_np)
        if self._acc_np is not None:
            self._acc_np[:, n0 : n0 + L] = 0.0
        self.n = n0 + L
        self._ring_insert(keys[0], values[0], n0)
        self.parent._write_behind(keys, values)
        return keys, values

    def _ring_insert(self, k: mx.array, v: mx.array, n0: int):
        """Put the newest tokens into the recent ring (slots [S, S+W)); evicted ones leave."""
        L = k.shape[1]
        S, W = self.S_eff, self.W_eff
        if W == 0:
            return
        tok = self._res_tok_np
        first = max(n0, n0 + L - W)
        slots = [S + (t % W) for t in range(first, n0 + L)]
        old = tok[:, slots].copy()
        for h in range(self.H):
            gone = old[h][old[h] >= 0]
            self._flags_np[h, gone] = 0
        idx = mx.array(np.array(slots, np.int32))
        src = k[:, first - n0 :].astype(self.dtype)
        vsrc = v[:, first - n0 :].astype(self.dtype)
        self.res_k[:, idx] = src
        self.res_v[:, idx] = vsrc
        mx.eval(self.res_k, self.res_v)
        tok[:, slots] = np.arange(first, n0 + L, dtype=np.int32)
        self._flags_np[:, first : n0 + L] = 1

    # ---- attention -------------------------------------------------------------------------
    def attention(self, queries, keys, values, *, scale, mask, sinks=None):
        self.scale = scale
        if queries.shape[2] == 1:
            return self._decode(queries, scale, sinks)
        return self._chunk(queries, keys, values, scale, sinks)

    def _resident_partial(self, q: mx.array):
        """Exact attention over the resident set. q (H, rep, d) fp32 scaled.

        Returns (o (H, rep, dv) normalized, lse (H, rep), scores (H, rep, R))."""
        s = q @ self.res_k.astype(mx.float32).swapaxes(-1, -2)
        valid = (self.res_tok >= 0)[:, None, :]
        s = mx.where(valid, s, -mx.inf)
        m = mx.max(s, axis=-1, keepdims=True)
        m = mx.where(mx.isfinite(m), m, 0)
        p = mx.exp(s - m)
        den = mx.sum(p, axis=-1, keepdims=True)
        o = (p @ self.res_v.astype(mx.float32)) / mx.maximum(den, 1e-30)
        lse = (m + mx.log(den))[..., 0]
        return o, lse, s

    def _decode(self, queries, scale, sinks):
        cfg = self.config
        H, n = self.H, self.n
        Hq, d = queries.shape[1], queries.shape[3]
        rep = Hq // H
        self.parent._flush_until(n - self.W_eff)
        q = (queries[0, :, 0, :].astype(mx.float32) * scale)
        qg = q.reshape(H, rep, d)
        # Accelerator: exact partial over the resident set (evaluated while CPU jobs run).
        o_r, lse_r, s_r = self._resident_partial(qg)
        mx.eval(q, o_r, lse_r, s_r)
        q_np = np.array(q)
        z = ops.scores(q_np, self._codebook_np, self._codes_np, n, rep)
        # Resident tokens use their exact scores in the softmax the policy sees.
        tok = self._res_tok_np
        s_np = np.array(s_r).reshape(Hq, -1)
        for h in range(Hq):
            kv = h // rep
            valid = tok[kv] >= 0
            z[h, tok[kv][valid]] = s_np[h][valid]
        cap = cfg.max_selected if isinstance(cfg.max_selected, int) else max(
            1, int(cfg.max_selected * n))
        idx, count, m, ssum, mass = ops.select(z, self._flags_np[:, :n], cfg.tau, cap,
                                               min(cfg.min_selected, cap), rep)
        # CPU workers: gather the selected offloaded values, weighted sums + log-sum-exp.
        t0 = time.perf_counter()
        o_c, lse_c = ops.gather_partial(
            self.parent.scheduler, self.parent.layer, q_np, z, idx, count, rep,
            self.parent.host, cfg.rescore == "exact",
        )
        o_r = np.array(o_r).reshape(Hq, -1)
        lse_r = np.array(lse_r).reshape(Hq)
        o, lse = ops.merge(o_r, lse_r, o_c, lse_c)
        if sinks is not None:
            o, lse = ops.merge(o, lse, np.zeros_like(o), np.array(sinks, np.float32).reshape(Hq))
        out = mx.array(o.reshape(1, Hq, 1, -1)).astype(queries.dtype)
        # H2O bookkeeping.
        if self._acc_np is not None:
            ops.acc_update(self._acc_np, z, m, ssum, rep, n, cfg.ema_alpha)
        self.steps += 1
        resident_mass = float(np.mean(np.exp(lse_r - ops.logaddexp(lse_r, lse_c))))
        self.parent.stats.record_step(float(np.mean(count)), n, resident_mass)
        if self._acc_np is not None and self.steps % cfg.refresh_every == 0:
            self._refresh()
        self.parent.stats.last_step_s = time.perf_counter() - t0
        return out

    def _refresh(self):
        """Promote/demote heavy hitters to follow the accumulators (and grow with the budget)."""
        self._rebuild_resident()

    def _chunk(self, queries, keys, values, scale, sinks):
        """A prompt chunk after compression: exact attention over the resident set and the
        chunk itself (causal). Block-wise prefill: sinks + heavy hitters are the anchor."""
        L = queries.shape[2]
        H, rep = self.H, queries.shape[1] // self.H
        tok = self.res_tok
        n0 = self.n - L
        # The chunk's own tokens may sit in the ring already: keep resident keys older than it.
        old = (tok >= 0) & (tok < n0)
        rk = self.res_k[None]
        rv = self.res_v[None]
        k = mx.concatenate([rk, keys.astype(self.dtype)], axis=2)
        v = mx.concatenate([rv, values.astype(self.dtype)], axis=2)
        R = self.R
        causal = mx.arange(L)[:, None] >= mx.arange(L)[None, :]
        res_mask = mx.broadcast_to(old[:, None, None, :], (H, rep, L, R))
        chunk_mask = mx.broadcast_to(causal[None, None], (H, rep, L, L))
        full = mx.concatenate([res_mask, chunk_mask], axis=-1).reshape(1, H * rep, L, R + L)
        return mx.fast.scaled_dot_product_attention(
            queries, k.astype(queries.dtype), v.astype(queries.dtype), scale=scale, mask=full,
            sinks=sinks,
        )

    # ---- trim and persistence --------------------------------------------------------------
    def is_trimmable(self) -> bool:
        return True

    def trim(self, n_trim: int) -> int:
        n_trim = min(n_trim, self.n)
        self.parent._flush()
        self.n -= n_trim
        self.parent.host.truncate(self.n)
        tok = self._res_tok_np
        gone = tok >= self.n
        tok[gone] = -1
        self._flags_np[:, self.n :] = 0
        self._rebuild_resident()
        return n_trim

    def state(self) -> dict:
        n = self.n
        st = {
            "plan": self.plan.to_json(),
            "n": n,
            "steps": self.steps,
            "scale": float(self.scale) if self.scale is not None else -1.0,
            "codebook": self.codebook,
            "codes": self.codes[:, :n],
            "flags": self.flags[:, :n],
            "res_k": self.res_k,
            "res_v": self.res_v,
            "res_tok": self.res_tok,
            "layout": [self.S_eff, self.W_eff],
        }
        if self.acc is not None:
            st["acc"] = self.acc[:, :n]
        return st

    @classmethod
    def from_state(cls, parent, st):
        plan = parent.context.adopt_plan(st["plan"])
        n = int(st["n"])
        self = cls(parent, plan, np.array(st["codebook"]), max(plan.step, -(-n // plan.step) * plan.step))
        self.n = n
        self.steps = int(st["steps"])
        self.scale = None if st["scale"] < 0 else float(st["scale"])
        self._codes_np[:, :n] = np.array(st["codes"])
        self._flags_np[:, :n] = np.array(st["flags"])
        if self._acc_np is not None and "acc" in st:
            self._acc_np[:, :n] = np.array(st["acc"])
        self.S_eff, self.W_eff = (int(x) for x in st["layout"])
        self._set_resident(mx.array(st["res_k"]), mx.array(st["res_v"]),
                           mx.array(np.array(st["res_tok"]).astype(np.int32)))
        return self
