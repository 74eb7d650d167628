"""The disk rows worker of the device path (cpu.disk_serve, tiered.step.disk_stage): requests
whose step never ran, rows made once and posted again, the copy team asking for pages ahead
after slow copies, and faults that reach the host as errors instead of a device waiting for
ever. The whole path, decoded against pages in RAM:
tests/test_device_decode.py::test_pages_on_the_disk_tier_decode_as_pages_in_ram."""

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
from tiered.cpu.disk_serve import (ANSWERED, EXPORTED, FAULT, FLOAT16, FLOAT32, Mailbox, Request,
                                   Tensor)

from disk_store import C, D, H, P, PPB, address, store


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
    data, _, pages, ref = store(np.random.default_rng(seed), code)
    mail = Mailbox(H, 2, C, {"values": D}, {"values": code}, address)
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
    data, _, pages, ref = store(np.random.default_rng(9), FLOAT16, blocks=12)
    capc = 12  # 24 chunks a head: 24 chunk-heads selected, all copied
    mail = Mailbox(H, capc, C, {"values": D}, {"values": FLOAT16}, address)
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
    mail = Mailbox(H, 1, C, {"values": D}, {"values": FLOAT16}, address)
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
    mail = Mailbox(H, 1, C, {"values": D}, {"values": FLOAT16}, address)
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


def test_the_workers_kernels_compile_ahead_in_a_process_of_their_own(monkeypatch):
    """warm_ahead starts one process that compiles the worker's kernels into the disk cache (and
    succeeds); warm() then waits for it and loads them."""
    monkeypatch.setattr(disk_serve, "_warm", [])
    monkeypatch.setattr(disk_serve, "_ahead", [])
    proc = disk_serve.warm_ahead()
    assert proc is not None and disk_serve.warm_ahead() is proc  # one process, not one a call
    disk_serve.warm()
    assert proc.poll() == 0 and disk_serve._warm
    assert disk_serve.warm_ahead() is None  # compiled here now
