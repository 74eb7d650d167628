"""The CPU side of the device path's disk rows (tiered.step.disk_stage): a worker thread that
answers each layer-step's request for the rows of selected chunks lying in the page file.

The GPU cannot read the page file (a plain file mapping; no pageable memory access on the
H200s measured, bench/probes/disk_uva_probe.py), so a layer whose store has disk blocks needs
the CPU to copy those rows. Here that costs the host no wait: when the main thread builds a
layer's step it posts a :class:`Request` (the layer's tables as they are at that step: a row of
addresses in the worker's ring) and goes on building. On the device, the step's exchange kernel
writes the selection into the layer's :class:`Mailbox` (pinned memory), stamps the request's
number and waits; this thread, polling the mailboxes of its pending requests, copies the
selected disk rows into the mailbox's row buffers, packed, with their places, together with
helper threads of its own (:mod:`tiered.cpu.disk_copy`), and stamps the number back; the
device's rows kernel then reads them in place. So the device waits for the copy of the disk
rows it needs, layer by layer; nothing else waits.

The worker never needs the GIL while the device may wait for it: from its first request it
stays in one native loop (:func:`_serve`) that takes requests from the ring, polls, copies,
answers and naps there; its helpers sleep on a futex between copies. Numba's own threads are
not used: a Numba parallel region takes the GIL to start. The host may hold the GIL while it
waits for the device (MLX freeing unified memory calls ``cudaFree``, which waits for the
device's work, from an array's destructor); a worker that went back to Python for its next
request, as an earlier one did, then waited for the GIL while the device waited for it, until
the device gave up after 20 s (an H100 test's intermittent "no answer within 20 s").

A request whose step is never run (a graph built and dropped) is passed over when a later
request's stamp reaches its mailbox. A failure in this thread is kept (:attr:`DiskServer.error`)
and its requests are still answered, so the device never waits for a dead thread; the host
raises it at the layer's next step (tiered.step.disk_stage).
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time

import numpy as np

from ._numba import (FUTEX, futex_wake, kernel, load_acquire_i64, monotonic_ns, sleep_us,
                     store_release_i64)
from .disk_copy import (  # noqa: F401  (the control words and types: the names users import)
    ANSWERED, CTL_WORDS, EXPORTED, FAULT, FLOAT16, FLOAT32, INT8, ROWS_WORD, STATS_WORDS,
    WAITED_NS, Mailbox, Request, Tensor, stage)
from .disk_copy import (F_CTL, F_JOB, F_LENGTH, F_NT, F_TENSORS, FIELDS, T_CODE, T_DIM,
                        TENSOR_FIELDS, _answer, _i64, _ring_row)
from .disk_team import (TEAM_ADVISE, TEAM_ADVISE_OFF, TEAM_ADVISE_ON, TEAM_GEN, TEAM_MAX, TEAM_N,
                        TEAM_SPIN, TEAM_STOP, TEAM_WORDS, _help, row_width)

# Threads copying a request's rows: the worker and THREADS - 1 helpers of its own (not Numba's:
# a Numba parallel region takes the GIL to start), polling, then sleeping on a futex, between
# copies. TIERED_DISK_THREADS; without futexes (not Linux) the worker alone.
THREADS = int(os.environ.get("TIERED_DISK_THREADS", str(min(4, os.cpu_count() or 1))))
# How long a helper polls for the next copy before it sleeps (TIERED_DISK_SPIN_US): as long as
# the worker polls for requests (SPIN_NS) where the cores are many enough to spare, else none.
# A decode step's requests come a layer apart (~1 ms on a GPU), so a polling team is never
# woken; waking one cost ~45 us a request on the 2-core CPU machine, a request's copy 30-300.
TEAM_SPIN_NS = 1000 * int(os.environ.get(
    "TIERED_DISK_SPIN_US", "2000" if (os.cpu_count() or 1) >= 4 * THREADS else "0"))


# The copy team asks the kernel to read a request's disk pages ahead of its copies (cpu.disk_team,
# TEAM_ADVISE) after a request copied at more than ADVISE_ON_NS a chunk-head (pages read from the
# disk: 150-300 us a chunk one at a time), until one copies at less than ADVISE_OFF_NS (pages in
# the page cache: ~1.5 us a chunk-head at 1M tokens on an H100 host, where a madvise call would
# cost as much as the copy). TIERED_DISK_ADVISE: auto, 1 (always), 0 (never).
ADVISE = os.environ.get("TIERED_DISK_ADVISE", "auto")
ADVISE_ON_NS, ADVISE_OFF_NS = {"1": (-1, -1), "0": (1 << 62, 1 << 62)}.get(ADVISE, (20_000, 4_000))
ADVISE_MIN = 16  # chunk-heads copied for a request's rate to count

SLOTS = 4096  # requests outstanding at most (a step of 32 layers posts 32)
# The ring's control words: requests posted (the host's count, released), stop, the worker's
# tallies: layer-steps answered, rows, chunk-heads, bytes, passed over, ns copying, ns from a
# request's arrival to its export, answers already exported when first polled, rows and
# chunk-heads copied (the rest were in the mailbox's cache: cpu.disk_cache)
(POSTED, STOP, N_STEPS, N_ROWS, N_CHUNKS, N_BYTES, N_PASSED, COPY_NS, POLL_NS, N_LATE,
 N_COPIED_ROWS, N_COPIED_CHUNKS) = range(12)
RING_WORDS = 16
# Polls back to back for 2 ms after the last request's arrival or answer, then naps of NAP_US
# while a request is pending (the device may be about to export it) or IDLE_US while none is;
# after DOZE_NS without either, naps of DOZE_US (an idle process's worker wakes 500 times a s)
SPIN_NS, DOZE_NS = 2_000_000, 1_000_000_000
NAP_US, IDLE_US, DOZE_US = 20, 200, 2000


@kernel()
def _serve(ring, queue, ctl_addr, state_addr, team_addr, stats):
    """The worker's loop, without the GIL from the first request to :meth:`DiskServer.close`:
    take the requests the host posts (``queue[i % SLOTS]``: the ring row of the i-th, below
    ``ctl[POSTED]``), poll their mailboxes, answer each request as the device exports it (rows
    copied with the team at ``team_addr``, their places, their number, then the release), pass
    over one whose mailbox shows a later request, free each slot (state 0). Never returning to
    Python, it answers while the host holds the GIL, even in a call that waits for the device.
    Returns when ``ctl[STOP]`` is set."""
    tally = _i64(ctl_addr, RING_WORDS)
    team = _i64(team_addr, TEAM_WORDS)
    pending = np.empty(SLOTS, np.int64)
    arrived = np.zeros(SLOTS, np.int64)
    polled = np.zeros(SLOTS, np.uint8)
    n, taken, last = 0, 0, monotonic_ns()
    while load_acquire_i64(ctl_addr + 8 * STOP) == 0:
        posted = load_acquire_i64(ctl_addr + 8 * POSTED)
        while taken < posted:
            pending[n] = queue[taken % SLOTS]
            last = arrived[pending[n]] = monotonic_ns()
            polled[pending[n]] = 0
            n += 1
            taken += 1
        k = 0
        while k < n:
            r = ring[pending[k]]
            got = load_acquire_i64(r[F_CTL])
            if got < r[F_JOB]:
                polled[pending[k]] = 1
                k += 1
                continue
            if got == r[F_JOB]:
                t0 = monotonic_ns()
                tally[POLL_NS] += t0 - arrived[pending[k]]
                tally[N_LATE] += 1 if polled[pending[k]] == 0 else 0
                _answer(r, False, team_addr, stats)
                store_release_i64(r[F_CTL] + 8 * ANSWERED, r[F_JOB])
                last = monotonic_ns()
                tally[COPY_NS] += last - t0
                tally[N_STEPS] += 1
                tally[N_ROWS] += stats[0]
                tally[N_CHUNKS] += stats[1]
                tally[N_COPIED_ROWS] += stats[2]
                tally[N_COPIED_CHUNKS] += stats[3]
                if stats[3] >= ADVISE_MIN:  # the copy rate says where the pages were read from
                    per = (last - t0) // stats[3]
                    if per > team[TEAM_ADVISE_ON]:
                        team[TEAM_ADVISE] = 1
                    elif per < team[TEAM_ADVISE_OFF]:
                        team[TEAM_ADVISE] = 0
                width = 0
                for j in range(r[F_NT]):
                    width += r[F_TENSORS + j * TENSOR_FIELDS + T_DIM] * row_width(
                        r[F_TENSORS + j * TENSOR_FIELDS + T_CODE])
                tally[N_BYTES] += stats[0] * width
            else:  # the mailbox went on to a later request: this one's step never ran
                tally[N_PASSED] += 1
            store_release_i64(state_addr + 8 * pending[k], 0)
            n -= 1
            for j in range(k, n):
                pending[j] = pending[j + 1]
        since = monotonic_ns() - last
        if since > DOZE_NS:
            sleep_us(DOZE_US)
        elif since > SPIN_NS:
            sleep_us(NAP_US if n > 0 else IDLE_US)


class DiskServer:
    """The worker thread (started on the first request; a daemon) and the ring the host posts
    requests to. ``counts``: layer-steps answered, rows and chunk-heads staged, their bytes,
    requests passed over, seconds copying, seconds from a request's arrival to its export,
    answers the device was waiting for before the worker polled (``late``), rows and
    chunk-heads copied (the rest were in the mailbox's chunk cache). ``error``: what stopped the
    loop; the requests are then answered with a fault (``ctl[FAULT] = 2``), so the device never
    waits for a dead thread, and the host raises it at the layer's next step."""

    def __init__(self):
        self.ring = np.zeros((SLOTS, FIELDS), np.int64)
        self.queue = np.zeros(SLOTS, np.int64)  # the ring row of each request, in post order
        self.ctl = np.zeros(RING_WORDS, np.int64)
        self.state = np.zeros(SLOTS, np.int64)  # 1: a request in that row (the worker frees it)
        self._held: list = [None] * SLOTS  # per row, what its addresses point into (kept alive)
        self._free = list(range(SLOTS - 1, -1, -1))
        self._busy: collections.deque = collections.deque()  # rows posted, not yet seen freed
        self._posted = 0
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self.team = np.zeros(TEAM_WORDS, np.int64)  # the copy team (cpu.disk_copy.TEAM_*)
        self.team[TEAM_N] = min(TEAM_MAX, max(0, THREADS - 1)) if FUTEX else 0
        self.team[TEAM_SPIN] = TEAM_SPIN_NS
        self.team[TEAM_ADVISE_ON], self.team[TEAM_ADVISE_OFF] = ADVISE_ON_NS, ADVISE_OFF_NS
        self.team[TEAM_ADVISE] = int(ADVISE == "1")
        self._helpers: list[threading.Thread] = []

    @property
    def counts(self) -> dict:
        c = self.ctl
        return {"layer_steps": int(c[N_STEPS]), "rows": int(c[N_ROWS]),
                "chunks": int(c[N_CHUNKS]), "bytes": int(c[N_BYTES]),
                "passed_over": int(c[N_PASSED]), "copy_s": 1e-9 * int(c[COPY_NS]),
                "poll_s": 1e-9 * int(c[POLL_NS]), "late": int(c[N_LATE]),
                "copied_rows": int(c[N_COPIED_ROWS]), "copied_chunks": int(c[N_COPIED_CHUNKS])}

    def post(self, req: Request) -> None:
        """Hand ``req`` to the worker: a ring row of addresses (its arrays kept alive here
        until the worker frees the row) and the posted count, released. No wait, no GIL
        needed on the worker's side."""
        row, keep = _ring_row(req)
        self.post_row(row, keep, req.job, req.length)

    def post_row(self, row: np.ndarray, keep: list, job: int, length: int) -> None:
        """:meth:`post` of a request's row made before (:func:`tiered.cpu.disk_copy._ring_row`
        of a request with the same mailbox, tables and pages: only its number and length
        differ), ``keep`` what it points into."""
        with self._lock:
            if self._thread is None:
                team = self.team.ctypes.data
                self._helpers = [threading.Thread(target=_help, args=(team, i), daemon=True,
                                                  name=f"tiered-disk-rows-{i + 1}")
                                 for i in range(int(self.team[TEAM_N]))]
                self._thread = threading.Thread(target=self._run, name="tiered-disk-rows",
                                                daemon=True)
                for t in [*self._helpers, self._thread]:
                    t.start()
            busy, state = self._busy, self.state
            while busy and state[busy[0]] == 0:  # answered, oldest first: let go
                s = busy.popleft()
                self._held[s] = None
                self._free.append(s)
            if not self._free:
                # rows answered out of order wait behind the oldest: look at all of them
                for s in [s for s in busy if state[s] == 0]:
                    busy.remove(s)
                    self._held[s] = None
                    self._free.append(s)
            if not self._free:
                raise RuntimeError(f"{SLOTS} disk-row requests outstanding: their steps never "
                                   "ran on the device")
            s = self._free.pop()
            busy.append(s)
            self._held[s] = keep
            ring = self.ring[s]
            ring[:] = row
            ring[F_JOB] = job
            ring[F_LENGTH] = length
            state[s] = 1
            self.queue[self._posted % SLOTS] = s
            self._posted += 1
            store_release(self.ctl.ctypes.data + 8 * POSTED, self._posted)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker (requests still pending are left unanswered)."""
        store_release(self.ctl.ctypes.data + 8 * STOP, 1)
        if self._thread is not None:
            self._thread.join(timeout)
        store_release(self.team.ctypes.data + 8 * TEAM_STOP, 1)
        store_release(self.team.ctypes.data + 8 * TEAM_GEN, int(self.team[TEAM_GEN]) + 1)
        _wake(self.team.ctypes.data + 8 * TEAM_GEN, TEAM_MAX)
        for t in self._helpers:
            t.join(timeout)

    def _run(self) -> None:
        try:
            _serve(self.ring, self.queue, self.ctl.ctypes.data, self.state.ctypes.data,
                   self.team.ctypes.data, np.zeros(STATS_WORDS, np.int64))
        except BaseException as e:  # kept for the host; the device must not wait for us
            self.error = e
            while self.ctl[STOP] == 0:
                for s in np.flatnonzero(self.state):
                    req = self._held[s][0]
                    req.mail.ctl[FAULT] = 2
                    store_release(req.mail.ctl_addr + 8 * ANSWERED,
                                  int(self.ring[s, F_JOB]))  # req: a row's first request
                    self.state[s] = 0
                time.sleep(0.001)


@kernel("void(int64, int64)")
def store_release(address, value):
    store_release_i64(address, value)


@kernel("void(int64, int64)")
def _wake(address, count):
    futex_wake(address, count)


SERVER = DiskServer()
_warm: list = []
_ahead: list = []  # the process compiling the worker's kernels ahead (warm_ahead)
AHEAD_WAIT_S = 120.0  # warm() waits this long at most for it, then compiles here
_AHEAD_CODE = "import tiered.cpu.disk_serve as d; d.warm()"


def warm() -> None:
    """Compile the worker's kernels here (once per process; cached on disk after the first), so
    the device's first wait is not a compile. Where :func:`warm_ahead` started compiling them
    in a process of its own, wait for it first: they then load from the disk cache."""
    if _warm:
        return
    if _ahead:
        try:
            _ahead[0].wait(AHEAD_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
    ctl, team = np.zeros(RING_WORDS, np.int64), np.zeros(TEAM_WORDS, np.int64)
    ctl[STOP] = team[TEAM_STOP] = 1  # compiled, returns at once
    _serve(np.zeros((SLOTS, FIELDS), np.int64), np.zeros(SLOTS, np.int64), ctl.ctypes.data,
           np.zeros(SLOTS, np.int64).ctypes.data, team.ctypes.data,
           np.zeros(STATS_WORDS, np.int64))
    _help(team.ctypes.data, 0)
    word = np.zeros(1, np.int64)
    store_release(word.ctypes.data, 0)
    _wake(word.ctypes.data, 0)
    _warm.append(True)


def warm_ahead() -> subprocess.Popen | None:
    """Start compiling the worker's kernels in a process of their own, into the kernels' disk
    cache (cpu._numba): on a machine that never ran them they took 21.3 s on the 2-core CPU
    machine, and over the disk tier an H100's first 1M run waited 38.7 s at its first decode
    step, the worker's kernels among what compiled there. A device-path layer calls this where
    a host budget may send pages to the disk tier (tiered.step.compile_ahead), long before the
    decode. Returns the process (None where the kernels are compiled here already or it could
    not start)."""
    if _warm:
        return None
    if not _ahead:
        env = dict(os.environ, TIERED_WARM_KERNELS="0")  # not MLX's modules again
        try:
            _ahead.append(subprocess.Popen([sys.executable, "-c", _AHEAD_CODE], env=env,
                                           stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL))
        except OSError:
            return None
    return _ahead[0]
