"""The disk tier under a cache: host and memory budgets, decode reads, and the blocks the
device writes into (pages allocated ahead, fences, a partly filled page on disk)."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from test_disk import _data, _store  # the small host store both files build


def test_cache_with_host_budget_spills_and_stays_correct(tmp_path):
    """A TieredCache under a small host budget puts pages on disk; with tau = 1 and exact
    rescoring the output still equals the full cache's; RAM stays within the budget."""
    import mlx.core as mx
    from conftest import make_small_model
    from mlx_lm.models.cache import KVCache

    import tiered

    model = make_small_model("llama-gqa-d64", layers=2, seed=2)
    prompt = mx.array(np.random.default_rng(6).integers(10, 49000, 600))[None]

    def run(cache):
        logits = model(prompt, cache=cache)[:, -1]
        out = []
        for _ in range(4):
            y = mx.argmax(logits, axis=-1)[:, None]
            logits = model(y, cache=cache)[:, -1]
            out.append(logits)
        return mx.concatenate(out)

    ref = run([KVCache(), KVCache()])
    cache = tiered.TieredCache.for_model(
        model, gpu_budget=0.25, tau=1.0, max_selected=1.0, host_dtype="float32", page_size=16,
        recent=16, host_budget="100KB", disk_dir=str(tmp_path), verify_pages=True)
    got = run(cache)
    rep = tiered.report_dict(cache)
    assert rep["bytes"]["disk"] > 0
    assert rep["bytes"]["host"] <= 100_000
    assert mx.abs(ref - got).max().item() < 2e-4
    cache.close()
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".pages")]


def test_memory_budget_caps_the_accelerator_tier_and_host_ram_together(tmp_path):
    """memory_budget: host pages get what the accelerator tier leaves of it, the rest goes to
    disk; accelerator and host RAM together stay within it, and the output is the one of the
    same cache without it (the disk tier stores pages exactly). report() says so."""
    import mlx.core as mx
    from conftest import make_small_model

    import tiered

    model = make_small_model("llama-gqa-d64", layers=2, seed=2)
    prompt = mx.array(np.random.default_rng(7).integers(10, 49000, 900))[None]
    # one decode path for both (the device path refuses pages on disk: a GPU would compare
    # it with the CPU-gather path, whose selection differs)
    opts = dict(gpu_budget=0.25, host_dtype="float32", page_size=16, recent=16,
                disk_dir=str(tmp_path), device_gather="off")

    def run(cache):
        out = [model(prompt, cache=cache)[:, -1]]
        for _ in range(4):
            out.append(model(mx.argmax(out[-1], axis=-1)[:, None], cache=cache)[:, -1])
        return mx.concatenate(out)

    free = tiered.TieredCache.for_model(model, **opts)
    ref = run(free)
    rep = tiered.report_dict(free)
    budget = rep["bytes"]["accelerator"] + rep["bytes"]["host"] // 3
    free.close()
    cache = tiered.TieredCache.for_model(model, memory_budget=budget, **opts)
    got = run(cache)
    rep = tiered.report_dict(cache)
    b = rep["bytes"]
    assert b["disk"] > 0 and b["accelerator"] + b["host"] <= budget
    assert rep["memory_budget"] == {"bytes": budget, "held": b["accelerator"] + b["host"],
                                    "within": True}
    assert "memory budget" in tiered.report(cache) and "within it" in tiered.report(cache)
    assert mx.abs(ref - got).max().item() == 0
    # the decode steps' reads left none of the page files' pages in the process's RSS
    assert _mapped_kib(tmp_path) == 0
    cache.close()
    with pytest.raises(ValueError, match="not both"):
        tiered.TieredCache.for_model(model, memory_budget="1MB", host_budget="1MB")


def _mapped_kib(folder) -> int:
    """KiB of files under ``folder`` mapped into this process's RSS (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # a mapping's first line
                inside = len(head) >= 6 and head[5].startswith(str(folder))
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/self/smaps")
def test_under_memory_budget_decode_reads_leave_no_page_file_pages_mapped(tmp_path, monkeypatch):
    """memory_budget bounds the process's RSS: a decode step's reads of the disk tier map the
    page file's pages into the process, and each layer-step lets them go (they stay in the
    page cache). Without the release they stay mapped (checked: the test can fail)."""
    import mlx.core as mx
    from conftest import make_small_model

    import tiered
    from tiered.cpu.page_reads import PageReads

    model = make_small_model("llama-gqa-d64", layers=2, seed=2)
    prompt = mx.array(np.random.default_rng(7).integers(10, 49000, 900))[None]
    opts = dict(gpu_budget=0.25, host_dtype="float32", page_size=16, recent=16,
                device_gather="off", tau=1.0, max_selected=1.0)

    def decode(folder) -> int:
        cache = tiered.TieredCache.for_model(model, memory_budget="120KB",
                                             disk_dir=str(folder), **opts)
        y = model(prompt, cache=cache)[:, -1]
        for _ in range(3):
            y = model(mx.argmax(y, axis=-1)[:, None], cache=cache)[:, -1]
            mx.eval(y)
        assert tiered.report_dict(cache)["bytes"]["disk"] > 0
        kib = _mapped_kib(folder)
        cache.close()
        return kib

    assert decode(tmp_path / "a") == 0
    monkeypatch.setattr(PageReads, "release_if_bounded", lambda self: None)
    assert decode(tmp_path / "b") > 0


def test_a_block_spills_only_after_the_queued_device_writes(tmp_path):
    """Device kernels write reserved slots by address (tiered.step.device_decode); a block moving
    to the disk tier is copied by the CPU, so the store waits for them first (and only then)."""
    store, budget = _store(tmp_path, 4)
    store.reserve(32)  # a block each for keys and values: room for two more
    fence = mx.arange(3) + 1  # a queued device op's output (lazy)
    store.fence = fence
    store.reserve(32)  # the next two blocks fit the budget: nothing waits
    assert store.fence is fence and store.disk_bytes == 0
    store.reserve(1)  # a block spills now: the queued work ran before
    assert store.fence is None and store.disk_bytes > 0
    assert budget.used <= budget.limit


def test_the_fence_is_one_element_of_the_kernels_output(tmp_path):
    """device_op keeps a (1,) view of whatever the kernel wrote: the compiled step and append
    take the fence as an input, and every new shape was a trace of their own (a refresh's
    gather of a new size each time); evaluating it still runs that kernel."""
    store, _ = _store(tmp_path, 4)
    done = mx.ones((1,), mx.int32)
    store.device_op(done)
    assert store.fence is done  # already one element: kept as it is
    for rows in (9764, 9771, 2048):
        ok = mx.arange(8 * rows).reshape(8, rows) >= 0  # a gather's (H, T) output (lazy)
        store.device_op(ok)
        assert store.fence.shape == (1,) and store.fence.dtype == mx.bool_
    store.settle()
    assert store.fence is None


@pytest.mark.parametrize("budget_blocks", [3, 100])
def test_blocks_allocated_ahead_keep_the_budget_and_the_data(tmp_path, monkeypatch,
                                                             budget_blocks):
    """With blocks allocated ahead (the CUDA default, forced here): each tensor holds at most
    one spare block, reserved in the budget; RAM stays within the budget, a tight budget
    still spills, the rows read back, and closing gives every byte back."""
    from tiered.cpu import host_tensor

    monkeypatch.setattr(host_tensor, "AHEAD", True)
    rng = np.random.default_rng(4)
    store, budget = _store(tmp_path, budget_blocks)
    block = store.values.block_bytes
    v, k = _data(rng, 300), _data(rng, 300)
    for i in range(0, 300, 50):
        store.append(v[:, :, i : i + 50], k[:, :, i : i + 50])
        assert budget.used <= budget.limit
        spares = sum(t._spare is not None for t in store.tensors)
        assert budget.used == sum(t.nbytes for t in store.tensors) + spares * block
    if budget_blocks == 100:
        assert spares == 2 and store.disk_bytes == 0
    else:
        assert store.disk_bytes > 0
    np.testing.assert_allclose(store.read("values"), v[0], atol=1e-3, rtol=1e-3)
    np.testing.assert_allclose(store.read("keys"), k[0], atol=1e-3, rtol=1e-3)
    store.close()
    assert budget.used == 0


def test_device_writes_get_pages_only_in_ram_blocks(tmp_path):
    """Where the device path writes pages by address (HostStore.device_writes), every page
    handed out lies in a RAM block: the disk tier's mapping is read-only. A tensor with no RAM
    block of its own to move takes one past a spent budget (charged; the next growth spills), a
    freed page on disk is passed over, and a block moving to disk changes the tensor's
    ``moves`` (the device tables upload its addresses again)."""
    store, budget = _store(tmp_path, 2)  # one block for keys, one for values
    store.device_writes = True
    moves = store.values.moves
    for _ in range(5):  # 5 blocks each (32 tokens a block)
        store.reserve(32)
        for t in store.tensors:
            last = store.logical_pages(0)[-1] // t.pages_per_block
            assert t.disk_index[last] < 0, "the newest page must be in RAM"
    assert store.disk_bytes > 0 and store.values.moves > moves
    assert budget.used <= budget.limit

    # a tensor whose blocks all start on disk (the budget spent elsewhere): the next one is
    # taken in RAM past the budget, then the growth after it spills that one
    tiny, tb = _store(tmp_path, 0)
    tiny.reserve(32)
    assert all(t.disk_index == [0] for t in tiny.tensors)  # no device writer: on disk
    tiny.device_writes = True
    tiny.reserve(32)
    assert [t.disk_index[-1] for t in tiny.tensors] == [-1, -1]
    assert tb.used == 2 * tiny.values.block_bytes > tb.limit
    tiny.reserve(32)
    assert [t.disk_index[1:] for t in tiny.tensors] == [[1, -1], [1, -1]]
    assert tb.used == 2 * tiny.values.block_bytes  # not growing past the one block each

    # a freed page on disk is passed over; a freed page in RAM is reused
    store.truncate(0)
    on_disk = [p for p in store._free if store._on_disk(p)]
    in_ram = [p for p in store._free if not store._on_disk(p)]
    assert on_disk and in_ram
    store.reserve(16)
    assert store.logical_pages(0)[0] in in_ram
    assert set(on_disk) <= set(store._free)
    store.close()
    tiny.close()


def test_the_device_takes_over_a_partly_filled_page_on_disk(tmp_path):
    """Pages the CPU filled before the device path took over lie on disk; the device writes
    the next tokens into RAM only: the partly filled last page moves to a new RAM page with its
    rows (the old one freed), and the rest of a block that started on disk is passed over."""
    rng = np.random.default_rng(6)
    store, _ = _store(tmp_path, 0)  # every block starts on disk
    v, k = _data(rng, 40), _data(rng, 40)
    store.append(v, k)  # pages 0, 1 (full) and 2 (8 of 16 tokens), in disk blocks of 2 pages
    assert list(store.logical_pages(0)) == [0, 1, 2] and store._on_disk(2)
    store.device_writes = True
    store.reserve(4)
    assert store.logical_pages(0)[-1] == 4 and not store._on_disk(4)  # page 3: on disk
    assert set(store._free) == {2, 3}
    np.testing.assert_allclose(store.read("values", 0, 0, 40), v[0], atol=1e-3)
    np.testing.assert_allclose(store.read("keys", 0, 0, 40), k[0], atol=1e-3)
    for _ in range(12):  # the device's next tokens: always into a RAM page
        store.reserve(5)
        assert not store._on_disk(store.logical_pages(0)[-1])
    assert not {2, 3} & set(store.logical_pages(0))
    store.close()
