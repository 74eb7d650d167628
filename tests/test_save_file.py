"""One save format read by every loader (tiered.persistence.save_file): a file while the cache fits
in RAM, a directory otherwise; the Python API, the CLI and mlx-lm's loader read each other's
saves."""

import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

import tiered
from tiered.persistence.snapshot import SnapshotError


def _model():
    from conftest import make_small_model

    return make_small_model("llama-gqa-d64", layers=2, seed=5)


def _prefilled(model, n=700, **opts):
    cache = tiered.TieredCache.for_model(model, gpu_budget=0.25, page_size=64, recent=16,
                                         prefill_window=256, **opts)
    ids = mx.array(np.random.default_rng(3).integers(0, 1000, (1, n)))
    model(ids, cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _next_logits(model, cache):
    out = model(mx.array([[7]]), cache=cache)[:, -1]
    mx.eval(out)
    return np.array(out)


def test_a_file_save_loads_with_every_loader(tmp_path):
    model = _model()
    cache = _prefilled(model)
    path = cache.save(str(tmp_path / "doc.safetensors"), model)
    want = _next_logits(model, _prefilled(model))
    got = tiered.TieredCacheList.load(path, model)
    assert got.tiered_layers == cache.tiered_layers
    np.testing.assert_allclose(_next_logits(model, got), want, rtol=1e-4, atol=1e-4)
    with tiered.installed():  # mlx-lm's own loader, the classes registered
        plain = load_prompt_cache(path)
    assert [type(c).__name__ for c in plain] == ["TieredCache"] * 2
    np.testing.assert_allclose(_next_logits(model, plain), want, rtol=1e-4, atol=1e-4)
    for c in (cache, got):
        c.close()


def test_a_file_refuses_another_model_and_other_options(tmp_path):
    model = _model()
    path = _prefilled(model).save(str(tmp_path / "doc.safetensors"), model)
    from conftest import make_small_model

    other = make_small_model("llama-gqa-d64", layers=2, seed=6)
    with pytest.raises(SnapshotError, match="another model"):
        tiered.TieredCacheList.load(path, other)
    with pytest.raises(SnapshotError, match="other options"):
        tiered.TieredCacheList.load(path, model, recent=32)


def test_mlx_lm_save_prompt_cache_files_load(tmp_path):
    model = _model()
    cache = _prefilled(model)
    path = str(tmp_path / "mlx.safetensors")
    save_prompt_cache(path, cache)
    got = tiered.TieredCacheList.load(path, model)
    want = _next_logits(model, _prefilled(model))
    np.testing.assert_allclose(_next_logits(model, got), want, rtol=1e-4, atol=1e-4)
    from conftest import make_small_model

    wider = make_small_model("llama-gqa-d64", layers=3, seed=5)
    with pytest.raises(SnapshotError, match="layers"):
        tiered.TieredCacheList.load(path, wider)


def test_a_disk_tier_cache_is_refused_as_one_file(tmp_path):
    model = _model()
    cache = _prefilled(model, n=2000, host_budget=1, disk_dir=str(tmp_path / "pages"))
    target = tmp_path / "doc.safetensors"
    with pytest.raises(SnapshotError, match="save to a directory"):
        cache.save(str(target), model)
    assert not target.exists() and not list(tmp_path.glob("*.partial*"))
    cache.close()


def test_the_cli_reads_a_file_the_python_api_wrote(embedded, tmp_path):
    model, tok = embedded
    doc = "The bicycle is red and it stands by the green door. " * 40
    from tiered.commands.cli import split_prompt

    prefix, _ = split_prompt(tok, doc, "What colour is the bicycle?", chat=True)
    cache = tiered.TieredCache.for_model(model, gpu_budget=0.125)
    model(mx.array(prefix)[None], cache=cache)
    path = cache.save(str(tmp_path / "doc.safetensors"), model)
    r = subprocess.run([sys.executable, "-m", "tiered", "run", "--load-cache", path,
                        "--question", "What colour is the bicycle?", "--max-tokens", "8"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    assert "red" in r.stdout.lower(), r.stdout


def test_directory_saves_cross_between_the_python_api_and_the_cli(embedded, tmp_path):
    """The Tour's save (a directory, TieredCacheList.save) answers through tiered run
    --load-cache, and tiered run --save-cache's directory loads with TieredCacheList.load."""
    import mlx_lm

    from tiered.commands.cli import split_prompt

    model, tok = embedded
    doc = tmp_path / "doc.txt"
    doc.write_text("The bicycle is red and it stands by the green door. " * 40)
    prefix, suffix = split_prompt(tok, doc.read_text(), "What colour is the bicycle?", chat=True)
    cache = tiered.TieredCache.for_model(model, gpu_budget=0.125)
    model(mx.array(prefix)[None], cache=cache)
    cache.save(str(tmp_path / "tour"), model)
    r = subprocess.run([sys.executable, "-m", "tiered", "run", "--load-cache",
                        str(tmp_path / "tour"), "--question", "What colour is the bicycle?",
                        "--max-tokens", "8"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "red" in r.stdout.lower(), (r.stdout, r.stderr)
    r = subprocess.run([sys.executable, "-m", "tiered", "run", "--document", str(doc),
                        "--question", "What colour is the bicycle?", "--max-tokens", "4",
                        "--save-cache", str(tmp_path / "cli")], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr
    loaded = tiered.TieredCacheList.load(str(tmp_path / "cli"), model)
    text = mlx_lm.generate(model, tok, prompt=suffix, prompt_cache=loaded, max_tokens=8)
    assert "red" in text.lower(), text
    loaded.close()
