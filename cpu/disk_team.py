"""The disk rows' copy (cpu.disk_copy) shared by a team of threads: the disk worker's helpers
(cpu.disk_serve), each polling, then sleeping on a futex, until the worker hands it a range of
a request's located chunks, and the copy of one chunk into its slot of the mailbox's cache
(the chunks to copy asked for AHEAD chunks before their copy: they lie scattered over the page
file, and a chunk's first loads otherwise wait for a page walk and a miss).

Where the page file's pages are not in the page cache (a page file larger than the RAM left for
it: the 4M-token run's 52 GiB beside 106 GiB of process memory on a 125 GiB host), each chunk's
first load is a read from the disk, one at a time per thread: 150-300 us a chunk. While the
team's ``TEAM_ADVISE`` word is set, each thread first asks the kernel to read all of its
chunks' pages (``madvise(MADV_WILLNEED)``: the reads queued together, not waited for), then
copies them (a probe on the 2-core machine's disk, 4,000 cold 1 KB chunks: 314-357 us a chunk
read one after another, 9.5-10.4 advised first). The disk worker sets the word from the copy
rate it sees (cpu.disk_serve)."""

from __future__ import annotations

import numba
import numpy as np

from ._numba import (address_as_pointer, futex_wait, futex_wake, kernel, load_acquire_i64,
                     madvise, monotonic_ns, prefetch_address, store_release_i64)

AHEAD = 4  # chunks asked for ahead of the one copied
MADV_WILLNEED = 3  # Linux
PAGE = 4096


@kernel(inline=True)
def _copy_slot(k, blks, rows, start, cslot, copy, C, addrs, scales, code, d, dest, src,
               out_addr, write_list):
    """Selection slot k's chunk (located by :func:`_disk_chunk`; its cache slot cslot[k] from
    :func:`tiered.cpu.disk_cache.assign`): where ``write_list``, its rows' places and the slot
    rows they are read from into the lists at its packed position start[k]; where copy[k], its
    rows into its cache slot (int8 dequantized into float32). A chunk's rows are one run of
    bytes: copied 8 bytes a load where rows are whole words."""
    blk, row, j = blks[k], rows[k], start[k]
    n = start[k + 1] - j
    if blk < 0:
        return
    cs = cslot[k]
    if write_list:
        for i in range(n):
            dest[j + i] = k * C + i
            src[j + i] = cs * C + i
    if copy[k] == 0:
        return
    j = cs * C
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
        src8 = address_as_pointer(addrs[blk] + row * d * width, np.uint64)
        dst8 = address_as_pointer(out_addr + j * d * width, np.uint64)
        for e in range(nbytes // 8):
            dst8[e] = src8[e]
    else:
        src1 = address_as_pointer(addrs[blk] + row * d * width, np.uint8)
        dst1 = address_as_pointer(out_addr + j * d * width, np.uint8)
        for e in range(nbytes):
            dst1[e] = src1[e]


@kernel(inline=True)
def row_width(code):
    """Bytes of a row element in a block of storage ``code`` (int8, float16, float32)."""
    return 1 if code == 2 else (2 if code == 0 else 4)


@kernel(inline=True)
def _prefetch_slot(k, blks, rows, start, addrs, code, d):
    """Ask for the lines of slot k's chunk (one to be copied: on disk, not cached)."""
    width = row_width(code)
    a = addrs[blks[k]] + rows[k] * d * width
    for e in range(0, (start[k + 1] - start[k]) * d * width, 64):
        prefetch_address(a + e)


@kernel(inline=True)
def _advise(address, nbytes, last):
    """Ask for the pages of [address, address + nbytes) to be read from the disk (queued, not
    waited for), less its first page where that is ``last`` (the page asked for last: chunks
    of a block follow each other); returns the new last page."""
    first = address // PAGE
    if first == last:
        first += 1
    end = (address + nbytes - 1) // PAGE
    if end >= first:
        madvise(first * PAGE, (end + 1 - first) * PAGE, MADV_WILLNEED)
        return end
    return last


@kernel(inline=True)
def _advise_slots(lo, hi, blks, rows, start, copy, addrs, scales, code, d):
    """:func:`_advise` over the chunks to copy in slots [lo, hi): their rows, and an int8
    tensor's scales."""
    width = row_width(code)
    last, last_s = np.int64(-1), np.int64(-1)
    for k in range(lo, hi):
        if blks[k] < 0 or copy[k] == 0:
            continue
        n = start[k + 1] - start[k]
        last = _advise(addrs[blks[k]] + rows[k] * d * width, n * d * width, last)
        if code == 2:
            last_s = _advise(scales[blks[k]] + rows[k] * 4, n * 4, last_s)


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
# tensor's located chunks: per-slot arrays' addresses and the copy's arguments); how long a
# helper polls for the next task before it sleeps (ns; a futex wake-up took tens of
# microseconds, a request's whole copy ~100); per helper its slot range [lo, hi) and the last
# generation it finished.
TEAM_GEN, TEAM_STOP, TEAM_N = 0, 1, 2
(TASK_SLOTS, TASK_BLKS, TASK_ROWS, TASK_START, TASK_C, TASK_ADDRS, TASK_NADDRS, TASK_SCALES,
 TASK_NSCALES, TASK_CODE, TASK_D, TASK_LIST, TASK_OUT, TASK_WRITE, TASK_CSLOT, TASK_COPY,
 TASK_SRC) = range(3, 20)
TEAM_SPIN, TEAM_ADVISE = 20, 21
TEAM_RANGES, TEAM_DONE, TEAM_MAX, TEAM_WORDS = 22, 52, 12, 64
# TEAM_ADVISE is set after a request copied at more than TEAM_ADVISE_ON ns a chunk-head, cleared
# below TEAM_ADVISE_OFF (cpu.disk_serve); words 48-51 lie past the ranges of TEAM_MAX + 1 threads
TEAM_ADVISE_ON, TEAM_ADVISE_OFF = 48, 49


@kernel(inline=True)
def _team_copy(w, lo, hi):
    """Slots [lo, hi) of the team's task (:func:`_copy_slot`)."""
    n, C, code, d, out, write = (w[TASK_SLOTS], w[TASK_C], w[TASK_CODE], w[TASK_D], w[TASK_OUT],
                                 w[TASK_WRITE] != 0)
    blks = _i64(w[TASK_BLKS], n)
    rows = _i64(w[TASK_ROWS], n)
    start = _i64(w[TASK_START], n + 1)
    cslot = _i64(w[TASK_CSLOT], n)
    copy = _u8(w[TASK_COPY], n)
    addrs = _i64(w[TASK_ADDRS], w[TASK_NADDRS])
    scales = _i64(w[TASK_SCALES], w[TASK_NSCALES])
    dest = address_as_pointer(w[TASK_LIST], np.int32)
    src = address_as_pointer(w[TASK_SRC], np.int32)
    if w[TEAM_ADVISE] != 0:
        _advise_slots(lo, hi, blks, rows, start, copy, addrs, scales, code, d)
    # pf walks ahead of k over the slots to copy, keeping AHEAD of them asked for (no array
    # allocated here: this runs inlined in the worker's native loop)
    pf, ahead = lo, 0
    for k in range(lo, hi):
        while pf < hi and ahead < AHEAD:
            if blks[pf] >= 0 and copy[pf] != 0:
                _prefetch_slot(pf, blks, rows, start, addrs, code, d)
                ahead += 1
            pf += 1
        if blks[k] >= 0 and copy[k] != 0:
            ahead -= 1
        _copy_slot(k, blks, rows, start, cslot, copy, C, addrs, scales, code, d, dest, src, out,
                   write)


@kernel()
def _help(team_addr, me):
    """Helper ``me``'s loop (its own thread, no GIL): poll the generation word for up to
    ``TEAM_SPIN`` ns after a task, then sleep on it; copy its range of each new task, say so;
    return when the team stops."""
    w = _i64(team_addr, TEAM_WORDS)
    seen = load_acquire_i64(team_addr + 8 * (TEAM_DONE + me))  # a task posted before it ran
    idle = monotonic_ns()
    while load_acquire_i64(team_addr + 8 * TEAM_STOP) == 0:
        g = load_acquire_i64(team_addr + 8 * TEAM_GEN)
        if g == seen:
            if monotonic_ns() - idle > w[TEAM_SPIN]:
                futex_wait(team_addr + 8 * TEAM_GEN, g)
                idle = monotonic_ns()  # woken: a task, most likely, and polls again after it
            continue
        if load_acquire_i64(team_addr + 8 * TEAM_STOP) != 0:
            break  # the generation of a stop (set before it), not a task
        seen = g
        _team_copy(w, w[TEAM_RANGES + 2 * me], w[TEAM_RANGES + 2 * me + 1])
        store_release_i64(team_addr + 8 * (TEAM_DONE + me), g)
        idle = monotonic_ns()

@kernel(inline=True)
def run(team_addr, slots, blks, rows, start, cslot, copy, C, addrs, scales, code, d, list_addr,
        out, first, src_addr):
    """The located chunks' copies (:func:`_copy_slot`) split over the calling thread and the
    team's helpers (by rows to copy, about evenly: cached chunks only list theirs); returns
    when all are done."""
    w = _i64(team_addr, TEAM_WORDS)
    K = w[TEAM_N]
    w[TASK_SLOTS], w[TASK_BLKS], w[TASK_ROWS], w[TASK_START] = (
        slots, blks.ctypes.data, rows.ctypes.data, start.ctypes.data)
    w[TASK_C], w[TASK_ADDRS], w[TASK_NADDRS] = C, addrs.ctypes.data, addrs.size
    w[TASK_SCALES], w[TASK_NSCALES], w[TASK_CODE], w[TASK_D] = (
        scales.ctypes.data, scales.size, code, d)
    w[TASK_LIST], w[TASK_OUT], w[TASK_WRITE] = list_addr, out, 1 if first else 0
    w[TASK_CSLOT], w[TASK_COPY], w[TASK_SRC] = cslot.ctypes.data, copy.ctypes.data, src_addr
    total = 0
    for k in range(slots):
        total += (start[k + 1] - start[k]) * copy[k]
    lo, before = 0, 0  # before: the rows to copy in slots [0, hi)
    for i in range(K + 1):  # part i: the slots before the (i + 1)-th share of those rows
        hi = lo
        want = total * (i + 1) // (K + 1)
        while hi < slots and before < want:
            before += (start[hi + 1] - start[hi]) * copy[hi]
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
