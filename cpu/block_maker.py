"""Host blocks allocated ahead of need and made ready off the main thread (issue 24).

On MLX's CUDA backend a block is an array queued on MLX's CPU stream (managed memory, filled
there), and the first read of such an array waited for the GPU work queued before the read,
not only for the block's fill: in a 1M-token prefill on an H200 the chunks that grew the host
pages took ~80 ms more than the others, the main thread waiting for the chunk before to finish
(bench/host_wait_probe.py, in git history). Here one daemon thread takes that wait: it reads each
queued block (its numpy view; MLX releases the GIL while it waits) and runs the block's ``prepare``
hook (the device path's advice, ``tiered.runtime.uva.advise_host``), so the main thread adopts a
block that is ready and keeps queueing work meanwhile.
"""

from __future__ import annotations

import queue
import threading

import mlx.core as mx
import numpy as np


def np_view(arr: mx.array, shape=None) -> np.ndarray:
    """The zero-copy numpy view of a host block (waits for the block's fill); ``shape``: of
    its first elements (a block allocated longer than it is: tiered.cpu.host_tensor)."""
    view = np.array(arr, copy=False)
    if not view.flags.writeable or not view.flags.c_contiguous:
        raise RuntimeError("host block is not a writable contiguous buffer")
    if shape is not None and view.shape != tuple(shape):
        view = view.reshape(-1)[: int(np.prod(shape))].reshape(shape)
    return view


class Ticket:
    """A block handed to the maker: ``view`` once ``done`` is set, ``prepared`` when its hook
    ran, ``error`` what the worker raised (re-raised by :meth:`result`)."""

    __slots__ = ("arr", "prepare", "shape", "done", "view", "prepared", "error")

    def __init__(self, arr: mx.array, prepare, shape=None):
        self.arr, self.prepare, self.shape = arr, prepare, shape
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

    def submit(self, arr: mx.array, prepare=None, shape=None) -> Ticket:
        """Queue a block (already queued on MLX's CPU stream) to be read and prepared;
        ``shape``: its view's (see :func:`np_view`)."""
        ticket = Ticket(arr, prepare, shape)
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
                t.view = np_view(t.arr, t.shape)
                if t.prepare is not None:
                    t.prepare(t.view)
                    t.prepared = True
            except BaseException as e:  # handed to the main thread by Ticket.result
                t.error = e
            finally:
                t.done.set()


MAKER = BlockMaker()


class BlockPool:
    """Host blocks a long prompt's pages will take, made ahead a few at a time (issue 24).

    On MLX CUDA a block is managed memory NaN-filled by a CPU stream, and that fill is the
    cost: ~28 ms per 32 MB block on an H200's host (the CPU's first touch of managed pages),
    so a 1M-token prompt's 1984 blocks took 56 s on one stream. Queued as the pages grew (32
    at a time, one per layer), the fills fell behind, and while more than 10 CPU tasks are
    active MLX makes every ``eval`` wait for one (``MAX_ACTIVE_TASKS``), the main thread's
    chunks too: the chunks that grew the pages took ~100-180 ms more than the others.

    ``tiered.prefill`` plans here what the prompt's host pages will take (:meth:`plan`,
    within the host budget as blocks are made) and, at every chunk, :meth:`top_up` queues
    blocks while fewer than ``pending`` of them are still filling, on several CPU streams
    (tiered.cpu.block_alloc.FILL_STREAMS). :meth:`HostTensor.grow` takes from here first;
    what is left goes back when the prefill ends. A block's bytes are reserved in its
    budget while it waits here, as a tensor's spare block's are.
    """

    def __init__(self):
        self._free: dict = {}  # (shape, dtype, id(budget)) -> [(ticket, budget, nbytes)]
        self._bytes: dict = {}  # the same keys -> bytes waiting (read per layer and chunk)
        self._plan: list = []  # [key, count left, nbytes, budget, make]
        self._filling: list = []  # tickets queued by top_up, not read yet
        self._lock = threading.Lock()

    @staticmethod
    def _key(shape, dtype, budget):
        return (tuple(shape), dtype, id(budget))

    def plan(self, shape, dtype: str, count: int, nbytes: int, budget, make) -> int:
        """Plan ``count`` blocks, each ``make()`` (a :class:`Ticket`) of ``nbytes`` reserved
        in ``budget`` (None: unbounded) when :meth:`top_up` makes it. Returns ``count``."""
        if count > 0:
            with self._lock:
                self._plan.append([self._key(shape, dtype, budget), count, nbytes, budget, make])
        return max(0, count)

    def top_up(self, pending: int) -> int:
        """Make planned blocks while fewer than ``pending`` are still filling; a plan whose
        budget is spent is dropped (its tensors grow into the disk tier as before). Returns
        the blocks queued."""
        made = 0
        while True:
            with self._lock:
                self._filling = [t for t in self._filling if not t.done.is_set()]
                if len(self._filling) >= pending or not self._plan:
                    return made
                entry = self._plan[0]
                key, _, nbytes, budget, make = entry
                if budget is not None and not budget.reserve(nbytes):
                    self._plan.pop(0)
                    continue
                entry[1] -= 1
                if entry[1] == 0:
                    self._plan.pop(0)
            try:
                ticket = make()
            except BaseException:
                if budget is not None:
                    budget.release(nbytes)
                raise
            with self._lock:
                self._free.setdefault(key, []).append((ticket, budget, nbytes))
                self._bytes[key] = self._bytes.get(key, 0) + nbytes
                self._filling.append(ticket)
            made += 1

    def planned(self) -> int:
        """Blocks planned and not made yet."""
        with self._lock:
            return sum(e[1] for e in self._plan)

    def take(self, shape, dtype: str, budget) -> Ticket | None:
        """A queued block of that shape and dtype reserved in ``budget``, or None. Its bytes
        stay reserved: they are the taker's now."""
        key = self._key(shape, dtype, budget)
        with self._lock:
            got = self._free.get(key)
            if not got:
                return None
            ticket, _, nbytes = got.pop(0)
            self._bytes[key] -= nbytes
            return ticket

    def held_bytes(self, shape=None, dtype=None, budget=None) -> int:
        """Bytes waiting here: all of them, or those of one shape, dtype and budget."""
        with self._lock:
            if shape is None:
                return sum(self._bytes.values())
            return self._bytes.get(self._key(shape, dtype, budget), 0)

    def release(self) -> int:
        """Drop the plan and every block still waiting (each once its worker let go of it),
        their bytes back to their budgets. Returns the bytes released."""
        with self._lock:
            entries = [e for v in self._free.values() for e in v]
            self._free.clear()
            self._bytes.clear()
            self._plan.clear()
            self._filling.clear()
        for ticket, budget, nbytes in entries:
            ticket.done.wait()
            if budget is not None:
                budget.release(nbytes)
        return sum(n for _, _, n in entries)


POOL = BlockPool()
