"""Processes side by side compile each PTX cache entry once (tiered.metal.ptx_claim): a process
holding an entry's lock makes others wait and use its entry; a holder that dies or stays past
the wait leaves the entry to be compiled anyway; a failed compile leaves the lock free."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time

import pytest

from tiered.metal import nvrtc, ptx_cache, ptx_claim

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _hold(entry, seconds=60.0):
    """Another process holding ``entry``'s lock (as one compiling it)."""
    lock = entry.with_name(entry.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(lock), str(seconds)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def _lock_is_free(entry) -> bool:
    fd = os.open(entry.with_name(entry.name + ".lock"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _fake_compile(calls):
    def compile_kernel(text, module, kernel, ordinal):
        calls.append(module)
        return b"// ptx of " + module.encode(), kernel + "_mangled"
    return compile_kernel


def test_a_held_entry_is_waited_for_and_the_holders_entry_used(tmp_path, monkeypatch):
    entry = tmp_path / "k" / "custom_kernel_x_1.ptx"
    holder = _hold(entry)
    calls, got = [], []
    monkeypatch.setattr(nvrtc, "compile_kernel", _fake_compile(calls))
    t = threading.Thread(target=lambda: got.append(
        ptx_cache._write("src", "custom_kernel_x_1", "x", entry, 0)))
    try:
        t.start()
        time.sleep(0.3)
        assert t.is_alive() and not got  # waiting for the holder
        entry.with_suffix(".txt").write_text("k\tm\n")  # the holder writes its entry, ends
        entry.write_bytes(b"// theirs")
    finally:
        holder.kill()
        holder.wait()
    t.join(10)
    assert got == [entry] and calls == []  # nothing compiled here
    assert entry.read_bytes() == b"// theirs" and _lock_is_free(entry)


def test_a_holder_that_dies_without_the_entry_leaves_it_to_compile(tmp_path, monkeypatch):
    entry = tmp_path / "custom_kernel_y_2.ptx"
    holder = _hold(entry, seconds=0.5)
    calls = []
    monkeypatch.setattr(nvrtc, "compile_kernel", _fake_compile(calls))
    t = time.monotonic()
    assert ptx_cache._write("src", "custom_kernel_y_2", "y", entry, 0) == entry
    assert time.monotonic() - t < 10
    holder.wait()
    assert calls == ["custom_kernel_y_2"]
    assert entry.read_bytes() == b"// ptx of custom_kernel_y_2"
    assert entry.with_suffix(".txt").read_text() == "mlx::core::cu::y\tmlx::core::cu::y_mangled\n"
    assert _lock_is_free(entry)


def test_a_holder_past_the_wait_is_not_waited_for(tmp_path, monkeypatch):
    entry = tmp_path / "custom_kernel_w_4.ptx"
    holder = _hold(entry)
    try:
        t = time.monotonic()
        with ptx_claim.held(entry, wait_s=0.3) as got:
            assert got is False
        assert 0.3 <= time.monotonic() - t < 5
        calls = []
        monkeypatch.setattr(nvrtc, "compile_kernel", _fake_compile(calls))
        monkeypatch.setattr(ptx_claim, "WAIT_S", 0.3)
        assert ptx_cache._write("src", "custom_kernel_w_4", "w", entry, 0) == entry
        assert calls == ["custom_kernel_w_4"]  # compiled anyway, beside the stuck holder
        assert not _lock_is_free(entry)  # still the holder's
    finally:
        holder.kill()
        holder.wait()


def test_a_failed_compile_leaves_the_lock_free(tmp_path, monkeypatch):
    entry = tmp_path / "custom_kernel_v_5.ptx"

    def fail(*a):
        raise RuntimeError("NVRTC said no")
    monkeypatch.setattr(nvrtc, "compile_kernel", fail)
    with pytest.raises(RuntimeError, match="NVRTC said no"):
        ptx_cache._write("src", "custom_kernel_v_5", "v", entry, 0)
    assert not entry.exists() and _lock_is_free(entry)
