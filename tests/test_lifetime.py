"""A cache's resources live exactly as long as the cache, and nothing is left behind.

- ``close()`` gives back every page file at once (descriptors and mappings, so the disk space
  too), even while the caller still holds the cache;
- after ``close()`` (or none) + ``del`` + ``gc.collect()``, nothing of the cache stays: not
  for the first cache that decodes in a process either (its first decode step freezes the
  collector, tiered.runtime.steady_gc: a reference cycle frozen then was never collected);
- the disk tier's directory probe leaves no file behind, and a full disk is reported as a
  full disk (its free bytes), not as "not writable".

The first-cache cases run in a fresh child process each (tests/isolated.py).
"""

from __future__ import annotations

import errno
import os

import pytest

from isolated import WARM_S, Child


def _fds(directory: str) -> set:
    """Descriptors of files in ``directory`` (the disk tier's, unlinked ones included; not
    those a GPU runtime opens at the first step)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(directory):
                out.add(fd)
        except OSError:
            pass
    return out


def _held_inodes(inodes: set) -> dict:
    """Which of these inodes this process still holds: by a descriptor, by a mapping."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.stat(f"/proc/self/fd/{fd}").st_ino in inodes:
                fds.add(fd)
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        maps = [line for line in f if len(line.split()) >= 5 and int(line.split()[4]) in inodes]
    return {"fds": sorted(fds), "maps": len(maps)}


def first_cache(disk_dir: str, close: bool) -> dict:
    """Run in a fresh process: the first cache that decodes, then its end."""
    os.environ.pop("TIERED_GC_FREEZE", None)
    import gc
    import weakref

    import mlx.core as mx
    import numpy as np
    from conftest import make_small_model

    from tiered import TieredCache
    from tiered.prefill import prefill

    model = make_small_model("llama-gqa-d64", layers=3, seed=1)
    ids = np.random.default_rng(1).integers(10, 49000, 500).tolist()
    before = _fds(disk_dir)
    cache = TieredCache.for_model(model, gpu_budget=0.25, page_size=64, recent=16,
                                  prefill_window=256, host_budget="150KB", disk_dir=disk_dir)
    prefill(model, cache, ids, chunk=250)
    for t in range(3):
        mx.eval(model(mx.array([[5 + t]]), cache=cache))
    files = [f for c in cache for t in c.host.tensors for f in (t.disk, t.scale_disk)
             if f is not None]
    inodes = {os.fstat(f.fd).st_ino for f in files}
    got = {"frozen": gc.get_freeze_count(), "files": len(files),
           "blocks": sum(os.fstat(f.fd).st_blocks for f in files),
           "live": _held_inodes(inodes)}
    refs = [weakref.ref(x) for x in [cache[0], cache[0].compressed, cache[0].host,
                                     cache[0].host.values, *files]]
    if close:
        cache.close()
        got["closed"] = _held_inodes(inodes)
        got["fds_closed"] = sorted(_fds(disk_dir) - before)
    del cache, files
    gc.collect()
    got["alive"] = [type(r()).__name__ for r in refs if r() is not None]
    got["gone"] = _held_inodes(inodes)
    got["fds_gone"] = sorted(_fds(disk_dir) - before)
    return got


@pytest.mark.parametrize("close", [True, False], ids=["close-del", "del"])
def test_the_first_cache_is_freed_and_close_frees_its_pages_at_once(tmp_path, close):
    child = Child()  # a fresh process: the cache is its first to decode
    try:
        got = child.call(WARM_S, first_cache, str(tmp_path), close)
    finally:
        child.stop()
    assert got["frozen"] > 0, "the collector was not frozen: the case tests nothing"
    assert got["files"] >= 3 and got["blocks"] > 0
    # each file: its descriptor, and the duplicate Python's mmap keeps
    assert len(got["live"]["fds"]) >= got["files"] and got["live"]["maps"] > 0
    if close:  # the cache is still referenced here
        assert got["closed"] == {"fds": [], "maps": 0}, got["closed"]
        assert got["fds_closed"] == [], got["fds_closed"]
    assert got["alive"] == [], got["alive"]
    assert got["gone"] == {"fds": [], "maps": 0}, got["gone"]
    assert got["fds_gone"] == [], got["fds_gone"]


# ---- the disk tier's directory probe -------------------------------------------------------
def _no_tmpfile(monkeypatch):
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)  # the named probe, as on macOS


@pytest.mark.parametrize("named", [False, True], ids=["O_TMPFILE", "named"])
def test_the_directory_probe_leaves_nothing(tmp_path, monkeypatch, named):
    from tiered.cpu.disk import check_directory

    if named:
        _no_tmpfile(monkeypatch)
    assert check_directory(str(tmp_path / "d")) == str(tmp_path / "d")
    assert os.listdir(tmp_path / "d") == []


@pytest.mark.parametrize("named", [False, True], ids=["O_TMPFILE", "named"])
@pytest.mark.parametrize("fails", ["write", "open"])
def test_a_full_disk_is_reported_as_full_and_the_probe_is_gone(tmp_path, monkeypatch, named,
                                                              fails):
    from tiered.cpu import disk

    if named:
        _no_tmpfile(monkeypatch)
    real_open, real_write = os.open, os.write
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def write(fd, data):
        raise full

    def open_(path, flags, *args, **kw):
        if str(path).startswith(str(tmp_path)) and flags & os.O_WRONLY:
            raise full
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(disk.os, "write" if fails == "write" else "open",
                        write if fails == "write" else open_)
    with pytest.raises(disk.DiskTierError, match=r"is full \(\d+ bytes free") as e:
        disk.check_directory(str(tmp_path))
    assert e.value.errno == errno.ENOSPC and str(tmp_path) in str(e.value)
    monkeypatch.setattr(disk.os, "write", real_write)
    assert os.listdir(tmp_path) == []


def test_an_unwritable_directory_is_still_not_writable(tmp_path, monkeypatch):
    from tiered.cpu import disk

    def write(fd, data):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(disk.os, "write", write)
    with pytest.raises(disk.DiskTierError, match="not writable"):
        disk.check_directory(str(tmp_path))
    assert os.listdir(tmp_path) == []
