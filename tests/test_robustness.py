"""Nothing lost, nothing shared: exact trim, transactional steps on a full disk tier, saved
caches as immutable snapshots, non-finite keys at the door, budgets enforced, cleanup."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_small_model
from mlx_lm.models.cache import trim_prompt_cache

import tiered
from tiered import TieredCache
from tiered.cpu.disk import DiskTierError
from tiered.runtime.ops import on_cpu_backend
from tiered.prefill import prefill

V = 49152


@pytest.fixture(scope="module")
def small():
    return make_small_model("llama-gqa-d64", layers=3, seed=1)


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(10, V - 10, n).tolist()


def _feed(model, cache, toks):
    return [model(mx.array([[t]]), cache=cache) for t in toks]


def _close(a, b, tol=1e-5):
    return max(mx.abs(x - y).max().item() for x, y in zip(a, b)) <= tol


def _tree_digest(path) -> dict:
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, path)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


# ---- trim -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernels", ["numba", "mlx"])
def test_trim_then_the_same_tokens_reproduce_the_first_feed(small, kernels):
    """Exact phase, compressed decode (across H2O refreshes), trim to 0 and a new prompt."""
    cache = TieredCache.for_model(small, gpu_budget=0.25, page_size=64, recent=16,
                                  kernels=kernels)
    small(mx.array(_ids(60))[None], cache=cache)  # below the threshold (76): exact
    toks = _ids(50, seed=1)
    first = _feed(small, cache, toks[:10])
    assert cache[0].phase == "exact" or cache[0].offset >= 76
    trim_prompt_cache(cache, 5)
    assert _close(first[-5:], _feed(small, cache, toks[5:10]))
    first = first + _feed(small, cache, toks[10:50])  # compresses at 76; refreshes every 16
    assert cache[0].phase == "compressed"
    for k in (1, 7, 33):
        trim_prompt_cache(cache, k)
        assert _close(first[-k:], _feed(small, cache, toks[50 - k:50])), k
    assert trim_prompt_cache(cache, cache[0].offset) == 110  # to 0: a fresh start
    fresh = TieredCache.for_model(small, gpu_budget=0.25, page_size=64, recent=16,
                                  kernels=kernels)
    p = mx.array(_ids(120, seed=2))[None]
    assert _close([small(p, cache=cache)], [small(p, cache=fresh)])
    assert _close(_feed(small, cache, toks[:5]), _feed(small, fresh, toks[:5]))


def test_trim_of_a_prompt_chunk_after_compression(small):
    cache = TieredCache.for_model(small, gpu_budget=0.25, page_size=64, recent=16,
                                  prefill_window=256)
    ids = _ids(900, seed=3)
    prefill(small, cache, ids[:700], chunk=128)
    assert cache[0].phase == "compressed"
    a = small(mx.array(ids[700:900])[None], cache=cache)
    trim_prompt_cache(cache, 200)
    b = small(mx.array(ids[700:900])[None], cache=cache)
    assert mx.abs(a - b).max().item() <= 1e-5


# ---- a full disk tier -------------------------------------------------------------------------
def test_disk_full_mid_prefill_then_retry_equals_an_undisturbed_run(small, tmp_path):
    """The disk tier's budget runs out at a prompt chunk: a clear error before any layer
    changes; with space given back, the same chunk again, and the answer is the one an
    undisturbed run gives."""
    ids = _ids(1200, seed=4)
    opts = dict(gpu_budget=0.25, page_size=64, recent=16, prefill_window=256,
                host_budget="150KB", disk_dir=str(tmp_path))

    def run(cache, on_error=None):
        done, chunk = 0, 128
        while done < len(ids) - 8:
            step = ids[done : done + chunk]
            try:
                small.model(mx.array(step)[None], cache=cache)
            except DiskTierError as e:
                assert on_error is not None, e
                assert "disk tier" in str(e) and {c.offset for c in cache} == {done}
                on_error(cache)
                on_error = None
                continue  # the same chunk again
            done += len(step)
        return _feed(small, cache, ids[-8:])

    ref = run(TieredCache.for_model(small, **opts, disk_budget="1GB"))
    cache = TieredCache.for_model(small, **opts, disk_budget="200KB")
    hit = []

    def free_space(c):
        hit.append(c[0].offset)
        c.context.disk_budget.limit = 1 << 30

    got = run(cache, free_space)
    assert hit, "the disk budget never ran out: the test did not test anything"
    assert _close(ref, got)


def test_disk_dir_is_checked_when_the_cache_is_made(small, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DiskTierError, match="not writable"):
        TieredCache.for_model(small, host_budget="1MB", disk_dir=str(blocker / "pages"))
    with pytest.raises(DiskTierError, match="free"):
        TieredCache.for_model(small, host_budget="1MB", disk_dir=str(tmp_path),
                              disk_budget="9000TB")


# ---- saved caches -----------------------------------------------------------------------------
def test_saved_cache_is_an_immutable_snapshot(small, tmp_path):
    """After a save the live cache is trimmed and goes on; two caches loaded from the save
    diverge on their own; the saved directory's bytes never change."""
    opts = dict(gpu_budget=0.25, page_size=64, recent=16, prefill_window=256,
                host_budget="150KB", disk_dir=str(tmp_path / "live"))
    ids = _ids(700, seed=5)
    live = TieredCache.for_model(small, **opts)
    prefill(small, live, ids[:600], chunk=200)
    saved = tmp_path / "saved"
    live.save(str(saved), small)
    digest = _tree_digest(saved)
    assert any(k.startswith("pages-") for k in digest), "the disk tier was not exercised"
    q = ids[600:610]
    a = TieredCacheList_load(saved, small)
    expect = _feed(small, a, q)
    trim_prompt_cache(live, 50)  # the live cache moves on: trimmed, fed other tokens
    _feed(small, live, _ids(40, seed=6))
    b = TieredCacheList_load(saved, small)
    assert _close(expect, _feed(small, b, q))  # as at save time
    c = TieredCacheList_load(saved, small)
    assert _close(expect, _feed(small, c, q))
    _feed(small, c, _ids(30, seed=8))  # c goes its own way; b and a are unaffected:
    x = _ids(5, seed=7)
    assert _close(_feed(small, a, x), _feed(small, b, x))
    for x in (a, b, c, live):
        x.close()
    assert _tree_digest(saved) == digest


def TieredCacheList_load(path, model, **kw):
    return tiered.TieredCacheList.load(str(path), model, **kw)


def test_loaded_cache_keeps_its_runtime_options_unless_overridden(small, tmp_path):
    cache = TieredCache.for_model(small, gpu_budget=0.25, host_budget="300KB",
                                  disk_dir=str(tmp_path / "d"))
    prefill(small, cache, _ids(300, seed=9), chunk=300)
    cache.save(str(tmp_path / "s"), small)
    loaded = TieredCacheList_load(tmp_path / "s", small)
    assert loaded.context.host_budget.limit == 300_000
    other = TieredCacheList_load(tmp_path / "s", small, host_budget="1MB")
    assert other.context.host_budget.limit == 1_000_000
    with pytest.raises(ValueError, match="other options"):
        TieredCacheList_load(tmp_path / "s", small, gpu_budget=0.5)


def test_a_failed_save_leaves_the_previous_snapshot(small, tmp_path, monkeypatch):
    cache = TieredCache.for_model(small, gpu_budget=0.25)
    prefill(small, cache, _ids(300, seed=10), chunk=300)
    cache.save(str(tmp_path / "s"), small)
    before = _tree_digest(tmp_path / "s")
    import mlx_lm.models.cache as mc

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mc, "save_prompt_cache", broken)
    small(mx.array([[5]]), cache=cache)
    with pytest.raises(ValueError, match="previous snapshot there .* is unchanged"):
        cache.save(str(tmp_path / "s"), small)
    assert _tree_digest(tmp_path / "s") == before
    monkeypatch.undo()
    TieredCacheList_load(tmp_path / "s", small)


# ---- the door ---------------------------------------------------------------------------------
@pytest.mark.skipif(not on_cpu_backend(), reason="on a GPU the check is queued (next test)")
@pytest.mark.parametrize("where", ["keys", "values"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_keys_or_values_are_refused_naming_the_layer(where, bad):
    cache = TieredCache(tiered.TieredConfig(gpu_budget="1GB", compress_from=1))
    tiered.install()
    k = mx.random.normal((1, 2, 40, 16))
    kk, vv = cache.update_and_fetch(k, k)
    cache.attention(mx.random.normal((1, 2, 40, 16)), kk, vv, scale=0.25, mask="causal")
    k1 = mx.random.normal((1, 2, 1, 16))
    kk, vv = cache.update_and_fetch(k1, k1)
    cache.attention(mx.random.normal((1, 2, 1, 16)), kk, vv, scale=0.25, mask=None)
    assert cache.phase == "compressed"
    x = np.array(k1)
    x[0, 1, 0, 3] = bad
    keys, values = (mx.array(x), k1) if where == "keys" else (k1, mx.array(x))
    with pytest.raises(ValueError, match="layer 0: non-finite"):
        cache.update_and_fetch(keys, values)
    assert cache.offset == 41  # nothing changed
    out = cache.update_and_fetch(k1, k1)
    assert out[0].shape[2] == 1


@pytest.mark.accelerator
@pytest.mark.skipif(on_cpu_backend(), reason="the queued check is the GPU's")
@pytest.mark.parametrize("where", ["keys", "values"])
@pytest.mark.parametrize("dim", [16, 64])  # 64: the CUDA device path; 16: the MLX-op path
def test_non_finite_tokens_are_refused_where_they_reach_the_host_on_a_gpu(where, dim):
    """On a GPU the door's check is queued with the step (a sync per layer and token would
    cost more than the step); the ValueError naming the layer comes where the tokens reach
    the host pages, here an explicit flush."""
    cache = TieredCache(tiered.TieredConfig(gpu_budget="1GB", compress_from=1))
    tiered.install()
    k = mx.random.normal((1, 2, 40, dim))
    kk, vv = cache.update_and_fetch(k, k)
    cache.attention(mx.random.normal((1, 2, 40, dim)), kk, vv, scale=0.25, mask="causal")
    k1 = mx.random.normal((1, 2, 1, dim))
    kk, vv = cache.update_and_fetch(k1, k1)
    mx.eval(cache.attention(mx.random.normal((1, 2, 1, dim)), kk, vv, scale=0.25, mask=None))
    assert cache.phase == "compressed"
    x = np.array(k1)
    x[0, 1, 0, 3] = float("nan")
    keys, values = (mx.array(x), k1) if where == "keys" else (k1, mx.array(x))
    cache.update_and_fetch(keys, values)
    with pytest.raises(ValueError, match="layer 0: non-finite keys or values .* tokens \\[41, 42\\)"):
        cache.flush()


@pytest.mark.parametrize("where", ["keys", "values"])
def test_a_non_finite_token_of_the_exact_window_keeps_the_layer_exact(where):
    """The exact phase keeps what it is given (as KVCache does); the compression refuses a
    non-finite key or value, naming the layer and the first such token, and leaves the layer
    exact with no host pages (checked on the device in one read: tiered.host_tier._to_host)."""
    cache = TieredCache(tiered.TieredConfig(gpu_budget="1GB", compress_from=1))
    tiered.install()
    x = np.array(mx.random.normal((1, 2, 40, 64)))
    x[0, 1, 17, 5] = float("nan")
    bad, good = mx.array(x), mx.random.normal((1, 2, 40, 64))
    keys, values = (bad, good) if where == "keys" else (good, bad)
    kk, vv = cache.update_and_fetch(keys, values)
    cache.attention(mx.random.normal((1, 2, 40, 64)), kk, vv, scale=0.125, mask="causal")
    assert cache.phase == "exact"
    k1 = mx.random.normal((1, 2, 1, 64))
    with pytest.raises(ValueError,
                       match="layer 0: non-finite keys or values .* tokens \\[17, 18\\)"):
        kk, vv = cache.update_and_fetch(k1, k1)
        cache.attention(mx.random.normal((1, 2, 1, 64)), kk, vv, scale=0.125, mask=None)
    assert cache.phase == "exact" and cache.host is None


# ---- budgets, cleanup -------------------------------------------------------------------------
def test_an_absolute_budget_is_met_or_refused_never_exceeded(embedded):
    model, tok = embedded
    from tiered.planning.tasks import topics_text

    ids = tok.encode(topics_text())[:6000]
    cache = TieredCache.for_model(model, gpu_budget="400KB")
    try:
        prefill(model, cache, ids, chunk=2048)
        _feed(model, cache, ids[:3])
    except tiered.planning.planner.BudgetError as e:
        assert "smallest budget that works" in str(e)
        return
    rep = tiered.report_dict(cache)
    assert rep["bytes"]["accelerator"] <= 400_000, rep["bytes"]


def test_use_after_close_is_a_clear_error(small):
    cache = TieredCache.for_model(small, gpu_budget=0.25)
    small(mx.array(_ids(10))[None], cache=cache)
    cache.close()
    with pytest.raises(ValueError, match="was closed"):
        small(mx.array([[5]]), cache=cache)


_CHILD = """
import sys, time, mlx.core as mx, numpy as np
sys.path.insert(0, sys.argv[2])
from conftest import make_small_model
import tiered
model = make_small_model("llama-gqa-d64", layers=2, seed=1)
cache = tiered.TieredCache.for_model(model, gpu_budget=0.25, page_size=64, recent=16,
                                     host_budget="20KB", disk_dir=sys.argv[1])
model(mx.array(np.arange(10, 700))[None], cache=cache)
model(mx.array([[5]]), cache=cache)
assert cache.tier_bytes()["disk"] > 0
print("READY", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_no_page_file_outlives_its_process(tmp_path, sig):
    tests = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path), tests],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "READY"
    assert not os.listdir(tmp_path)  # live page files are anonymous already
    p.send_signal(sig)
    p.wait(timeout=30)
    assert not os.listdir(tmp_path)


def _dir_bytes(path):
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.mark.parametrize("budget", [1.0, 0.125])
def test_save_estimate_bounds_what_a_save_writes(small, tmp_path, budget):
    """The space a save needs, estimated before the prefill, is at least what it writes."""
    from tiered.persistence import persist

    toks = _ids(900, seed=5)
    cache = TieredCache.for_model(small, gpu_budget=budget)
    prefill(small, cache, toks, chunk=256)
    cache.save(str(tmp_path / "c"), small)
    written = _dir_bytes(tmp_path / "c")
    assert 0 < written <= persist.estimate_save_bytes(small, len(toks)), written
    cache.close()


def test_cli_refuses_a_save_without_room_before_the_prefill(tmp_path, monkeypatch, capsys):
    """--save-cache to a disk without room for the document's cache: one line, exit 2, and
    no prefill done."""
    import shutil

    from tiered.commands import cli
    from tiered import prefill as prefill_mod

    doc = tmp_path / "doc.txt"
    doc.write_text("The harbour master keeps a blue bicycle behind the bakery. " * 60)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: real(p)._replace(free=64 * 1024))  # 64 KiB free
    ran = []
    monkeypatch.setattr(prefill_mod, "prefill", lambda *a, **k: ran.append(1))
    rc = cli.main(["run", "--document", str(doc), "--question", "Where?", "--save-cache",
                   str(tmp_path / "c"), "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "needed" in err and not ran, err
    assert not (tmp_path / "c" / "tiered.json").exists()


def test_a_refresh_the_planner_refuses_keeps_the_resident_set(monkeypatch):
    """The planner sizes the resident set refresh_every tokens ahead; where it refuses a length
    the layer already holds (a tight budget at a short length), the H2O refresh keeps the
    set's size instead of failing the decode step with a BudgetError."""
    from tiered.planning.planner import BudgetError, Plan

    model = make_small_model("llama-gqa-d64", layers=2, seed=3)
    cache = TieredCache.for_model(model, gpu_budget=0.25, page_size=64, recent=16,
                                  refresh_every=2)
    prompt = mx.array(np.random.default_rng(0).integers(10, 40000, 300))[None]
    logits = model(prompt, cache=cache)
    logits = model(mx.argmax(logits[:, -1], axis=-1)[:, None], cache=cache)
    layers = [c.compressed for c in cache]
    assert all(layer is not None for layer in layers)
    sizes, steps = [layer.R for layer in layers], [layer.steps for layer in layers]

    def refuse(self, n, horizon=0):
        raise BudgetError("refused (test)")

    monkeypatch.setattr(Plan, "check", refuse)
    for _ in range(4):  # every layer refreshes at least once (refresh_every 2)
        logits = model(mx.argmax(logits[:, -1], axis=-1)[:, None], cache=cache)
        mx.eval(logits)
    assert [layer.R for layer in layers] == sizes
    assert [layer.steps for layer in layers] == [s + 4 for s in steps]
    assert np.isfinite(np.array(logits)).all()
    cache.close()
