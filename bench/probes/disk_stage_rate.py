"""How fast the disk-rows worker's copy runs (issue 62): ``tiered.cpu.disk_serve.stage`` on a
1M-token run's request shape (8 kv heads, 256 chunk slots per head of 8 tokens, head_dim 128,
float16 values), from RAM blocks and from a real page file (mapped in ahead, and fresh), on
the calling thread alone (threads 0), the disk worker's own team (threads -n: the worker's
way) and 1..N Numba threads, from the main thread and from a worker thread, alone and beside
another busy Numba parallel loop (the refresh worker's kind of load); where cupy finds a GPU, into a
page-locked mailbox, alone and while a kernel polls the mailbox's answer word at system scope
as the exchange kernel does (tiered.step.disk_stage) while the worker copies.

    python bench/probes/disk_stage_rate.py --gib 4 --reps 30

Prints ms per request and GB/s of rows staged, median of ``--reps`` requests, each with a new
random selection over the whole file (``--reselect F``: also requests keeping F of the previous
one's chunks, which the worker's chunk cache then does not copy again).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common

import common  # noqa: F401  (tiered before mlx)
import numba
import numpy as np

from tiered.cpu import disk_serve, disk_team
from tiered.cpu.disk import PageFile
from tiered.cpu.disk_serve import FLOAT16, Mailbox, Request, Tensor
from tiered.cpu._numba import kernel
from tiered.step import disk_stage

H, P, PPB, D, C, CAPC = 8, 64, 64, 128, 8, 256


@kernel(parallel=True)
def _busy(a, reps):
    """A parallel loop that keeps Numba's threads of its caller busy (a rival team)."""
    s = 0.0
    for _ in range(reps):
        for i in numba.prange(a.shape[0]):
            s += a[i] * 1.0000001
    return s


def requests(mail, tensor, blocks, rng, share, reselect=0.0, epoch=0):
    """Requests whose ``share`` of each head's slots are selected chunks anywhere in the file;
    ``reselect``: that share of each head's chunks kept from the request before (its chunks
    then in the mailbox's cache: tiered.cpu.disk_cache), the rest new. ``epoch``: each maker
    its own (a mailbox's cached chunks are one store's)."""
    pages = rng.permutation(blocks * PPB).astype(np.int64)
    length = len(pages) * P
    n = int(CAPC * share)
    jobs = itertools.count(1)
    before = [None] * H

    def make():
        for h in range(H):
            fresh = rng.choice(length // C, CAPC, replace=False)
            if before[h] is not None and reselect > 0:
                keep = rng.choice(before[h], int(n * reselect), replace=False)
                fresh = np.concatenate([keep, np.setdiff1d(fresh, keep)])[:CAPC]
            chosen = np.sort(fresh[:n])
            before[h] = chosen
            mail.idx[h * CAPC:(h + 1) * CAPC] = np.concatenate([chosen, np.sort(fresh[n:])])
        mail.count[:] = n
        return Request(job=next(jobs), mail=mail, capc=CAPC, length=length, pages=pages,
                       page_size=P, tensors=[tensor], epoch=epoch)
    return make


def timed(make, reps, stats, threads=True, team=0, before=None):
    ts = []
    for _ in range(reps):
        r = make()
        if before is not None:
            before()  # untimed: e.g. the page file out of the page cache
        t = time.perf_counter()
        disk_serve.stage(r, stats, threads, team)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)), int(stats[0]) * D * 2


# The exchange kernel's wait (tiered.step.disk_stage.EXCHANGE), alone, through the same
# system-scope loads and pause: one thread polling a host word until it reaches `want`.
POLL = disk_stage.HEADER + r"""
extern "C" __global__ void tqp_poll(const long long* word, long long want,
                                    unsigned long long* polls, unsigned long long limit_ns) {
  const unsigned long long t0 = tqd_timer();
  unsigned long long n = 0;
  while (tqd_load_acquire(word) < want && tqd_timer() - t0 <= limit_ns) {
    tqd_pause();
    n++;
  }
  polls[0] = n;
}
"""


def gpu_rows(mail, row, make, threads):
    """The copies into the page-locked mailbox, alone and beside the device's wait."""
    try:
        import cupy as cp
        cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001  (no cupy, no driver, no GPU: the rows are skipped)
        print(f"no page-locked rows: cupy with a GPU is needed ({type(e).__name__})")
        return
    bufs = mail.buffers
    for b in bufs:
        cp.cuda.runtime.hostRegister(b.ctypes.data, b.nbytes, 2)  # cudaHostRegisterMapped
    try:
        row("mailbox page-locked", make, threads, "thread")
        polls = cp.zeros(1, cp.uint64)
        # ctl[1]; registered with unified addressing, the host address is the device's too
        # (cupy's runtime module has no hostGetDevicePointer)
        word = mail.ctl.ctypes.data + 8
        mail.ctl[1] = 0
        stream = cp.cuda.Stream(non_blocking=True)
        t = time.perf_counter()
        with stream:
            cp.RawKernel(POLL, "tqp_poll")((1,), (1,), (cp.uint64(word), cp.int64(1), polls,
                                                         cp.uint64(120 * 10**9)))
        time.sleep(0.05)
        row("page-locked, device polling", make, threads, "thread")
        row("page-locked, device polling", make, 0, "thread")
        mail.ctl[1] = 1  # the answer: the kernel's loop ends
        stream.synchronize()
        wall = time.perf_counter() - t
        print(f"the device polled {int(polls.get()[0])} times in {wall:.2f} s", flush=True)
        mail.ctl[1] = 0
    finally:
        for b in bufs:
            cp.cuda.runtime.hostUnregister(b.ctypes.data)


def team_of(threads, spin_us=None):
    """The disk worker's copy team: its address (the calling thread and threads - 1 helpers
    polling ``spin_us`` for a task before they sleep; None: the worker's default)."""
    server = disk_serve.DiskServer()
    server.team[disk_team.TEAM_N] = threads - 1
    if spin_us is not None:
        server.team[disk_team.TEAM_SPIN] = 1000 * spin_us
    for i in range(threads - 1):
        threading.Thread(target=disk_team._help, args=(server.team.ctypes.data, i),
                         daemon=True).start()
    return server


def served_cold(pf, blocks, rng, args, drop, mode):
    """Requests through the disk worker itself (cpu.disk_serve.DiskServer, its own team), the
    page file dropped from the page cache before each: posted, exported as the device does,
    answered; ``mode`` auto: the worker's own switch to asking for pages ahead (TEAM_ADVISE),
    never: that switch off. Prints the answers' median ms and how many were advised."""
    server = disk_serve.DiskServer()
    if mode == "never":
        server.team[disk_team.TEAM_ADVISE_ON] = server.team[disk_team.TEAM_ADVISE_OFF] = 1 << 62
    else:
        server.team[disk_team.TEAM_ADVISE_ON] = disk_serve.ADVISE_ON_NS
        server.team[disk_team.TEAM_ADVISE_OFF] = disk_serve.ADVISE_OFF_NS
    server.team[disk_team.TEAM_ADVISE] = 0
    mail = Mailbox(H, CAPC, C, {"values": D}, {"values": FLOAT16}, lambda b: b.ctypes.data)
    tensor = Tensor(addrs=np.asarray([pf.address(i) for i in range(blocks)], np.int64),
                    disk=np.ones(blocks, np.uint8), scales=np.zeros(0, np.int64), ppb=PPB,
                    code=FLOAT16, dim=D, out=mail.addrs[4])
    make = requests(mail, tensor, blocks, rng, args.share, epoch=10)
    ts, advised = [], 0
    for _ in range(args.reps):
        req = make()
        drop()
        advised += int(server.team[disk_team.TEAM_ADVISE])
        server.post(req)
        t = time.perf_counter()
        disk_serve.store_release(mail.ctl_addr + 8 * disk_serve.EXPORTED, req.job)
        while mail.ctl[disk_serve.ANSWERED] < req.job:
            time.sleep(0)
        ts.append(time.perf_counter() - t)
    server.close()
    print(f"worker, cold, switch {mode:<5} team {disk_serve.THREADS:>2} answered in "
          f"{1e3 * float(np.median(ts)):8.3f} ms (median of {len(ts)}; "
          f"first {1e3 * ts[0]:.1f} ms); {advised} advised", flush=True)


def in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0, help="page file size")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--share", type=float, default=0.5, help="share of slots selected")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--reselect", type=float, default=0.0,
                    help="also time requests that keep this share of the previous request's "
                         "chunks (cached by the worker), as the disk worker copies")
    ap.add_argument("--cold", action="store_true",
                    help="only the copies from a page file out of the page cache (dropped before "
                         "each request), the team asking for the pages ahead (TEAM_ADVISE) or not")
    ap.add_argument("--spin-us", type=int, default=None,
                    help="the copy team's helpers poll this long for a task before they sleep "
                         f"(default: the worker's, here {disk_serve.TEAM_SPIN_NS // 1000})")
    args = ap.parse_args()
    block_bytes = PPB * H * P * D * 2
    blocks = max(2, int(args.gib * 2**30 // block_bytes))
    rng = np.random.default_rng(0)
    mail = Mailbox(H, CAPC, C, {"values": D}, {"values": FLOAT16}, lambda b: b.ctypes.data)
    stats = np.zeros(disk_serve.STATS_WORDS, np.int64)
    t = time.perf_counter()
    pf = PageFile(args.dir, "probe", (PPB, H, P, D), np.float16)
    ram = []
    for b in range(blocks):
        blk = rng.standard_normal((PPB, H, P, D), np.float32).astype(np.float16)
        pf.append(blk)
        if b < blocks // 4 or b == 0:
            ram.append(blk)
    print(f"page file: {blocks} blocks of {block_bytes / 2**20:.0f} MiB "
          f"({blocks * block_bytes / 2**30:.2f} GiB) written in {time.perf_counter() - t:.1f} s; "
          f"Numba threads {numba.config.NUMBA_NUM_THREADS}", flush=True)

    def tensor(addrs, n):
        return Tensor(addrs=np.asarray(addrs, np.int64), disk=np.ones(n, np.uint8),
                      scales=np.zeros(0, np.int64), ppb=PPB, code=FLOAT16, dim=D, out=mail.addrs[4])

    t_ram = tensor([b.ctypes.data for b in ram], len(ram))
    t_disk = tensor([pf.address(i) for i in range(blocks)], blocks)
    make_ram = requests(mail, t_ram, len(ram), rng, args.share, epoch=1)
    make_disk = requests(mail, t_disk, blocks, rng, args.share, epoch=2)
    timed(make_ram, 2, stats)  # compile
    nmax = numba.config.NUMBA_NUM_THREADS
    counts = [0] + sorted({1, 2, 4, 8, nmax} & set(range(1, nmax + 1)))
    counts += [-n for n in counts if n > 1 and n <= disk_team.TEAM_MAX + 1]

    teams = {}

    def row(label, make, threads, where="main"):  # threads 0: this thread alone; -n: the
        numba.set_num_threads(max(1, threads))  # worker's team of n (the disk worker's way)
        if threads < 0 and threads not in teams:  # one team per size, made once
            teams[threads] = team_of(-threads, args.spin_us)
        team = teams[threads].team.ctypes.data if threads < 0 else 0
        fn = (lambda: timed(make, args.reps, stats, threads > 0, team))
        s, nbytes = fn() if where == "main" else in_thread(
            lambda: (numba.set_num_threads(max(1, threads)), fn())[1])
        print(f"{label:<34} threads {threads:>2} {where:<6} {1e3 * s:7.3f} ms  "
              f"{nbytes / 2**20:5.2f} MiB  {nbytes / s / 1e9:6.2f} GB/s", flush=True)

    print(f"threading layer: {numba.threading_layer()}")
    if args.cold:
        def drop():  # unmapped from the process, then out of the page cache (clean pages)
            pf.release()
            os.posix_fadvise(pf.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.fsync(pf.fd)
        for n in [c for c in counts if c < 0] + [-1]:
            for advise in (0, 1, 0, 1):
                server = teams.get(n) or teams.setdefault(n, team_of(-n, args.spin_us))
                server.team[disk_team.TEAM_ADVISE] = advise
                s, nbytes = timed(make_disk, args.reps, stats, False, server.team.ctypes.data,
                                  drop)
                print(f"page file, cold, {'advised' if advise else 'one by one':<10} team {-n:>2} "
                      f"{1e3 * s:8.3f} ms  {nbytes / 2**20:5.2f} MiB  {nbytes / s / 1e9:6.2f} GB/s",
                      flush=True)
        for mode in ("never", "auto", "never", "auto"):
            served_cold(pf, blocks, rng, args, drop, mode)
        return
    timed(make_ram, args.reps, stats)  # first touches of the RAM blocks
    for n in counts:
        row("RAM blocks", make_ram, n)
    pf.release()
    for n in counts:
        row("page file, fresh mapping (faults)", make_disk, n)
    pf.release()
    t = time.perf_counter()
    done = pf.populate()
    print(f"populated {done} blocks in {time.perf_counter() - t:.2f} s", flush=True)
    for n in counts:
        row("page file, mapped in", make_disk, n)
    row("page file, mapped in", make_disk, nmax, "thread")
    if args.reselect > 0:
        again = requests(mail, t_disk, blocks, rng, args.share, args.reselect, epoch=3)
        for n in [0] + [c for c in counts if c < 0]:
            row(f"mapped in, {args.reselect:.0%} re-selected", again, n)
    try:
        gpu_rows(mail, row, make_disk, -disk_serve.THREADS)  # as the worker copies
    except Exception as e:  # noqa: BLE001  (a probe: the rows below still run)
        print(f"page-locked rows failed: {type(e).__name__}: {e}", flush=True)
    # a rival Numba team busy beside the worker (as the refresh worker's passes are)
    stop = threading.Event()
    a = np.ones(1 << 20, np.float32)
    _busy(a, 1)

    def rival():
        numba.set_num_threads(max(1, nmax // 2))
        while not stop.is_set():
            _busy(a, 20)
    th = threading.Thread(target=rival, daemon=True)
    th.start()
    time.sleep(0.2)
    row("mapped in, rival team busy", make_disk, -disk_serve.THREADS, "thread")
    row("mapped in, rival team busy", make_disk, nmax, "thread")
    row("mapped in, rival team busy", make_disk, max(1, nmax // 2), "thread")
    stop.set()
    th.join()


if __name__ == "__main__":
    main()
