"""The disk rows' copy (cpu.disk_copy, cpu.disk_team): the rows it stages against the store's own
layout, on Numba's threads, alone or on a copy team, and the chunk cache. The worker that
answers the device: tests/test_disk_serve.py. The whole path, decoded against pages
in RAM: tests/test_device_decode.py::test_pages_on_the_disk_tier_decode_as_pages_in_ram."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tiered.cpu import disk_serve, disk_team
from tiered.cpu.disk_serve import FLOAT16, FLOAT32, INT8, Mailbox, Request, Tensor

from disk_store import C, D, H, P, PPB, address, store


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
    data, scales, pages, ref = store(rng, code)
    disk = np.array([1, 0, 1], np.uint8)  # blocks 0 and 2 in the page file
    capc = 3
    mail = Mailbox(H, capc, C, {"values": D}, {"values": code}, address)
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
    data, _, pages, ref = store(rng, FLOAT32, blocks=6)
    capc, length = 3, len(pages) * P
    nc = length // C
    mail = Mailbox(H, capc, C, {"values": D}, {"values": FLOAT32}, address, cache=cache)
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
    stores = {n: store(rng, FLOAT16) for n in ("keys", "values")}
    pages = stores["values"][2]
    stores["keys"] = store(np.random.default_rng(5), FLOAT16)[:2] + (pages,)
    ref_k = np.zeros_like(stores["values"][3])
    for t in range(len(pages) * P):  # the keys' rows under the values' page table
        phys = pages[t // P]
        ref_k[:, t] = stores["keys"][0][phys // PPB][phys % PPB, :, t % P]
    mail = Mailbox(H, 2, C, {"keys": D, "values": D}, {"keys": FLOAT16, "values": FLOAT16},
                   address)
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
