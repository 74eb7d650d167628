"""Damaged and hostile saved caches: every load ends in a loaded cache that decodes as the
original did, or in one clear error (SnapshotError, a ValueError) — never a crash, a hang, or
a byte written outside the directories involved.

Each load runs in a child process under a timeout (a segfault or a hang fails the case, it
does not take the test run down). Mutations of a real save (a small model, the disk tier in
use so pages are saved too): each file truncated, bytes flipped in each file, the manifest's
names pointed outside the directory (with its checksums recomputed, so only the name checks
stand), data files swapped with those of a save of another model, the manifest's numbers and
types replaced by hostile ones (negative, huge, wrong type).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import make_small_model

from tiered import TieredCache
from tiered.prefill import prefill

CHILD_TIMEOUT_S = 120
OK, REFUSED = "loaded", "refused"

CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import tiered, mlx.core as mx
    from conftest import make_small_model
    model = make_small_model("llama-gqa-d64", layers=3, seed={seed})
    for path in {paths!r}:
        print(json.dumps({{"start": path}}), flush=True)
        try:
            cache = tiered.TieredCacheList.load(path, model)
        except ValueError as e:
            print(json.dumps({{"result": "refused", "error": type(e).__name__ + ": " + str(e)}}),
                  flush=True)
            continue
        out = model(mx.array([[11, 12, 13]]), cache=cache)
        print(json.dumps({{"result": "loaded", "logits": out[0, -1, :64].tolist()}}), flush=True)
        cache.close()
""")


def _save(tmp, seed, name):
    model = make_small_model("llama-gqa-d64", layers=3, seed=seed)
    ids = np.random.default_rng(seed).integers(10, 49000, 500).tolist()
    cache = TieredCache.for_model(model, gpu_budget=0.25, page_size=64, recent=16,
                                  prefill_window=256, host_budget="150KB",
                                  disk_dir=str(tmp / f"live{seed}"))
    prefill(model, cache, ids, chunk=250)
    cache.save(str(tmp / name), model)
    cache.close()
    return tmp / name


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("saves")
    a, b = _save(tmp, 1, "a"), _save(tmp, 2, "b")
    assert any(p.name.startswith("pages-") for p in a.iterdir()), "no disk tier in the save"
    return tmp, a, b


def _load_all(paths, seed=1):
    """Load each directory in one child process; a crash or a hang names the case."""
    code = CHILD.format(tests=os.path.dirname(__file__), seed=seed, paths=[str(p) for p in paths])
    timeout = CHILD_TIMEOUT_S + 10 * len(paths)
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=timeout, cwd=str(paths[0].parent))
        out = r.stdout
    except subprocess.TimeoutExpired as e:
        out, r = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), None
    lines = [json.loads(x) for x in out.strip().splitlines() if x.startswith("{")]
    started = [x["start"] for x in lines if "start" in x]
    results = [x for x in lines if "result" in x]
    if r is None:
        pytest.fail(f"loading {started[-1] if started else paths[0]} hung")
    assert r.returncode == 0, (f"loading {started[-1] if started else paths[0]} crashed (exit "
                               f"{r.returncode}): {r.stderr[-800:]}")
    assert len(results) == len(paths)
    return results


def _load(path, seed=1):
    return _load_all([path], seed)[0]


def _files(d):
    return sorted(p for p in d.rglob("*") if p.is_file())


def _tree(root):
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


def _copy(src, dst):
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _manifest(d):
    return json.loads((d / "tiered.json").read_text())


def _write_manifest(d, meta, *, rehash=True):
    if rehash:  # checksums that match the (changed) files: only the other checks stand
        for name, entry in meta.get("files", {}).items():
            p = d / name
            if p.is_file():
                entry["bytes"] = p.stat().st_size
                entry["sha256"] = hashlib.sha256(p.read_bytes()).hexdigest()
    (d / "tiered.json").write_text(json.dumps(meta))


def _check_all(root, cases, expect_refused=True, reference=None):
    """Load every case; none may write outside its directory; refused, or loaded and
    decoding as the reference."""
    before = _tree(root)
    got = _load_all(cases)
    new = sorted(k for k in set(_tree(root)) - set(before)
                 if not any(k.startswith(c.name + os.sep) for c in cases))
    assert not new, f"a load wrote {new}"
    for case, g in zip(cases, got):
        if g["result"] == OK:
            assert not expect_refused or reference is not None, (case.name, g)
            if reference is not None:
                np.testing.assert_allclose(g["logits"], reference, rtol=1e-5, atol=1e-5)
        elif expect_refused is None:
            pass
    return got


def test_the_intact_save_loads(saves):
    root, a, _ = saves
    (got,) = _check_all(root, [a], expect_refused=False)
    assert got["result"] == OK


def test_truncated_and_flipped_files_are_refused(saves):
    root, a, _ = saves
    files = [p.relative_to(a) for p in _files(a)]
    assert len(files) >= 3
    cases = []
    for i, rel in enumerate(files):
        for kind in ("truncate", "flip"):
            case = _copy(a, root / f"{kind}{i}")
            p = case / rel
            data = bytearray(p.read_bytes())
            if kind == "truncate":
                data = data[: len(data) // 2]
            else:
                for j in range(0, len(data), max(1, len(data) // 7)):
                    data[j] ^= 0x5A
            p.write_bytes(bytes(data))
            cases.append(case)
    for case, got in zip(cases, _check_all(root, cases)):
        assert got["result"] == REFUSED, (case.name, got)


def test_swapped_files_from_another_models_save_are_refused(saves):
    root, a, b = saves
    cases = []
    for i, src in enumerate(_files(b)):
        if src.name == "tiered.json":
            continue
        for rehash in (False, True):
            case = _copy(a, root / f"swap{i}{rehash}")
            targets = [p for p in _files(case) if p.suffix == src.suffix and p.name != "tiered.json"]
            shutil.copyfile(src, targets[0])
            if rehash:  # the checksums recomputed: the content checks refuse it
                _write_manifest(case, _manifest(case))
            cases.append(case)
    for case, got in zip(cases, _check_all(root, cases)):
        assert got["result"] == REFUSED, (case.name, got)


HOSTILE_NAMES = ["../outside.safetensors", "/etc/passwd", "pages-x/../../x", "a/b/c/d",
                 "..", "", "tiered.json", "pages-" + "0" * 12 + "/../../../y"]


def test_names_outside_the_directory_are_refused(saves):
    root, a, _ = saves
    (root / "outside.safetensors").write_bytes((a / next(
        p.name for p in a.iterdir() if p.suffix == ".safetensors")).read_bytes())
    cases = []
    for i, name in enumerate(HOSTILE_NAMES):
        for key in ("cache", "pages"):
            case = _copy(a, root / f"name{i}{key}")
            meta = _manifest(case)
            meta[key] = name
            _write_manifest(case, meta)
            cases.append(case)
    for case, got in zip(cases, _check_all(root, cases)):
        assert got["result"] == REFUSED, (case.name, got)


HOSTILE_VALUES = [-1, 2**63, "x", None, [], True]


def test_hostile_manifest_values_are_refused_or_harmless(saves):
    root, a, _ = saves
    reference = _load(a)["logits"]
    cases = []
    for k, v in _manifest(a).items():
        if isinstance(v, dict):
            continue
        for j, value in enumerate(HOSTILE_VALUES):
            case = _copy(a, root / f"val_{k}_{j}")
            meta = _manifest(case)
            meta[k] = value
            _write_manifest(case, meta)
            cases.append(case)
    # a field the load does not depend on may load: then it decodes as saved
    _check_all(root, cases, expect_refused=False, reference=reference)
