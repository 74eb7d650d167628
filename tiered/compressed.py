"""The compressed phase of one layer: codes for every token, full K/V for a resident set.

Accelerator tier (MLX arrays, ``(H, capacity, ...)``, grown in steps):

- compressed keys of every live token (:mod:`tiered.keys`: codebook codes or affine);
- ``acc`` (H, cap) fp32: H2O accumulator (EMA of softmax weight, averaged over the GQA group);
- ``flags`` (H, cap) uint8: 1 where a token is resident;
- the resident set ``res_k``/``res_v`` (H, R, d) in the model dtype and ``res_tok`` (H, R)
  int32: slots ``[0, S)`` sinks, ``[S, S+W)`` a ring of the W most recent tokens, ``[S+W, R)``
  heavy hitters (per KV head). Empty slots hold token id -1.

Host tier: :class:`tiered.cpu.HostStore` with every token's values (and keys).

A decode step (one query): exact scores and the partial over the resident set on the
accelerator; approximate scores of every token from the compressed keys (exported); tau-
cumulative selection of the offloaded tokens that matter; their values gathered and summed by
CPU workers (approximate weights, or exactly rescored from the host keys) while the accelerator
works on; the two partials merged exactly; H2O accumulators updated and, every
``refresh_every`` steps, heavy hitters promoted from the host (and demoted).

Two implementations of the step share this state: ``numpy_path`` (MLX's CPU backend: Numba
kernels on zero-copy views) and the MLX path (GPUs: kernels of ``tiered.metal``; only the
selected indices and their scores cross to the CPU).
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from tiered import metal

from . import device_decode, ops, undo
from .keys import AffineKeys, CodebookKeys, _capacity
from .planner import BudgetError, Plan


def _np(a: mx.array) -> np.ndarray:
    """Zero-copy numpy view of an evaluated MLX array (CPU memory)."""
    mx.eval(a)
    return np.array(a, copy=False)


class CompressedLayer:
    def __init__(self, parent, plan: Plan, keys_store, capacity: int):
        self.parent = parent
        self.config = parent.config
        self.plan = plan
        B, H, dk, dv, dtype = parent._geometry
        self.H, self.dk, self.dv, self.dtype = H, dk, dv, dtype
        self.numpy_path = _numpy_path(self.config)
        self.keys = keys_store
        self.n = 0  # live tokens
        self.steps = 0  # decode steps since compression
        self.scale = None
        self.S, self.W = plan.sinks, plan.recent
        self.S_eff = self.W_eff = 0
        self.acc = self.flags = None
        self._alloc(capacity)
        self.res_k = self.res_v = self.res_tok = None
        self._res_tok_np = None
        # Lookahead (accelerator path): the offloaded tokens a step attends sit in a device
        # buffer ("spill", (H, C + 1, d); slot C stays empty), filled from the previous step's
        # selection; _pending is that selection (device array, or host (idx, count)).
        self.lookahead = bool(self.config.lookahead) and not self.numpy_path
        self.spill_k = self.spill_v = self.spill_tok = None
        self._spill_tok_np = None
        self._pending = None  # the selection the buffer moves to next (device array or host)
        self._spill_job = None  # (batch, count): that move, running on a CPU worker
        self._spill_count = None  # per-head selection counts of the move applied last
        self._spill_live = False  # a selection was made since the last prompt chunk / trim
        self.spill_moves = self.spill_rows_moved = 0  # moves applied; rows they uploaded
        # Block-wise prefill (prompt chunks after compression): exact K/V of the anchor block
        # (the first tokens) and of the previous chunk (the local block), until decoding starts.
        self.anchor_k = self.anchor_v = None
        self.local_k = self.local_v = None
        self.local_start = 0
        self._prev_local = (0, None, None)  # the local block before the last chunk
        self.journal = undo.Journal(0, self.config.undo_tokens)  # what trim gives back
        self._update = True  # this call changes the layer (False: a sharing layer reads it)

    # ---- storage ---------------------------------------------------------------------------
    def _alloc(self, capacity: int, n: int = 0):
        H = self.H
        flags = mx.zeros((H, capacity), mx.uint8)
        acc = mx.zeros((H, capacity), mx.float32) if self.plan.use_h2o else None
        if self.flags is not None and n:
            flags[:, :n] = self.flags[:, :n]
            if acc is not None:
                acc[:, :n] = self.acc[:, :n]
        mx.eval(flags, *([acc] if acc is not None else []))
        self.flags, self.acc = flags, acc
        self._flags_np = _np(flags) if self.numpy_path else None
        self._acc_np = _np(acc) if self.numpy_path and acc is not None else None

    @property
    def capacity(self) -> int:
        return self.flags.shape[1]

    def _set_resident(self, res_k, res_v, tok: np.ndarray):
        self.res_k, self.res_v = res_k, res_v
        self._res_tok_np = np.ascontiguousarray(tok, np.int32)
        self.res_tok = mx.array(self._res_tok_np)
        self.R = tok.shape[1]

    @property
    def nbytes(self) -> int:
        arrays = [self.flags]
        if self.acc is not None:
            arrays.append(self.acc)
        if self.res_k is not None:
            arrays += [self.res_k, self.res_v, self.res_tok]
        if self.spill_k is not None:
            arrays += [self.spill_k, self.spill_v, self.spill_tok]
        arrays += [a for a in (self.anchor_k, self.anchor_v, self.local_k, self.local_v)
                   if a is not None]
        return sum(a.nbytes for a in arrays) + self.keys.nbytes

    def _acc_host(self) -> np.ndarray:
        if self._acc_np is not None:
            return self._acc_np
        return np.array(self.acc[:, : self.n])

    # ---- construction from the exact phase -------------------------------------------------
    @classmethod
    def from_exact(cls, parent, plan: Plan, codebook, keys: mx.array, values: mx.array,
                   seed: np.ndarray | None, scale: float, chunk: int = 0):
        """Compress ``keys``/``values`` (1, H, n, d) of the exact phase. ``chunk`` > 1: the last
        ``chunk`` tokens are a prompt chunk still to be attended (block-wise); the chunk before
        them becomes the local block."""
        n = keys.shape[2]
        cap = _capacity(n, plan.step)
        store = make_key_store(parent, plan, codebook, cap)
        self = cls(parent, plan, store, cap)
        self.scale = scale
        store.append(keys[0], 0)
        self.n = n
        self.journal = undo.Journal(n, parent.config.undo_tokens)
        # Heavy hitters seeded from the prefill's attention (tiered.ops.h2o_seed).
        if self.acc is not None and seed is not None:
            w = seed
            if self.numpy_path:
                self._acc_np[:, :n] = w
            else:
                self.acc[:, :n] = mx.array(w)
        self._rebuild_resident(keys[0], values[0])
        A = min(parent.config.anchor_tokens, n)
        if A and chunk > 1:
            self.anchor_k = keys[0, :, :A].astype(self.dtype)
            self.anchor_v = values[0, :, :A].astype(self.dtype)
            n0 = n - chunk
            lo = max(A, n0 - chunk)
            if n0 > lo:
                self.local_k = keys[0, :, lo:n0].astype(self.dtype)
                self.local_v = values[0, :, lo:n0].astype(self.dtype)
                self.local_start = lo
            mx.eval(self.anchor_k, self.anchor_v,
                    *[a for a in (self.local_k, self.local_v) if a is not None])
        return self

    def _resident_layout(self, n: int) -> int:
        """Resident slots per head at n tokens (sinks + ring + heavy)."""
        if not self.plan.keep_values_resident:
            return min(self.W, n)
        r = self.plan.check(n, horizon=self.config.refresh_every + 1)
        if self.lookahead:  # the spill buffer's slots cost what resident slots cost
            spill = self._spill_size(n + self.config.refresh_every + 1)
            need = min(self.plan.minimum_resident(), n)
            if r - spill < need:
                raise BudgetError(
                    f"gpu_budget too small for lookahead at {n} tokens: its buffer of {spill} "
                    f"tokens per kv head leaves {r - spill} resident slots, {need} needed "
                    "(raise gpu_budget, lower max_selected, or set lookahead=False)")
            r -= spill
        return min(max(r, 0), n)

    def _spill_size(self, n: int) -> int:
        """Slots per kv head of the lookahead buffer: a selection and its successors, plus the
        always-empty slot that padded updates write to (at most half the resident slots)."""
        return 2 * self._cap(n)[0] + 1

    def _choose_heavy(self, count: int, n: int, S: int, W: int) -> np.ndarray:
        """(H, count) token ids of the top accumulators outside sinks and the recent ring."""
        H = self.H
        out = np.full((H, count), -1, np.int32)
        lo, hi = min(S, n), max(n - W, 0)
        if count <= 0 or hi <= lo:
            return out
        acc = self._acc_host()[:, lo:hi]
        host = self.parent.host
        if self.res_tok is not None and (host is None or host.keys is None):
            # No full keys on the host: only tokens whose K/V are on the accelerator (the
            # resident set, the recent ring) can be heavy hitters. Eviction, as in H2O.
            allowed = np.zeros_like(acc, dtype=bool)
            for h in range(H):
                t = self._res_tok_np[h]
                t = t[(t >= lo) & (t < hi)] - lo
                allowed[h, t] = True
            acc = np.where(allowed, acc, -np.inf)
        k = min(count, hi - lo)
        top = np.argpartition(-acc, k - 1, axis=1)[:, :k] if k < hi - lo else np.tile(
            np.arange(hi - lo), (H, 1))
        picked = np.take_along_axis(acc, top, axis=1)
        top = np.where(np.isfinite(picked), top + lo, -1)
        out[:, :k] = np.sort(top, axis=1)
        return out

    def _rebuild_resident(self, keys: mx.array | None = None, values: mx.array | None = None,
                          journal: bool = False):
        """Lay out sinks, recent ring and heavy hitters; K/V from ``keys``/``values`` (H, n, d)
        when given (exact phase), else from the current resident set and the host.
        ``journal``: record what it replaces (a refresh; see tiered.undo)."""
        n, H = self.n, self.H
        if keys is None:
            self.parent._flush()  # tokens leaving the ring are read back from the host
        R = self._resident_layout(n)
        if self.plan.keep_values_resident:
            S, W = min(self.S, n), min(self.plan.recent_window(R), n)
        else:
            S, W = 0, R
        ring = np.full((H, W), -1, np.int32)
        for t in range(max(S, n - W), n):  # the sinks are resident already: no second copy
            ring[:, t % W] = t
        sinks = np.tile(np.arange(S, dtype=np.int32), (H, 1))
        heavy_n = max(R - S - W, 0)
        heavy = self._choose_heavy(heavy_n, n, S, W) if self.acc is not None else np.full(
            (H, heavy_n), -1, np.int32)
        tok = np.concatenate([sinks, ring, heavy], axis=1).astype(np.int32)
        if journal:
            self.journal.record(n, "refresh", undo.demoted_rows(self, tok))
        res_k, res_v = self._fetch_kv(tok, keys, values)
        self.S_eff, self.W_eff = S, W
        self._set_resident(res_k, res_v, tok)
        flags = np.zeros((H, n), np.uint8)
        for h in range(H):
            flags[h, tok[h][tok[h] >= 0]] = 1
        if self.numpy_path:
            self._flags_np[:, :n] = flags
        else:
            self.flags[:, :n] = mx.array(flags)
            mx.eval(self.flags)

    def _fetch_kv(self, tok: np.ndarray, keys, values):
        """Full K/V (H, R, d) for token ids ``tok`` (-1: zeros), in the model dtype."""
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
        """K/V (H, R, d) for token ids, in the model dtype: rows already resident are copied
        on the device, only the others are read from the host pages and uploaded (a refresh
        promotes few tokens; moving the whole resident set through the host cost seconds per
        refresh at 128k tokens)."""
        host = self.parent.host
        H, R = tok.shape
        old_tok = self._res_tok_np
        R_old = 0 if old_tok is None else old_tok.shape[1]
        src = np.zeros((H, R), np.int32)  # row of concat(resident, new rows) per slot
        need = []
        for h in range(H):
            miss = tok[h] >= 0
            if old_tok is not None:
                order = np.argsort(old_tok[h], kind="stable")
                sorted_old = old_tok[h][order]
                pos = np.clip(np.searchsorted(sorted_old, tok[h]), 0, len(sorted_old) - 1)
                hit = (sorted_old[pos] == tok[h]) & (tok[h] >= 0)
                src[h, hit] = order[pos[hit]]
                miss &= ~hit
            need.append(np.flatnonzero(miss))
        n_new = max((len(x) for x in need), default=0)
        new_tok = np.full((H, n_new), -1, np.int32)
        for h, pos in enumerate(need):
            new_tok[h, : len(pos)] = tok[h, pos]
            src[h, pos] = R_old + np.arange(len(pos), dtype=np.int32)
        # Rows as stored (float16 by default: half the bytes of float32 to upload, and no
        # conversion on the host).
        parts_k = [self.res_k] if R_old else []
        parts_v = [self.res_v] if R_old else []
        if n_new:
            parts_k.append(mx.array(host.gather_rows("keys", 0, new_tok)).astype(self.dtype))
            parts_v.append(mx.array(host.gather_rows("values", 0, new_tok)).astype(self.dtype))
        elif not R_old:  # nothing anywhere: an empty block keeps the shapes
            parts_k.append(mx.zeros((H, 0, self.dk), self.dtype))
            parts_v.append(mx.zeros((H, 0, self.dv), self.dtype))
        idx = mx.array(src)[..., None]
        k = mx.take_along_axis(mx.concatenate(parts_k, axis=1), idx, axis=1)
        v = mx.take_along_axis(mx.concatenate(parts_v, axis=1), idx, axis=1)
        return k, v

    # ---- appends ---------------------------------------------------------------------------
    def append(self, keys: mx.array, values: mx.array):
        """New tokens (1, H, L, d): compressed keys, recent ring, write-behind to the host."""
        L = keys.shape[2]
        n0 = self.n
        # The host write can fail (disk tier full): it goes first, so a failure changes nothing
        self.parent._write_behind(keys, values)
        if n0 + L > self.capacity:
            self._alloc(_capacity(n0 + L, self.plan.step), n0)
        with ops.kernel_threads(self.config.kernel_threads if L == 1 else 1 << 16):
            self.keys.append(keys[0], n0)
        self.n = n0 + L  # new tokens' accumulators start at 0 (fresh buffers are zeroed)
        if self.acc is not None and not self.numpy_path:
            self.acc[:, n0 : n0 + L] = 0.0
        elif self._acc_np is not None:
            self._acc_np[:, n0 : n0 + L] = 0.0
        self._ring_insert(keys[0], values[0], n0)
        return keys, values

    def _ring_insert(self, k: mx.array, v: mx.array, n0: int):
        """Put the newest tokens into the recent ring (slots [S, S+W)); evicted ones leave."""
        L = k.shape[1]
        S, W = self.S_eff, self.W_eff
        if W == 0:
            self.journal.record(n0 + L, "append", (n0, np.zeros(0, np.int32),
                                                   np.zeros((self.H, 0), np.int32),
                                                   self.res_k[:, :0], self.res_v[:, :0]))
            return
        tok = self._res_tok_np
        first = max(n0, n0 + L - W)
        slots = np.array([S + (t % W) for t in range(first, n0 + L)], np.int32)
        self.journal.record(n0 + L, "append", (n0, slots) + undo.ring_rows(self, slots))
        old = tok[:, slots].copy()
        new = np.arange(first, n0 + L, dtype=np.int32)
        # On an accelerator each array made from host values costs a host-to-device transfer
        # (~0.26 ms on MLX CUDA, more than the step's kernels): one decode token (L == 1) goes
        # into its slot by a static slice (no index arrays), and its token id, the same in
        # every layer, comes from the per-value cache of device arrays.
        idx = slice(int(slots[0]), int(slots[0]) + 1) if L == 1 else mx.array(slots)
        self.res_k[:, idx] = k[:, first - n0 :].astype(self.dtype)
        self.res_v[:, idx] = v[:, first - n0 :].astype(self.dtype)
        tok[:, slots] = new
        if L == 1 and not self.numpy_path:
            self.res_tok[:, idx] = metal.device_ints(int(new[0]))
        else:
            self.res_tok = mx.array(tok)
        if self.numpy_path:
            for h in range(self.H):
                self._flags_np[h, old[h][old[h] >= 0]] = 0
            self._flags_np[:, first : n0 + L] = 1
            mx.eval(self.res_k, self.res_v)
        else:
            heads = np.repeat(np.arange(self.H, dtype=np.int32), old.shape[1])
            gone = old.reshape(-1)
            keep = gone >= 0
            if L == 1 and keep.all() and np.all(gone == gone[0]):
                self.flags[:, int(gone[0])] = 0  # the ring's oldest token, the same for every head
            elif keep.any():
                self.flags[mx.array(heads[keep]), mx.array(gone[keep])] = 0
            self.flags[:, first : n0 + L] = 1  # stays lazy: the step's one sync evaluates it

    # ---- attention -------------------------------------------------------------------------
    def attention(self, queries, keys, values, *, scale, mask, sinks=None, update=True):
        """Attention of a query (decode) or a prompt chunk over the tiers. keys/values: the
        chunk's own K/V (chunks). ``update=False``: a layer sharing this cache reads it; nothing
        changes (no accumulator update, no refresh, no lookahead move, no local block)."""
        self.scale = scale
        self._update = update
        if queries.shape[2] == 1:
            if update and (self.anchor_k is not None or self.local_k is not None):
                self.end_prefill()
            if self.numpy_path:
                return self._decode_numpy(queries, scale, sinks)
            if self._device_tables(update) is not None:
                return device_decode.decode(self, queries, scale, sinks, self._tables)
            return self._decode_mlx(queries, scale, sinks)
        if update:
            self._spill_reset()  # the next decode step selects afresh (synchronously)
        return self._chunk(queries, keys, values, scale, sinks)

    def _device_tables(self, update: bool):
        """The device path's tables when this layer decodes there (tiered.device_decode), else
        None; decided at the first decode step (pages on the disk tier later turn it off)."""
        mode = self.config.device_gather
        if mode == "off" or not update:
            return None
        why = device_decode.supported(self)
        if why is not None:
            if mode == "on":
                raise ValueError(f"device_gather='on': layer {self.parent.layer} cannot: {why}")
            self._tables = None
            return None
        if getattr(self, "_tables", None) is None:
            self.parent._flush()  # what the CPU path queued, on the host before the device writes
            self._tables = device_decode.DeviceTables()
        return self._tables

    def _resident_scores(self, q: mx.array, keys: mx.array | None = None,
                         tok: mx.array | None = None) -> mx.array:
        """Exact scores (H, rep, R) of the resident set (or of ``keys`` (H, R, d) holding
        tokens ``tok`` (H, R), such as the spill buffer); q (H, rep, d) fp32 scaled. -inf on
        empty slots (token -1)."""
        keys, tok = (self.res_k, self.res_tok) if keys is None else (keys, tok)
        # in the keys' dtype (a float32 copy of the resident keys per step would cost more
        # than the product); the scores come out float32
        s = (q.astype(keys.dtype) @ keys.swapaxes(-1, -2)).astype(mx.float32)
        return mx.where((tok >= 0)[:, None, :], s, -mx.inf)

    def _resident_partial(self, s: mx.array, values: mx.array | None = None):
        """Exact attention over the resident set from its scores s (H, rep, R) (or over
        ``values`` (H, R, dv) given with their scores s).

        Returns (o (H, rep, dv) normalized, lse (H, rep); -inf where the set is empty)."""
        values = self.res_v if values is None else values
        m = mx.max(s, axis=-1, keepdims=True)
        m = mx.where(mx.isfinite(m), m, 0)
        p = mx.exp(s - m)
        den = mx.sum(p, axis=-1, keepdims=True)
        o = (p.astype(values.dtype) @ values).astype(mx.float32) / mx.maximum(den, 1e-30)
        lse = mx.where(den[..., 0] > 0, (m + mx.log(den))[..., 0], -mx.inf)
        return o, lse

    def _check_pages(self, idx: np.ndarray, count: np.ndarray):
        """Debug mode: verify the disk pages the gather is about to read."""
        host = self.parent.host
        if self.config.verify_pages and host.disk_bytes:
            for k in range(idx.shape[0]):
                host.verify_tokens(0, idx[k, : count[k]])

    def _prefetch_likely(self):
        """Read ahead the disk pages of the tokens the policy is likely to select next: the
        highest accumulators outside the resident set (off the critical path, on a worker)."""
        host = self.parent.host
        if host is None or not host.disk_bytes or self._acc_np is None:
            return
        acc = self._acc_np[:, : self.n]
        k = min(256, self.n)
        top = np.argpartition(-acc, k - 1, axis=1)[:, :k]
        b = self.parent.scheduler.batch(self.parent.layer)
        b.submit(host.prefetch_tokens, 0, top.reshape(-1))

    def _cap(self, n: int) -> tuple[int, int]:
        cfg = self.config
        cap = cfg.max_selected if isinstance(cfg.max_selected, int) else max(
            1, int(cfg.max_selected * n))
        if self.lookahead and self.plan.keep_values_resident:
            # The buffer (a selection and its successors) takes at most half of the resident
            # slots the budget allows: the selection is capped to fit it.
            r = self.plan.check(n, horizon=cfg.refresh_every + 1)
            cap = max(1, min(cap, (r // 2 - 1) // 2))
        return cap, min(cfg.min_selected, cap)

    def _step_done(self, mean_count: float, resident_mass):
        """What every decode step ends with: its stats, and every ``refresh_every`` steps the
        H2O refresh (promote / demote heavy hitters)."""
        self.steps += 1
        self.parent.stats.record_step(mean_count, self.n, resident_mass)
        if self.acc is not None and self.steps % self.config.refresh_every == 0:
            self._rebuild_resident(journal=True)

    def _finish(self, queries, o_r, lse_r, o_c, lse_c, count, sinks, t0):
        Hq = queries.shape[1]
        o, lse = ops.merge(o_r, lse_r, o_c, lse_c)
        if sinks is not None:
            o, lse = ops.merge(o, lse, np.zeros_like(o), np.array(sinks, np.float32).reshape(Hq))
        resident_mass = float(np.mean(np.exp(lse_r - ops.logaddexp(lse_r, lse_c))))
        if self._update:
            self._step_done(float(np.mean(count)), resident_mass)
        self.parent.stats.last_step_s = time.perf_counter() - t0
        return mx.array(o.reshape(1, Hq, 1, -1)).astype(queries.dtype)

    def _decode_numpy(self, queries, scale, sinks):
        """One query on the CPU backend: Numba kernels on zero-copy views. The CPU workers
        gather while this thread computes the resident partial and the H2O update."""
        with ops.kernel_threads(self.config.kernel_threads):
            return self._decode_numpy_step(queries, scale, sinks)

    def _decode_start(self, queries, scale):
        """What both decode paths do first: flush the write-behind up to the ring, scale the
        query (Hq, d) and score the resident tokens exactly. Returns (Hq, rep, q, s_r)."""
        H, n = self.H, self.n
        Hq, d = queries.shape[1], queries.shape[3]
        rep = Hq // H
        self.parent._flush_until(n - self.W_eff)
        q = queries[0, :, 0, :].astype(mx.float32) * scale
        return Hq, rep, q, self._resident_scores(q.reshape(H, rep, d))

    def _decode_numpy_step(self, queries, scale, sinks):
        t0 = time.perf_counter()
        marks = [("", t0)]
        cfg = self.config
        n = self.n
        Hq, rep, q, s_r = self._decode_start(queries, scale)
        mx.eval(q, s_r)
        marks.append(("sync", time.perf_counter()))
        q_np = np.array(q)
        z = self._scores_with_resident(q, q_np, s_r, rep)
        cap, floor = self._cap(n)
        idx, count, m, ssum, _ = ops.select(z, self._flags_np[:, :n], cfg.tau, cap, floor, rep)
        marks.append(("select", time.perf_counter()))
        self._check_pages(idx, count)
        handle = ops.submit_gather(self.parent.scheduler, self.parent.layer, q_np, z, idx, count,
                                   rep, self.parent.host, cfg.rescore == "exact")
        t_acc = time.perf_counter()
        marks.append(("submit", t_acc))
        o_r, lse_r = self._resident_partial(s_r)
        mx.eval(o_r, lse_r)
        if self._update:
            self.journal.record(n, "step", (n, q, rep, self.steps))
            if self._acc_np is not None:
                ops.acc_update(self._acc_np, z, m, ssum, rep, n, cfg.ema_alpha)
        marks.append(("resident", time.perf_counter()))
        o_c, lse_c = ops.wait_gather(handle, marks[-1][1] - t_acc)
        marks.append(("wait", time.perf_counter()))
        if self._update and self.steps % self.config.refresh_every == 0:
            self._prefetch_likely()
        out = self._finish(queries, np.array(o_r).reshape(Hq, -1), np.array(lse_r).reshape(Hq),
                           o_c, lse_c, count, sinks, t0)
        marks.append(("finish", time.perf_counter()))
        self.parent.stats.record_phases(marks)
        return out

    def _select_device(self, q, s_r, Hq: int, rep: int, select: bool = True):
        """Scores of every token from the compressed keys (the resident tokens' replaced by
        their exact scores s_r) and the tau-cumulative selection, on the device (lazy).
        Returns (z (Hq, n + 1), sel)."""
        n = self.n
        z = self.keys.scores(q, n, rep)
        # Resident tokens take their exact scores (scatter into a spare column n for empty
        # slots). z keeps that column: the selection reads only the first n, and slicing it off
        # would copy all of z for the row-contiguous kernels.
        R = self.R
        tok = mx.repeat(self.res_tok, rep, axis=0)  # (Hq, R)
        cols = mx.where(tok >= 0, tok, n)
        zp = mx.concatenate([z, mx.zeros((Hq, 1), mx.float32)], axis=1)
        z = mx.put_along_axis(zp, cols, s_r.reshape(Hq, R), axis=1)  # (Hq, n + 1)
        if not select:
            return z, None
        cap, floor = self._cap(n)
        sel = metal.tau_select(z, n, self.flags, self.config.tau, cap, floor, with_stats=True)
        return z, sel

    def _combine(self, o_r, lse_r, o_c, lse_c, sinks, Hq: int):
        """Exact merge of two partials (Hq, dv) / (Hq,) on the device, and the sink logit."""
        lse = mx.logaddexp(lse_r, lse_c)
        lse = mx.where(mx.isfinite(lse), lse, 0)
        o = o_r * mx.exp(lse_r - lse)[:, None] + o_c * mx.exp(lse_c - lse)[:, None]
        if sinks is not None:  # a learned sink logit per head joins the softmax with no value
            s_sink = mx.array(sinks).astype(mx.float32).reshape(Hq)
            o = o * mx.sigmoid(lse - s_sink)[:, None]
        return o, lse

    def _end_step(self, queries, o, lse_r, lse, mean_count: float, marks):
        """Stats, the periodic H2O refresh, and the output (1, Hq, 1, dv) in the query dtype."""
        Hq = queries.shape[1]
        if self._update:
            self._step_done(mean_count, mx.exp(lse_r - lse).mean())
        marks.append(("finish", time.perf_counter()))
        self.parent.stats.last_step_s = marks[-1][1] - marks[0][1]
        self.parent.stats.record_phases(marks)
        return o.reshape(1, Hq, 1, -1).astype(queries.dtype)

    def _decode_mlx(self, queries, scale, sinks):
        """One query on an accelerator. Scores, selection and H2O stay on the device; one sync
        per layer brings the selected indices (and, for approximate weights, their scores) to
        the CPU workers, whose gather overlaps the resident partial and the accumulator update;
        the merge happens on the device and the layer's output stays lazy. With lookahead,
        every step after the first runs :meth:`_decode_lookahead` instead."""
        if self.lookahead and self._spill_live and self._update:
            return self._decode_lookahead(queries, scale, sinks)
        t0 = time.perf_counter()
        marks = [("", t0)]
        cfg = self.config
        H = self.H
        Hq, rep, q, s_r = self._decode_start(queries, scale)
        z, sel = self._select_device(q, s_r, Hq, rep)
        exact = cfg.rescore == "exact"
        if exact:
            extra = q  # the CPU rescores with the query
        else:
            rows = mx.repeat(mx.maximum(sel.idx, 0), rep, axis=0)
            extra = mx.take_along_axis(z, rows, axis=1)  # the selected tokens' scores
        # What the CPU needs, in one array: each device array read on the host costs a copy
        # and a wait of its own on MLX CUDA (0.15-0.18 ms per copy on an H100 / H200).
        cap_alloc = sel.idx.shape[1]
        packed = mx.concatenate([sel.idx.reshape(-1), sel.count,
                                 extra.astype(mx.float32).reshape(-1).view(mx.int32)])
        marks.append(("build", time.perf_counter()))  # host time queuing scores and selection
        mx.eval(packed)  # the one sync of the step
        marks.append(("sync", time.perf_counter()))  # device work since the previous sync
        flat = np.array(packed)
        idx = flat[: H * cap_alloc].reshape(H, cap_alloc)
        count = flat[H * cap_alloc : H * cap_alloc + H]
        extra_np = flat[H * cap_alloc + H :].view(np.float32).reshape(extra.shape)
        self._check_pages(idx, count)
        handle = ops.submit_gather(self.parent.scheduler, self.parent.layer,
                                   extra_np if exact else None,
                                   None if exact else extra_np, idx, count, rep,
                                   self.parent.host, exact, z_by_slot=not exact)
        t_acc = time.perf_counter()
        marks.append(("submit", t_acc))
        o_r, lse_r = self._resident_partial(s_r)
        lazy = [o_r, lse_r]
        if self._update:
            self.journal.record(self.n, "step", (self.n, q, rep, self.steps))
        if self.acc is not None and self._update:  # one kernel pass on a GPU (metal/h2o_acc.h)
            self.acc = metal.acc_update(self.acc, z, sel.m, sel.s, self.n, rep, cfg.ema_alpha)
            lazy.append(self.acc)
        mx.async_eval(*lazy)  # the device works while the CPU gathers
        marks.append(("resident", time.perf_counter()))  # launching it (runs on asynchronously)
        o_c, lse_c = ops.wait_gather(handle, marks[-1][1] - t_acc)
        marks.append(("wait", time.perf_counter()))
        if self.lookahead and self._update:  # the next step attends this selection
            self._set_pending((idx.copy(), count.copy()))
        both = mx.array(np.concatenate([o_c, lse_c[:, None]], axis=1))  # one transfer, not two
        lse_r = lse_r.reshape(Hq)
        o, lse = self._combine(o_r.reshape(Hq, -1), lse_r, both[:, :-1], both[:, -1], sinks, Hq)
        return self._end_step(queries, o, lse_r, lse, float(np.mean(count)), marks)

    def _decode_lookahead(self, queries, scale, sinks):
        """One query, no sync: the offloaded tokens attended are the previous step's selection
        and each selected token's successor (a copying head moves one token forward per step),
        held with their exact keys and values in the spill buffer. Host work per step: bring
        the buffer up to date (the previous selection's indices, the rows that changed, read by
        the CPU workers from the pages and uploaded); this step's selection stays on the device
        until the next step reads it."""
        t0 = time.perf_counter()
        marks = [("", t0)]
        cfg = self.config
        H, d = self.H, queries.shape[3]
        count = self._spill_finish()
        nxt = self.parent.context.next_lookahead_layer(self.parent.layer)
        if nxt is not None:  # its move runs on a worker while this layer and the next build
            nxt._spill_start()
        marks.append(("spill", time.perf_counter()))
        Hq, rep, q, s_r = self._decode_start(queries, scale)
        z, sel = self._select_device(q, s_r, Hq, rep)
        self._set_pending(mx.concatenate([sel.idx.reshape(-1), sel.count]))
        s_s = self._resident_scores(q.reshape(H, rep, d), self.spill_k, self.spill_tok)
        o_s, lse_s = self._resident_partial(s_s, self.spill_v)
        o_r, lse_r = self._resident_partial(s_r)
        lse_r = lse_r.reshape(Hq)
        o, lse = self._combine(o_r.reshape(Hq, -1), lse_r, o_s.reshape(Hq, -1),
                               lse_s.reshape(Hq), sinks, Hq)
        lazy = [o, self._pending]
        self.journal.record(self.n, "step", (self.n, q, rep, self.steps))
        if self.acc is not None:
            self.acc = metal.acc_update(self.acc, z, sel.m, sel.s, self.n, rep, cfg.ema_alpha)
            lazy.append(self.acc)
        mx.async_eval(*lazy)
        marks.append(("build", time.perf_counter()))
        return self._end_step(queries, o, lse_r, lse, float(np.mean(count)), marks)

    def _set_pending(self, selection):
        self._pending = selection
        self._spill_live = True
        self.parent.context.register_lookahead(self.parent.layer, self)

    def _spill_start(self):
        """Submit the move of the spill buffer to the pending selection (main thread: reads
        the selection, flushes the rows it needs to the host; a worker does the rest)."""
        if self._spill_job is not None or self._pending is None:
            return
        H = self.H
        pend, self._pending = self._pending, None
        if isinstance(pend, mx.array):
            flat = np.array(pend)  # this layer's part of the previous step: done by now
            idx, count = flat[:-H].reshape(H, -1), flat[-H:]
        else:
            idx, count = pend
        self.parent._flush_until(self.n - self.W_eff)  # the rows the worker reads
        size = self._spill_size(self.n)
        if self.spill_k is None or self.spill_k.shape[1] < size:
            self._grow_spill(size)
        batch = self.parent.scheduler.batch(self.parent.layer)
        # One job per layer: split by kv heads across workers it measured slower (H200,
        # 128k: 393 vs 250 ms per token). The worker owns _spill_tok_np until the join; it
        # gets its own copy of the resident ids (the ring insert changes them in place).
        batch.submit(_spill_move, idx, count, self._res_tok_np.copy(), self.n,
                     self._spill_tok_np, self.parent.host)
        self._spill_job = (batch, count)

    def _spill_finish(self) -> np.ndarray:
        """Wait for the move (starting it first if nobody did) and apply it on the device.
        Returns the per-head counts of the selection it moved to."""
        self._spill_start()
        if self._spill_job is None:  # applied already (a flush joined it early)
            return self._spill_count
        batch, count = self._spill_job
        self._spill_job = None
        ((slots, toks, rows),) = batch.wait()
        self.spill_moves += 1
        if rows is not None:
            self.spill_rows_moved += int(np.count_nonzero(toks >= 0))
            dk = self.dk
            rows = mx.array(rows)  # one upload: keys and values of the changed slots
            ints = mx.array(np.stack([slots, toks]))
            at = ints[0][..., None]
            self.spill_k = mx.put_along_axis(self.spill_k, at, rows[..., :dk].astype(self.dtype),
                                             axis=1)
            self.spill_v = mx.put_along_axis(self.spill_v, at, rows[..., dk:].astype(self.dtype),
                                             axis=1)
            self.spill_tok = mx.put_along_axis(self.spill_tok, ints[0], ints[1], axis=1)
        self._spill_count = count
        return count

    def spill_join(self):
        """Finish a move in flight (before anything changes the host pages it reads)."""
        if self._spill_job is not None:
            self._spill_finish()

    def _spill_reset(self):
        """Forget the pending selection: the next decode step selects synchronously."""
        self.spill_join()
        self._pending = None
        self._spill_live = False

    def _grow_spill(self, size: int):
        """(Re)allocate the spill buffer with ``size`` slots per kv head, keeping its rows."""
        H = self.H
        k = mx.zeros((H, size, self.dk), self.dtype)
        v = mx.zeros((H, size, self.dv), self.dtype)
        tok = np.full((H, size), -1, np.int32)
        if self.spill_k is not None:  # the old last slot was the empty one: keep the rest
            old = self.spill_k.shape[1] - 1
            k[:, :old] = self.spill_k[:, :old]
            v[:, :old] = self.spill_v[:, :old]
            tok[:, :old] = self._spill_tok_np
        self.spill_k, self.spill_v = k, v
        self._spill_tok_np = np.ascontiguousarray(tok[:, : size - 1])
        self.spill_tok = mx.array(tok)
        mx.eval(self.spill_k, self.spill_v, self.spill_tok)

    def _chunk(self, queries, keys, values, scale, sinks):
        """A prompt chunk after compression: block-wise attention (HCAttention's appendix).

        The chunk (positions [n0, n0 + L)) attends exactly to the anchor block (the first
        ``anchor_tokens`` tokens), the local block (the previous chunk), the sinks, and itself,
        causally. Accelerator memory and time per chunk stay bounded whatever the document's
        length: anchor + two chunks."""
        L = queries.shape[2]
        n0 = self.n - L
        if not self._update:
            # A layer sharing this cache: the chunk is the owner's, already the local block;
            # attend over the block before it, kept for this.
            keys, values = self.local_k[None], self.local_v[None]
            loc0, lk, lv = self._prev_local
        else:
            loc0, lk, lv = self.local_start, self.local_k, self.local_v
        A = 0 if self.anchor_k is None else self.anchor_k.shape[1]
        locn = 0 if lk is None else lk.shape[1]
        if loc0 + locn != n0:  # the local block must be the tokens right before the chunk
            locn = 0
        parts_k, parts_v = [], []
        if A:
            parts_k.append(self.anchor_k)
            parts_v.append(self.anchor_v)
        if locn:
            parts_k.append(lk)
            parts_v.append(lv)
        S = self.S_eff if A == 0 else 0  # the sinks live in the anchor block when there is one
        if S:
            parts_k.append(self.res_k[:, :S])
            parts_v.append(self.res_v[:, :S])
        parts_k.append(keys[0].astype(self.dtype))
        parts_v.append(values[0].astype(self.dtype))
        k = mx.concatenate(parts_k, axis=1)[None]
        v = mx.concatenate(parts_v, axis=1)[None]
        if sinks is None and queries.shape[0] == 1:
            # Every earlier key is visible to every row: plain causal attention over [past, chunk].
            out = ops.exact_attention(queries, k.astype(queries.dtype), v.astype(queries.dtype),
                                      scale=scale, mask="causal", fast=True)
        else:
            out = mx.fast.scaled_dot_product_attention(
                queries, k.astype(queries.dtype), v.astype(queries.dtype), scale=scale,
                mask="causal", sinks=sinks)
        if self._update:
            self.journal.record(self.n, "chunk", (self.local_start, self.local_k, self.local_v,
                                                  self._prev_local))
            self._prev_local = (self.local_start, self.local_k, self.local_v)
            self.local_k = keys[0].astype(self.dtype)
            self.local_v = values[0].astype(self.dtype)
            self.local_start = n0
        return out

    @property
    def prefill_bytes(self) -> int:
        """Bytes of the block-wise prefill's working set (anchor + local block): bounded, and
        gone once decoding starts."""
        return sum(a.nbytes for a in (self.anchor_k, self.anchor_v, self.local_k, self.local_v)
                   if a is not None)

    def end_prefill(self):
        """Decoding starts: the prefill-only blocks (anchor, local) leave the accelerator."""
        self.journal.record(self.n, "prefill_end", (self.local_start, self.local_k, self.local_v,
                                                    self._prev_local, self.anchor_k,
                                                    self.anchor_v))
        self.anchor_k = self.anchor_v = self.local_k = self.local_v = None
        self._prev_local = (0, None, None)

    def restore_blocks(self, payload):
        """Undo a chunk's or the decode start's change of the block-wise prefill's blocks."""
        self.local_start, self.local_k, self.local_v, self._prev_local = payload[:4]
        if len(payload) > 4:
            self.anchor_k, self.anchor_v = payload[4:]

    def step_scores(self, q: mx.array, rep: int):
        """A decode step's scores z (every token; the resident ones exact) and their softmax
        max m and sum s per query head, recomputed for the layer as it is (tiered.undo)."""
        H, d = self.H, q.shape[-1]
        Hq = q.shape[0]
        s_r = self._resident_scores(q.reshape(H, rep, d))
        if not self.numpy_path:
            z, sel = self._select_device(q, s_r, Hq, rep)
            return z, sel.m, sel.s
        mx.eval(q, s_r)
        z = self._scores_with_resident(q, np.array(q), s_r, rep)
        cap, floor = self._cap(self.n)
        _, _, m, ssum, _ = ops.select(z, self._flags_np[:, : self.n], self.config.tau, cap,
                                      floor, rep)
        return z, m, ssum

    def _scores_with_resident(self, q, q_np, s_r, rep):
        """numpy scores (Hq, n) from the codes, the resident tokens' replaced by their exact
        scores s_r (they enter the policy's softmax exactly)."""
        z = self.keys.scores(q, self.n, rep, q_np)
        tok = self._res_tok_np
        s_np = np.array(s_r).reshape(z.shape[0], -1)
        for h in range(z.shape[0]):
            valid = tok[h // rep] >= 0
            z[h, tok[h // rep][valid]] = s_np[h][valid]
        return z

    # ---- trim and persistence --------------------------------------------------------------
    def is_trimmable(self) -> bool:
        return True

    def trim(self, n_trim: int) -> int:
        """Give back the last n_trim tokens: undone through the journal (tiered.undo), so that
        feeding them again reproduces the first feed; past the journal, the tokens go and the
        resident set is rebuilt from the policy."""
        n_trim = min(n_trim, self.n)
        target = self.n - n_trim
        self._spill_reset()  # the spill may hold trimmed tokens: the next update drops them
        self.parent._drop_pending_after(target)
        exact = undo.undo(self, target)
        self.n = target
        self.parent.host.truncate(min(target, self.parent.host.length))
        if not exact:
            tok = self._res_tok_np
            tok[tok >= target] = -1
            self.res_tok = mx.array(tok)
        if self.numpy_path:
            self._flags_np[:, target:] = 0
        else:
            self.flags[:, target:] = 0
        if not exact:
            self._rebuild_resident()
            self.journal.forget(target)
        return n_trim

    def state(self) -> dict:
        n = self.n
        st = {
            "plan": self.plan.to_json(),
            "n": n,
            "steps": self.steps,
            "scale": float(self.scale) if self.scale is not None else -1.0,
            "keys": self.keys.state(n),
            "flags": self.flags[:, :n],
            "res_k": self.res_k,
            "res_v": self.res_v,
            "res_tok": self.res_tok,
            "layout": [self.S_eff, self.W_eff],
        }
        if self.acc is not None:
            st["acc"] = self.acc[:, :n]
        if self.anchor_k is not None:  # block-wise prefill in progress: its blocks travel too
            st["anchor"] = [self.anchor_k, self.anchor_v]
        if self.local_k is not None:
            st["local"] = [self.local_k, self.local_v]
            st["local_start"] = self.local_start
        return st

    @classmethod
    def from_state(cls, parent, st):
        plan = parent.context.adopt_plan(st["plan"])
        n = int(st["n"])
        cap = _capacity(n, plan.step)
        B, H, dk, dv, dtype = parent._geometry
        ks = st["keys"]
        if ks["kind"] == "affine":
            store = AffineKeys.from_state(ks, H, dk, plan.affine_bits, plan.affine_group_size,
                                          plan.step, dtype)
        else:
            store = CodebookKeys.from_state(ks, H, plan.step, _numpy_path(parent.config))
        self = cls(parent, plan, store, cap)
        self.n, self.steps = n, int(st["steps"])
        self.journal = undo.Journal(n, parent.config.undo_tokens)
        self.scale = None if st["scale"] < 0 else float(st["scale"])
        if self.numpy_path:
            self._flags_np[:, :n] = np.array(st["flags"])
            if self._acc_np is not None and "acc" in st:
                self._acc_np[:, :n] = np.array(st["acc"])
        else:
            self.flags[:, :n] = st["flags"]
            if self.acc is not None and "acc" in st:
                self.acc[:, :n] = st["acc"]
        self.S_eff, self.W_eff = (int(x) for x in st["layout"])
        self._set_resident(mx.array(st["res_k"]), mx.array(st["res_v"]),
                           np.array(st["res_tok"]).astype(np.int32))
        if "anchor" in st:
            self.anchor_k, self.anchor_v = st["anchor"]
        if "local" in st:
            self.local_k, self.local_v = st["local"]
            self.local_start = int(st["local_start"])
        return self


def _spill_move(idx, count, res_tok, n, spill_tok, host):
    """Worker job of the lookahead buffer: which slots change (updates spill_tok) and the
    stored keys and values of their new tokens, (H, M, dk + dv) (None when nothing changes)."""
    slots, toks = ops.spill_changes(idx, count, res_tok, n, spill_tok)
    if not slots.shape[1]:
        return slots, toks, None
    rows = np.concatenate([host.gather_rows("keys", 0, toks),
                           host.gather_rows("values", 0, toks)], axis=-1)
    return slots, toks, rows


def _numpy_path(config) -> bool:
    if config.kernels == "auto":
        return ops.on_cpu_backend()
    return config.kernels == "numba"


def make_key_store(parent, plan: Plan, codebook, capacity: int):
    B, H, dk, dv, dtype = parent._geometry
    if plan.codec == "affine":
        return AffineKeys(H, dk, plan.affine_bits, plan.affine_group_size, parent.config.rotate,
                          parent.config.seed + parent.layer, plan.step, dtype)
    return CodebookKeys(H, codebook, capacity, plan.step, numpy_path=_numpy_path(parent.config))
