"""The decode step of a compressed layer on the two synchronous paths: ``numpy_path`` (MLX's
CPU backend: Numba kernels on zero-copy views, the CPU workers gathering) and the MLX path
(GPUs: scores and selection on the device, one sync per layer to hand the selection to the
CPU workers). The accelerator path without that sync is :mod:`tiered.step.device_step`."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from ..cpu.attention import softmax_pv
from ..runtime import dispatch, ops
from ..runtime.primitives import merge_partials
from ..step import chunk_select, unified_step


class DecodePaths:
    """Methods of :class:`tiered.layer.compressed.CompressedLayer` (see the module docstring)."""

    # the last decode step's log-sum-exp over this layer's tokens (Hq,), numpy or MLX, on the
    # CPU-gather and numpy paths (tiered.shard merges a rank's layer with the others' by it)
    last_lse = None

    @property
    def tau(self) -> float:
        """This layer's tau: ``offloaded_tau`` (if higher) where every value is on the host
        and the method is tiered, else the config's."""
        sel = self.config.selection
        if self.plan.method == "tiered" and not self.plan.keep_values_resident:
            return max(sel.tau, sel.offloaded_tau)
        return sel.tau

    def _cap(self, n: int) -> tuple[int, int]:
        """(cap, floor) of this step's selection, in tokens per kv head, at n live tokens."""
        selection = self.config.selection
        plan = self.plan
        cap = max(selection.cap(n, plan.method == "tiered" and not plan.keep_values_resident),
                  min(plan.max_selected, n))
        if self.lookahead and self.plan.keep_values_resident:
            # The buffer (a selection and its successors) takes at most half of the resident
            # slots the budget allows: the selection is capped to fit it.
            r = self.plan.check(n, horizon=self.config.heavy.horizon)
            cap = max(1, min(cap, (r // 2 - 1) // 2))
        return cap, min(max(selection.min_selected, self.plan.min_selected), cap)

    def _unified(self, update: bool) -> bool:
        """Whether this step runs tiered.step.unified_step (host pages on slabs)."""
        host = self.parent.host
        if not update or self.config.device_gather == "off" or host is None \
                or host.values.slabs is None:
            return False
        why = unified_step.supported(self)
        if why is not None and self.config.device_gather == "on":
            raise ValueError(f"device_gather='on': layer {self.parent.layer} cannot: {why}")
        return why is None

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
        if host is None or not host.disk_bytes or self.heavy is None or not self.numpy_path:
            return
        top = self.heavy.top(min(256, self.n), 0, self.n)
        b = self.parent.scheduler.batch(self.parent.layer)
        b.submit(host.prefetch_tokens, 0, top.reshape(-1))

    def _finish(self, queries, o_r, lse_r, o_c, lse_c, count, sinks, t0):
        Hq = queries.shape[1]
        if sinks is not None:
            sinks = np.array(sinks, np.float32).reshape(Hq)
        o, lse = merge_partials(o_r, lse_r, o_c, lse_c, sinks)
        self.last_lse = lse  # (Hq,): a sharded cache merges this layer with other ranks'
        with np.errstate(invalid="ignore"):  # both partials empty: NaN, as before
            resident_mass = float(np.mean(np.exp(lse_r - lse)))
        if self._update:
            self._step_done(float(np.mean(count)), resident_mass)
        self.parent.stats.last_step_s = time.perf_counter() - t0
        return mx.array(o.reshape(1, Hq, 1, -1)).astype(queries.dtype)

    def _host_sinks(self, idx, count, exclude):
        """The offloaded layout's sinks (``plan.sinks``, set by the layer-aware planner) joined
        to the selection: every step gathers and rescores them from the host, so the first
        tokens' weight never hangs on how well the codes score them. Measured at 1/32 of the
        fp32 SmolLM2-135M (per-group codebooks, 2 pydoc documents of 256 scored tokens):
        perplexity 21.07 / 18.71 without them, 15.76 / 14.27 with them (the full cache
        14.35 / 13.64). The resident layout holds its sinks on the accelerator instead.
        The worst-coded tokens (``tiered.layer.compressed.HOST_OUTLIERS`` per head) join too."""
        s = min(self.plan.sinks, self.n - self.W_eff)  # not the ring's (resident) tokens
        if self.plan.keep_values_resident or s <= 0:
            return idx, count
        extra = self._host_outliers
        if extra is not None:  # not the ring's tokens either (its ids are n - W_eff and past)
            extra = np.where(extra < self.n - self.W_eff, extra, -1)
        return ops.with_host_sinks(idx, count, s, exclude, extra)

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
        self.parent.flush_until(n - self.W_eff)
        q = queries[0, :, 0, :].astype(mx.float32) * scale
        return Hq, rep, q, self._resident_scores(q.reshape(H, rep, d))

    def _decode_numpy_step(self, queries, scale, sinks):
        t0 = time.perf_counter()
        marks = [("", t0)]
        cfg = self.config
        n = self.n
        Hq, rep, q, s_r = self._decode_start(queries, scale)
        dispatch.eval(q, s_r)
        marks.append(("sync", time.perf_counter()))
        q_np = np.array(q)
        z = self._scores_with_resident(q, q_np, s_r, rep)
        cap, floor = self._cap(n)
        sel = chunk_select.select_np(z, n, n, self._flags_np, self.tau, cap, floor)
        idx, count = self._host_sinks(sel.idx, sel.count, self._flags_np)
        marks.append(("select", time.perf_counter()))
        self._check_pages(idx, count)
        handle = ops.submit_gather(self.parent.scheduler, self.parent.layer, q_np, z, idx, count,
                                   rep, self.parent.host, cfg.rescore == "exact")
        t_acc = time.perf_counter()
        marks.append(("submit", t_acc))
        o_r, lse_r = self._resident_partial_np(s_r)
        if self._update:
            self.journal.record(n, "step", (n, q, rep, self.steps))
            if self.heavy is not None:
                self.heavy.update(z, sel.m, sel.s, n, rep)
        marks.append(("resident", time.perf_counter()))
        o_c, lse_c = ops.wait_gather(handle, marks[-1][1] - t_acc)
        self.parent.host.release_if_bounded()  # the page file's pages read: out of the RSS
        marks.append(("wait", time.perf_counter()))
        if self._update and self.steps % self.config.refresh_every == 0:
            self._prefetch_likely()
        out = self._finish(queries, np.array(o_r).reshape(Hq, -1), np.array(lse_r).reshape(Hq),
                           o_c, lse_c, count, sinks, t0)
        marks.append(("finish", time.perf_counter()))
        self.parent.stats.record_phases(marks)
        return out

    def _resident_partial_np(self, s_r):
        """The resident partial of :meth:`_decode_numpy_step` (s_r evaluated): float32 values
        through one Numba kernel on this thread (tiered.cpu.attention.softmax_pv: 0.45 ms
        against MLX's ops' 2.46 at 8,192 slots, 3 kv heads of 3 queries, 2-core CPU); others
        through MLX."""
        if self.res_v.dtype != mx.float32:
            o_r, lse_r = self._resident_partial(s_r)
            dispatch.eval(o_r, lse_r)
            return o_r, lse_r
        return softmax_pv(ops.numpy_view(s_r), ops.numpy_view(self.res_v))

    def _select_device(self, q, s_r, Hq: int, rep: int, select: bool = True):
        """Scores of every token from the compressed keys (the resident tokens' replaced by
        their exact scores s_r) and the tau-cumulative selection, on the device (lazy).
        Returns (z (Hq, n + 1), sel): chunks selected, their live tokens listed
        (tiered.step.chunk_select)."""
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
        sel = chunk_select.select_mx(z, n, n, self.flags, self.tau, cap, floor)
        return z, sel

    def _combine(self, o_r, lse_r, o_c, lse_c, sinks, Hq: int):
        """:func:`tiered.runtime.primitives.merge_partials` of two partials (Hq, dv) / (Hq,) on the
        device, with the model's sink logits (any array or None) as (Hq,) float32."""
        if sinks is not None:
            sinks = mx.array(sinks).astype(mx.float32).reshape(Hq)
        return merge_partials(o_r, lse_r, o_c, lse_c, sinks)

    def _end_step(self, queries, o, resident_mass, mean_count, marks, keep_later=False):
        """Stats, the periodic H2O refresh, and the output (1, Hq, 1, dv) in the query dtype.
        resident_mass: the resident set's share of the attention mass (lazy). ``keep_later``:
        the caller evaluates the refresh's lazy arrays with its graph (``_take_later``); else
        they are handed to the device here."""
        Hq = queries.shape[1]
        if self._update:
            self._step_done(mean_count, resident_mass)
        if not keep_later and self._later:
            dispatch.async_eval(*self._take_later())
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
        dispatch.eval(packed)  # the one sync of the step
        marks.append(("sync", time.perf_counter()))  # device work since the previous sync
        flat = np.array(packed)
        idx = flat[: H * cap_alloc].reshape(H, cap_alloc)
        count = flat[H * cap_alloc : H * cap_alloc + H]
        extra_np = flat[H * cap_alloc + H :].view(np.float32).reshape(extra.shape)
        if exact:  # approximate weights come by selection slot: the selection stays as it is
            idx, count = self._host_sinks(idx, count, None)
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
        if self.heavy is not None and self._update:  # one kernel pass (metal/h2o_acc.h)
            lazy.append(self.heavy.update(z, sel.m, sel.s, self.n, rep))
        dispatch.async_eval(*lazy)  # the device works while the CPU gathers
        marks.append(("resident", time.perf_counter()))  # launching it (runs on asynchronously)
        o_c, lse_c = ops.wait_gather(handle, marks[-1][1] - t_acc)
        self.parent.host.release_if_bounded()  # the page file's pages read: out of the RSS
        marks.append(("wait", time.perf_counter()))
        if self.lookahead and self._update:  # the next step attends this selection
            self._set_pending((idx.copy(), count.copy()))
        both = mx.array(np.concatenate([o_c, lse_c[:, None]], axis=1))  # one transfer, not two
        lse_r = lse_r.reshape(Hq)
        o, lse = self._combine(o_r.reshape(Hq, -1), lse_r, both[:, :-1], both[:, -1], sinks, Hq)
        self.last_lse = lse  # (Hq,): a sharded cache merges this layer with other ranks'
        return self._end_step(queries, o, mx.exp(lse_r - lse).mean(), float(np.mean(count)),
                              marks)
