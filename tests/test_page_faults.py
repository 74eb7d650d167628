"""Page reads that cannot fault, and failed reads that leave the cache usable.

- A disk-tier page file that shrinks under a running cache (truncated through
  /proc/<pid>/fd/<fd>: the files are anonymous) is a DiskTierError naming the file and its
  sizes in every read that touches the disk tier (the CPU gather of a decode step, host reads
  such as keys_and_values and the refresh's rows, a save), never a SIGBUS; the failed step is
  not applied.
- A step that fails inside the gather in one thread leaves the cache usable from every thread
  (MLX streams are per thread): what it decodes next is what a cache that never failed decodes.
- A gather job that hangs is a TimeoutError naming the layer after TIERED_GATHER_TIMEOUT
  seconds; the step is not applied and runs again once asked.

The cases that could crash or hang run in a child process (tests/isolated.py) under a timeout.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from isolated import WARM_S, Child

CASE_S = 240.0


@pytest.fixture(scope="module")
def child():
    c = Child()
    yield c
    c.stop()


# ---- run in the child ----------------------------------------------------------------------
def _cache(disk_dir: str):
    """A 3-layer model and its cache after a 500-token prompt whose pages reach the disk tier
    (host budget 150 KB), one decode step taken."""
    import mlx.core as mx
    from conftest import make_small_model

    from tiered import TieredCache
    from tiered.prefill import prefill

    model = make_small_model("llama-gqa-d64", layers=3, seed=1)
    cache = TieredCache.for_model(model, gpu_budget=0.25, page_size=64, recent=16,
                                  prefill_window=256, host_budget="150KB", disk_dir=disk_dir)
    prefill(model, cache, np.random.default_rng(1).integers(10, 49000, 500).tolist(), chunk=250)
    mx.eval(model(mx.array([[5]]), cache=cache))
    assert cache[1].host.disk_bytes > 0, "no disk tier: the case tests nothing"
    return model, cache


def _step(model, cache, token: int) -> np.ndarray:
    import mlx.core as mx

    out = model(mx.array([[token]]), cache=cache)
    mx.eval(out)
    return np.array(out)


def _error(fn) -> str:
    """'<type>: <message>' of what fn raised, '' when it returned."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return ""


def shrunk_reads(disk_dir: str, lost: str) -> dict:
    model, cache = _cache(disk_dir)
    host = cache[1].host
    pf = host.keys.disk
    size = 0 if lost == "all" else pf.nbytes - pf.stride // 2
    os.truncate(f"/proc/self/fd/{pf.fd}", size)
    offsets = [c.offset for c in cache]
    got = {"name": pf.name, "size": size, "held": pf.nbytes,
           "step": _error(lambda: _step(model, cache, 6))}
    got["offsets_kept"] = [c.offset for c in cache] == offsets
    got["keys_and_values"] = _error(cache[1].keys_and_values)
    got["gather_rows"] = _error(lambda: host.gather_rows("keys", 0, np.zeros((2, 1), np.int64)))
    got["read"] = _error(lambda: host.read("keys", 0, 0, 64))
    got["save"] = _error(lambda: cache.save(os.path.join(disk_dir, "saved"), model))
    got["step_again"] = _error(lambda: _step(model, cache, 6))
    cache.close()
    return got


def failed_step_in_a_thread(disk_dir: str) -> dict:
    from tiered.runtime import ops

    model, ref = _cache(os.path.join(disk_dir, "ref"))
    want = [_step(model, ref, t) for t in (6, 7, 8, 9)]
    ref.close()
    model, cache = _cache(os.path.join(disk_dir, "live"))
    got, errors = [_step(model, cache, 6)], []
    real = ops._gather_job

    def broken(*args):
        raise RuntimeError("a read of the host pages failed")

    def in_thread(fn):
        box = []
        t = threading.Thread(target=lambda: box.append(_error(fn)))
        t.start()
        t.join()
        return box[0]

    ops._gather_job = broken
    try:
        errors.append(in_thread(lambda: _step(model, cache, 7)))
    finally:
        ops._gather_job = real
    offsets = [c.offset for c in cache]
    got.append(_step(model, cache, 7))  # the main thread
    res = []
    errors.append(in_thread(lambda: res.append(_step(model, cache, 8))))  # another thread
    got += res + [_step(model, cache, 9)]
    cache.close()
    return {"errors": errors, "offsets": offsets, "diff": [float(np.abs(a - b).max())
                                                           for a, b in zip(got, want)]}


def hung_gather(disk_dir: str) -> dict:
    from tiered.runtime import ops

    model, ref = _cache(os.path.join(disk_dir, "ref"))
    want = [_step(model, ref, t) for t in (6, 7)]
    ref.close()
    os.environ["TIERED_GATHER_TIMEOUT"] = "1"  # read when the cache's scheduler is made
    try:
        model, cache = _cache(os.path.join(disk_dir, "live"))
    finally:
        del os.environ["TIERED_GATHER_TIMEOUT"]
    assert cache.context.get_scheduler().timeout == 1.0
    release, real, calls = threading.Event(), ops._gather_job, []

    def hangs(*args):
        calls.append(1)
        if len(calls) == 1:
            release.wait(120)  # the first job of the step hangs
        return real(*args)

    ops._gather_job = hangs
    t0 = time.perf_counter()
    try:
        error = _error(lambda: _step(model, cache, 6))
    finally:
        ops._gather_job = real
        waited = time.perf_counter() - t0
        release.set()
    offsets = [c.offset for c in cache]
    got = [_step(model, cache, t) for t in (6, 7)]
    cache.close()
    return {"error": error, "waited": waited, "offsets": offsets,
            "diff": [float(np.abs(a - b).max()) for a, b in zip(got, want)]}


# ---- the cases -----------------------------------------------------------------------------
@pytest.mark.parametrize("lost", ["all", "half a block"])
def test_a_shrunk_page_file_is_an_error_in_every_read_not_a_sigbus(child, tmp_path, lost):
    got = child.call(WARM_S, shrunk_reads, str(tmp_path), lost)
    assert got["size"] < got["held"]
    for what in ("step", "keys_and_values", "gather_rows", "read", "save", "step_again"):
        assert got[what].startswith("DiskTierError"), (what, got[what])
        assert f"{got['name']}" in got[what] and f"shrank to {got['size']} bytes" in got[what]
        assert f"holds {got['held']} bytes" in got[what], (what, got[what])
    assert got["offsets_kept"], "the failed step was applied"


def test_a_step_failed_in_one_thread_leaves_the_cache_usable_from_every_thread(child,
                                                                               tmp_path):
    got = child.call(WARM_S, failed_step_in_a_thread, str(tmp_path))
    assert got["errors"][0] == "RuntimeError: a read of the host pages failed", got["errors"]
    assert got["errors"][1] == "", got["errors"]  # the other thread decoded
    assert got["offsets"] == [502, 502, 502], "the failed step was applied"
    assert max(got["diff"]) <= 1e-5, got["diff"]


def test_a_gather_that_hangs_times_out_and_the_step_runs_again(child, tmp_path):
    got = child.call(CASE_S, hung_gather, str(tmp_path))
    assert got["error"].startswith("TimeoutError: layer 0:"), got["error"]
    assert "TIERED_GATHER_TIMEOUT" in got["error"]
    assert got["waited"] < 30, got["waited"]
    assert got["offsets"] == [501, 501, 501], "the timed-out step was applied"
    assert max(got["diff"]) <= 1e-5, got["diff"]


def test_a_batch_wait_times_out_and_the_scheduler_goes_on():
    from tiered.scheduler import Scheduler

    release = threading.Event()
    with Scheduler(2, timeout=0.2) as s:
        b = s.batch(layer=3)
        b.submit(release.wait, 30)
        b.submit(lambda: 1)
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError, match="layer 3: .*0.2 s"):
            b.wait()
        assert time.perf_counter() - t0 < 5
        b2 = s.batch(layer=3)  # fresh threads: the stuck one is left to its job
        for i in range(4):
            b2.submit(lambda i=i: i * i)
        assert b2.wait() == [0, 1, 4, 9]
        release.set()


@pytest.mark.parametrize("value,want", [("", 300.0), ("2.5", 2.5), ("none", None),
                                        ("0", None)])
def test_gather_timeout_comes_from_the_environment(monkeypatch, value, want):
    from tiered.scheduler import Scheduler

    monkeypatch.setenv("TIERED_GATHER_TIMEOUT", value)
    assert Scheduler(1).timeout == want
    monkeypatch.setenv("TIERED_GATHER_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="TIERED_GATHER_TIMEOUT"):
        Scheduler(1)
