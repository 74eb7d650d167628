"""The CPU side of the device path's disk rows (tiered.step.disk_stage): a worker thread that
answers each layer-step's request for the rows of selected chunks lying in the page file.

The GPU cannot read the page file (a plain file mapping; no pageable memory access on the
H200s measured, bench/probes/disk_uva_probe.py), so a layer whose store has disk blocks needs
the CPU to copy those rows. Here that costs the host no wait: when the main thread builds a
layer's step it posts a :class:`Request` (the layer's tables as they are at that step) and goes
on building. On the device, the step's exchange kernel writes the selection into the layer's
:class:`Mailbox` (pinned memory), stamps the request's number and waits; this thread, polling
the mailboxes of its pending requests (:func:`_serve_head`, without the GIL), copies the
selected disk rows into the mailbox's row buffers, packed, with their places, and stamps the
number back; the device's rows kernel then reads them in place. So the device waits for the
copy of the disk rows it needs, layer by layer; nothing else waits.

A request whose step is never run (a graph built and dropped) is passed over when a later
request's stamp reaches its mailbox. A failure in this thread is kept (:attr:`DiskServer.error`)
and the request is still answered, so the device never waits for a dead thread; the host raises
it at the layer's next step (tiered.step.disk_stage).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import weakref
from dataclasses import dataclass

import numba
import numpy as np

from ._numba import (address_as_pointer, kernel, load_acquire_i64, monotonic_ns,
                     store_release_i64)

# Mailbox control words (int64): the request number the device exported, the one this thread
# answered, a fault (1: the device's wait timed out, 2: this thread failed), the rows staged,
# the nanoseconds the device waited for answers (summed by the device).
EXPORTED, ANSWERED, FAULT, ROWS_WORD, WAITED_NS = 0, 1, 2, 3, 4
CTL_WORDS = 8
STATS_WORDS = 4  # a worker's tallies of one answer: rows, chunk-heads, ns polled, ns staging
# Storage codes: the host dtype of a tensor's pages, and what its staged rows hold
FLOAT16, FLOAT32, INT8 = 0, 1, 2  # int8 rows are staged dequantized, as float32

# Polls of the pending mailboxes per call without the GIL. Each return to Python takes the GIL
# from the threads that build and hand over the step (switch interval 20 us), so a call spins
# until something happens or for a few ms (2-core CPU machine, 2 pending: 20,000 polls took
# 0.46 ms, 2^21 9.5 ms). One cache's requests are exported in order, so the first pending one
# is the one to wait for; another cache's, posted meanwhile, waits for the call's end.
SPINS = 1 << 20
IDLE_ROUNDS = 50  # fruitless calls in a row before polling slows to IDLE_SLEEP_S
IDLE_SLEEP_S = 0.0005
SWITCH_INTERVAL_S = 0.00002  # as tiered.runtime.dispatch sets it for its thread
# The copies' threads (Numba's, set in this thread only; TIERED_DISK_THREADS). Few, not the
# host's cores: the step's own threads (the main one, the dispatcher, this one polling, the
# refresh worker's team) are busy beside them, and a copy waits for its slowest thread. On
# an H100 host (16 cores) 2 MiB of rows took 0.08 ms on 16 threads alone and 0.36 ms beside a
# busy rival team, 0.17 on 8 (bench/probes/disk_stage_rate.py); in the 1M run 0.63 ms a
# layer on 16 threads.
COPY_THREADS = int(os.environ.get("TIERED_DISK_THREADS", "4"))


class Mailbox:
    """One layer's pinned exchange with the device: control words, the exported selection
    (idx (H, capc) uint32, count (H,) int32), the place of each staged row in (H, capc * chunk)
    (int32, packed: the first ctl[ROWS_WORD] hold) and the staged rows of each tensor, packed
    in the same order (float16, or float32 for float32 and int8 pages). ``register``
    page-locks a buffer and returns its device address; ``pool``: (zeros(n, dtype), release(
    buffers)) that the buffers come from and go back to when the mailbox is dropped
    (tiered.runtime.uva.pinned_zeros and release), else numpy's."""

    def __init__(self, H: int, capc: int, chunk: int, dims: dict, codes: dict, register,
                 pool=None):
        self.H, self.capc, self.chunk = H, capc, chunk
        rows = H * capc * chunk
        zeros = pool[0] if pool is not None else np.zeros
        self.ctl = zeros(CTL_WORDS, np.int64)
        self.idx = zeros(H * capc, np.uint32)
        self.count = zeros(H, np.int32)
        self.list = zeros(rows, np.int32)
        self.rows = {name: zeros(rows * d, np.float16 if codes[name] == FLOAT16 else np.float32)
                     for name, d in dims.items()}
        self.buffers = [self.ctl, self.idx, self.count, self.list, *self.rows.values()]
        self.addrs = [int(register(b)) for b in self.buffers]  # device addresses, in that order
        if pool is not None:
            weakref.finalize(self, pool[1], list(self.buffers)).atexit = False
        self.ctl_addr = self.ctl.ctypes.data
        self.nbytes = sum(b.nbytes for b in self.buffers)

    def fits(self, H: int, capc: int, chunk: int, names) -> bool:
        return (H == self.H and chunk == self.chunk and capc <= self.capc
                and all(n in self.rows for n in names))


@dataclass
class Tensor:
    """One tensor's tables as a request sees them: block addresses (the page file's mapping for
    disk blocks), which blocks are on disk, int8 scale blocks' addresses, storage code, dim."""
    addrs: np.ndarray  # int64 (blocks,)
    disk: np.ndarray  # uint8 (blocks,)
    scales: np.ndarray  # int64 (blocks,), empty unless int8
    ppb: int
    code: int
    dim: int
    out: int  # the mailbox row buffer's address


@dataclass
class Request:
    job: int
    mail: Mailbox
    capc: int
    length: int  # tokens on the host pages when the step was built
    pages: np.ndarray  # int64 physical page of each logical page
    page_size: int
    tensors: list


@kernel(inline=True)
def _disk_chunk(idx, cnt, h, s, capc, C, length, page_ids, page_size, ppb, H, disk):
    """(block, first row, tokens) of slot s's chunk of head h where it is selected and lies in
    a disk block, else (-1, 0, 0). A chunk's tokens share a page (page_size % C == 0, as the
    device path requires), so their rows follow each other in the block."""
    if s >= min(max(cnt[h], 0), capc):
        return -1, 0, 0
    t = np.int64(idx[h * capc + s]) * C
    n = min(np.int64(C), length - t)
    if n <= 0:
        return -1, 0, 0
    lp = t // page_size
    phys = page_ids[lp]
    blk = phys // ppb
    if disk[blk] == 0:
        return -1, 0, 0
    return blk, ((phys - blk * ppb) * H + h) * page_size + (t - lp * page_size), n


@kernel(inf_safe=True, parallel=True)
def _stage(idx_addr, count_addr, H, capc, C, length, page_ids, page_size, ppb, disk, addrs,
           scales, code, d, list_addr, out_addr, write_list, stats):
    """Copy the rows of the selected chunks' tokens that lie in disk blocks, packed head by
    head in token order, to out_addr (int8 dequantized into float32), and (``write_list``)
    each one's row of (H, capc * C) into the list; stats: rows, chunk-heads with one. A chunk's
    rows are one run of bytes: copied 8 bytes a load where rows are whole words. The work is
    split by chunk, not by head: a head per thread used 8 of the host's threads at most and
    waited for its slowest."""
    idx = address_as_pointer(idx_addr, np.uint32)
    cnt = address_as_pointer(count_addr, np.int32)
    dest = address_as_pointer(list_addr, np.int32)
    width = 2 if code == 0 else (4 if code == 1 else 1)
    out_w = 2 if code == 0 else 4
    slots = H * capc
    start = np.zeros(slots + 1, np.int64)
    blks = np.empty(slots, np.int64)
    rows = np.empty(slots, np.int64)
    for k in numba.prange(slots):  # each slot's chunk located once
        blks[k], rows[k], start[k + 1] = _disk_chunk(idx, cnt, k // capc, k % capc, capc, C,
                                                     length, page_ids, page_size, ppb, H, disk)
    chunks = 0
    for k in range(slots):
        chunks += start[k + 1] > 0
        start[k + 1] += start[k]
    for k in numba.prange(slots):
        blk, row, j = blks[k], rows[k], start[k]
        n = start[k + 1] - j
        if blk < 0:
            continue
        if write_list:
            for i in range(n):
                dest[j + i] = k * C + i
        if code == 2:
            q = address_as_pointer(addrs[blk] + row * d, np.int8)
            sc = address_as_pointer(scales[blk] + row * 4, np.float32)
            o = address_as_pointer(out_addr + j * d * 4, np.float32)
            for i in range(n):
                for e in range(d):
                    o[i * d + e] = np.float32(q[i * d + e]) * sc[i]
        else:
            nbytes = n * d * width
            if nbytes % 8 == 0:
                src = address_as_pointer(addrs[blk] + row * d * width, np.uint64)
                dst = address_as_pointer(out_addr + j * d * out_w, np.uint64)
                for e in range(nbytes // 8):
                    dst[e] = src[e]
            else:
                src8 = address_as_pointer(addrs[blk] + row * d * width, np.uint8)
                dst8 = address_as_pointer(out_addr + j * d * out_w, np.uint8)
                for e in range(nbytes):
                    dst8[e] = src8[e]
    stats[0] = start[slots]
    stats[1] = chunks


@kernel()
def _stage_request(ctl_addr, idx_addr, count_addr, H, capc, C, length, pages, page_size,
                   list_addr, n_t, addrs0, disk0, scales0, ppb0, code0, d0, out0, addrs1, disk1,
                   scales1, ppb1, code1, d1, out1, stats):
    """A request's rows (its first ``n_t`` tensors, up to two), their places and their number
    (ctl[ROWS_WORD]); the caller releases the answer."""
    stats[0] = 0
    if n_t > 0:
        _stage(idx_addr, count_addr, H, capc, C, length, pages, page_size, ppb0, disk0, addrs0,
               scales0, code0, d0, list_addr, out0, True, stats)
    if n_t > 1:
        _stage(idx_addr, count_addr, H, capc, C, length, pages, page_size, ppb1, disk1, addrs1,
               scales1, code1, d1, list_addr, out1, False, stats)
    rows = address_as_pointer(ctl_addr + 8 * ROWS_WORD, np.int64)
    rows[0] = stats[0]


def stage(req: Request, stats: np.ndarray) -> None:
    """Fill ``req``'s mailbox with its disk rows (the selection the device exported there):
    the packed rows, their places (the list) and their number (ctl[ROWS_WORD])."""
    _stage_request(req.mail.ctl_addr, *_head_args(req), stats)


@kernel()
def _serve_head(ctl_addrs, ids, spins, idx_addr, count_addr, H, capc, C, length, pages,
                page_size, list_addr, n_t, addrs0, disk0, scales0, ppb0, code0, d0, out0,
                addrs1, disk1, scales1, ppb1, code1, d1, out1, stats):
    """Poll the pending requests' mailboxes for their numbers (ctl_addrs, ids); where the
    first (the oldest) is the one exported, answer it here, without the GIL: staged rows, their
    number, the release; stats[2:4]: ns polled before, ns staging. Returns (1, polls) when it
    answered the first (0: the device was waiting before the first poll), (2, i) when request i is
    exported instead (the caller answers it), (3, i) when request i was passed over, (0, 0)
    after ``spins`` polls."""
    t0 = monotonic_ns()
    for k in range(spins):
        for i in range(ids.shape[0]):
            got = load_acquire_i64(ctl_addrs[i])
            if got == ids[i]:
                if i != 0:
                    return 2, i
                t1 = monotonic_ns()
                _stage_request(ctl_addrs[0], idx_addr, count_addr, H, capc, C, length, pages,
                               page_size, list_addr, n_t, addrs0, disk0, scales0, ppb0, code0,
                               d0, out0, addrs1, disk1, scales1, ppb1, code1, d1, out1, stats)
                store_release_i64(ctl_addrs[0] + 8 * ANSWERED, ids[0])
                stats[2] = t1 - t0
                stats[3] = monotonic_ns() - t1
                return 1, k
            if got > ids[i]:
                return 3, i
    return 0, 0


class DiskServer:
    """The worker thread (started on the first request; a daemon). ``counts``: layer-steps
    answered, rows and chunk-heads copied, bytes, requests passed over, seconds copying,
    seconds polling for the device's export, answers where the device was waiting before the
    worker polled (``late``)."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self.counts = {"layer_steps": 0, "rows": 0, "chunks": 0, "bytes": 0, "passed_over": 0,
                       "copy_s": 0.0, "poll_s": 0.0, "late": 0}

    def post(self, req: Request) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    # This thread takes the GIL between requests while the device waits for
                    # the answers (H200, 1M tokens, 32 layers with disk rows: 194-314 ms/token,
                    # of which this thread's copies 21-24; where the rest went is not measured)
                    if sys.getswitchinterval() > SWITCH_INTERVAL_S:
                        sys.setswitchinterval(SWITCH_INTERVAL_S)
                    self._thread = threading.Thread(target=self._run, name="tiered-disk-rows",
                                                     daemon=True)
                    self._thread.start()
        self._q.put(req)

    def _run(self) -> None:
        numba.set_num_threads(max(1, min(COPY_THREADS, numba.config.NUMBA_NUM_THREADS)))
        pending: list[Request] = []
        idle = 0
        stats = np.zeros(STATS_WORDS, np.int64)
        while True:
            if not pending:
                pending.append(self._q.get())
            try:
                while True:
                    pending.append(self._q.get_nowait())
            except queue.Empty:
                pass
            ids = np.fromiter((r.job for r in pending), np.int64, len(pending))
            ctls = np.fromiter((r.mail.ctl_addr for r in pending), np.int64, len(pending))
            head = pending[0]
            stats[:] = 0
            try:
                what, i = _serve_head(ctls, ids, SPINS, *_head_args(head), stats)
            except BaseException as e:  # the head's tables were refused: answer it failed
                what, i = 2, 0
                self.error = e
            if what == 1:
                self._count(pending.pop(0), stats, 1e-9 * stats[3])
                self.counts["poll_s"] += 1e-9 * stats[2]
                self.counts["late"] += i == 0
                idle = 0
            elif what == 2:
                self._answer(pending.pop(i), stats)
                idle = 0
            elif what == 3:
                pending.pop(i)
                self.counts["passed_over"] += 1
            else:
                idle += 1
                if idle > IDLE_ROUNDS:
                    time.sleep(IDLE_SLEEP_S)

    def _answer(self, req: Request, stats: np.ndarray) -> None:
        t0 = time.perf_counter()
        stats[:] = 0
        try:
            if self.error is not None:
                raise self.error
            stage(req, stats)
        except BaseException as e:  # kept for the host; the device must not wait for us
            self.error = e
            req.mail.ctl[FAULT] = 2
        self._count(req, stats, time.perf_counter() - t0)
        store_release(req.mail.ctl_addr + 8 * ANSWERED, req.job)

    def _count(self, req: Request, stats: np.ndarray, seconds: float) -> None:
        c = self.counts
        c["layer_steps"] += 1
        c["rows"] += int(stats[0])
        c["chunks"] += int(stats[1])
        c["bytes"] += int(stats[0]) * sum(t.dim * (1 if t.code == INT8 else 2 if t.code == FLOAT16
                                                   else 4) for t in req.tensors)
        c["copy_s"] += seconds


_NONE = np.zeros(0, np.int64)
_NONE8 = np.zeros(0, np.uint8)


def _head_args(req: Request) -> tuple:
    """The arguments of :func:`_serve_head` for ``req`` (up to two tensors)."""
    mail, ts = req.mail, req.tensors
    if not 1 <= len(ts) <= 2:
        raise ValueError(f"a request stages one or two tensors, not {len(ts)}")
    t1 = ts[1] if len(ts) > 1 else None
    one = (ts[0].addrs, ts[0].disk, ts[0].scales, ts[0].ppb, ts[0].code, ts[0].dim, ts[0].out)
    two = ((t1.addrs, t1.disk, t1.scales, t1.ppb, t1.code, t1.dim, t1.out) if t1 is not None
           else (_NONE, _NONE8, _NONE, 1, 0, 0, 0))
    return (mail.addrs[1], mail.addrs[2], mail.H, req.capc, mail.chunk, req.length, req.pages,
            req.page_size, mail.addrs[3], len(ts), *one, *two)


@kernel("void(int64, int64)")
def store_release(address, value):
    store_release_i64(address, value)


SERVER = DiskServer()
_warm: list = []


def warm() -> None:
    """Compile the worker's kernels here (once per process; cached on disk after the first), so
    the device's first wait is not a compile."""
    if _warm:
        return
    z8, z64 = np.zeros(1, np.uint8), np.zeros(1, np.int64)
    mail = Mailbox(1, 1, 1, {"values": 1}, {"values": FLOAT16}, lambda b: b.ctypes.data)
    for code in (FLOAT16, FLOAT32, INT8):
        t = Tensor(addrs=z64, disk=z8, scales=z64, ppb=1, code=code, dim=1, out=mail.addrs[4])
        req = Request(job=1, mail=mail, capc=1, length=0, pages=z64, page_size=1, tensors=[t])
        stage(req, np.zeros(STATS_WORDS, np.int64))
        _serve_head(np.array([mail.ctl_addr], np.int64), np.array([1], np.int64), 1,
                    *_head_args(req), np.zeros(STATS_WORDS, np.int64))
    _warm.append(True)
