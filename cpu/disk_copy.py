"""The disk rows' copy (cpu.disk_serve's worker, tiered.step.disk_stage): a layer's pinned
mailbox with the device, a request's tables, and the kernels that locate the selected chunks'
rows lying in disk blocks, give them slots of the mailbox's chunk cache (cpu.disk_cache), copy
those not cached there (cpu.disk_team) and list every row's place and slot row."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numba
import numpy as np

from ._numba import address_as_pointer, kernel
from .disk_cache import CACHE, CacheMap, assign
from .disk_team import _copy_slot, _i64, _u8, run

# Mailbox control words (int64): the request number the device exported, the one this thread
# answered, a fault (1: the device's wait timed out, 2: this thread failed), the rows staged,
# the nanoseconds the device waited for answers (summed by the device).
EXPORTED, ANSWERED, FAULT, ROWS_WORD, WAITED_NS = 0, 1, 2, 3, 4
CTL_WORDS = 8
STATS_WORDS = 4  # a worker's tallies of one answer: rows and chunk-heads read, and copied
# Storage codes: the host dtype of a tensor's pages, and what its staged rows hold
FLOAT16, FLOAT32, INT8 = 0, 1, 2  # int8 rows are staged dequantized, as float32


class Mailbox:
    """One layer's pinned exchange with the device: control words, the exported selection
    (idx (H, capc) uint32, count (H,) int32), the place of each staged row in (H, capc * chunk)
    (int32, packed: the first ctl[ROWS_WORD] hold), the staged rows of each tensor in chunk
    slots of ``chunk`` rows (float16, or float32 for float32 and int8 pages; ``cache`` times a
    step's selection, kept from step to step: :mod:`tiered.cpu.disk_cache`), and the slot row
    each staged row is read from (src, int32, in the list's order). ``register`` page-locks a
    buffer and returns its device address; ``pool``: (zeros(n, dtype), release(buffers)) that
    the buffers come from and go back to when the mailbox is dropped
    (tiered.runtime.uva.pinned_zeros and release), else numpy's."""

    def __init__(self, H: int, capc: int, chunk: int, dims: dict, codes: dict, register,
                 pool=None, cache: int | None = None):
        self.H, self.capc, self.chunk = H, capc, chunk
        rows = H * capc * chunk
        self.slots = (CACHE if cache is None else max(1, cache)) * H * capc
        zeros = pool[0] if pool is not None else np.zeros
        self.ctl = zeros(CTL_WORDS, np.int64)
        self.idx = zeros(H * capc, np.uint32)
        self.count = zeros(H, np.int32)
        self.list = zeros(rows, np.int32)
        self.rows = {name: zeros(self.slots * chunk * d,
                                 np.float16 if codes[name] == FLOAT16 else np.float32)
                     for name, d in dims.items()}
        self.src = zeros(rows, np.int32)
        # device addresses in this order: rows of the i-th tensor at 4 + i, src last
        self.buffers = [self.ctl, self.idx, self.count, self.list, *self.rows.values(), self.src]
        self.addrs = [int(register(b)) for b in self.buffers]
        if pool is not None:
            weakref.finalize(self, pool[1], list(self.buffers)).atexit = False
        self.cache = CacheMap(self.slots)  # host memory only: the worker's
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
    epoch: int = 0  # the store's rewrites so far (a change drops the cached chunks)


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
def _packed(start, slots):
    """Prefix sums of the slots' row counts in place (start[k]: slot k's first packed row);
    the chunk-heads with a row."""
    chunks = 0
    for k in range(slots):
        chunks += start[k + 1] > 0
        start[k + 1] += start[k]
    return chunks


# A request as one int64 row (:func:`_ring_row`; the disk worker's ring holds them): its
# mailbox's words and lists, its chunk cache (cpu.disk_cache), and per tensor (up to two)
# TENSOR_FIELDS words from F_TENSORS on
(F_JOB, F_CTL, F_IDX, F_COUNT, F_H, F_CAPC, F_C, F_LENGTH, F_PAGES, F_NPAGES, F_PAGE_SIZE,
 F_LIST, F_NT, F_SRC, F_TABLE, F_BITS, F_OWNER, F_STAMP, F_STATE, F_NSLOTS, F_EPOCH,
 F_TENSORS) = range(22)
T_ADDRS, T_BLOCKS, T_DISK, T_SCALES, T_NSCALES, T_PPB, T_CODE, T_DIM, T_OUT = range(9)
TENSOR_FIELDS = 9
FIELDS = F_TENSORS + 2 * TENSOR_FIELDS


@kernel(inline=True)
def _tensor(r, t):
    """Tensor t of request row r: (block addresses, disk flags, scale blocks, pages per
    block, storage code, dim, its mailbox row buffer's address)."""
    b = F_TENSORS + t * TENSOR_FIELDS
    return (_i64(r[b + T_ADDRS], r[b + T_BLOCKS]), _u8(r[b + T_DISK], r[b + T_BLOCKS]),
            _i64(r[b + T_SCALES], r[b + T_NSCALES]), r[b + T_PPB], r[b + T_CODE],
            r[b + T_DIM], r[b + T_OUT])


@kernel(inline=True)
def _setup(r):
    """Request r's selection, page table and lists, its slot count, and per slot its first
    packed row (start, a prefix sum once filled), its chunk's block and first row."""
    slots = r[F_H] * r[F_CAPC]
    return (address_as_pointer(r[F_IDX], np.uint32), address_as_pointer(r[F_COUNT], np.int32),
            _i64(r[F_PAGES], r[F_NPAGES]), address_as_pointer(r[F_LIST], np.int32),
            address_as_pointer(r[F_SRC], np.int32), slots, np.zeros(slots + 1, np.int64),
            np.empty(slots, np.int64), np.empty(slots, np.int64))


@kernel(inline=True)
def _locate(r, idx, cnt, page_ids, ppb, disk, k):
    """:func:`_disk_chunk` of request r's selection slot k in a tensor's blocks."""
    capc = r[F_CAPC]
    return _disk_chunk(idx, cnt, k // capc, k % capc, capc, r[F_C], r[F_LENGTH], page_ids,
                       r[F_PAGE_SIZE], ppb, r[F_H], disk)


@kernel(inline=True)
def _slotted(r, idx, blks, start, slots, first, cslot, copy, stats):
    """The located rows' packed offsets (start's prefix sums); for the ``first`` tensor, the
    chunks' cache slots (tiered.cpu.disk_cache.assign) and stats: rows and chunk-heads listed,
    and copied."""
    chunks = _packed(start, slots)
    if not first:
        return
    stats[0], stats[1] = start[slots], chunks
    n = r[F_NSLOTS]
    stats[2], stats[3] = assign(
        idx, blks, start, slots, r[F_CAPC], r[F_H], r[F_C], r[F_JOB], r[F_EPOCH], r[F_NT],
        _i64(r[F_TABLE], np.int64(1) << r[F_BITS]), r[F_BITS], _i64(r[F_OWNER], n),
        _i64(r[F_STAMP], n), _i64(r[F_STATE], 4), cslot, copy)


@kernel(inf_safe=True, parallel=True)
def _stage(r, t, first, cslot, copy, stats):
    """Tensor t's rows of request r's selected chunks that lie in disk blocks copied into their
    cache slots where not cached; ``first`` (tensor 0): the slots given, each listed row's place
    in (H, capc * C) and slot row into the lists (packed head by head in token order), stats.
    On Numba's threads, by chunk (a head per thread waited for its slowest). A parallel region
    takes the GIL to start, so the disk worker copies with :func:`_stage_team` instead."""
    addrs, disk, scales, ppb, code, d, out = _tensor(r, t)
    idx, cnt, page_ids, dest, src, slots, start, blks, rows = _setup(r)
    for k in numba.prange(slots):  # each slot's chunk located once
        blks[k], rows[k], start[k + 1] = _locate(r, idx, cnt, page_ids, ppb, disk, k)
    _slotted(r, idx, blks, start, slots, first, cslot, copy, stats)
    for k in numba.prange(slots):
        _copy_slot(k, blks, rows, start, cslot, copy, r[F_C], addrs, scales, code, d, dest, src,
                   out, first)


@kernel(inline=True)
def _located(r, t, first, cslot, copy, stats):
    """Tensor t's chunks of request r located on this thread, the packed rows' offsets, and
    (``first``) their cache slots: (its tables, the lists, slots, start, blocks, first rows)."""
    addrs, disk, scales, ppb, code, d, out = _tensor(r, t)
    idx, cnt, page_ids, dest, src, slots, start, blks, rows = _setup(r)
    for k in range(slots):
        blks[k], rows[k], start[k + 1] = _locate(r, idx, cnt, page_ids, ppb, disk, k)
    _slotted(r, idx, blks, start, slots, first, cslot, copy, stats)
    return addrs, scales, code, d, out, dest, src, slots, start, blks, rows


@kernel(inf_safe=True)
def _stage_one(r, t, first, cslot, copy, stats):
    """:func:`_stage` on the calling thread alone (no parallel region: no GIL)."""
    addrs, scales, code, d, out, dest, src, slots, start, blks, rows = _located(
        r, t, first, cslot, copy, stats)
    for k in range(slots):
        _copy_slot(k, blks, rows, start, cslot, copy, r[F_C], addrs, scales, code, d, dest, src,
                   out, first)


@kernel(inf_safe=True)
def _stage_team(team_addr, r, t, first, cslot, copy, stats):
    """:func:`_stage_one` with the copies split over the calling thread and the copy team's
    helpers (tiered.cpu.disk_team): no parallel region, no GIL."""
    addrs, scales, code, d, out, dest, src, slots, start, blks, rows = _located(
        r, t, first, cslot, copy, stats)
    run(team_addr, slots, blks, rows, start, cslot, copy, r[F_C], addrs, scales, code, d,
        r[F_LIST], out, first, r[F_SRC])


@kernel()
def _answer(r, threads, team_addr, stats):
    """Stage the rows of request row ``r`` (:func:`_ring_row`) into its mailbox: its first
    ``r[F_NT]`` tensors (up to two), their places and slot rows, and their number
    (ctl[ROWS_WORD]), with a copy team (``team_addr``), on Numba's threads (``threads``) or on
    the calling thread alone; the caller releases the answer. stats: rows and chunk-heads
    listed, and copied (the rest were cached)."""
    stats[:] = 0
    slots = r[F_H] * r[F_CAPC]
    cslot = np.empty(slots, np.int64)
    copy = np.empty(slots, np.uint8)
    for t in range(min(r[F_NT], 2)):
        if team_addr != 0:
            _stage_team(team_addr, r, t, t == 0, cslot, copy, stats)
        elif threads:
            _stage(r, t, t == 0, cslot, copy, stats)
        else:
            _stage_one(r, t, t == 0, cslot, copy, stats)
    rows = address_as_pointer(r[F_CTL] + 8 * ROWS_WORD, np.int64)
    rows[0] = stats[0]


def stage(req: Request, stats: np.ndarray, threads: bool = True, team_addr: int = 0) -> None:
    """Fill ``req``'s mailbox with its disk rows (the selection the device exported there):
    the rows not cached copied into their slots, the places and slot rows of all (the lists)
    and their number (ctl[ROWS_WORD]); with the copy team at ``team_addr`` (as the disk worker
    copies), else on Numba's threads (``threads``) or on this thread alone."""
    row, _keep = _ring_row(req)  # _keep: what the row's addresses point into, alive meanwhile
    _answer(row, threads, team_addr, stats)


def _ring_row(req: Request) -> tuple[np.ndarray, list]:
    """``req`` as a row of addresses and sizes (F_* and T_* above) and the arrays it points
    into, to keep alive while the row may be read."""
    ts = req.tensors
    if not 1 <= len(ts) <= 2:
        raise ValueError(f"a request stages one or two tensors, not {len(ts)}")
    mail = req.mail
    cache = mail.cache
    if req.capc > mail.capc:
        raise ValueError(f"a request of {req.capc} chunks a head for a mailbox of {mail.capc}")
    pages = np.ascontiguousarray(req.pages, np.int64)
    keep = [req, pages]
    row = np.zeros(FIELDS, np.int64)
    row[:F_TENSORS] = (req.job, mail.ctl_addr, mail.addrs[1], mail.addrs[2], mail.H, req.capc,
                       mail.chunk, req.length, pages.ctypes.data, pages.size, req.page_size,
                       mail.addrs[3], len(ts), mail.src.ctypes.data, cache.table.ctypes.data,
                       cache.bits, cache.owner.ctypes.data, cache.stamp.ctypes.data,
                       cache.state.ctypes.data, cache.owner.size,
                       req.epoch)
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
