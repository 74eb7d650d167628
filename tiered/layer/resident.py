"""The resident set of a compressed layer: its layout (sinks, recent ring, heavy hitters,
the lookahead buffer's share), the H2O choice of heavy hitters, and rebuilding it from the
exact phase or from the host pages at a refresh."""

from __future__ import annotations

import functools
import logging

import mlx.core as mx
import numpy as np

from ..cpu.resident_maps import Swap
from ..planning.planner import BudgetError
from ..runtime import dispatch, staging
from ..step import device_decode, undo
from . import refresh_plan
from .heavy import ids_layout

log = logging.getLogger("tiered")

RESIDENT_GRAIN = 64  # slots: a device-path refresh keeps the count to a multiple of this


class ResidentSet:
    """Methods of :class:`tiered.layer.compressed.CompressedLayer` (see the module docstring)."""

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
        _, lo, hi = refresh_plan.heavy_choice(n, 0, S, W)
        among = self._heavy_among(lo, hi)
        if among is not None:
            return self.heavy.top(count, lo, hi, among=among)
        allowed = None
        if hi > lo and self._resident_only():
            allowed = undo.resident_mask(self._res_tok_np, hi)[:, lo:]
        return self.heavy.top(count, lo, hi, allowed)

    def _resident_only(self) -> bool:
        """No full keys on the host: only tokens whose K/V are on the accelerator (the
        resident set, the recent ring) can be heavy hitters. Eviction, as in H2O."""
        host = self.parent.host
        return self.res_tok is not None and (host is None or host.keys is None)

    def _heavy_among(self, lo: int, hi: int) -> mx.array | None:
        """On an accelerator, the candidates of a resident-only choice: the resident ids
        themselves, chosen among on the device (the refresh reads only the chosen ids)."""
        if hi > lo and not self.numpy_path and self._resident_only():
            return self.res_tok
        return None

    def _refresh_layout(self, n: int, journal: bool, clip: bool = False) -> tuple[int, int, int]:
        """(resident slots, sinks, recent window) per head of a rebuild at n tokens; ``clip``:
        a trim's, which never fails (where the plan does not hold n, at most the set's size)."""
        try:
            R = self._resident_layout(n)
        except BudgetError:
            if not (journal or clip) or self.res_tok is None:
                raise  # compressing: the caller keeps the layer exact
            # A refresh never fails a decode step: the planner's look-ahead (refresh_every
            # tokens) can refuse a length the layer already holds; the set keeps its size.
            R = min(self.R, n)
        if journal and self.on_device and R > RESIDENT_GRAIN:
            # A refresh on the device path keeps the slots' count to a multiple of the grain:
            # the budget's count grows by about a slot per refresh, and every new count is a
            # new shape for the compiled step (tiered.step.device_compiled) to trace.
            R = max(R - R % RESIDENT_GRAIN, min(self.plan.minimum_resident(), n))
        if self.plan.keep_values_resident:
            return R, min(self.S, n), min(self.plan.recent_window(R), n)
        return R, 0, R

    def refresh_keeps_all(self) -> bool:
        """Whether a refresh now would keep the resident set as it is, so it can be skipped.

        Without full keys on the host only resident tokens can be chosen (see
        :meth:`_resident_only`), and of them only the heavy slots' tokens are candidates: the
        sinks are below ``lo`` and the ring holds the last W tokens, at or past ``hi``. With
        the same sinks and ring and at least as many slots, there are at least as many heavy
        slots as candidates, so the choice takes every candidate; more slots would stay empty
        (nothing else can fill them). At 1M tokens on an H200 such a refresh cost about 7 ms
        of host time and 6 ms of device time per layer (a profile's shares; two layers per
        step) to rebuild the same set, and the empty slots were scanned every step (issue 24)."""
        if self.heavy is None or not self._resident_only() or self._res_tok_np is None:
            return False
        R, S, W = self._refresh_layout(self.n, True)
        return R >= self._res_tok_np.shape[1] and (S, W) == (self.S_eff, self.W_eff)

    def queue_refresh(self) -> None:
        """A refresh at the end of a device step: the heavy hitters' ids are computed on the
        device now and the set is rebuilt at the layer's next change (:meth:`settle`), when
        reading them waits for nothing (reading them now waited for the device to finish the
        step so far, twice per token)."""
        R, S, W = self._refresh_layout(self.n, True)
        count, lo, hi = refresh_plan.heavy_choice(self.n, R, S, W)
        self._later += self.heavy.prefetch(count, lo, hi, self._heavy_among(lo, hi))
        self._refresh_due = True

    def _take_later(self) -> list:
        """The refresh's lazy arrays queued since the last step (see ``_later``), handed over."""
        later, self._later = self._later, []
        return later

    def settle(self) -> None:
        """Apply a queued refresh (:meth:`queue_refresh`) before the layer is read or changed."""
        if self._refresh_due:
            self._refresh_due = False
            self._rebuild_resident(journal=True)

    def prepare_refresh(self) -> None:
        """Once the queued refresh's ids were handed to the device, plan its host side on the
        worker thread (tiered.layer.refresh_plan); :meth:`settle` then applies the plan."""
        if not (self._refresh_due and refresh_plan.ENABLED and self._ahead is None
                and self.heavy is not None and self.res_k is not None):
            return
        q = self.heavy.handed_ids()
        if q is None:
            return
        (count, lo, hi), among = q[0], q[1]
        n, H = self.n, self.H
        try:
            R, S, W = self._refresh_layout(n, True)
        except BudgetError:
            return
        if refresh_plan.heavy_choice(n, R, S, W) != (count, lo, hi):
            return  # not the choice a settle would make: it computes its own
        key, old = (n, H, R, S, W), self._res_tok_np
        heavy = functools.partial(ids_layout, H=H, count=count, lo=lo, hi=hi,
                                  among=among is not None)
        fut = refresh_plan.WORKER.submit(refresh_plan.plan, q[2][0], q[3], heavy, key, old,
                                         (self.S_eff, self.W_eff))
        self._ahead = (key, old, q, fut)

    def _take_ahead(self, key: tuple):
        """The plan made ahead for this refresh (``key`` = (n, H, R, S, W)), or None where
        there is none or its inputs no longer hold (the refresh is then computed here)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        made_for, old, q, fut = ahead
        try:
            got = fut.result()
        except Exception as e:  # noqa: BLE001  (computed again on this thread)
            log.warning("tiered: a refresh planned ahead failed (%r); computing it again", e)
            return None
        if (got is None or made_for != key or old is not self._res_tok_np
                or not self.heavy.take_queued(q)):
            return None
        return got

    def _rebuild_resident(self, keys: mx.array | None = None, values: mx.array | None = None,
                          journal: bool = False, clip: bool = False):
        """Lay out sinks, recent ring and heavy hitters; K/V from ``keys``/``values`` (H, n, d)
        when given (exact phase), else from the current resident set and the host.
        ``journal``: record what it replaces (a refresh; see tiered.step.undo). ``clip``: a trim's
        rebuild (see _refresh_layout)."""
        n, H = self.n, self.H
        if keys is None and not self.on_device:
            # tokens leaving the ring are read back from the host. The device path needs no
            # flush (and no wait): whatever is not resident is on the pages already
            self.parent.flush()
        R, S, W = self._refresh_layout(n, journal, clip)
        ahead = self._take_ahead((n, H, R, S, W)) if keys is None else None
        if ahead is not None:
            self._swap_resident(ahead.tok, S, W, journal, ahead.in_place)
            return
        heavy_n = refresh_plan.heavy_choice(n, R, S, W)[0]
        heavy = self._choose_heavy(heavy_n, n, S, W) if self.heavy is not None else np.full(
            (H, heavy_n), -1, np.int32)
        tok = refresh_plan.layout(n, H, S, W, heavy)  # the sinks are not repeated in the ring
        if clip and keys is None and self._resident_only():
            # no full keys on the host: a token the set does not hold now (a trim's new ring)
            # stays offloaded (codes and host values), its slot empty
            tok = np.where(undo.resident_mask(self._res_tok_np, n)[np.arange(H)[:, None],
                                                                   np.maximum(tok, 0)], tok, -1)
        if keys is None:
            self._swap_resident(tok, S, W, journal)
            return
        res_k, res_v = self._fetch_kv(tok, keys, values)
        self.S_eff, self.W_eff = S, W
        self._set_resident(res_k, res_v, tok)
        undo.flags_from_resident(self)

    def _fetch_kv(self, tok: np.ndarray, keys, values):
        """Full K/V (H, R, d) for token ids ``tok`` (-1: zeros) from ``keys``/``values``
        (H, n, d), in the model dtype."""
        idx = mx.array(np.maximum(tok, 0))[..., None]
        valid = mx.array(tok >= 0)[..., None]
        k = mx.where(valid, mx.take_along_axis(keys, idx, axis=1), 0).astype(self.dtype)
        v = mx.where(valid, mx.take_along_axis(values, idx, axis=1), 0).astype(self.dtype)
        (dispatch.eval if self.numpy_path else dispatch.async_eval)(k, v)  # no wait on a GPU
        return k, v

    def _swap_resident(self, tok: np.ndarray, S: int, W: int, journal: bool,
                       planned: refresh_plan.InPlace | None = None):
        """The resident set becomes tokens ``tok`` (H, R): rows already resident are copied on
        the device, only the promoted ones are read from the host pages, and only the flags
        that change are written (a refresh promotes few tokens; moving the whole set, or
        rebuilding every flag, cost milliseconds of host time per refresh at 128k tokens).
        ``journal``: record the old ids and the demoted rows (tiered.step.undo). ``planned``: the
        in-place swap's host side, made ahead (tiered.layer.refresh_plan)."""
        H = self.H
        if planned is not None:
            self._swap_in_place(tok, S + W, 0, journal, planned)
            return
        if self.res_k is None:  # nothing resident yet: an empty old set
            self._res_tok_np = np.full((H, 0), -1, np.int32)
            self.res_k = mx.zeros((H, 0, self.dk), self.dtype)
            self.res_v = mx.zeros((H, 0, self.dv), self.dtype)
        grow = refresh_plan.growth(self._res_tok_np, tok, S, W, (self.S_eff, self.W_eff))
        if grow is not None:
            self._swap_in_place(tok, S + W, grow, journal)
            return
        sw = Swap(self._res_tok_np, tok)
        heads, toks, value = sw.flag_changes()
        tok_d, src_d, prom_d, pcount_d, dslots_d, heads_d, toks_d, value_d = (
            staging.upload_many([tok, sw.src, sw.promoted, sw.promoted_count, sw.demoted_slots,
                                 heads, toks, value]))
        journaled = self._journal_refresh(sw, dslots_d, journal)
        parts_k = [self.res_k, self._promoted_rows("keys", sw.promoted, prom_d, pcount_d)]
        parts_v = [self.res_v, self._promoted_rows("values", sw.promoted, prom_d, pcount_d)]
        idx = src_d[..., None]
        valid = (tok_d >= 0)[..., None]
        k = mx.take_along_axis(mx.concatenate(parts_k, axis=1), idx, axis=1)
        v = mx.take_along_axis(mx.concatenate(parts_v, axis=1), idx, axis=1)
        k = mx.where(valid, k, 0).astype(self.dtype)
        v = mx.where(valid, v, 0).astype(self.dtype)
        self.S_eff, self.W_eff = S, W
        self._finish_swap(k, v, tok, tok_d, (heads, toks, value), (heads_d, toks_d, value_d),
                          journaled)

    def _journal_refresh(self, sw, dslots_d, journal: bool) -> tuple:
        """Journal a refresh (tiered.step.undo): the old ids and the demoted rows, returned (to be
        evaluated with the swap); () when ``journal`` is off."""
        if not journal:
            return ()
        idx = dslots_d[..., None]
        rows_k = mx.take_along_axis(self.res_k, idx, axis=1)
        rows_v = mx.take_along_axis(self.res_v, idx, axis=1)
        self.journal.record(self.n, "refresh", (self._res_tok_np.copy(), self.S_eff,
                                                self.W_eff, sw.demoted, rows_k, rows_v))
        return rows_k, rows_v

    def _finish_swap(self, k, v, tok: np.ndarray, tok_d, flags_np: tuple, flags_d: tuple,
                     journaled: tuple) -> None:
        """A swap's flag changes, its arrays evaluated (the CPU backend) or queued with the
        next step (accelerators: no wait, and no hand-off of their own), the new set kept."""
        heads, toks, value = flags_np
        if self.numpy_path:
            self._flags_np[heads, toks] = value
            dispatch.eval(k, v, *journaled)
        else:
            if heads.size:
                heads_d, toks_d, value_d = flags_d
                self.flags[heads_d, toks_d] = value_d.astype(mx.uint8)
            self._later += [k, v, *journaled]
        self._set_resident(k, v, tok, tok_d)
        self._keep_ring_rows()

    def _swap_in_place(self, tok: np.ndarray, fixed: int, grow: int, journal: bool,
                       planned: refresh_plan.InPlace | None = None) -> None:
        """A refresh that keeps the sinks and the ring (the common case) written into the old
        layout (``Swap.in_place``; ``grow`` empty slots added at the end first): the promoted
        rows go into freed slots by one scatter per tensor, and only the changed entries are
        uploaded. Rebuilding the layout gathered every resident row of both tensors and
        uploaded two (H, R) index arrays per refresh. H200, Llama-3-8B shape at 128k tokens,
        with the drain-free read of the heavy hitters' ids (HeavyHitters.handed_with), back to
        back: 31.6 -> 28.8 ms/token (bench/decode_speed.py, docs/decode-speed-gpu.md)."""
        H = self.H
        res_k, res_v, res_tok = self.res_k, self.res_v, self.res_tok
        p = planned or refresh_plan.in_place(self._res_tok_np, tok, fixed, grow)
        grow = p.new.shape[1] - self._res_tok_np.shape[1]
        sw, new, prom = p.swap, p.new, p.prom
        heads, toks, value = p.parts[6:]
        slots_d, toks_ed, kind_d, prom_d, pcount_d, dslots_d, heads_d, toks_d, value_d = (
            staging.upload_many(p.parts, packed=p.packed))
        # the old set's ids and rows (the demoted slots are below its size)
        journaled = self._journal_refresh(sw, dslots_d, journal)
        if grow:
            res_k = mx.concatenate([res_k, mx.zeros((H, grow, self.dk), self.dtype)], axis=1)
            res_v = mx.concatenate([res_v, mx.zeros((H, grow, self.dv), self.dtype)], axis=1)
            res_tok = mx.concatenate([res_tok, mx.full((H, grow), -1, mx.int32)], axis=1)
        pad = (kind_d == 2)[..., None]
        out = []
        for name, cur in (("keys", res_k), ("values", res_v)):
            rows = self._promoted_rows(name, prom, prom_d, pcount_d)
            # promoted rows (zeros past each head's count: the emptied slots), padding entries
            # rewrite slot 0 as it is
            rows = mx.where(pad, cur[:, :1], rows).astype(self.dtype)
            idx = mx.broadcast_to(slots_d[..., None], rows.shape)
            out.append(mx.put_along_axis(cur, idx, rows, axis=1))
        tok_d = mx.put_along_axis(res_tok, slots_d, toks_ed, axis=1)
        self._finish_swap(out[0], out[1], new, tok_d, (heads, toks, value),
                          (heads_d, toks_d, value_d), journaled)

    def _promoted_rows(self, name: str, tokens: np.ndarray, tok_d, counts_d) -> mx.array:
        """(H, m, d) rows of promoted ``tokens`` (H, m) (``tok_d``, ``counts_d``: their device
        copy and per-head counts; -1 past each count gives zeros)."""
        host = self.parent.host
        if not (tokens >= 0).any():
            return mx.zeros(tokens.shape + (self.dk if name == "keys" else self.dv,), self.dtype)
        if self.on_device and host.keys is not None and not host.disk_bytes:
            # the GPU reads the promoted rows from the host pages in place (a CPU gather and
            # upload took most of a refresh's ~30 ms per layer)
            return self._device_rows(getattr(host, name), tok_d, counts_d)
        rows = host.gather_rows(name, 0, tokens)
        if self.on_device and getattr(host, name).dtype == "int8":
            rows = rows.astype(np.float16)  # as the device path's dequantizing gather gives them
        return mx.array(rows).astype(self.dtype)

    def _device_rows(self, tensor, tok: mx.array, counts: mx.array) -> mx.array:
        """Rows (H, m, d) of tokens tok (H, m) (the first counts[h] of row h; int32) read by
        the device from the host pages (the kernel takes m at run time: nothing to compile)."""
        rows, _ = device_decode.gather_chunks(self._tables, self.parent.host, tensor, tok,
                                              counts, self.flags, chunk=1)
        return rows.astype(self.dtype)
