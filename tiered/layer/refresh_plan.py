"""A refresh's host work, done ahead on a worker thread on accelerators (issue 24).

An H2O refresh of a layer on the device path reads the heavy hitters' ids the device chose,
lays out the new resident set (sinks, recent ring, heavy hitters), matches it against the old
one (:class:`tiered.cpu.resident_maps.Swap`) and packs what changes into one upload; only then
come the MLX operations that move rows and flags. On an H200 at 128k tokens with flat
attention (every heavy set turns over), that host work was most of a refresh's main-thread
time and the refresh 24% of the main thread (py-spy, two refreshed layers per token):
reading the ids 9% of it (a wait for the device), the match and the in-place layout 33%,
the upload's packing most of another 25%.

None of that needs the main thread: the ids are read once the dispatcher handed them to the
device (:meth:`tiered.layer.heavy.HeavyHitters.handed_with`), and the rest is numpy and Numba
(``nogil``) on host arrays that nothing changes before the refresh applies (every change of a
layer settles a queued refresh first, :meth:`tiered.layer.resident.ResidentSet.settle`). So, once
handed, the layer submits :func:`plan` to one daemon thread ("tiered-refresh"); the settle
takes its result and builds only the MLX operations. A plan whose inputs no longer hold (the
layer's length or id map changed, another choice of ids was queued) is dropped and the
settle computes as before, on the main thread: what it applies is the same either way.

``TIERED_REFRESH_AHEAD=0`` turns the worker off.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from ..cpu.resident_maps import Swap
from ..runtime import dispatch, staging

ENABLED = os.environ.get("TIERED_REFRESH_AHEAD", "1") not in ("0", "false", "no", "off")


@dataclass
class InPlace:
    """A refresh written into the old layout (:meth:`Swap.in_place`): per head the entries'
    slots, tokens and kinds, the new id map, the promoted ids, and the upload's parts."""
    swap: Swap
    new: np.ndarray
    prom: np.ndarray
    parts: list  # slots, tokens, kind, promoted, promoted counts, demoted slots, flag changes
    packed: np.ndarray  # tiered.runtime.staging.pack of the parts (what upload_many uploads)


@dataclass
class Plan:
    """The host side of one refresh: the new ids (H, R) and, when the sinks and the ring stay
    (the common case), the in-place swap; ``key`` says what it was planned from."""
    tok: np.ndarray
    in_place: InPlace | None
    key: tuple


def heavy_choice(n: int, R: int, S: int, W: int) -> tuple[int, int, int]:
    """(heavy slots, lo, hi) of a refresh at n tokens with R slots, S sinks and a ring of W:
    the heavy hitters are chosen among tokens [lo, hi), past the sinks and before the ring."""
    return max(R - S - W, 0), min(S, n), max(n - W, 0)


def layout(n: int, H: int, S: int, W: int, heavy: np.ndarray) -> np.ndarray:
    """(H, S + W + heavy) token ids: the sinks, the recent ring (slot t % W holds token t; the
    sinks are not repeated) and the heavy hitters."""
    ring = np.full((H, W), -1, np.int32)
    t = np.arange(max(S, n - W), n, dtype=np.int32)  # at most W tokens: distinct slots
    ring[:, t % W] = t  # one call, not one per token: it runs beside the main thread's Python
    sinks = np.tile(np.arange(S, dtype=np.int32), (H, 1))
    return np.concatenate([sinks, ring, heavy], axis=1).astype(np.int32)


def growth(old: np.ndarray, tok: np.ndarray, S: int, W: int, current: tuple) -> int | None:
    """Slots a refresh from ``old`` to ``tok`` adds when it can be written into the old layout
    (the same sinks and ring, ``current`` = (S, W) in use, and no fewer slots), else None."""
    fixed = S + W
    grow = tok.shape[1] - old.shape[1]
    if (grow >= 0 and 0 < fixed <= old.shape[1] and (S, W) == tuple(current)
            and np.array_equal(old[:, :fixed], tok[:, :fixed])):
        return grow
    return None


def in_place(old: np.ndarray, tok: np.ndarray, fixed: int, grow: int) -> InPlace:
    """The host side of an in-place swap (``grow`` empty slots appended to ``old`` first)."""
    if grow:
        old = np.concatenate([old, np.full((old.shape[0], grow), -1, np.int32)], axis=1)
    sw = Swap(old, tok)
    slots, toks_e, kind, new, prom = sw.in_place(old, fixed)
    heads, toks, value = sw.flag_changes()
    parts = [slots, toks_e, kind, prom, sw.promoted_count, sw.demoted_slots, heads, toks,
             value]
    return InPlace(sw, new, prom, parts, staging.pack(parts))


def plan(ids_d, done, heavy_layout, key: tuple, old: np.ndarray, current: tuple) -> Plan | None:
    """Run on the worker: wait for the hand-off ``done``, read the chosen ids ``ids_d``, lay
    them out (``heavy_layout(ids)`` -> (H, count)) and plan the swap from ``old``. ``key`` =
    (n, H, R, S, W). None where the hand-off failed (the settle then reads on its own)."""
    dispatch.wait_for(done)
    if not dispatch.handed(done):
        return None
    n, H, _, S, W = key
    tok = layout(n, H, S, W, heavy_layout(np.array(ids_d)))
    grow = growth(old, tok, S, W, current)
    return Plan(tok, None if grow is None else in_place(old, tok, S + W, grow), key)


class Worker:
    """One daemon thread running submitted functions in order; each returns a Future."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="tiered-refresh",
                                                daemon=True)
                self._thread.start()
        self._q.put((fut, fn, args))
        return fut

    def _run(self):
        while True:
            fut, fn, args = self._q.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001  (the settle decides what to do)
                fut.set_exception(e)


WORKER = Worker()
