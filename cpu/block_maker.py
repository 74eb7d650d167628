"""Host blocks allocated ahead of need and made ready off the main thread (issue 24).

On MLX's CUDA backend a block is an array queued on MLX's CPU stream (managed memory, filled
there), and the first read of such an array waited for the GPU work queued before the read,
not only for the block's fill: in a 1M-token prefill on an H200 the chunks that grew the host
pages took ~80 ms more than the others, the main thread waiting for the chunk before to finish
(bench/host_wait_probe.py). Here one daemon thread takes that wait: it reads each queued block
(its numpy view; MLX releases the GIL while it waits) and runs the block's ``prepare`` hook
(the device path's advice, ``tiered.uva.advise_host``), so the main thread adopts a block that
is ready and keeps queueing work meanwhile.
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
    """A block handed to the maker: ``view`` once ``done`` is set, ``prepared`` when its hook
    ran, ``error`` what the worker raised (re-raised by :meth:`result`)."""

    __slots__ = ("arr", "prepare", "done", "view", "prepared", "error")

    def __init__(self, arr: mx.array, prepare):
        self.arr, self.prepare = arr, prepare
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

    def submit(self, arr: mx.array, prepare=None) -> Ticket:
        """Queue a block (already queued on MLX's CPU stream) to be read and prepared."""
        ticket = Ticket(arr, prepare)
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
                t.view = np_view(t.arr)
                if t.prepare is not None:
                    t.prepare(t.view)
                    t.prepared = True
            except BaseException as e:  # handed to the main thread by Ticket.result
                t.error = e
            finally:
                t.done.set()


MAKER = BlockMaker()
