"""The compressed phase saved and loaded: through mlx-lm's prompt cache files, as a cache
directory (exact or compressed, page files on disk), and the codebooks calibrated from a text
file, cached and checked."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import test_tiered_core as core
from conftest import make_small_model
from mlx_lm.models.cache import save_prompt_cache
from test_tiered_core import PATHS, _decode_logits, _prompt

import tiered
from tiered import TieredCache

small = core.small  # the module-scoped small model (a fixture: one model per module)


@pytest.mark.parametrize("path", PATHS, ids=["numba", "mlx", "affine"])
def test_compressed_round_trip_through_mlx_lm(small, tmp_path, path):
    prompt = _prompt(300, seed=6)
    cache = TieredCache.for_model(small, page_size=64, recent=16, **path)
    _decode_logits(small, cache, prompt, 3)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache)
    loaded = tiered.load_prompt_cache(path)
    y = mx.array([[7]])
    a = [small(y, cache=cache)]
    b = [small(y, cache=loaded)]
    for _ in range(5):
        a.append(small(mx.argmax(a[-1][:, -1], axis=-1)[:, None], cache=cache))
        b.append(small(mx.argmax(b[-1][:, -1], axis=-1)[:, None], cache=loaded))
    for x, z in zip(a, b):
        assert mx.abs(x - z).max().item() < 1e-5


def test_calibration_from_text_is_cached_and_checked(embedded, tmp_path):
    """A calibration text trains the codebooks once; the file is reused, and a corrupted file
    is a clear error naming it."""
    import glob

    from tiered.planning.tasks import topics_text

    model, tok = embedded
    text = tmp_path / "calib.txt"
    text.write_text(topics_text()[:20000])
    opts = dict(gpu_budget=0.25, calibration=str(text), calibration_tokens=512,
                cache_dir=str(tmp_path / "cache"))
    first = TieredCache.for_model(model, **opts)
    files = glob.glob(str(tmp_path / "cache" / "*.safetensors"))
    assert len(files) == 1
    second = TieredCache.for_model(model, **opts)
    a, b = first.context.codebooks, second.context.codebooks
    assert sorted(a) == list(range(30))
    assert all(np.array_equal(a[i], b[i]) for i in a)
    # The layers use them: compress a short prompt and check the codebook is the calibrated one.
    model(mx.array(tok.encode(topics_text()[50000:53000]))[None], cache=second)
    model(mx.array([[tok.encode(" the")[0]]]), cache=second)
    assert np.array_equal(np.array(second[5].compressed.keys.codebook), a[5])
    raw = bytearray(open(files[0], "rb").read())
    raw[len(raw) // 2] ^= 0xFF
    open(files[0], "wb").write(bytes(raw))
    with pytest.raises(ValueError, match="calibration"):
        TieredCache.for_model(model, **opts)


@pytest.mark.parametrize("tokens", [60, 500], ids=["exact-phase", "compressed"])
def test_save_and_load_a_cache_directory(small, tmp_path, tokens):
    """60 tokens are below this budget's compression threshold (76): saved exact. 500 tokens
    compress (beyond the 256-token prefill window, or at the save, which stores the layout
    the next step would use)."""
    prompt = _prompt(tokens, seed=12)
    opts = dict(gpu_budget=0.25, page_size=64, recent=16, prefill_window=256,
                host_budget="200KB", disk_dir=str(tmp_path / "live"))
    cache = TieredCache.for_model(small, **opts)
    from tiered.prefill import prefill

    prefill(small, cache, prompt[0].tolist(), chunk=200)
    cache.save(str(tmp_path / "saved"), small)
    loaded = tiered.TieredCacheList.load(str(tmp_path / "saved"), small)
    assert loaded[0].phase == cache[0].phase == ("exact" if tokens < 76 else "compressed")
    question = mx.array([[11, 12, 13, 14]])
    a = small(question, cache=cache)
    b = small(question, cache=loaded)
    assert mx.abs(a - b).max().item() < 1e-5
    for _ in range(3):
        y = mx.argmax(a[:, -1], axis=-1)[:, None]
        a, b = small(y, cache=cache), small(y, cache=loaded)
        assert mx.abs(a - b).max().item() < 1e-5
    cache.close()  # the live page files go; the saved copies stay usable
    y = mx.argmax(b[:, -1], axis=-1)[:, None]
    assert mx.isfinite(small(y, cache=loaded)).all().item()
    other = make_small_model("llama-gqa-d64", layers=3, seed=2)
    with pytest.raises(ValueError, match="another model"):
        tiered.TieredCacheList.load(str(tmp_path / "saved"), other)
    with pytest.raises(ValueError, match="other options"):
        tiered.TieredCacheList.load(str(tmp_path / "saved"), small, gpu_budget=0.125)
    loaded.close()
