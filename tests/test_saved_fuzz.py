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
from tiered.persistence.snapshot import manifest_digest

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
    """The snapshot's files (not its lock files, which hold no data)."""
    return sorted(p for p in d.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


def _tree(root):
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


def _copy(src, dst):
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _manifest(d):
    return json.loads((d / "tiered.json").read_text())


def _write_manifest(d, meta, *, rehash=True):
    if rehash:  # checksums and digest that match the (changed) files: the other checks stand
        for name, entry in meta.get("files", {}).items() if isinstance(meta.get("files"),
                                                                        dict) else ():
            p = d / name if isinstance(name, str) else None
            if p is not None and isinstance(entry, dict) and p.is_file():
                entry["bytes"] = p.stat().st_size
                entry["sha256"] = hashlib.sha256(p.read_bytes()).hexdigest()
        meta["digest"] = manifest_digest(meta)
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


# ---- every field: the manifest's options, the states' metadata, with and without re-signing --
def _case(root, a, name):
    """A copy of save ``a`` whose data files are hard links (a load never writes into them;
    a case that edits one writes a new file in its place)."""
    case = root / name
    shutil.copytree(a, case, copy_function=os.link)
    (case / "tiered.json").unlink()
    shutil.copyfile(a / "tiered.json", case / "tiered.json")
    return case


def _other_value(v):
    """A valid-looking value of the same kind as ``v`` that differs from it."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + 1
    if isinstance(v, float):
        return v / 2
    if isinstance(v, str):
        return v + "x"
    return 1


OPTION_VALUES = [-1, 2**63, "x", None, True, float("nan"), [], {"a": 1}]


def _same_options(edited: dict, saved: dict) -> bool:
    """Whether ``edited`` is ``saved`` once the config fills its defaults (rescore=None is
    the rescoring the saved options chose), runtime options aside."""
    from tiered import TieredConfig
    from tiered.options.config import RUNTIME_OPTIONS

    try:
        a, b = (TieredConfig.from_kwargs(**c).to_dict() for c in (edited, saved))
    except (TypeError, ValueError):
        return False
    return all(a[k] == b[k] for k in a if k not in RUNTIME_OPTIONS)


def test_every_manifest_option_edited_is_refused_or_decodes_as_saved(saves):
    """Each option in the manifest, replaced by a hostile value or another valid-looking one:
    re-signed (checksums and digest recomputed), the load refuses it unless the option is a
    runtime one (then it decodes as saved, writing nowhere but its directory); not re-signed,
    the digest refuses every edit."""
    from tiered.options.config import RUNTIME_OPTIONS

    root, a, _ = saves
    reference = _load(a)["logits"]
    config = _manifest(a)["config"]
    cases, runtime = [], []
    for k, v in config.items():
        for j, value in enumerate(OPTION_VALUES + [_other_value(v)]):
            if value == v and type(value) is type(v):
                continue
            case = _case(root, a, f"opt_{k}_{j}")
            meta = _manifest(case)
            meta["config"][k] = value
            _write_manifest(case, json.loads(json.dumps(meta)))  # NaN as JSON writes it
            cases.append(case)
            runtime.append(k in RUNTIME_OPTIONS)
        case = _case(root, a, f"opt_{k}_unsigned")
        meta = _manifest(case)
        meta["config"][k] = _other_value(v)
        _write_manifest(case, meta, rehash=False)  # the digest refuses it, runtime or not
        cases.append(case)
        runtime.append(False)
    got = _check_all(root, cases, expect_refused=False, reference=reference)
    for case, is_runtime, g in zip(cases, runtime, got):
        if case.name.endswith("_unsigned") or not (
                is_runtime or _same_options(_manifest(case)["config"], config)):
            assert g["result"] == REFUSED, (case.name, g)
    print(f"{len(cases)} option edits: {sum(g['result'] == OK for g in got)} loaded (runtime "
          f"options, decoding as saved), {sum(g['result'] == REFUSED for g in got)} refused")
    assert len(cases) >= 8 * len(config)


def _edit_states(case, edit):
    """Rewrite the case's states file with ``edit(meta: dict)`` applied to every layer's
    metadata JSON (what mlx-lm stores as a string of char codes)."""
    import mlx.core as mx

    path = next(p for p in case.iterdir() if p.suffix == ".safetensors")
    arrays, metadata = mx.load(str(path), return_metadata=True)
    for key in list(arrays):
        if key.count(".") == 1 and key.endswith(".2") and arrays[key].ndim == 1:
            meta = json.loads("".join(chr(i) for i in arrays[key].tolist()))
            edit(meta)
            arrays[key] = mx.array([ord(c) for c in json.dumps(meta)])
    path.unlink()  # a hard link: write a new file in its place
    mx.save_safetensors(str(path), arrays, metadata)


STATE_EDITS = {
    "offset+1": lambda m: m.update(offset=m["offset"] + 1),
    "offset-1": lambda m: m.update(offset=m["offset"] - 1),
    "offset huge": lambda m: m.update(offset=2**62),
    "layer": lambda m: m.update(layer=m["layer"] + 1),
    "layers": lambda m: m.update(layers=m["layers"] * 1000),
    "phase exact": lambda m: m.update(phase="exact"),
    "geometry heads": lambda m: m.update(geometry=[1, 7] + m["geometry"][2:]),
    "geometry dtype": lambda m: m.update(geometry=m["geometry"][:4] + ["int8"]),
    "scale": lambda m: m.update(scale="x"),
    "head_perm": lambda m: m.update(head_perm=[0, 0, 1]),
    "returned": lambda m: m.update(returned=[[1, 2, 3]]),
    "format": lambda m: m.update(format=1),
}


def test_every_state_field_edited_is_refused_or_decodes_as_saved(saves):
    """Each layer's saved metadata (the states inside the .safetensors) edited field by field,
    and each option in the states edited, the manifest re-signed so that only the content
    checks stand: refused, or loaded and decoding as saved."""
    root, a, _ = saves
    reference = _load(a)["logits"]
    edits = dict(STATE_EDITS)
    for k, v in _manifest(a)["config"].items():
        edits[f"config {k}"] = (lambda k, v: lambda m: m["config"].update({k: _other_value(v)}))(
            k, v)
    cases = []
    for i, (name, edit) in enumerate(edits.items()):
        case = _case(root, a, f"state{i}")
        _edit_states(case, edit)
        _write_manifest(case, _manifest(case))
        cases.append(case)
    got = _check_all(root, cases, expect_refused=False, reference=reference)
    refused = sum(g["result"] == REFUSED for g in got)
    print(f"{len(cases)} state edits: {refused} refused, {len(cases) - refused} loaded as saved")
    from tiered.options.config import RUNTIME_OPTIONS

    for (name, _), case, g in zip(edits.items(), cases, got):
        if name.startswith("config ") and name[7:] not in RUNTIME_OPTIONS:
            assert g["result"] == REFUSED, (name, g)
