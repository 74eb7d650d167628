"""Host blocks allocated ahead of need and made ready off the main thread (issue 24).

On MLX's CUDA backend a block is an array on MLX's CPU stream (managed memory, NaN-filled
there). Made on the main thread it cost that thread twice: its first read waited for the GPU
work queued before it (a 1M-token prefill's chunks that grew the host pages took ~80 ms more
than the others on an H200: bench/host_wait_probe.py), and its evaluation allocated the
managed memory there, ``cudaMallocManaged`` waiting for the CUDA driver's lock while the
dispatcher thread launched kernels (py-spy, steady 2048-token prefill chunks of a Llama-3-8B:
7% of the samples). Here one daemon thread does both: it makes each block on its own CPU
stream (MLX's streams are per thread; the block is only ever read through its numpy view and
address, never as an input of the main thread's graphs), waits for the fill with the GIL let
go, and runs the block's ``prepare`` hook (the device path's advice,
``tiered.uva.advise_host``), so the main thread adopts a block that is ready and keeps
queueing work meanwhile.
"""

from __future__ import annotations

import queue
import threading

import mlx.core as mx
import numpy as np


def np_view(arr: mx.array) -> np.ndarray:
    """The zero-copy numpy view of a host block (waits for the block's fill)."""
    view = np.array(arr, copy=False)
    if not view.flags.writeable or not view.flags.c_contiguous:
        raise RuntimeError("host block is not a writable contiguous buffer")
    return view


class Ticket:
    """A block the maker makes: ``arr`` and ``view`` once ``done`` is set, ``prepared`` when its
    hook ran, ``error`` what the worker raised (re-raised by :meth:`result`)."""

    __slots__ = ("make", "arr", "prepare", "done", "view", "prepared", "error")

    def __init__(self, make, prepare):
        self.make, self.prepare = make, prepare
        self.arr: mx.array | None = None
        self.done = threading.Event()
        self.view: np.ndarray | None = None
        self.prepared = False
        self.error: BaseException | None = None

    def result(self) -> np.ndarray:
        """The block's view, waiting for the worker if it has not finished."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.view


class BlockMaker:
    """One worker thread for every host tensor of the process (started on first use)."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, make, prepare=None) -> Ticket:
        """Queue a block: ``make()`` returns it as an MLX CPU array (called on the worker's
        thread, where it is evaluated), ``prepare(view)`` runs after."""
        ticket = Ticket(make, prepare)
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="tiered-blocks",
                                                daemon=True)
                self._thread.start()
        self._q.put(ticket)
        return ticket

    def _run(self):
        while True:
            t = self._q.get()
            try:
                t.arr = t.make()
                t.make = None
                mx.eval(t.arr)  # on this thread's own CPU stream
                t.view = np_view(t.arr)
                if t.prepare is not None:
                    t.prepare(t.view)
                    t.prepared = True
            except BaseException as e:  # handed to the main thread by Ticket.result
                t.error = e
            finally:
                t.done.set()


MAKER = BlockMaker()
