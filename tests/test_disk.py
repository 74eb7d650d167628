"""Disk tier: page files with checksums, spill under a host budget, errors before loss."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tiered.cpu import HostStore
from tiered.cpu import kernels as K
from tiered.cpu.disk import DiskTierError, PageFile
from tiered.cpu.memory_budget import HostBudget


def _data(rng, L, H=2, d=8):
    return rng.standard_normal((1, H, L, d)).astype(np.float32)


def _store(tmp_path, budget_blocks, dtype="float16", **kw):
    probe = HostStore(2, 8, page_size=16, dtype=dtype, pages_per_block=2)
    block = probe.values.block_bytes
    budget = HostBudget(budget_blocks * block)
    return HostStore(2, 8, page_size=16, dtype=dtype, pages_per_block=2, budget=budget,
                     disk_dir=str(tmp_path), **kw), budget


@pytest.mark.parametrize("dtype", ["float16", "float32", "int8"])
def test_spill_round_trip_with_checksums(tmp_path, dtype):
    rng = np.random.default_rng(0)
    store, budget = _store(tmp_path, 3, dtype)
    v, k = _data(rng, 300), _data(rng, 300)
    store.append(v, k)
    assert budget.used <= budget.limit  # RAM never above the budget
    assert store.disk_bytes > 0 and store.values.disk_index.count(-1) >= 1
    tol = 1e-3 if dtype == "float16" else (0 if dtype == "float32" else 0.05)
    np.testing.assert_allclose(store.read("values"), v[0], atol=tol, rtol=tol)
    np.testing.assert_allclose(store.read("keys"), k[0], atol=tol, rtol=tol)
    store.verify_tokens(0, np.arange(300))  # every disk page's CRC32 holds
    assert not os.listdir(tmp_path), "page files are anonymous: nothing in the directory"
    held = [os.readlink(f"/proc/self/fd/{t.disk.fd}") for t in store.tensors]
    assert all(p.startswith(str(tmp_path)) and p.endswith("(deleted)") for p in held), held
    store.close()


def test_gather_kernel_reads_spilled_blocks(tmp_path):
    rng = np.random.default_rng(1)
    store, _ = _store(tmp_path, 1)
    v, k = _data(rng, 200), _data(rng, 200)
    store.append(v, k)
    assert any(i >= 0 for i in store.values.disk_index)
    rep, H = 2, 2
    q = rng.standard_normal((H * rep, 8)).astype(np.float32)
    idx = np.stack([np.sort(rng.choice(200, 60, replace=False)) for _ in range(H)]).astype(np.int32)
    count = np.full(H, 60, np.int32)
    o = np.zeros((H * rep, 8), np.float32)
    lse = np.zeros(H * rep, np.float32)
    K.gather_partial(q, None, idx, count, rep, *K.host_store_args(store), True, o, lse)
    for qh in range(H * rep):
        h = qh // rep
        keys = store.gather("keys", 0, h, idx[h])
        vals = store.gather("values", 0, h, idx[h])
        w = keys.astype(np.float64) @ q[qh]
        p = np.exp(w - w.max())
        np.testing.assert_allclose(o[qh], (p / p.sum()) @ vals, rtol=1e-4, atol=1e-5)
    store.close()


@pytest.mark.parametrize("dtype", ["int8", "float16"])
def test_gather_rows_reads_spilled_blocks(tmp_path, dtype):
    """gather_rows (the block-wise prefill's retrieval read) of pages in the page file: every
    head's rows, int8 ones with their scales from the page file too, as the per-head reads
    give them; -1 as zeros."""
    rng = np.random.default_rng(4)
    store, _ = _store(tmp_path, 1, dtype)
    store.append(_data(rng, 200), _data(rng, 200))
    assert sum(i >= 0 for i in store.values.disk_index) >= 2
    tokens = np.stack([rng.choice(200, 70, replace=False) for _ in range(2)]).astype(np.int32)
    tokens[1, -5:] = -1
    for kind in ("keys", "values"):
        rows = store.gather_rows(kind, 0, tokens)
        for h in range(2):
            keep = tokens[h] >= 0
            np.testing.assert_array_equal(rows[h, keep].astype(np.float32),
                                          store.gather(kind, 0, h, tokens[h, keep]))
            assert not rows[h, ~keep].any()
    store.close()


def test_corrupt_page_is_detected(tmp_path):
    rng = np.random.default_rng(2)
    store, _ = _store(tmp_path, 1)
    store.append(_data(rng, 200), _data(rng, 200))
    t = store.values
    blk = t.disk_index.index(0)
    t.verify(range(blk * 2, blk * 2 + 2))  # intact
    fd = os.open(f"/proc/self/fd/{t.disk.fd}", os.O_WRONLY)
    os.pwrite(fd, b"\xff\x7f\x00\x01", 100)  # flip bytes inside the first page on disk
    os.close(fd)
    with pytest.raises(ValueError, match="Corrupt page"):
        store.verify_tokens(0, np.arange(200))
    store.close()


def test_unwritable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    store = HostStore(2, 8, page_size=16, pages_per_block=2, budget=HostBudget(1),
                      disk_dir=str(blocker / "pages"))
    with pytest.raises(DiskTierError, match="not writable"):
        store.append(np.zeros((1, 2, 5, 8), np.float32), np.zeros((1, 2, 5, 8), np.float32))


def test_full_disk_loses_nothing(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    store, budget = _store(tmp_path, 2)
    v, k = _data(rng, 64), _data(rng, 64)
    store.append(v, k)  # exactly the two RAM blocks (2 pages x 16 tokens each)
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10))
    with pytest.raises(DiskTierError, match="disk tier full"):
        store.append(_data(rng, 1), _data(rng, 1))
    monkeypatch.undo()
    # What was there is intact and still readable from RAM.
    np.testing.assert_allclose(store.read("values", 0, 0, 64), v[0], atol=1e-3)
    np.testing.assert_allclose(store.read("keys", 0, 0, 64), k[0], atol=1e-3)
    store.close()


def test_disk_budget_is_enforced(tmp_path):
    rng = np.random.default_rng(4)
    store, _ = _store(tmp_path, 1, disk_budget=HostBudget(1))
    with pytest.raises(DiskTierError, match="disk tier budget full"):
        store.append(_data(rng, 200), _data(rng, 200))
    store.close()


def test_disk_blocks_travel_only_through_a_saved_pages_folder(tmp_path):
    """A store's state names its page files by bare name: restoring it needs the folder a
    save copied them into (PAGES_SOURCE), and the restored store reads a copy of its own."""
    from tiered.cpu.disk import PAGES_SOURCE

    rng = np.random.default_rng(5)
    store, _ = _store(tmp_path / "live", 1)
    v = _data(rng, 150)
    store.append(v, _data(rng, 150))
    st = store.state()
    with pytest.raises(ValueError, match="TieredCacheList.load"):
        HostStore.from_state(st)
    saved = tmp_path / "saved"
    saved.mkdir()
    for t in store.tensors:
        t.disk.copy_to(str(saved / t.disk.name))
    token = PAGES_SOURCE.set(str(saved))
    try:
        clone = HostStore.from_state(st, disk_dir=str(tmp_path / "work"))
    finally:
        PAGES_SOURCE.reset(token)
    before = {f: (saved / f).read_bytes() for f in os.listdir(saved)}
    np.testing.assert_array_equal(clone.read("values"), store.read("values"))
    store.close()
    clone.append(_data(rng, 40), _data(rng, 40))  # the clone grows on its own files
    np.testing.assert_allclose(clone.read("values", 0, 0, 150), v[0], atol=1e-3)
    assert {f: (saved / f).read_bytes() for f in os.listdir(saved)} == before
    clone.close()


def test_page_files_are_anonymous_and_stale_ones_are_swept(tmp_path):
    """Live page files have no name in the directory (nothing is left if the process dies);
    a named page file of a dead process (tiered 0.1, or a crash between create and unlink)
    goes when the next page file is made there; a live process's file stays."""
    from tiered.cpu import disk

    dead = tmp_path / "tiered-999999999-0123456789ab-layer0-values.pages"
    alive = tmp_path / f"tiered-{os.getppid()}-0123456789ab-layer0-values.pages"
    other = tmp_path / "notes.pages"
    for f in (dead, alive, other):
        f.write_bytes(b"x")
    disk._swept.discard(str(tmp_path))
    pf = PageFile(str(tmp_path), "t", (2, 2, 16, 8), np.float16)
    pf.append(np.ones((2, 2, 16, 8), np.float16))
    assert sorted(os.listdir(tmp_path)) == sorted([alive.name, other.name])
    pf.close()


@pytest.mark.skipif(not os.uname().sysname == "Linux", reason="MADV_POPULATE_READ is Linux's")
def test_populated_blocks_read_without_page_faults(tmp_path):
    """populate() maps the blocks in: reading them through the mapping then takes (almost) no
    minor faults, where the fresh mapping took one per few pages; blocks appended later are
    populated by the next call, and release() makes it start over."""
    import resource

    shape = (4, 2, 64, 64)  # 128 KiB blocks of float32, each its own mapping
    pf = PageFile(str(tmp_path), "t", shape, np.float32)
    rng = np.random.default_rng(0)
    blocks = [rng.standard_normal(shape).astype(np.float32) for _ in range(17)]
    for b in blocks[:16]:
        pf.append(b)

    def faults_reading(indices):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        total = sum(float(pf.views[i][:, :, :, 0].sum()) for i in indices)  # one word a row
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0, total

    cold, _ = faults_reading(range(8))
    assert cold >= 8  # a fresh mapping faults at least once
    if pf.populate() == 0:
        pytest.skip("this kernel has no MADV_POPULATE_READ")
    pf.append(blocks[16])
    assert pf.populate() == 1 and pf.populate() == 0
    warm, total = faults_reading(range(8, 17))
    assert warm <= 2
    np.testing.assert_allclose(total, sum(float(b[:, :, :, 0].sum()) for b in blocks[8:]),
                               rtol=1e-5)
    pf.release()
    assert pf.populate() == 17


def test_a_page_file_that_shrinks_is_an_error_not_sigbus(tmp_path):
    pf = PageFile(str(tmp_path), "t", (2, 2, 16, 8), np.float16)
    pf.append(np.ones((2, 2, 16, 8), np.float16))
    pf.check_size()
    os.truncate(f"/proc/self/fd/{pf.fd}", 0)
    with pytest.raises(DiskTierError, match="shrank"):
        pf.check_size()
    pf.close()


def test_page_file_rejects_a_truncated_saved_file(tmp_path):
    from tiered.cpu.disk import PAGES_SOURCE

    pf = PageFile(str(tmp_path), "t", (2, 2, 16, 8), np.float16)
    pf.append(np.ones((2, 2, 16, 8), np.float16))
    saved = tmp_path / "saved"
    saved.mkdir()
    pf.copy_to(str(saved / pf.name))
    st = pf.state()
    token = PAGES_SOURCE.set(str(saved))
    try:
        good = PageFile.adopt(st, str(tmp_path))
        assert np.array_equal(good.views[0], pf.views[0])
        st["blocks"] = 5
        with pytest.raises(ValueError, match="Corrupt page file"):
            PageFile.adopt(st, str(tmp_path))
        for bad in ("../x.pages", "/etc/passwd", ".."):
            with pytest.raises(ValueError, match="bare file name"):
                PageFile.adopt(dict(st, name=bad), str(tmp_path))
    finally:
        PAGES_SOURCE.reset(token)
    pf.close()
