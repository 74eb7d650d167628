"""The disk rows worker of the device path (cpu.disk_serve, tiered.step.disk_stage): the rows it
stages against the store's own layout, requests whose step never ran, and faults that reach
the host as errors instead of a device waiting for ever. The whole path, decoded against pages
in RAM: tests/test_device_decode.py::test_pages_on_the_disk_tier_decode_as_pages_in_ram."""

from __future__ import annotations

import ctypes
import threading
import time

import mlx.core as mx
import numba
import numpy as np
import pytest

from tiered.cpu import disk_serve, disk_team
from tiered.cpu._numba import load_acquire_i64, monotonic_ns, store_release_i64
from tiered.cpu.disk_serve import (ANSWERED, EXPORTED, FAULT, FLOAT16, FLOAT32, INT8, Mailbox,
                                   Request, Tensor)

H, P, PPB, D, C = 2, 4, 2, 8, 4  # kv heads, page size, pages per block, head dim, chunk


def _address(buf):
    return buf.ctypes.data


def _store(rng, code, blocks=3):
    """Blocks (PPB, H, P, D) of a tensor in the host layout (int8 with a scale per row), a
    shuffled page table, and the reference rows (H, tokens, D) as float32."""
    shape = (PPB, H, P, D)
    if code == INT8:
        data = [rng.integers(-127, 128, shape).astype(np.int8) for _ in range(blocks)]
        scales = [rng.uniform(0.01, 1, shape[:3]).astype(np.float32) for _ in range(blocks)]
    else:
        dt = np.float16 if code == FLOAT16 else np.float32
        data = [rng.normal(size=shape).astype(dt) for _ in range(blocks)]
        scales = []
    pages = rng.permutation(blocks * PPB).astype(np.int64)
    n = len(pages) * P
    ref = np.zeros((H, n, D), np.float32)
    for t in range(n):
        phys = pages[t // P]
        b, slot = phys // PPB, phys % PPB
        row = data[b][slot, :, t % P].astype(np.float32)
        if code == INT8:
            row = row * scales[b][slot, :, t % P][:, None]
        ref[:, t] = row
    return data, scales, pages, ref


def _team(helpers, spin_ns=0):
    """A copy team of ``helpers`` threads (cpu.disk_team._help) polling ``spin_ns`` for a task
    before they sleep, and a stop for it."""
    team = np.zeros(disk_team.TEAM_WORDS, np.int64)
    team[disk_team.TEAM_N] = helpers
    team[disk_team.TEAM_SPIN] = spin_ns
    threads = [threading.Thread(target=disk_team._help, args=(team.ctypes.data, i), daemon=True)
               for i in range(helpers)]
    for t in threads:
        t.start()

    def stop():
        disk_serve.store_release(team.ctypes.data + 8 * disk_team.TEAM_STOP, 1)
        disk_serve.store_release(team.ctypes.data + 8 * disk_team.TEAM_GEN, team[0] + 1)
        disk_serve._wake(team.ctypes.data + 8 * disk_team.TEAM_GEN, helpers)
        for t in threads:
            t.join(5)
        return not any(t.is_alive() for t in threads)
    return team, stop


@pytest.mark.parametrize("way", ["numba threads", "alone", "team of 3", "team of 3, polling",
                                 "team of 3, advising"])
@pytest.mark.parametrize("code", [FLOAT16, FLOAT32, INT8])
def test_staged_rows_are_the_disk_blocks_rows_of_the_selected_chunks(code, way):
    rng = np.random.default_rng(code)
    data, scales, pages, ref = _store(rng, code)
    disk = np.array([1, 0, 1], np.uint8)  # blocks 0 and 2 in the page file
    capc = 3
    mail = Mailbox(H, capc, C, {"values": D}, {"values": code}, _address)
    tensor = Tensor(addrs=np.array([b.ctypes.data for b in data], np.int64), disk=disk,
                    scales=np.array([s.ctypes.data for s in scales], np.int64) if scales
                    else np.zeros(0, np.int64), ppb=PPB, code=code, dim=D, out=mail.addrs[4])
    length = len(pages) * P - 3  # the last chunk partly past the length
    mail.idx[:] = np.array([[5, 0, 2], [1, 5, 0]], np.uint32).ravel()
    mail.count[:] = [3, 2]  # head 1's third slot is not selected
    stats = np.zeros(disk_serve.STATS_WORDS, np.int64)
    # a polling team takes each generation without sleeping (polls of 10 s: never asleep here)
    team, stop = (_team(2, 10**10 if "polling" in way else 0) if way.startswith("team")
                  else (None, None))
    if "advising" in way:  # each thread asks for its chunks' pages before it copies them
        team[disk_team.TEAM_ADVISE] = 1

    def staged(job, epoch):
        disk_serve.stage(Request(job=job, mail=mail, capc=capc, length=length, pages=pages,
                                 page_size=P, tensors=[tensor], epoch=epoch), stats,
                         way == "numba threads", 0 if team is None else team.ctypes.data)

    generations = 3 if team is not None else 1
    for job in range(1, generations + 1):  # a team's generations one after another, each
        mail.rows["values"][:] = 0  # with a new rewrite count: every chunk copied again
        staged(job, epoch=job)
    want = []  # (place, token), head by head in slot order
    for h in range(H):
        for s in range(mail.count[h]):
            for i in range(C):
                t = int(mail.idx[h * capc + s]) * C + i
                if t < length and disk[pages[t // P] // PPB]:
                    want.append(((h * capc + s) * C + i, h, t))

    def check():
        rows = mail.rows["values"].reshape(-1, D)
        k = int(mail.ctl[disk_serve.ROWS_WORD])
        assert 0 < k == len(want) == stats[0] < H * capc * C
        np.testing.assert_array_equal(mail.list[:k], [w[0] for w in want])
        for j, (_, h, t) in enumerate(want):
            np.testing.assert_array_equal(rows[mail.src[j]].astype(np.float32), ref[h, t])
        assert stats[1] == len({w[0] // C for w in want})

    check()
    assert stats[2] == stats[0] and stats[3] == stats[1]  # all copied
    # the same selection once more, the store unchanged: every whole chunk is read from the
    # cache and only the partial last chunk is copied (a store's last tokens are never cached)
    staged(generations + 1, epoch=generations)
    if team is not None:
        assert stop()  # the helpers leave their loops
    check()
    partial = sum(1 for _, h, t in want if t // C == (length - 1) // C and length % C)
    assert partial < stats[0]  # some rows came from the cache
    assert stats[2] == partial and stats[3] == 1 * (partial > 0)


@pytest.mark.parametrize("cache", [1, 2])
def test_cached_chunks_are_read_where_the_worker_put_them_until_the_store_is_rewritten(cache):
    """Requests of random overlapping selections: every staged row, read through its slot row,
    is the store's, whether copied now or cached by an earlier request; only chunks not cached
    are copied; a new rewrite count (a truncation) drops the cache: everything is copied
    again."""
    rng = np.random.default_rng(11)
    data, _, pages, ref = _store(rng, FLOAT32, blocks=6)
    capc, length = 3, len(pages) * P
    nc = length // C
    mail = Mailbox(H, capc, C, {"values": D}, {"values": FLOAT32}, _address, cache=cache)
    tensor = Tensor(addrs=np.array([b.ctypes.data for b in data], np.int64),
                    disk=np.ones(6, np.uint8), scales=np.zeros(0, np.int64), ppb=PPB,
                    code=FLOAT32, dim=D, out=mail.addrs[4])
    stats = np.zeros(disk_serve.STATS_WORDS, np.int64)
    seen: set = set()  # chunk-heads staged since the last drop
    last: set = set()  # the previous request's
    copied = listed = 0
    for job in range(1, 41):
        epoch = job // 15  # the cache drops at jobs 15 and 30
        if job % 15 == 0:
            seen.clear()
        sel = [np.sort(rng.choice(nc, capc, replace=False)) for _ in range(H)]
        mail.idx[:] = np.concatenate(sel).astype(np.uint32)
        mail.count[:] = rng.integers(1, capc + 1, H)
        disk_serve.stage(Request(job=job, mail=mail, capc=capc, length=length, pages=pages,
                                 page_size=P, tensors=[tensor], epoch=epoch), stats, False)
        k = int(mail.ctl[disk_serve.ROWS_WORD])
        rows = mail.rows["values"].reshape(-1, D)
        for j in range(k):
            place = int(mail.list[j])
            h, s_, i = place // (capc * C), place // C % capc, place % C
            t = int(mail.idx[h * capc + s_]) * C + i
            np.testing.assert_array_equal(rows[mail.src[j]], ref[h, t])
        new = {(h, int(mail.idx[h * capc + s_])) for h in range(H)
               for s_ in range(mail.count[h])}
        assert stats[3] >= len(new - seen)  # a chunk never staged is always copied
        if cache == 2 and job % 15 != 0 and job > 1:  # room for two: the last stays cached
            assert stats[3] <= len(new - last)
        seen |= new
        last = new
        copied += int(stats[2])
        listed += int(stats[0])
    assert 0 < copied < listed  # some rows came from the cache


def test_a_request_of_other_tensors_does_not_read_the_cached_slots_of_the_first():
    """A mailbox whose requests staged values only, then keys and values for the same chunks:
    the keys' slots were never filled, so the cache is dropped and both are copied."""
    rng = np.random.default_rng(4)
    stores = {n: _store(rng, FLOAT16) for n in ("keys", "values")}
    pages = stores["values"][2]
    stores["keys"] = _store(np.random.default_rng(5), FLOAT16)[:2] + (pages,)
    ref_k = np.zeros_like(stores["values"][3])
    for t in range(len(pages) * P):  # the keys' rows under the values' page table
        phys = pages[t // P]
        ref_k[:, t] = stores["keys"][0][phys // PPB][phys % PPB, :, t % P]
    mail = Mailbox(H, 2, C, {"keys": D, "values": D}, {"keys": FLOAT16, "values": FLOAT16},
                   _address)
    tensors = {n: Tensor(addrs=np.array([b.ctypes.data for b in stores[n][0]], np.int64),
                         disk=np.ones(3, np.uint8), scales=np.zeros(0, np.int64), ppb=PPB,
                         code=FLOAT16, dim=D, out=mail.addrs[4 + i])
               for i, n in enumerate(("keys", "values"))}
    mail.idx[:] = np.array([[1, 2], [0, 3]], np.uint32).ravel()
    mail.count[:] = [2, 2]
    stats = np.zeros(disk_serve.STATS_WORDS, np.int64)
    req = dict(mail=mail, capc=2, length=len(pages) * P, pages=pages, page_size=P)
    disk_serve.stage(Request(job=1, tensors=[tensors["values"]], **req), stats, False)
    disk_serve.stage(Request(job=2, tensors=[tensors["values"], tensors["keys"]], **req), stats,
                     False)
    assert stats[2] == stats[0] == 4 * C  # all copied again
    k = int(mail.ctl[disk_serve.ROWS_WORD])
    keys = mail.rows["keys"].reshape(-1, D)
    for j in range(k):
        place = int(mail.list[j])
        h, t = place // (2 * C), int(mail.idx[place // C]) * C + place % C
        np.testing.assert_array_equal(keys[mail.src[j]].astype(np.float32), ref_k[h, t])


def _answered(mail, job, timeout=10.0):
    end = time.monotonic() + timeout
    while mail.ctl[ANSWERED] < job and time.monotonic() < end:
        time.sleep(0.001)
    return mail.ctl[ANSWERED] >= job


def _device_exports(mail, job, idx, count):
    """What the exchange kernel does: the selection, then the request number."""
    mail.idx[: idx.size] = idx.ravel()
    mail.count[:] = count
    disk_serve.store_release(mail.ctl_addr + 8 * EXPORTED, job)


def _served(code, seed):
    """A mailbox of 2 chunk slots per head, a request's fields for it over a store whose blocks
    all lie on disk (as a worker is posted them), the store's reference rows, and its blocks
    (the request holds only their addresses: the caller keeps them alive)."""
    data, _, pages, ref = _store(np.random.default_rng(seed), code)
    mail = Mailbox(H, 2, C, {"values": D}, {"values": code}, _address)
    tensor = Tensor(addrs=np.array([b.ctypes.data for b in data], np.int64),
                    disk=np.ones(3, np.uint8), scales=np.zeros(0, np.int64), ppb=PPB,
                    code=code, dim=D, out=mail.addrs[4])
    return mail, dict(mail=mail, capc=2, length=len(pages) * P, pages=pages, page_size=P,
                      tensors=[tensor]), ref, data


def test_a_request_whose_step_never_ran_is_passed_over():
    disk_serve.warm()  # compiled here, not in the worker while the test waits
    server = disk_serve.DiskServer()
    mail, req, ref, blocks = _served(FLOAT32, seed=3)
    server.post(Request(job=1, **req))  # built, never run on the device
    server.post(Request(job=2, **req))
    _device_exports(mail, 2, np.array([[1, 2], [0, 3]], np.uint32), [2, 1])
    assert _answered(mail, 2)
    assert server.counts["passed_over"] == 1 and server.counts["layer_steps"] == 1
    rows = mail.rows["values"].reshape(-1, D)[mail.src[: 3 * C]]
    assert mail.ctl[disk_serve.ROWS_WORD] == 3 * C  # head 0: two chunks, head 1: one
    np.testing.assert_array_equal(mail.list[: 3 * C], np.r_[0:2 * C, 2 * C:3 * C])
    np.testing.assert_array_equal(rows[:C], ref[0, C:2 * C])
    np.testing.assert_array_equal(rows[C:2 * C], ref[0, 2 * C:3 * C])
    np.testing.assert_array_equal(rows[2 * C:3 * C], ref[1, :C])
    server.close()


def test_a_row_made_before_is_posted_as_the_new_requests_row():
    """disk_stage.post makes a layer's ring row once while its tables hold and posts it with
    each step's number and length: the ring then holds what that request's own row would be,
    and the worker answers that request with its rows."""
    from tiered.cpu.disk_copy import _ring_row

    disk_serve.warm()
    server = disk_serve.DiskServer()
    mail, req, ref, blocks = _served(FLOAT16, seed=5)
    row, keep = _ring_row(Request(job=1, **req))
    shorter = dict(req, length=req["length"] - 1)
    server.post_row(row, keep, 7, shorter["length"])
    s = server.queue[0]
    np.testing.assert_array_equal(server.ring[s], _ring_row(Request(job=7, **shorter))[0])
    _device_exports(mail, 7, np.array([[0, 5], [2, 1]], np.uint32), [2, 2])
    assert _answered(mail, 7)
    assert mail.ctl[disk_serve.ROWS_WORD] == 4 * C - 1  # the last chunk ends at the length
    rows = mail.rows["values"].reshape(-1, D)[mail.src[: 4 * C - 1]]
    want = np.concatenate([ref[0, :C], ref[0, 5 * C:6 * C - 1], ref[1, 2 * C:3 * C],
                           ref[1, C:2 * C]])
    np.testing.assert_array_equal(rows, want)
    server.close()


def test_the_worker_asks_for_pages_ahead_after_a_slow_copy_and_stops_after_a_fast_one():
    """The disk worker sets its team's TEAM_ADVISE from each request's copy time per chunk-head
    (cpu.disk_serve): here with thresholds that every copy passes over, then under."""
    disk_serve.warm()
    data, _, pages, ref = _store(np.random.default_rng(9), FLOAT16, blocks=12)
    capc = 12  # 24 chunks a head: 24 chunk-heads selected, all copied
    mail = Mailbox(H, capc, C, {"values": D}, {"values": FLOAT16}, _address)
    tensor = Tensor(addrs=np.array([b.ctypes.data for b in data], np.int64),
                    disk=np.ones(12, np.uint8), scales=np.zeros(0, np.int64), ppb=PPB,
                    code=FLOAT16, dim=D, out=mail.addrs[4])
    server = disk_serve.DiskServer()
    team = server.team
    team[disk_team.TEAM_ADVISE_ON], team[disk_team.TEAM_ADVISE_OFF] = -1, -1  # every copy slow
    for job, (on, off, want) in enumerate([(-1, -1, 1), (1 << 62, 1 << 62, 0)], start=1):
        team[disk_team.TEAM_ADVISE_ON], team[disk_team.TEAM_ADVISE_OFF] = on, off
        server.post(Request(job=job, mail=mail, capc=capc, length=len(pages) * P, pages=pages,
                            page_size=P, tensors=[tensor], epoch=job))  # all copied again
        sel = np.stack([np.arange(0, 2 * capc, 2), np.arange(1, 2 * capc, 2)]).astype(np.uint32)
        _device_exports(mail, job, sel, [capc, capc])
        assert _answered(mail, job)
        assert team[disk_team.TEAM_ADVISE] == want
        rows = mail.rows["values"].reshape(-1, D)[mail.src[: 2 * capc * C]]
        np.testing.assert_array_equal(rows[: capc * C].reshape(capc, C, D)[1],
                                      ref[0, 2 * C:3 * C])  # head 0's second chunk: chunk 2
    server.close()


class _Host:  # a store as disk_stage.check sees it: its mailbox
    pass


def _host_with(mail, monkeypatch):
    from tiered.step import disk_stage

    host, state = _Host(), disk_stage._LayerState()
    state.mail = mail
    monkeypatch.setitem(disk_stage._STATE, host, state)
    return host


def test_a_failing_worker_still_answers_and_the_host_raises(monkeypatch):
    from tiered.step import disk_stage

    server = disk_serve.DiskServer()
    monkeypatch.setattr(disk_serve, "SERVER", server)

    def broken(*args):
        raise OSError("the page file went away")

    monkeypatch.setattr(disk_serve, "_serve", broken)
    mail = Mailbox(H, 1, C, {"values": D}, {"values": FLOAT16}, _address)
    tensor = Tensor(addrs=np.zeros(1, np.int64), disk=np.ones(1, np.uint8),
                    scales=np.zeros(0, np.int64), ppb=PPB, code=FLOAT16, dim=D, out=mail.addrs[4])
    server.post(Request(job=1, mail=mail, capc=1, length=0, pages=np.zeros(1, np.int64),
                        page_size=P, tensors=[tensor]))
    _device_exports(mail, 1, np.zeros((H, 1), np.uint32), [0, 0])
    assert _answered(mail, 1)  # the device is not left waiting
    assert mail.ctl[FAULT] == 2

    with pytest.raises(RuntimeError, match="disk rows worker failed"):
        disk_stage.check(_host_with(mail, monkeypatch))
    server.close()


def test_a_request_of_no_tensor_is_refused_when_posted():
    mail = Mailbox(H, 1, C, {"values": D}, {"values": FLOAT16}, _address)
    with pytest.raises(ValueError, match="one or two tensors"):
        disk_serve.DiskServer().post(Request(job=1, mail=mail, capc=1, length=0,
                                             pages=np.zeros(1, np.int64), page_size=P,
                                             tensors=[]))


def test_the_device_gives_up_a_wait_nobody_answers(device_path, monkeypatch):
    """No worker answers: the exchange kernel stops waiting after WAIT_MS, the rows read as
    zeros, the mailbox is flagged and the host's next check raises (a hang otherwise)."""
    from tiered.runtime import uva
    from tiered.step import disk_stage

    monkeypatch.setattr(disk_stage, "WAIT_MS", 200)
    mail = Mailbox(H, 2, C, {"values": D}, {"values": FLOAT16}, uva.register)  # device-readable
    mail.list[:] = np.arange(mail.list.size)
    mail.src[:] = np.arange(mail.src.size)
    mail.ctl[disk_serve.ROWS_WORD] = mail.list.size
    mail.rows["values"][:] = 1.0
    addrs = mx.array(np.array(mail.addrs, np.uint64))
    idx = mx.array(np.array([[1, 2], [0, 3]], np.int32))
    count = mx.array(np.array([2, 1], np.int32))
    t0 = time.monotonic()
    out, done = disk_stage.launch(idx, count, addrs, mx.array([7], dtype=mx.int64),
                                  mx.array([0]), (("values", D, 0, "float16", 4, 5),), C)
    rows = out["values"]
    mx.eval(rows)
    assert time.monotonic() - t0 < 30
    assert mail.ctl[FAULT] == 1 and mail.ctl[EXPORTED] == 7
    assert mail.ctl[disk_serve.WAITED_NS] >= 200_000_000  # the device's wait, counted
    assert mx.abs(rows).max().item() == 0.0
    np.testing.assert_array_equal(mail.idx.reshape(H, 2), [[1, 2], [0, 3]])

    with pytest.raises(RuntimeError, match="wait for disk rows failed"):
        disk_stage.check(_host_with(mail, monkeypatch))


@numba.njit(nogil=True)
def _device_waits(ctl_addr, job, flags_addr, timeout_ns):
    """A device step's exchange, on a CPU thread without the GIL: says it is ready (flags[0]),
    waits for the go (flags[1]), exports ``job``, then waits for the answer; the ns waited."""
    store_release_i64(flags_addr, 1)
    while load_acquire_i64(flags_addr + 8) == 0:
        pass
    store_release_i64(ctl_addr + 8 * EXPORTED, job)
    t0 = monotonic_ns()
    while load_acquire_i64(ctl_addr + 8 * ANSWERED) < job:
        if monotonic_ns() - t0 > timeout_ns:
            break
    return monotonic_ns() - t0


def test_the_worker_answers_while_the_host_holds_the_gil():
    """The device waits inside a step for the worker; meanwhile the host may sit in a call that
    holds the GIL and waits for the device (one such call, read in MLX's CUDA allocator: freeing
    unified memory with cudaFree, which waits for the device's work). A worker that needs the
    GIL to take a request or to answer one would hang both until the device gives up (20 s):
    it answers without the GIL."""
    disk_serve.warm()
    server = disk_serve.DiskServer()
    mail, req, ref, blocks = _served(FLOAT16, seed=5)
    server.post(Request(job=1, **req))  # the worker started and idle
    _device_exports(mail, 1, np.array([[1, 2], [0, 3]], np.uint32), [2, 1])
    assert _answered(mail, 1)
    flags = np.zeros(2, np.int64)
    waited = []
    device = threading.Thread(target=lambda: waited.append(
        _device_waits(mail.ctl_addr, 2, flags.ctypes.data, 5_000_000_000)))
    device.start()
    while flags[0] == 0:
        time.sleep(0.001)
    hold_gil = ctypes.PyDLL(None).usleep  # a C call that keeps the GIL
    hold_gil.argtypes = [ctypes.c_uint]
    server.post(Request(job=2, **req))
    flags[1] = 1
    hold_gil(600_000)  # the host holds the GIL for 0.6 s while the device waits
    device.join()
    assert mail.ctl[ANSWERED] == 2
    assert waited[0] < 300_000_000, f"answered after {waited[0] / 1e6:.0f} ms"
    rows = mail.rows["values"].reshape(-1, D)
    np.testing.assert_array_equal(rows[:C].astype(np.float32), ref[0, C:2 * C])
    server.close()
