"""Saves and loads under misuse: nothing lost, nothing written outside, nothing loaded into the
wrong model (issue 56).

- mlx-lm's single-file save of a cache with a disk tier is refused before any file is written,
  naming the call that works;
- saves from threads and processes at once leave a snapshot that loads, and every save that
  reports success is loadable; a save while another thread decodes reads a step boundary;
- a load writes nothing outside its directory and the disk_dir it is given (not the saving
  process's removed disk_dir, not a disk_dir edited into the manifest);
- a cache refuses a model whose weights differ anywhere (a fine-tune of one layer's k/v
  projections; q and k scaled in every layer);
- a host budget given at load holds (the pages beyond it go to the disk tier);
- the save-room estimate bounds what a save writes for fp16 models and every host dtype.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_small_model
from mlx_lm.models.cache import save_prompt_cache

import tiered
from tiered import TieredCache, TieredCacheList
from tiered.prefill import prefill
from tiered.persistence.snapshot import manifest_digest

OPTS = dict(gpu_budget=0.25, page_size=64, recent=16, prefill_window=256)
DOCS = {"a": 1, "b": 2}  # document name -> seed of its token ids


def _ids(n, seed):
    return np.random.default_rng(seed).integers(10, 49000, n).tolist()


@pytest.fixture(scope="module")
def small():
    return make_small_model("llama-gqa-d64", layers=3, seed=1)


def _cache(model, doc, tmp, **kw):
    cache = TieredCache.for_model(model, **{**OPTS, "host_budget": "150KB",
                                            "disk_dir": str(tmp / f"live-{doc}"), **kw})
    prefill(model, cache, _ids(500, DOCS[doc]), chunk=250)
    return cache


def _next_logits(model, cache):
    return np.array(model(mx.array([[11, 12, 13]]), cache=cache)[0, -1, :64])


def _tree(root):
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_single_file_save_of_a_disk_tier_is_refused_before_writing(small, tmp_path):
    cache = _cache(small, "a", tmp_path)
    assert any(c.host.disk_bytes for c in cache if c.host is not None), "no disk tier"
    target = tmp_path / "one.safetensors"
    with pytest.raises(ValueError, match=r"cache\.save\(directory, model\)"):
        save_prompt_cache(str(target), cache)
    assert not target.exists()
    cache.save(str(tmp_path / "dir"), small)  # the call the message names works
    loaded = TieredCacheList.load(str(tmp_path / "dir"), small)
    np.testing.assert_array_equal(_next_logits(small, loaded), _next_logits(small, cache))


def test_single_file_save_without_a_disk_tier_still_round_trips(small, tmp_path):
    cache = TieredCache.for_model(small, **OPTS)
    prefill(small, cache, _ids(500, 1), chunk=250)
    save_prompt_cache(str(tmp_path / "one.safetensors"), cache)
    loaded = tiered.load_prompt_cache(str(tmp_path / "one.safetensors"))
    np.testing.assert_array_equal(_next_logits(small, loaded), _next_logits(small, cache))


def test_a_load_writes_nothing_outside_its_directory(small, tmp_path):
    """The saving process's disk_dir, removed, is not created again; a disk_dir edited into
    the manifest (re-signed) is not written; pages beyond the load's host budget go to the
    cache directory (anonymous files) or to the disk_dir the load names."""
    import shutil

    cache = _cache(small, "a", tmp_path)
    saved = tmp_path / "saved"
    cache.save(str(saved), small)
    ref = _next_logits(small, cache)
    cache.close()
    shutil.rmtree(tmp_path / "live-a")
    meta = json.loads((saved / "tiered.json").read_text())
    meta["config"]["disk_dir"] = str(tmp_path / "elsewhere" / "deep")
    meta["digest"] = manifest_digest(meta)
    (saved / "tiered.json").write_text(json.dumps(meta))
    before = _tree(tmp_path)
    loaded = TieredCacheList.load(str(saved), small, host_budget="100KB")
    np.testing.assert_array_equal(_next_logits(small, loaded), ref)
    assert loaded.config.disk_dir == str(saved)
    assert _tree(tmp_path) - before <= {"saved/.tiered-read.lock"}, _tree(tmp_path) - before
    named = tmp_path / "named"
    other = TieredCacheList.load(str(saved), small, host_budget="100KB", disk_dir=str(named))
    np.testing.assert_array_equal(_next_logits(small, other), ref)
    assert {p.split(os.sep)[0] for p in _tree(tmp_path) - before} <= {"saved", "named"}


def test_a_cache_refuses_a_model_with_other_weights(small, tmp_path):
    cache = _cache(small, "a", tmp_path)
    cache.save(str(tmp_path / "s"), small)
    tuned = make_small_model("llama-gqa-d64", layers=3, seed=1)  # the same weights...
    TieredCacheList.load(str(tmp_path / "s"), tuned).close()
    attn = tuned.layers[1].self_attn  # ...then a fine-tune of one layer's k/v projections
    attn.k_proj.weight = attn.k_proj.weight + 1e-3
    attn.v_proj.weight = attn.v_proj.weight - 1e-3
    with pytest.raises(ValueError, match="another model"):
        TieredCacheList.load(str(tmp_path / "s"), tuned)
    scaled = make_small_model("llama-gqa-d64", layers=3, seed=1)
    for layer in scaled.layers:  # q and k scaled alike: the same attention, other K/V bits
        layer.self_attn.q_proj.weight = layer.self_attn.q_proj.weight * 2
        layer.self_attn.k_proj.weight = layer.self_attn.k_proj.weight * 0.5
    with pytest.raises(ValueError, match="another model"):
        TieredCacheList.load(str(tmp_path / "s"), scaled)


def test_identity_sees_one_changed_weight_of_the_embedded_model(embedded):
    from tiered.persistence.identity import model_identity

    model, _ = embedded
    before = model_identity(model)
    assert model_identity(model) == before
    proj = model.layers[29].self_attn.k_proj
    name = "weight" if "weight" in proj else next(iter(proj))
    old = proj[name]
    flat = old.reshape(-1)
    proj[name] = mx.concatenate([flat[:1] + (1 if flat.dtype != mx.float32 else 1e-3),
                                 flat[1:]]).reshape(old.shape).astype(old.dtype)
    try:
        assert model_identity(model) != before
    finally:
        proj[name] = old
    assert model_identity(model) == before


def test_a_host_budget_given_at_load_holds(small, tmp_path):
    cache = _cache(small, "a", tmp_path, host_budget="2MB")
    cache.save(str(tmp_path / "s"), small)
    ref = _next_logits(small, cache)
    loaded = TieredCacheList.load(str(tmp_path / "s"), small, host_budget="100KB")
    assert loaded.tier_bytes()["host"] <= 100_000, loaded.tier_bytes()
    assert loaded.tier_bytes()["disk"] > 0
    np.testing.assert_array_equal(_next_logits(small, loaded), ref)


@pytest.mark.parametrize("host_dtype,host_keys", [("float16", True), ("float32", True),
                                                  ("int8", True), ("float16", False)])
def test_save_estimate_bounds_what_a_save_writes_for_fp16_models(tmp_path, host_dtype,
                                                                 host_keys):
    from tiered.persistence import persist

    model = make_small_model("llama-gqa-d64", layers=3, seed=1)
    model.set_dtype(mx.float16)
    opts = dict(gpu_budget=0.125, host_dtype=host_dtype, host_keys=host_keys)
    cache = TieredCache.for_model(model, **opts, prefill_window=256)
    ids = _ids(700, 3)
    prefill(model, cache, ids, chunk=256)
    assert any(c.phase == "compressed" for c in cache)
    cache.save(str(tmp_path / "c"), model)
    written = sum(p.stat().st_size for p in (tmp_path / "c").rglob("*") if p.is_file())
    estimate = persist.estimate_save_bytes(model, len(ids), tiered.TieredConfig(**opts))
    assert written <= estimate, (written, estimate)


def test_a_save_while_another_thread_decodes_reads_a_step_boundary(small, tmp_path):
    """Thread A decodes; thread B saves into new directories meanwhile. Every save loads and
    decodes as a cache fed exactly the tokens it says it holds."""
    cache = TieredCache.for_model(small, **OPTS)
    prefill(small, cache, _ids(500, 1), chunk=250)
    toks = _ids(60, 9)
    done, saving, saves, errors = threading.Event(), threading.Event(), [], []

    def decode():
        saving.wait(60)
        try:
            for t in toks:
                small(mx.array([[t]]), cache=cache)
        finally:
            done.set()

    def save():
        try:
            while not done.is_set() or not saves:
                saving.set()
                d = tmp_path / f"s{len(saves)}"
                cache.save(str(d), small)
                saves.append(d)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            saving.set()

    threads = [threading.Thread(target=decode), threading.Thread(target=save)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    small(mx.array([[5]]), cache=cache)  # the decoding thread's cache works from this one too
    seen = set()
    for d in saves:
        loaded = TieredCacheList.load(str(d), small)
        k = loaded[0].offset - 500
        assert all(c.offset == 500 + k for c in loaded) and 0 <= k <= len(toks)
        if k in seen:
            continue
        seen.add(k)
        ref = TieredCache.for_model(small, **OPTS)
        prefill(small, ref, _ids(500, 1), chunk=250)
        for t in toks[:k]:
            small(mx.array([[t]]), cache=ref)
        np.testing.assert_array_equal(_next_logits(small, loaded), _next_logits(small, ref))
    assert len(seen) >= 2, seen  # saves at several step boundaries, while it decoded


WRITER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import numpy as np, mlx.core as mx, tiered
    from conftest import make_small_model
    from tiered.prefill import prefill
    model = make_small_model("llama-gqa-d64", layers=3, seed=1)
    ids = np.random.default_rng({seed}).integers(10, 49000, 500).tolist()
    cache = tiered.TieredCache.for_model(model, gpu_budget=0.25, page_size=64, recent=16,
                                         prefill_window=256, host_budget="150KB",
                                         disk_dir={live!r})
    prefill(model, cache, ids, chunk=250)
    for r in range({rounds}):
        cache.save({target!r}, model)
        loaded = tiered.TieredCacheList.load({target!r}, model)
        out = model(mx.array([[11, 12, 13]]), cache=loaded)[0, -1, :64]
        print(json.dumps({{"logits": np.array(out).tolist()}}), flush=True)
        loaded.close()
""")


def test_saves_and_loads_from_threads_and_processes_at_once(small, tmp_path, monkeypatch):
    """Two processes and three threads save two documents into one directory and load it
    after every save, while another thread loads it in a loop: every load succeeds and decodes
    as one of the two documents (never a mix, never a missing file). Several threads run the
    model at once here: on CUDA that takes the dispatcher off (``TIERED_DISPATCH_THREAD=0``),
    and the threads run the model one at a time, under the lock tiered's saves and loads take
    (tiered.persistence.persist.MLX_WORK), as the README asks: on MLX 0.32.4's CUDA backend two
    threads evaluating at once aborted the process inside MLX (H200: a prefill beside a decode)."""
    import contextlib

    from tiered.runtime import dispatch, uva
    from tiered.persistence import persist

    monkeypatch.setattr(dispatch, "_enabled", False)
    one = persist.MLX_WORK if uva.available() else contextlib.nullcontext()
    target = tmp_path / "shared"
    refs = {}
    for doc in DOCS:
        c = _cache(small, doc, tmp_path)
        refs[doc] = _next_logits(small, c)
        c.close()
    first = _cache(small, "a", tmp_path)
    first.save(str(target), small)

    def which(logits):
        hits = [d for d, r in refs.items() if np.allclose(logits, r, rtol=1e-5, atol=1e-5)]
        assert len(hits) == 1, "a load decodes as neither document"
        return hits[0]

    procs = [subprocess.Popen([sys.executable, "-c", WRITER.format(
        tests=os.path.dirname(__file__), seed=DOCS[doc], live=str(tmp_path / f"p{doc}"),
        rounds=4, target=str(target))], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, cwd=str(tmp_path)) for doc in DOCS]
    errors, seen, stop = [], [], threading.Event()

    def writer(doc):
        try:
            if doc == "a":
                cache = first
            else:
                with one:
                    cache = _cache(small, doc, tmp_path / "t")
            for _ in range(3):
                cache.save(str(target), small)
                loaded = TieredCacheList.load(str(target), small)
                with one:
                    seen.append(which(_next_logits(small, loaded)))
                loaded.close()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def reader():
        try:
            while not stop.is_set():
                loaded = TieredCacheList.load(str(target), small)
                with one:
                    seen.append(which(_next_logits(small, loaded)))
                loaded.close()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(d,)) for d in ("a", "b", "a")]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    outs = [p.communicate(timeout=600) for p in procs]
    for t in threads[:-1]:
        t.join(600)
    stop.set()
    threads[-1].join(600)
    assert not errors, errors
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        assert len(lines) == 4
        seen += [which(np.array(x["logits"])) for x in lines]
    assert len(seen) >= 17 and set(seen) == set(DOCS)
    final = TieredCacheList.load(str(target), small)
    which(_next_logits(small, final))
    names = {p.name for p in target.iterdir()}
    assert sum(n.startswith("cache-") for n in names) == 1, names  # no file of a lost save
