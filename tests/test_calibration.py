"""The calibration store of the key codecs: codebooks calibrated per layer, saved atomically,
corruption and mismatch detected, cached by load_or_calibrate; the model fingerprint."""

from __future__ import annotations

import os
import shutil

import tiered  # noqa: F401  (loads the optimized BLAS before mlx.core)

import mlx.core as mx
import numpy as np
import pytest

from tiered.codecs import (
    CalibrationKey,
    calibrate,
    calibration_path,
    load_calibration,
    load_or_calibrate,
    model_fingerprint,
    save_calibration,
    train_codebook,
)


# ---- helpers ------------------------------------------------------------------------------
def make_key(**changes):
    fields = dict(model_id="llama-0123abcd", layers=3, heads=2, head_dim=16, groups=4, size=8,
                  per_group=False, iters=4, seed=0, source="self:abc")
    fields.update(changes)
    return CalibrationKey(**fields)


def small_codebooks(key, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(key.codebook_shape()).astype(np.float32)
            for _ in range(key.layers)]


# ---- calibration ----------------------------------------------------------------------------
def test_calibrate_reports_progress_and_matches_train_codebook():
    rng = np.random.default_rng(11)
    layers = [rng.standard_normal((2, 300, 16)).astype(np.float32) for _ in range(3)]
    seen = []
    cbs = calibrate(iter(layers), groups=4, size=8, iters=3,
                    progress=lambda i, n: seen.append((i, n)))
    assert seen == [(1, None), (2, None), (3, None)]
    seen.clear()
    cbs2 = calibrate(layers, groups=4, size=8, iters=3, progress=lambda i, n: seen.append((i, n)))
    assert seen == [(1, 3), (2, 3), (3, 3)]
    for cb, cb2, keys in zip(cbs, cbs2, layers):
        np.testing.assert_array_equal(cb, cb2)
        np.testing.assert_array_equal(cb, train_codebook(keys, groups=4, size=8, iters=3))


def test_save_load_round_trip(tmp_path):
    key = make_key()
    assert load_calibration(tmp_path, key) is None
    cbs = small_codebooks(key)
    path = save_calibration(tmp_path / "sub", key, cbs)  # creates the directory
    assert path == calibration_path(tmp_path / "sub", key)
    assert os.listdir(tmp_path / "sub") == [os.path.basename(path)]  # no temp file left
    for got, want in zip(load_calibration(tmp_path / "sub", key.to_dict()), cbs):
        np.testing.assert_array_equal(got, want)
    # an ordinary safetensors file, readable by MLX
    loaded = mx.load(path)
    np.testing.assert_array_equal(np.array(loaded["layer_0001"]), cbs[1])
    # a different config or model lands in a different file
    assert calibration_path(tmp_path, make_key(seed=1)) != calibration_path(tmp_path, key)
    assert calibration_path(tmp_path, make_key(model_id="x")) != calibration_path(tmp_path, key)


def test_every_flipped_byte_is_detected(tmp_path):
    key = make_key(layers=2, heads=1, head_dim=8, groups=2, size=2)
    path = save_calibration(tmp_path, key, small_codebooks(key))
    blob = open(path, "rb").read()
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0xFF
        open(path, "wb").write(bytes(bad))
        with pytest.raises(ValueError, match=os.path.basename(path)):
            load_calibration(tmp_path, key)
    # a single flipped bit in the tensor data is caught by the checksum
    bad = bytearray(blob)
    bad[-3] ^= 0x01
    open(path, "wb").write(bytes(bad))
    with pytest.raises(ValueError, match="checksum"):
        load_calibration(tmp_path, key)


def test_truncated_and_unreadable_files_are_detected(tmp_path):
    key = make_key()
    path = save_calibration(tmp_path, key, small_codebooks(key))
    blob = open(path, "rb").read()
    for n in (0, 5, 8, 40, len(blob) // 2, len(blob) - 1):
        open(path, "wb").write(blob[:n])
        with pytest.raises(ValueError, match=f"Corrupt calibration file {path}"):
            load_calibration(tmp_path, key)
    open(path, "wb").write(blob + b"\0")
    with pytest.raises(ValueError, match="Corrupt"):
        load_calibration(tmp_path, key)
    os.remove(path)
    os.mkdir(path)
    with pytest.raises(ValueError, match="directory"):
        load_calibration(tmp_path, key)


def test_file_of_another_model_or_config_is_rejected(tmp_path):
    key, other = make_key(), make_key(model_id="qwen2-ffff", iters=5)
    src = save_calibration(tmp_path, other, small_codebooks(other))
    shutil.copy(src, calibration_path(tmp_path, key))
    with pytest.raises(ValueError, match="different model or configuration") as e:
        load_calibration(tmp_path, key)
    assert "model_id" in str(e.value) and "iters" in str(e.value)
    assert calibration_path(tmp_path, key) in str(e.value)


def test_save_validates_codebooks(tmp_path):
    key = make_key()
    with pytest.raises(ValueError, match="layers"):
        save_calibration(tmp_path, key, small_codebooks(key)[:2])
    bad = small_codebooks(make_key(per_group=True))
    with pytest.raises(ValueError, match=r"shape of codebooks\[0\]"):
        save_calibration(tmp_path, key, bad)
    with pytest.raises(ValueError, match="Unknown calibration key"):
        load_calibration(tmp_path, key.to_dict() | {"colour": "red"})


def test_unwritable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    target = blocker / "cache"
    with pytest.raises(OSError, match="directory .*a-file"):
        save_calibration(target, make_key(), small_codebooks(make_key()))


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root ignores directory permissions")
def test_read_only_directory_is_a_clear_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(OSError, match="ro"):
            save_calibration(ro, make_key(), small_codebooks(make_key()))
    finally:
        ro.chmod(0o700)


def test_crash_during_save_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    key = make_key()
    old = small_codebooks(key, seed=0)
    save_calibration(tmp_path, key, old)

    def crash(src, dst):
        raise KeyboardInterrupt  # a crash between writing and renaming

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        save_calibration(tmp_path, key, small_codebooks(key, seed=1))
    monkeypatch.undo()
    assert len(os.listdir(tmp_path)) == 1
    for got, want in zip(load_calibration(tmp_path, key), old):
        np.testing.assert_array_equal(got, want)


def test_load_or_calibrate_caches_and_replaces_corrupt_files(tmp_path):
    rng = np.random.default_rng(12)
    layers = [rng.standard_normal((2, 200, 16)).astype(np.float32) for _ in range(3)]
    key = make_key()
    calls = []

    def sample():
        calls.append(1)
        return layers

    cbs, cached = load_or_calibrate(tmp_path, key, sample)
    assert not cached and len(calls) == 1
    again, cached = load_or_calibrate(tmp_path, key, sample)
    assert cached and len(calls) == 1
    for a, b in zip(cbs, again):
        np.testing.assert_array_equal(a, b)
    path = calibration_path(tmp_path, key)
    open(path, "r+b").truncate(100)
    with pytest.warns(UserWarning, match="Corrupt"):
        _, cached = load_or_calibrate(tmp_path, key, sample)
    assert not cached and len(calls) == 2
    assert load_calibration(tmp_path, key) is not None


def test_model_fingerprint_is_stable_and_sensitive():
    from conftest import make_small_model

    a = make_small_model("llama-gqa-d64", layers=2, vocab=512)
    fp = model_fingerprint(a)
    assert fp.startswith("llama-") and fp == model_fingerprint(a)
    assert fp == model_fingerprint(make_small_model("llama-gqa-d64", layers=2, vocab=512))
    assert fp != model_fingerprint(make_small_model("llama-gqa-d64", layers=2, vocab=512, seed=1))
    assert fp != model_fingerprint(make_small_model("llama-gqa-d64", layers=3, vocab=512))
    # a change in one sampled weight changes the id
    from mlx.utils import tree_flatten, tree_unflatten

    name, w = min(tree_flatten(a.parameters()), key=lambda kv: kv[0])  # always sampled
    a.update(tree_unflatten([(name, w.at[0].add(1.0) if w.ndim else w + 1)]))
    assert model_fingerprint(a) != fp
