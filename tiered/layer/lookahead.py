"""The lookahead option of the accelerator path: a step attends the previous step's offloaded
selection (and each selected token's successor) from a spill buffer that the CPU workers keep
up to date, so no step waits for its own gather."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from ..runtime import dispatch, ops


def _spill_move(idx, count, res_tok, n, spill_tok, host):
    """Worker job of the lookahead buffer: which slots change (updates spill_tok) and the
    stored keys and values of their new tokens, (H, M, dk + dv) (None when nothing changes)."""
    slots, toks = ops.spill_changes(idx, count, res_tok, n, spill_tok)
    if not slots.shape[1]:
        return slots, toks, None
    rows = np.concatenate([host.gather_rows("keys", 0, toks),
                           host.gather_rows("values", 0, toks)], axis=-1)
    return slots, toks, rows


class Lookahead:
    """Methods of :class:`tiered.layer.compressed.CompressedLayer` (see the module docstring)."""

    def _decode_lookahead(self, queries, scale, sinks):
        """One query, no sync: the offloaded tokens attended are the previous step's selection
        and each selected token's successor (a copying head moves one token forward per step),
        held with their exact keys and values in the spill buffer. Host work per step: bring
        the buffer up to date (the previous selection's indices, the rows that changed, read by
        the CPU workers from the pages and uploaded); this step's selection stays on the device
        until the next step reads it."""
        t0 = time.perf_counter()
        marks = [("", t0)]
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
        if self.heavy is not None:
            lazy.append(self.heavy.update(z, sel.m, sel.s, self.n, rep))
        dispatch.async_eval(*lazy)
        marks.append(("build", time.perf_counter()))
        return self._end_step(queries, o, mx.exp(lse_r - lse).mean(), float(np.mean(count)),
                              marks)

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
        self.parent.flush_until(self.n - self.W_eff)  # the rows the worker reads
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
        dispatch.eval(self.spill_k, self.spill_v, self.spill_tok)
