"""Steps against saves: a save of a cache never reads it while another thread is inside a step.

A step is the model's forward pass through the tiered layers of one cache: it starts at the
first tiered layer's ``update_and_fetch`` and ends when the last tiered layer's attention
returns or raises. A save (:func:`tiered.persistence.persist.save`) waits for the step running in
another thread to end (the next step waits from the moment a save asks), then holds steps back until
it has read the cache; where the other
thread does not end its step within ``TIERED_SAVE_WAIT`` seconds (default 60: a step that
raised outside tiered's calls leaves no end mark), the save is refused. A thread's own step
never blocks its own save.

The cost on the decode path is one uncontended condition-variable round trip at each end of
a step (about a microsecond each).
"""

from __future__ import annotations

import contextlib
import os
import threading


class SnapshotError(ValueError):
    """A cache directory that cannot be read or written as a snapshot (or a save refused
    while another thread is inside a step). Defined here, below the snapshots
    (tiered.persistence.snapshot), which raise it too."""


def save_wait_s() -> float:
    try:
        return max(0.0, float(os.environ.get("TIERED_SAVE_WAIT", "60")))
    except ValueError:
        return 60.0


class StepGuard:
    def __init__(self):
        self._cond = threading.Condition()
        self._step: int | None = None  # the thread inside a step
        self._saver: int | None = None  # the thread saving
        self._waiting: set[int] = set()  # threads waiting to save: the next step waits too
        self._savers: set[int] = set()  # threads that ever saved (or tried to) this cache

    def enter(self) -> None:
        """A step starts on this thread (waits while another thread saves)."""
        me = threading.get_ident()
        with self._cond:
            while (self._saver not in (None, me)) or (self._waiting - {me}):
                self._cond.wait()
            self._step = me

    def leave(self) -> None:
        """The step on this thread ended (returned or raised)."""
        with self._cond:
            if self._step == threading.get_ident():
                self._step = None
                self._cond.notify_all()

    def others_waiting(self) -> bool:
        """Whether a thread other than this one waits to save, or has saved this cache: a
        step then ends with what it left lazy evaluated on its own thread (MLX streams are per
        thread: a save on another thread cannot evaluate them). Checking only for a waiting
        saver left a window: a save asked for just after the check read the step's lazy
        arrays and failed ("There is no Stream(cpu, 6) in current thread", one save in tens
        of a thread saving in a loop beside a decoding one)."""
        me = threading.get_ident()
        return bool(self._waiting - {me}) or bool(self._savers - {me})

    @contextlib.contextmanager
    def saving(self, what: str):
        """Hold steps of other threads back while the body reads the cache."""
        me = threading.get_ident()
        with self._cond:
            self._savers.add(me)
            self._waiting.add(me)
            try:
                free = self._cond.wait_for(
                    lambda: self._saver is None and self._step in (None, me),
                    timeout=save_wait_s())
            finally:
                self._waiting.discard(me)
                self._cond.notify_all()
            if not free:
                raise SnapshotError(
                    f"cannot save {what}: a decode step of this cache has been running in "
                    f"another thread for {save_wait_s():g} s (TIERED_SAVE_WAIT); save between "
                    "steps, from the thread that decodes, or after generation ends")
            self._saver = me
        try:
            yield
        finally:
            with self._cond:
                self._saver = None
                self._cond.notify_all()
