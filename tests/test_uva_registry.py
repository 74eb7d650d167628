"""tiered.runtime.uva's registry of page-locked buffers, against a recording stand-in for the
CUDA driver: a registered buffer stays alive (its address cannot come back as another
buffer's while the registry holds it), and the disk rows' mailboxes reuse released buffers
instead of registering new memory for every cache."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from tiered.runtime import uva


class FakeDriver:
    """cuMemHostRegister / cuMemHostUnregister that record the ranges they were given."""

    def __init__(self):
        self.pinned: dict[int, int] = {}  # address -> bytes, as the driver would hold them
        self.calls: list = []

        def register(ptr, size, flags):
            self.calls.append(("register", ptr, size))
            for p, n in self.pinned.items():
                if p <= ptr < p + n:
                    return 712  # CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
            self.pinned[ptr] = size
            return 0

        def unregister(ptr):
            self.calls.append(("unregister", ptr))
            return 0 if self.pinned.pop(ptr, None) is not None else 713

        self.cuMemHostRegister_v2 = register
        self.cuMemHostUnregister = unregister


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(uva, "_driver", lambda: fake)
    monkeypatch.setattr(uva, "_current_context", lambda: None)
    monkeypatch.setattr(uva, "_registered", {})
    monkeypatch.setattr(uva, "_free", {})
    return fake


def test_a_registered_buffer_outlives_its_owner_and_its_address_is_not_reused(driver):
    buf = np.zeros(1 << 18, np.float16)  # 512 KiB: its own mapping, unmapped when freed
    ptr = uva.register(buf)
    assert uva.register(buf) == ptr and len(driver.calls) == 1  # idempotent
    del buf
    gc.collect()
    held = uva._registered[ptr][1]
    assert held.ctypes.data == ptr and held.nbytes == 1 << 19  # the memory is still there
    later = [np.zeros(1 << 18, np.float16) for _ in range(8)]
    for b in later:
        assert b.ctypes.data != ptr
        uva.register(b)
    # every new buffer was registered with the driver: none taken for the old one
    assert len([c for c in driver.calls if c[0] == "register"]) == 9
    assert all(driver.pinned.get(b.ctypes.data) == b.nbytes for b in later)


def test_unregister_lets_the_buffer_go_and_a_view_past_the_end_is_refused(driver):
    buf = np.zeros(1024, np.int32)
    ptr = uva.register(buf)
    view = buf[:256]
    assert uva.register(view) == ptr  # inside the registered buffer: nothing more to do
    wider = np.lib.stride_tricks.as_strided(buf, shape=(2048,), strides=(4,))
    with pytest.raises(uva.UVAError, match="past the registered buffer's end"):
        uva.register(wider)
    uva.unregister(buf)
    assert ptr not in uva._registered and ptr not in driver.pinned
    assert driver.calls[-1] == ("unregister", ptr)


def test_released_buffers_are_reused_zeroed_and_stay_registered(driver):
    a = uva.pinned_zeros(100, np.int32)
    a[:] = 7
    uva.release([a])
    b = uva.pinned_zeros(100, np.int32)
    assert b is a and not b.any()
    c = uva.pinned_zeros(100, np.float32)  # another dtype: a buffer of its own
    assert c is not a
    assert [x[0] for x in driver.calls] == ["register", "register"]
    assert a.ctypes.data in driver.pinned


def test_a_dropped_mailbox_gives_its_buffers_to_the_next_one(driver):
    from tiered.cpu.disk_serve import FLOAT16, Mailbox

    def mailbox():
        return Mailbox(8, 32, 8, {"values": 128}, {"values": FLOAT16}, uva.register,
                       (uva.pinned_zeros, uva.release))

    first = mailbox()
    addrs = list(first.addrs)
    first.ctl[:] = 5  # the old owner's words
    del first
    gc.collect()
    second = mailbox()
    # the same buffers, the words zeroed; the two lists (place, slot row) have one size and
    # dtype, so the pool may hand them back the other way round
    same = [0, 1, 2, *range(4, len(addrs) - 1)]
    assert [second.addrs[i] for i in same] == [addrs[i] for i in same]
    assert {second.addrs[3], second.addrs[-1]} == {addrs[3], addrs[-1]}
    assert not second.ctl.any()
    registered = [c for c in driver.calls if c[0] == "register"]
    assert len(registered) == 6  # ctl, idx, count, list, rows, src
    third = mailbox()  # the second is alive: new buffers
    assert set(third.addrs).isdisjoint(addrs)
