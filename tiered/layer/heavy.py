"""Heavy hitters (H2O, Zhang et al. 2023): each token's accumulated attention.

One float32 accumulator per kv head and token, an exponential moving average of the token's
softmax weight (averaged over the query heads of its GQA group): seeded from the prefill's
attention (:func:`tiered.runtime.ops.h2o_seed`), folded with every decode step's weights, and read
when the resident set is refreshed (:mod:`tiered.layer.resident` keeps the top ones).

The accumulators live on the accelerator; on the numpy path (MLX's CPU backend) a numpy view
of the same buffer is updated in place by a Numba kernel. Both updates take the step's scores z
(Hq, >= n) with each query head's softmax max m and total s: p = exp(z - m) / s.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import tiered.metal as metal

from ..runtime import dispatch, ops


class HeavyHitters:
    """Accumulators (H, capacity) of one layer; ``alpha`` the EMA's weight of the past."""

    def __init__(self, H: int, capacity: int, alpha: float, numpy_path: bool):
        self.H, self.alpha, self.numpy_path = H, alpha, numpy_path
        self.acc: mx.array | None = None
        self._np: np.ndarray | None = None
        # [(count, lo, hi), among, (ids,), the dispatcher's event of the submission holding
        # them (None: not handed over by the dispatcher)] queued by prefetch
        self._queued = None
        self.grow(capacity, 0)

    def grow(self, capacity: int, n: int) -> None:
        """A buffer of ``capacity`` tokens keeping the first n accumulators (new ones 0)."""
        self._queued = None
        acc = mx.zeros((self.H, capacity), mx.float32)
        if self.acc is not None and n:
            acc[:, :n] = self.acc[:, :n]
        if self.numpy_path:  # a view follows; on an accelerator it stays lazy (no host wait)
            dispatch.eval(acc)
        self.acc = acc
        self._high = n  # columns from here on are 0 (clear has nothing to do there)
        self._np = ops.numpy_view(acc) if self.numpy_path else None

    @property
    def nbytes(self) -> int:
        return self.acc.nbytes

    def host(self, n: int) -> np.ndarray:
        """The first n accumulators (H, n) on the host (a view on the numpy path)."""
        return self._np[:, :n] if self._np is not None else np.array(self.acc[:, :n])

    def set(self, start: int, values) -> None:
        """Accumulators of tokens [start, start + L) from ``values`` (H, L): the seed, or a
        saved state."""
        self._queued = None
        L = values.shape[1]
        self._high = max(self._high, start + L)
        if self._np is not None:
            self._np[:, start : start + L] = np.asarray(values, np.float32)
        else:
            self.acc[:, start : start + L] = mx.array(values).astype(mx.float32)

    def clear(self, start: int, L: int) -> None:
        """New tokens start at 0 (a slot can hold an undone token's value)."""
        self._queued = None
        if not self.dirty(start):
            return  # never written since the buffer was made: 0 already (an op per step saved)
        if self._np is not None:
            self._np[:, start : start + L] = 0.0
        else:
            self.acc[:, start : start + L] = 0.0

    def update(self, z, m, s, n: int, rep: int) -> mx.array | None:
        """Fold one step's weights into the first n accumulators: acc = alpha acc + (1 - alpha)
        mean over the group of exp(z - m) / s. On the numpy path z, m, s are numpy arrays and
        the update is done on return (None); else it is queued and the new array returned."""
        self._queued = None
        self._high = max(self._high, n)
        if self._np is not None:
            ops.acc_update(self._np, z, m, s, rep, n, self.alpha)
            return None
        self.acc = metal.acc_update(self.acc, z, m, s, n, rep, self.alpha)
        return self.acc

    def dirty(self, start: int) -> bool:
        """Whether columns from ``start`` on may hold values (written since the buffer was
        made), so that a new token there must be cleared."""
        return start < self._high

    def updated(self, acc: mx.array, n: int) -> mx.array:
        """Take ``acc`` (computed elsewhere: a compiled step's update of the first n, or the
        compiled append's clear, tiered.step.device_append) as the accumulators; returns it."""
        self._queued = None
        self._high = max(self._high, n)
        self.acc = acc
        return acc

    def undo(self, z, m, s, n: int, rep: int) -> None:
        """The inverse of :meth:`update` with the same step's z, m, s (tiered.step.undo)."""
        self._queued = None
        H, alpha = self.H, self.alpha
        if self._np is not None:
            zz = np.asarray(z)[:, :n].astype(np.float64)
            inv = np.where(s > 0, (1.0 - alpha) / (rep * np.maximum(s, 1e-30)), 0.0)
            p = (np.exp(zz - m[:, None].astype(np.float64)) * inv[:, None]).reshape(
                H, rep, n).sum(1)
            acc = self._np
            acc[:, :n] = ((acc[:, :n].astype(np.float64) - p) / alpha).astype(np.float32)
            return
        p = mx.exp(z[:, :n] - m[:, None]) / s[:, None]
        p = (1 - alpha) * p.reshape(H, rep, n).mean(axis=1)
        self.acc[:, :n] = (self.acc[:, :n] - p) / alpha

    def prefetch(self, count: int, lo: int, hi: int, among: mx.array | None = None) -> list:
        """Queue :meth:`top` (count, lo, hi, among) on the accelerator, to be read by the next
        ``top`` with the same arguments if the accumulators have not changed meanwhile: the
        read then finds the ids computed (a read of them right away waits for the device).
        Returns the lazy arrays, for the caller to evaluate with the step's graph."""
        self._queued = None
        if self._np is None and count > 0 and hi > lo:
            self._queued = [(count, lo, hi), among, self._top_device(count, lo, hi, among),
                            None]
            return list(self._queued[2])
        return []

    def awaiting_handoff(self) -> bool:
        """Whether prefetched ids wait for a submission to the dispatcher (:meth:`handed_with`)."""
        return self._queued is not None and self._queued[3] is None

    def handed_with(self, done) -> None:
        """The prefetched ids are in the dispatcher's submission ``done`` (tiered.runtime.dispatch):
        :meth:`top` reads them once it was handed over, without draining the dispatcher
        (which waited for the layers queued since: ~1.3 ms per refresh of a Llama-3-8B layer
        at 128k tokens on an H200, bench/probes/device_host_profile.py)."""
        if self.awaiting_handoff():
            self._queued[3] = done

    def handed_ids(self) -> list | None:
        """The prefetched choice once handed to the dispatcher: [(count, lo, hi), among,
        (ids,), done], else None (tiered.layer.refresh_plan reads it ahead)."""
        q = self._queued
        return None if q is None or q[3] is None else q

    def take_queued(self, q: list) -> bool:
        """Use the prefetched choice ``q`` (from :meth:`handed_ids`) as :meth:`top` would:
        True (and it is forgotten) when it is still the one queued."""
        if q is None or self._queued is not q:
            return False
        self._queued = None
        return True

    def _top_device(self, count: int, lo: int, hi: int, among: mx.array | None = None):
        """(H, <= count) int32, lazy: what :func:`_sorted_ids` makes of the top ones, computed
        on the device, so that the host reads one small array and sorts nothing. ``among``
        (H, R) int32 token ids (-1: none): only those in [lo, hi) may be chosen (without host
        keys only resident tokens can be, and a mask over every token cost a copy of all the
        accumulators and a host argpartition per refresh: ~30 ms per layer at 1M tokens)."""
        if among is None:
            vals, width = self.acc[:, lo:hi], hi - lo
        else:
            ok = (among >= lo) & (among < hi)
            vals = mx.where(ok, mx.take_along_axis(self.acc, mx.maximum(among, 0), axis=1),
                            -mx.inf)
            width = among.shape[1]
        k = min(count, width)
        neg = -vals
        top_d = (mx.argpartition(neg, k - 1, axis=1)[:, :k] if k < width else
                 mx.broadcast_to(mx.arange(k, dtype=mx.uint32), (self.H, k)))
        picked = mx.take_along_axis(neg, top_d, axis=1)
        ids = (top_d.astype(mx.int32) + lo if among is None
               else mx.take_along_axis(among, top_d.astype(mx.int32), axis=1))
        return (mx.sort(mx.where(mx.isfinite(picked), ids, -1), axis=1),)

    def top(self, count: int, lo: int, hi: int, allowed: np.ndarray | None = None,
            among: mx.array | None = None) -> np.ndarray:
        """(H, count) token ids in [lo, hi) with the highest accumulators, sorted per head, -1
        where fewer qualify. ``allowed`` (H, hi - lo) bool: only these may be chosen;
        ``among`` (H, R) int32 (accelerators): only these token ids may be chosen."""
        H = self.H
        out = np.full((H, count), -1, np.int32)
        queued, self._queued = self._queued, None
        if count <= 0 or hi <= lo:
            return out
        if self._np is None and allowed is None:
            # On the accelerator only the chosen ids come to the host (a copy of every
            # accumulator and a host argpartition cost ~8 ms per layer at 128k).
            hit = queued is not None and queued[0] == (count, lo, hi) and queued[1] is among
            (ids_d,) = queued[2] if hit else self._top_device(count, lo, hi, among)
            if not (hit and dispatch.handed(queued[3])):
                dispatch.eval(ids_d)
            return ids_layout(np.array(ids_d), H, count, lo, hi, among is not None)
        if among is not None:
            raise ValueError("HeavyHitters.top: 'among' is for accumulators on the accelerator")
        k = min(count, hi - lo)
        acc = self.host(hi)[:, lo:hi]
        if allowed is not None:
            acc = np.where(allowed, acc, -np.inf)
        top = np.argpartition(-acc, k - 1, axis=1)[:, :k] if k < hi - lo else np.tile(
            np.arange(hi - lo), (H, 1))
        return _sorted_ids(out, top, np.take_along_axis(acc, top, axis=1), lo, k)


def ids_layout(ids: np.ndarray, H: int, count: int, lo: int, hi: int,
               among: bool) -> np.ndarray:
    """(H, count) the device's chosen ids ``ids`` (H, <= count) as :meth:`HeavyHitters.top`
    returns them, -1 where fewer qualify (a choice ``among`` resident ids ends at column
    min(count, hi - lo))."""
    out = np.full((H, count), -1, np.int32)
    if not among:
        out[:, : ids.shape[1]] = ids
        return out
    k = min(count, hi - lo)
    for h in range(H):
        got = ids[h][ids[h] >= 0]
        out[h, k - len(got) : k] = got
    return out


def _sorted_ids(out: np.ndarray, top: np.ndarray, picked: np.ndarray, lo: int, k: int):
    """out[:, :k] = the chosen ids (top + lo) sorted per head, -1 where the value is -inf."""
    out[:, :k] = np.sort(np.where(np.isfinite(picked), top + lo, -1), axis=1)
    return out
