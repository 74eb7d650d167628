"""The resident set of a compressed layer: its layout (sinks, recent ring, heavy hitters,
the lookahead buffer's share), the H2O choice of heavy hitters, and rebuilding it from the
exact phase or from the host pages at a refresh."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import device_decode, undo
from .planner import BudgetError


class ResidentSet:
    """Methods of :class:`tiered.compressed.CompressedLayer` (see the module docstring)."""

    def _resident_layout(self, n: int) -> int:
        """Resident slots per head at n tokens (sinks + ring + heavy)."""
        if not self.plan.keep_values_resident:
            return min(self.W, n)
        horizon = self.config.heavy.horizon
        r = self.plan.check(n, horizon=horizon)
        if self.lookahead:  # the spill buffer's slots cost what resident slots cost
            spill = self._spill_size(n + horizon)
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
        lo, hi = min(S, n), max(n - W, 0)
        allowed = None
        host = self.parent.host
        if hi > lo and self.res_tok is not None and (host is None or host.keys is None):
            # No full keys on the host: only tokens whose K/V are on the accelerator (the
            # resident set, the recent ring) can be heavy hitters. Eviction, as in H2O.
            allowed = undo.resident_mask(self._res_tok_np, hi)[:, lo:]
        return self.heavy.top(count, lo, hi, allowed)

    def _rebuild_resident(self, keys: mx.array | None = None, values: mx.array | None = None,
                          journal: bool = False):
        """Lay out sinks, recent ring and heavy hitters; K/V from ``keys``/``values`` (H, n, d)
        when given (exact phase), else from the current resident set and the host.
        ``journal``: record what it replaces (a refresh; see tiered.undo)."""
        n, H = self.n, self.H
        if keys is None and not self.on_device:
            # tokens leaving the ring are read back from the host. The device path needs no
            # flush (and no wait): whatever is not resident is on the pages already
            self.parent.flush()
        try:
            R = self._resident_layout(n)
        except BudgetError:
            if not journal or self.res_tok is None:
                raise  # compressing: the caller keeps the layer exact
            # A refresh never fails a decode step: the planner's look-ahead (refresh_every
            # tokens) can refuse a length the layer already holds; the set keeps its size.
            R = self.R
        if self.plan.keep_values_resident:
            S, W = min(self.S, n), min(self.plan.recent_window(R), n)
        else:
            S, W = 0, R
        ring = np.full((H, W), -1, np.int32)
        for t in range(max(S, n - W), n):  # the sinks are resident already: no second copy
            ring[:, t % W] = t
        sinks = np.tile(np.arange(S, dtype=np.int32), (H, 1))
        heavy_n = max(R - S - W, 0)
        heavy = self._choose_heavy(heavy_n, n, S, W) if self.heavy is not None else np.full(
            (H, heavy_n), -1, np.int32)
        tok = np.concatenate([sinks, ring, heavy], axis=1).astype(np.int32)
        if journal:
            self.journal.record(n, "refresh", undo.demoted_rows(self, tok))
        res_k, res_v = self._fetch_kv(tok, keys, values)
        self.S_eff, self.W_eff = S, W
        self._set_resident(res_k, res_v, tok)
        undo.flags_from_resident(self)

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
        (mx.eval if self.numpy_path else mx.async_eval)(k, v)  # no wait on an accelerator
        return k, v

    def _device_rows(self, tensor, tok: np.ndarray, counts: np.ndarray) -> mx.array:
        """Rows (H, m, d) of tokens tok (H, m) (the first counts[h] of row h) read by the
        device from the host pages (the kernel takes m at run time: nothing to compile)."""
        rows, _ = device_decode.gather_chunks(self._tables, self.parent.host, tensor,
                                              mx.array(tok.astype(np.int32)),
                                              mx.array(counts.astype(np.int32)), self.flags,
                                              chunk=1)
        return rows.astype(self.dtype)

    def _gather_known(self, tok: np.ndarray):
        """K/V (H, R, d) for token ids, in the model dtype: rows already resident are copied
        on the device, only the others are read from the host pages and uploaded (a refresh
        promotes few tokens; moving the whole resident set through the host cost seconds per
        refresh at 128k tokens)."""
        host = self.parent.host
        H, R = tok.shape
        old_tok = self._res_tok_np
        R_old = 0 if old_tok is None else old_tok.shape[1]
        # row of concat(resident, new rows) per slot: the old slot of a token already
        # resident (a token -> slot map, no per-head search), else its row among the new ones
        src = np.zeros((H, R), np.int32)
        miss = tok >= 0
        if R_old:
            slot_of = undo.slot_map(old_tok, max(int(tok.max(initial=0)), int(old_tok.max())) + 1)
            at = np.take_along_axis(slot_of, np.maximum(tok, 0), axis=1)
            hit = miss & (at >= 0)
            src[hit] = at[hit]
            miss &= ~hit
        new_pos, counts = undo.compact(miss)
        n_new = new_pos.shape[1]
        new_tok = np.take_along_axis(tok, new_pos, axis=1)
        live = np.arange(n_new)[None, :] < counts[:, None]
        new_tok[~live] = -1
        rows = np.broadcast_to(np.arange(H)[:, None], new_pos.shape)
        src[rows[live], new_pos[live]] = R_old + np.broadcast_to(
            np.arange(n_new, dtype=np.int32), new_pos.shape)[live]
        # Rows as stored (float16 by default: half the bytes of float32 to upload, and no
        # conversion on the host).
        parts_k = [self.res_k] if R_old else []
        parts_v = [self.res_v] if R_old else []
        if n_new and self.on_device and host.keys is not None:
            # On the device path the GPU reads the promoted rows from the host pages in place
            # (a CPU gather and upload took most of a refresh's ~30 ms per layer at 128k).
            parts_k.append(self._device_rows(host.keys, new_tok, counts))
            parts_v.append(self._device_rows(host.values, new_tok, counts))
        elif n_new:
            parts_k.append(mx.array(host.gather_rows("keys", 0, new_tok)).astype(self.dtype))
            parts_v.append(mx.array(host.gather_rows("values", 0, new_tok)).astype(self.dtype))
        elif not R_old:  # nothing anywhere: an empty block keeps the shapes
            parts_k.append(mx.zeros((H, 0, self.dk), self.dtype))
            parts_v.append(mx.zeros((H, 0, self.dv), self.dtype))
        idx = mx.array(src)[..., None]
        k = mx.take_along_axis(mx.concatenate(parts_k, axis=1), idx, axis=1)
        v = mx.take_along_axis(mx.concatenate(parts_v, axis=1), idx, axis=1)
        return k, v
