"""MLX's own kernels compiled ahead in side processes (tiered.metal.mlx_warm): every op it runs
is valid MLX; on CUDA each missing module is made in a process of its own and lands in the
cache whole (names file and PTX) and nowhere else; a module that fails warns once and leaves
nothing; modules already cached and dtypes already started make no process; the first settle
waits for the prefill's, the decode's are made after them; the fused swiglu module is named as
MLX names it; nothing starts off CUDA."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest
from tiered.metal import _build, mlx_warm, ptx_cache

WRITE = """
import os, pathlib, time
d = pathlib.Path(os.environ["MLX_PTX_CACHE_DIR"])
time.sleep(0.3)
(d / "{name}.txt").write_text("{name}_kernel\\tmangled_{name}\\n")
(d / "{name}.ptx").write_text("PTX of {name}")
(d / "{name}.cu").write_text("source")
"""


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_every_op_runs_in_mlx(dtype):
    ops = mlx_warm.modules(dtype)
    assert "gather_axis_float32_int32" in ops and f"gather_{dtype}_int32_1" in ops
    assert "gather_float16_int32_1" in ops  # the host rows' dtype, whatever the model's
    phases = [set(mlx_warm.modules(dtype, p)) for p in (mlx_warm.FIRST, mlx_warm.COMPRESS,
                                                       mlx_warm.DECODE)]
    assert set(ops) == set.union(*phases) and sum(map(len, phases)) == len(ops)  # each once
    first = phases[0]  # what the first prompt chunk launches: the embedding, the swiglu
    assert len(first) == 2 and f"gather_{dtype}_int32_1" in first
    assert any("Sigmoid" in n for n in first)
    for name, op in ops.items():
        exec(compile(op, name, "exec"), {"mx": mx})


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_swiglu_module_is_named_as_mlx_names_it(dtype, tmp_path):
    """MLX's CPU backend names its fused library after the same kernel_lib_ as CUDA's module
    (mlx/compile.cpp), in its temporary directory: the name predicted is the one MLX made."""
    import os
    import subprocess
    import sys

    (name, op), = [(n, o) for n, o in mlx_warm.modules(dtype, mlx_warm.PREFILL).items()
                   if "Sigmoid" in n]
    mlx_lm_own = ("from mlx_lm.models.activations import swiglu\n"
                  f"a = mx.zeros((3, 5), mx.{dtype}); b = mx.zeros((3, 5), mx.{dtype})\n"
                  "mx.eval(swiglu(a, b))")
    for i, code in enumerate((op, mlx_lm_own)):  # the op, and what mlx-lm's models run
        tmp = tmp_path / str(i)
        tmp.mkdir()
        subprocess.run([sys.executable, "-c", "import mlx.core as mx\n" + code], check=True,
                       env=dict(os.environ, TMPDIR=str(tmp)), timeout=120)
        made = {p.name for p in tmp.rglob("*.cpp")}
        assert f"{name}_contiguous.cpp" in made, made


def test_model_dtype_is_the_first_floating_parameter():
    import mlx.nn as nn

    lin = nn.Linear(4, 4)
    assert mlx_warm.model_dtype(lin) == "float32"
    lin.set_dtype(mx.bfloat16)
    assert mlx_warm.model_dtype(lin) == "bfloat16"
    q = nn.QuantizedLinear(64, 64)
    q.set_dtype(mx.float16)
    assert mlx_warm.model_dtype(q) == "float16"  # the scales
    assert mlx_warm.model_dtype(nn.Sequential()) is None


def test_nothing_starts_off_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(mlx_warm, "_started", set())
    monkeypatch.setattr(_build, "accelerator", lambda: "cuda")  # as the fake CUDA paths do
    assert not _build._cuda_now()
    assert mlx_warm.start("float16", root=tmp_path) == []
    assert mlx_warm.start_early(root=tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def test_modules_are_made_aside_and_moved_in_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(_build, "_cuda_now", lambda: True)
    monkeypatch.setattr(mlx_warm, "_started", set())
    monkeypatch.setattr(mlx_warm, "_warned", type(mlx_warm._warned)())
    ops = {"mod_a": WRITE.format(name="mod_a"),
           "mod_cached": "raise SystemExit('must not run')",
           "mod_bad": "raise SystemExit(3)", "mod_none": "pass"}
    at_compress = {"mod_b": WRITE.format(name="mod_b")}
    late = {"mod_late": WRITE.format(name="mod_late")}
    monkeypatch.setattr(mlx_warm, "modules", lambda dtype, phase=None: {
        mlx_warm.FIRST: ops, mlx_warm.COMPRESS: at_compress}.get(phase, late))
    monkeypatch.setattr(ptx_cache, "_later", {})
    monkeypatch.setattr(ptx_cache, "_idle", {})
    (tmp_path / "mod_cached.ptx").write_text("old")
    with pytest.warns(RuntimeWarning, match="was not compiled ahead") as caught:
        jobs = mlx_warm.start("float16", root=tmp_path)
        assert len(jobs) == 4  # not the cached one, nor the decode's
        assert tmp_path / "mod_a.ptx" in ptx_cache._pending  # the first chunk's
        assert list(ptx_cache._later) == [tmp_path / "mod_b.ptx"]  # the compression's
        assert tmp_path / "mod_late.ptx" not in ptx_cache._pending  # nothing waits for it
        ptx_cache.settle()  # what tiered's first evaluation does
        ptx_cache.join_later()  # what a layer's compression does
        assert not ptx_cache._later
        late_thread = [t for t in threading.enumerate() if t.name == "tiered-warm-decode"]
        assert len(late_thread) == 1
        late_thread[0].join(60)
    assert len(caught) == 1  # one warning for the two that failed
    assert sorted(j.result() for j in jobs) == [False, False, True, True]
    assert not ptx_cache._pending
    for name in ("mod_a", "mod_b", "mod_late"):
        assert (tmp_path / f"{name}.ptx").read_text() == f"PTX of {name}"
        assert (tmp_path / f"{name}.txt").read_text() == f"{name}_kernel\tmangled_{name}\n"
    # the decode's module was made after the prefill's (their files' times)
    assert (tmp_path / "mod_late.ptx").stat().st_mtime_ns >= max(
        (tmp_path / f"{n}.ptx").stat().st_mtime_ns for n in ("mod_a", "mod_b"))
    assert (tmp_path / "mod_cached.ptx").read_text() == "old"
    left = {p.name for p in tmp_path.iterdir()}
    assert not any(n.startswith(".warm.") for n in left)  # the private directories are gone
    assert not {"mod_bad.ptx", "mod_none.ptx", "mod_none.txt"} & left
    assert mlx_warm.start("float16", root=tmp_path) == []  # once per dtype and process


def test_turned_off(tmp_path, monkeypatch):
    monkeypatch.setattr(_build, "_cuda_now", lambda: True)
    monkeypatch.setattr(mlx_warm, "_started", set())
    monkeypatch.setenv("TIERED_WARM_KERNELS", "0")
    assert mlx_warm.start("float16", root=tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def test_start_for_reads_the_model_dtype_only_where_it_can_start(monkeypatch):
    import mlx.nn as nn

    got = []
    monkeypatch.setattr(mlx_warm, "start", lambda dtype: got.append(dtype) or ["job"])
    monkeypatch.setattr(mlx_warm, "model_dtype", lambda m: got.append("read") or "bfloat16")
    assert mlx_warm.start_for(nn.Linear(2, 2)) == [] and got == []  # this machine: no CUDA
    monkeypatch.setattr(_build, "_cuda_now", lambda: True)
    assert mlx_warm.start_for(nn.Linear(2, 2)) == ["job"] and got == ["read", "bfloat16"]
    monkeypatch.setenv("TIERED_WARM_KERNELS", "0")
    assert mlx_warm.start_for(nn.Linear(2, 2)) == [] and got == ["read", "bfloat16"]


def test_the_prefills_modules_start_at_import_and_the_models_own_are_waited_for(
        tmp_path, monkeypatch):
    """start_early (``import tiered`` on CUDA): the prefill's modules of float16 and bfloat16
    models (the first chunk's, the compression's; one shared by both made once), idle; start
    for the model's dtype then joins them: the first settle waits for its first chunk's, a
    layer's compression (join_later) for its compression's, and nothing for the other
    dtype's."""
    monkeypatch.setattr(_build, "_cuda_now", lambda: True)
    monkeypatch.setattr(mlx_warm, "_started", set())
    monkeypatch.setattr(ptx_cache, "_later", {})
    monkeypatch.setattr(ptx_cache, "_idle", {})
    monkeypatch.setattr(ptx_cache, "_pending", {})
    runs = tmp_path / "runs"
    runs.mkdir()
    root = tmp_path / "ptx"

    def made(name):
        return f"open(r'{runs}/{name}', 'a').write('x')\n" + WRITE.format(name=name)

    def modules(dtype, phase=None):
        names = {mlx_warm.FIRST: [f"first_{dtype}"],
                 mlx_warm.COMPRESS: [f"comp_{dtype}", "comp_shared"]}.get(phase, [])
        return {name: made(name) for name in names}

    monkeypatch.setattr(mlx_warm, "modules", modules)
    early = mlx_warm.start_early(root=root)
    names = ["first_float16", "first_bfloat16", "comp_float16", "comp_shared", "comp_bfloat16"]
    assert len(early) == 6 and early[5] is early[3]  # the shared one: one job
    assert not ptx_cache._pending and not ptx_cache._later
    assert list(ptx_cache._idle) == [root / f"{n}.ptx" for n in names]  # first chunk's first
    jobs = mlx_warm.start("float16", root=root)
    assert jobs == early[:1] + early[2:4]
    assert list(ptx_cache._pending) == [root / "first_float16.ptx"]
    assert list(ptx_cache._later) == [root / "comp_float16.ptx", root / "comp_shared.ptx"]
    ptx_cache.settle()
    assert early[0].done() and (root / "first_float16.ptx").read_text() == "PTX of first_float16"
    ptx_cache.join_later()  # a layer's compression
    assert early[2].done() and early[3].done() and not ptx_cache._later
    assert set(ptx_cache._idle) == {root / "first_bfloat16.ptx", root / "comp_bfloat16.ptx"}
    assert not ptx_cache._pending
    early[1].result(60), early[4].result(60)
    assert sorted(p.name for p in runs.iterdir()) == sorted(names)
    assert all(p.read_text() == "x" for p in runs.iterdir())  # each made once
    assert mlx_warm.start_early(root=root) == []  # made: nothing to start
    monkeypatch.setenv("TIERED_WARM_KERNELS", "0")
    (root / "first_float16.ptx").unlink()
    assert mlx_warm.start_early(root=root) == []
