"""Processes side by side compile each PTX cache entry once (tiered.metal.ptx_claim): a live
claim makes others wait for the entry; a dead or failed claimant's entry is compiled anyway."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from tiered.metal import nvrtc, ptx_cache, ptx_claim


@pytest.fixture
def other_process():
    """A live process that is not this one (its pid stands for another compiler)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


def _claim_as(entry, pid: int):
    path = entry.with_name(entry.name + ".claim")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(pid))
    return path


def _fake_compile(calls):
    def compile_kernel(text, module, kernel, ordinal):
        calls.append(module)
        return b"// ptx of " + module.encode(), kernel + "_mangled"
    return compile_kernel


def test_a_live_claim_is_waited_for_and_its_entry_used(tmp_path, other_process, monkeypatch):
    entry = tmp_path / "k" / "custom_kernel_x_1.ptx"
    claim = _claim_as(entry, other_process.pid)
    assert ptx_claim.claim(entry) is None  # held by a live process
    calls = []
    monkeypatch.setattr(nvrtc, "compile_kernel", _fake_compile(calls))
    got = []
    t = threading.Thread(target=lambda: got.append(
        ptx_cache._write("src", "custom_kernel_x_1", "x", entry, 0)))
    t.start()
    time.sleep(0.2)
    assert t.is_alive() and not got  # waiting for the other process's entry
    entry.with_suffix(".txt").write_text("k\tm\n")
    entry.write_bytes(b"// theirs")
    t.join(10)
    assert got == [entry] and calls == []  # nothing compiled here
    assert entry.read_bytes() == b"// theirs" and claim.exists()  # their claim is theirs


def test_a_dead_claimant_is_taken_over_and_the_claim_released(tmp_path, monkeypatch):
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # a pid no process has now
    entry = tmp_path / "custom_kernel_y_2.ptx"
    claim = _claim_as(entry, p.pid)
    calls = []
    monkeypatch.setattr(nvrtc, "compile_kernel", _fake_compile(calls))
    assert ptx_cache._write("src", "custom_kernel_y_2", "y", entry, 0) == entry
    assert calls == ["custom_kernel_y_2"]
    assert entry.read_bytes() == b"// ptx of custom_kernel_y_2"
    assert entry.with_suffix(".txt").read_text() == "mlx::core::cu::y\tmlx::core::cu::y_mangled\n"
    assert not claim.exists()


def test_a_claimant_that_dies_without_the_entry_ends_the_wait(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    entry = tmp_path / "custom_kernel_z_3.ptx"
    _claim_as(entry, p.pid)
    t = time.monotonic()
    assert ptx_claim.wait(entry, timeout=30) is False
    assert time.monotonic() - t < 10
    p.wait()
    held = ptx_claim.claim(entry)  # the caller then compiles it itself
    assert held is not None and held.read_text() == str(os.getpid())
    ptx_claim.release(held)
    assert not held.exists()


def test_an_old_claim_is_stale(tmp_path, other_process, monkeypatch):
    entry = tmp_path / "custom_kernel_w_4.ptx"
    claim = _claim_as(entry, other_process.pid)
    old = time.time() - ptx_claim.STALE_S - 5
    os.utime(claim, (old, old))
    held = ptx_claim.claim(entry)
    assert held == claim and claim.read_text() == str(os.getpid())
    ptx_claim.release(held)


def test_a_failed_compile_releases_its_claim(tmp_path, monkeypatch):
    entry = tmp_path / "custom_kernel_v_5.ptx"

    def fail(*a):
        raise RuntimeError("NVRTC said no")
    monkeypatch.setattr(nvrtc, "compile_kernel", fail)
    with pytest.raises(RuntimeError, match="NVRTC said no"):
        ptx_cache._write("src", "custom_kernel_v_5", "v", entry, 0)
    assert not entry.exists() and not entry.with_name(entry.name + ".claim").exists()
