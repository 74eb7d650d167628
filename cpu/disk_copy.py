"""The disk rows' copy (cpu.disk_serve's worker, tiered.step.disk_stage): a layer's pinned
mailbox with the device, a request's tables, and the kernels that copy the selected chunks'
rows lying in disk blocks into the mailbox, packed, with their places."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numba
import numpy as np

from ._numba import (address_as_pointer, futex_wait, futex_wake, kernel, load_acquire_i64,
                     store_release_i64)

# Mailbox control words (int64): the request number the device exported, the one this thread
# answered, a fault (1: the device's wait timed out, 2: this thread failed), the rows staged,
# the nanoseconds the device waited for answers (summed by the device).
EXPORTED, ANSWERED, FAULT, ROWS_WORD, WAITED_NS = 0, 1, 2, 3, 4
CTL_WORDS = 8
STATS_WORDS = 4  # a worker's tallies of one answer: rows, chunk-heads, ns polled, ns staging
# Storage codes: the host dtype of a tensor's pages, and what its staged rows hold
FLOAT16, FLOAT32, INT8 = 0, 1, 2  # int8 rows are staged dequantized, as float32


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


@kernel(inline=True)
def _copy_slot(k, blks, rows, start, C, addrs, scales, code, d, dest, out_addr, write_list):
    """Slot k's chunk (located by :func:`_disk_chunk`): its rows into the packed output at row
    start[k] (int8 dequantized into float32), and (``write_list``) their places into the list.
    A chunk's rows are one run of bytes: copied 8 bytes a load where rows are whole words."""
    blk, row, j = blks[k], rows[k], start[k]
    n = start[k + 1] - j
    if blk < 0:
        return
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
        return
    width = 2 if code == 0 else 4
    nbytes = n * d * width
    if nbytes % 8 == 0:
        src = address_as_pointer(addrs[blk] + row * d * width, np.uint64)
        dst = address_as_pointer(out_addr + j * d * width, np.uint64)
        for e in range(nbytes // 8):
            dst[e] = src[e]
    else:
        src8 = address_as_pointer(addrs[blk] + row * d * width, np.uint8)
        dst8 = address_as_pointer(out_addr + j * d * width, np.uint8)
        for e in range(nbytes):
            dst8[e] = src8[e]


@kernel(inline=True)
def _packed(start, slots):
    """Prefix sums of the slots' row counts in place (start[k]: slot k's first packed row);
    the chunk-heads with a row."""
    chunks = 0
    for k in range(slots):
        chunks += start[k + 1] > 0
        start[k + 1] += start[k]
    return chunks


@kernel(inline=True)
def _setup(idx_addr, count_addr, list_addr, H, capc):
    """The selection and the list as arrays, the slot count, and per slot: its first packed
    row (start, a prefix sum once filled), its chunk's block and first row."""
    slots = H * capc
    return (address_as_pointer(idx_addr, np.uint32), address_as_pointer(count_addr, np.int32),
            address_as_pointer(list_addr, np.int32), slots, np.zeros(slots + 1, np.int64),
            np.empty(slots, np.int64), np.empty(slots, np.int64))


@kernel(inf_safe=True, parallel=True)
def _stage(idx_addr, count_addr, H, capc, C, length, page_ids, page_size, ppb, disk, addrs,
           scales, code, d, list_addr, out_addr, write_list, stats):
    """Copy the rows of the selected chunks' tokens that lie in disk blocks, packed head by
    head in token order, to out_addr (int8 dequantized into float32), and (``write_list``)
    each one's row of (H, capc * C) into the list; stats: rows, chunk-heads with one. On
    Numba's threads, split by chunk, not by head (a head per thread used 8 of the host's
    threads at most and waited for its slowest). Each parallel region takes the GIL to start
    (Numba's gufunc wrapper), so the disk worker, which must never wait for the GIL, copies
    with :func:`_stage_one`."""
    idx, cnt, dest, slots, start, blks, rows = _setup(idx_addr, count_addr, list_addr, H, capc)
    for k in numba.prange(slots):  # each slot's chunk located once
        blks[k], rows[k], start[k + 1] = _disk_chunk(idx, cnt, k // capc, k % capc, capc, C,
                                                     length, page_ids, page_size, ppb, H, disk)
    chunks = _packed(start, slots)
    for k in numba.prange(slots):
        _copy_slot(k, blks, rows, start, C, addrs, scales, code, d, dest, out_addr, write_list)
    stats[0] = start[slots]
    stats[1] = chunks


@kernel(inline=True)
def _located(idx_addr, count_addr, list_addr, H, capc, C, length, page_ids, page_size, ppb, disk):
    """Each slot's chunk located on this thread, the packed rows' offsets: (list, slots,
    start, blocks, first rows, chunk-heads with a row)."""
    idx, cnt, dest, slots, start, blks, rows = _setup(idx_addr, count_addr, list_addr, H, capc)
    for k in range(slots):
        blks[k], rows[k], start[k + 1] = _disk_chunk(idx, cnt, k // capc, k % capc, capc, C,
                                                     length, page_ids, page_size, ppb, H, disk)
    return dest, slots, start, blks, rows, _packed(start, slots)


@kernel(inf_safe=True)
def _stage_one(idx_addr, count_addr, H, capc, C, length, page_ids, page_size, ppb, disk, addrs,
               scales, code, d, list_addr, out_addr, write_list, stats):
    """:func:`_stage` on the calling thread alone (no parallel region: no GIL)."""
    dest, slots, start, blks, rows, chunks = _located(idx_addr, count_addr, list_addr, H, capc,
                                                      C, length, page_ids, page_size, ppb, disk)
    for k in range(slots):
        _copy_slot(k, blks, rows, start, C, addrs, scales, code, d, dest, out_addr, write_list)
    stats[0] = start[slots]
    stats[1] = chunks


@kernel(inline=True)
def _i64(addr, n):
    """The n int64 words at ``addr``."""
    return numba.carray(address_as_pointer(addr, np.int64), (n,))


@kernel(inline=True)
def _u8(addr, n):
    """The n bytes at ``addr``."""
    return numba.carray(address_as_pointer(addr, np.uint8), (n,))


# A copy team (the disk worker's helper threads, cpu.disk_serve): TEAM_WORDS int64 words. The
# generation (its low 32 bits the futex word the helpers sleep on), stop, helpers; the task (a
# tensor's located chunks: per-slot arrays' addresses and the copy's arguments); per helper its
# slot range [lo, hi) and the last generation it finished.
TEAM_GEN, TEAM_STOP, TEAM_N = 0, 1, 2
(TASK_SLOTS, TASK_BLKS, TASK_ROWS, TASK_START, TASK_C, TASK_ADDRS, TASK_NADDRS, TASK_SCALES,
 TASK_NSCALES, TASK_CODE, TASK_D, TASK_LIST, TASK_OUT, TASK_WRITE) = range(3, 17)
TEAM_RANGES, TEAM_DONE, TEAM_MAX, TEAM_WORDS = 20, 52, 12, 64


@kernel(inline=True)
def _team_copy(w, lo, hi):
    """Slots [lo, hi) of the team's task (:func:`_copy_slot`)."""
    n, C, code, d, out, write = (w[TASK_SLOTS], w[TASK_C], w[TASK_CODE], w[TASK_D], w[TASK_OUT],
                                 w[TASK_WRITE] != 0)
    blks = _i64(w[TASK_BLKS], n)
    rows = _i64(w[TASK_ROWS], n)
    start = _i64(w[TASK_START], n + 1)
    addrs = _i64(w[TASK_ADDRS], w[TASK_NADDRS])
    scales = _i64(w[TASK_SCALES], w[TASK_NSCALES])
    dest = address_as_pointer(w[TASK_LIST], np.int32)
    for k in range(lo, hi):
        _copy_slot(k, blks, rows, start, C, addrs, scales, code, d, dest, out, write)


@kernel()
def _help(team_addr, me):
    """Helper ``me``'s loop (its own thread, no GIL): sleep on the generation word, copy its
    range of each new task, say so; return when the team stops."""
    w = _i64(team_addr, TEAM_WORDS)
    seen = load_acquire_i64(team_addr + 8 * (TEAM_DONE + me))  # a task posted before it ran
    while load_acquire_i64(team_addr + 8 * TEAM_STOP) == 0:
        g = load_acquire_i64(team_addr + 8 * TEAM_GEN)
        if g == seen:
            futex_wait(team_addr + 8 * TEAM_GEN, g)
            continue
        if load_acquire_i64(team_addr + 8 * TEAM_STOP) != 0:
            break  # the generation of a stop (set before it), not a task
        seen = g
        _team_copy(w, w[TEAM_RANGES + 2 * me], w[TEAM_RANGES + 2 * me + 1])
        store_release_i64(team_addr + 8 * (TEAM_DONE + me), g)


@kernel(inf_safe=True)
def _stage_team(team_addr, idx_addr, count_addr, H, capc, C, length, page_ids, page_size, ppb,
                disk, addrs, scales, code, d, list_addr, out_addr, write_list, stats):
    """:func:`_stage_one` with the copies split over the calling thread and the team's helpers
    (by rows, about evenly): no parallel region, no GIL."""
    _, slots, start, blks, rows, chunks = _located(idx_addr, count_addr, list_addr, H, capc, C,
                                                   length, page_ids, page_size, ppb, disk)
    w = _i64(team_addr, TEAM_WORDS)
    K = w[TEAM_N]
    w[TASK_SLOTS], w[TASK_BLKS], w[TASK_ROWS], w[TASK_START] = (
        slots, blks.ctypes.data, rows.ctypes.data, start.ctypes.data)
    w[TASK_C], w[TASK_ADDRS], w[TASK_NADDRS] = C, addrs.ctypes.data, addrs.size
    w[TASK_SCALES], w[TASK_NSCALES], w[TASK_CODE], w[TASK_D] = (
        scales.ctypes.data, scales.size, code, d)
    w[TASK_LIST], w[TASK_OUT], w[TASK_WRITE] = list_addr, out_addr, 1 if write_list else 0
    lo = 0
    for i in range(K + 1):  # part i: the slots before the (i + 1)-th share of the rows
        hi = lo
        want = start[slots] * (i + 1) // (K + 1)
        while hi < slots and start[hi] < want:
            hi += 1
        if i == K:
            hi = slots
        w[TEAM_RANGES + 2 * i], w[TEAM_RANGES + 2 * i + 1] = lo, hi
        lo = hi
    g = w[TEAM_GEN] + 1
    store_release_i64(team_addr + 8 * TEAM_GEN, g)
    if K > 0:
        futex_wake(team_addr + 8 * TEAM_GEN, K)
    _team_copy(w, w[TEAM_RANGES + 2 * K], w[TEAM_RANGES + 2 * K + 1])
    for i in range(K):
        while load_acquire_i64(team_addr + 8 * (TEAM_DONE + i)) != g:
            pass
    stats[0] = start[slots]
    stats[1] = chunks


@kernel(inline=True)
def _stage_tensor(threads, team_addr, idx_addr, count_addr, H, capc, C, length, page_ids,
                  page_size, ppb, disk, addrs, scales, code, d, list_addr, out_addr,
                  write_list, stats):
    if team_addr != 0:
        _stage_team(team_addr, idx_addr, count_addr, H, capc, C, length, page_ids, page_size,
                    ppb, disk, addrs, scales, code, d, list_addr, out_addr, write_list, stats)
    elif threads:
        _stage(idx_addr, count_addr, H, capc, C, length, page_ids, page_size, ppb, disk, addrs,
               scales, code, d, list_addr, out_addr, write_list, stats)
    else:
        _stage_one(idx_addr, count_addr, H, capc, C, length, page_ids, page_size, ppb, disk,
                   addrs, scales, code, d, list_addr, out_addr, write_list, stats)


@kernel()
def _stage_request(ctl_addr, idx_addr, count_addr, H, capc, C, length, pages, page_size,
                   list_addr, n_t, addrs0, disk0, scales0, ppb0, code0, d0, out0, addrs1, disk1,
                   scales1, ppb1, code1, d1, out1, threads, team_addr, stats):
    """A request's rows (its first ``n_t`` tensors, up to two), their places and their number
    (ctl[ROWS_WORD]): with a copy team (``team_addr``), on Numba's threads (``threads``) or on
    the calling thread alone; the caller releases the answer."""
    stats[0] = 0
    if n_t > 0:
        _stage_tensor(threads, team_addr, idx_addr, count_addr, H, capc, C, length, pages,
                      page_size, ppb0, disk0, addrs0, scales0, code0, d0, list_addr, out0, True,
                      stats)
    if n_t > 1:
        _stage_tensor(threads, team_addr, idx_addr, count_addr, H, capc, C, length, pages,
                      page_size, ppb1, disk1, addrs1, scales1, code1, d1, list_addr, out1, False,
                      stats)
    rows = address_as_pointer(ctl_addr + 8 * ROWS_WORD, np.int64)
    rows[0] = stats[0]


# A request as one int64 row (:func:`_ring_row`; the disk worker's ring holds them); per tensor
# (up to two) TENSOR_FIELDS words from F_TENSORS on
(F_JOB, F_CTL, F_IDX, F_COUNT, F_H, F_CAPC, F_C, F_LENGTH, F_PAGES, F_NPAGES, F_PAGE_SIZE,
 F_LIST, F_NT, F_TENSORS) = range(14)
T_ADDRS, T_BLOCKS, T_DISK, T_SCALES, T_NSCALES, T_PPB, T_CODE, T_DIM, T_OUT = range(9)
TENSOR_FIELDS = 9
FIELDS = F_TENSORS + 2 * TENSOR_FIELDS


@kernel(inline=True)
def _answer(r, threads, team_addr, stats):
    """Stage the rows of request row ``r`` (:func:`_ring_row`) into its mailbox
    (:func:`_stage_request`)."""
    a, b = F_TENSORS, F_TENSORS + TENSOR_FIELDS
    stats[:] = 0
    _stage_request(r[F_CTL], r[F_IDX], r[F_COUNT], r[F_H], r[F_CAPC], r[F_C], r[F_LENGTH],
                   _i64(r[F_PAGES], r[F_NPAGES]), r[F_PAGE_SIZE], r[F_LIST], r[F_NT],
                   _i64(r[a + T_ADDRS], r[a + T_BLOCKS]), _u8(r[a + T_DISK], r[a + T_BLOCKS]),
                   _i64(r[a + T_SCALES], r[a + T_NSCALES]), r[a + T_PPB], r[a + T_CODE],
                   r[a + T_DIM], r[a + T_OUT],
                   _i64(r[b + T_ADDRS], r[b + T_BLOCKS]), _u8(r[b + T_DISK], r[b + T_BLOCKS]),
                   _i64(r[b + T_SCALES], r[b + T_NSCALES]), r[b + T_PPB], r[b + T_CODE],
                   r[b + T_DIM], r[b + T_OUT], threads, team_addr, stats)


def stage(req: Request, stats: np.ndarray, threads: bool = True, team_addr: int = 0) -> None:
    """Fill ``req``'s mailbox with its disk rows (the selection the device exported there):
    the packed rows, their places (the list) and their number (ctl[ROWS_WORD]); with the copy
    team at ``team_addr`` (as the disk worker copies), else on Numba's threads (``threads``)
    or on this thread alone."""
    row, _keep = _ring_row(req)  # _keep: what the row's addresses point into, alive meanwhile
    _answer(row, threads, team_addr, stats)


def _ring_row(req: Request) -> tuple[np.ndarray, list]:
    """``req`` as a row of addresses and sizes (F_* and T_* above) and the arrays it points
    into, to keep alive while the row may be read."""
    ts = req.tensors
    if not 1 <= len(ts) <= 2:
        raise ValueError(f"a request stages one or two tensors, not {len(ts)}")
    mail = req.mail
    pages = np.ascontiguousarray(req.pages, np.int64)
    keep = [req, pages]
    row = np.zeros(FIELDS, np.int64)
    row[:F_TENSORS] = (req.job, mail.ctl_addr, mail.addrs[1], mail.addrs[2], mail.H, req.capc,
                       mail.chunk, req.length, pages.ctypes.data, pages.size, req.page_size,
                       mail.addrs[3], len(ts))
    for j, t in enumerate(ts):
        addrs = np.ascontiguousarray(t.addrs, np.int64)
        disk = np.ascontiguousarray(t.disk, np.uint8)
        scales = np.ascontiguousarray(t.scales, np.int64)
        if disk.size < addrs.size or (t.code == INT8 and scales.size < addrs.size):
            raise ValueError("a tensor's disk flags and scale blocks must cover its blocks")
        keep += [addrs, disk, scales]
        b = F_TENSORS + j * TENSOR_FIELDS
        row[b : b + TENSOR_FIELDS] = (addrs.ctypes.data, addrs.size, disk.ctypes.data,
                                      scales.ctypes.data, scales.size, t.ppb, t.code, t.dim,
                                      t.out)
    return row, keep
