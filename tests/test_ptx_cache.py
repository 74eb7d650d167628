"""Custom CUDA kernels cached per machine (tiered.metal.ptx_cache): the entry is written under
the name MLX looks for, MLX runs what the entry holds, and a second process compiles nothing.
The CUDA cases run in subprocesses: MLX fixes its cache directory at its first compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import pytest

from tiered.runtime import uva
from tiered.metal import ptx_cache

needs_cuda = pytest.mark.skipif(not uva.available(),
                                reason="custom CUDA kernels need MLX's CUDA backend")

MASK = (1 << 64) - 1


def murmur_hash64a(data: bytes, seed: int) -> int:
    """libstdc++'s 64-bit ``_Hash_bytes`` written out (the reference for std_hash)."""
    mul, h = 0xC6A4A7935BD1E995, (seed ^ (len(data) * 0xC6A4A7935BD1E995)) & MASK
    whole = len(data) & ~7
    for i in range(0, whole, 8):
        k = int.from_bytes(data[i:i + 8], "little") * mul & MASK
        k = (k ^ (k >> 47)) * mul & MASK
        h = ((h ^ k) * mul) & MASK
    if len(data) & 7:
        h = ((h ^ int.from_bytes(data[whole:], "little")) * mul) & MASK
    h = ((h ^ (h >> 47)) * mul) & MASK
    return h ^ (h >> 47)


@pytest.mark.parametrize("text", ["", "a", "abcdefg", "abcdefgh", "custom_kernel_x" * 37])
def test_std_hash_is_libstdcxx_murmur(text):
    assert ptx_cache.std_hash(text) == murmur_hash64a(text.encode(), 0xC70F6907)


def test_long_module_names_split_into_directories_as_mlx_does(tmp_path):
    name = "k" * 600
    path = ptx_cache.ptx_path(name, tmp_path)
    parts = path.relative_to(tmp_path).parts
    assert [len(p) for p in parts] == [245, 245, 110 + len(".ptx")]
    assert "".join(parts) == name + ".ptx"
    assert ptx_cache.ptx_path("short", tmp_path) == tmp_path / "short.ptx"


_CHILD = r'''
import json, sys
import mlx.core as mx
from tiered.metal import nvrtc, ptx_cache

mode = sys.argv[1]
spec = dict(name="probe", input_names=["a", "n"], output_names=["o", "flag"],
            source="o[0] = VAL + a_shape[0] + n[0]; flag[0] = B ? 1 : 0;")
a, n = mx.zeros((5,), mx.float16), mx.array(2, mx.int32)
launch = dict(inputs=[a, n], output_shapes=[(1,), (1,)], output_dtypes=[mx.float32, mx.int32],
              grid=(1, 1, 1), threadgroup=(1, 1, 1),
              template=[("VAL", 3), ("B", True), ("T", mx.float16)])
sig = [(a.dtype, a.ndim), (n.dtype, n.ndim)]
if mode == "verbose":
    mx.eval(mx.fast.cuda_kernel(**spec)(**launch, verbose=True))
    sys.stdout.flush()
    func, text = ptx_cache.kernel_source(spec["name"], spec["input_names"], spec["output_names"],
                                         spec["source"], "", sig, launch["output_dtypes"],
                                         launch["template"])
    print("\n@@" + json.dumps({"func": func, "text": text}))
elif mode == "planted":  # another body's code under this launch's module name
    func, text = ptx_cache.kernel_source(spec["name"], spec["input_names"], spec["output_names"],
                                         spec["source"], "", sig, launch["output_dtypes"],
                                         launch["template"])
    module = f"{func}_{ptx_cache.std_hash(text):x}"
    other = text.replace("o[0] = VAL", "o[0] = 1000 + VAL")
    code, mangled = nvrtc.compile_kernel(other, module, "mlx::core::cu::" + func)
    path = ptx_cache.ptx_path(module)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".txt").write_text(f"mlx::core::cu::{func}\t{mangled}\n")
    path.write_bytes(code)
    o, flag = mx.fast.cuda_kernel(**spec)(**launch)
    print("\n@@" + json.dumps({"o": o.item(), "flag": flag.item()}))
else:  # through the cache
    o, flag = ptx_cache.cuda_kernel(**spec)(**launch)
    ptx_cache.settle()  # as tiered's evaluations do: the entry written before MLX looks
    print("\n@@" + json.dumps({"o": o.item(), "flag": flag.item(),
                               "compiled": ptx_cache.compiled_here()}))
'''


def _child(mode: str, cache: Path) -> tuple[str, dict]:
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(cache))
    out = subprocess.run([sys.executable, "-P", "-c", _CHILD, mode], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    head, _, tail = out.stdout.rpartition("\n@@")
    return head, json.loads(tail)


@needs_cuda
def test_the_source_built_here_is_the_one_mlx_generates(tmp_path):
    printed, ours = _child("verbose", tmp_path)
    assert f"Generated source code for `{ours['func']}`:\n```\n" in printed
    body = printed.split(f"`{ours['func']}`:\n```\n", 1)[1].rsplit("\n```", 1)[0]
    assert body == ours["text"]


@needs_cuda
def test_mlx_runs_the_entry_written_under_its_module_name(tmp_path):
    # 3 + 5 (a's length) + 2 = 10 from the kernel's own source; the planted body adds 1000
    _, got = _child("planted", tmp_path)
    assert got == {"o": 1010.0, "flag": 1}


@needs_cuda
def test_a_second_process_compiles_nothing(tmp_path):
    _, first = _child("cached", tmp_path)
    _, second = _child("cached", tmp_path)
    assert first == {"o": 10.0, "flag": 1, "compiled": 1}
    assert second == {"o": 10.0, "flag": 1, "compiled": 0}
    assert len(list(tmp_path.rglob("custom_kernel_probe_3_t_float16_t_*.ptx"))) == 1


def _probe_request(value: int):
    return ptx_cache.request("probe", ["a"], ["o"], "o[0] = V + a[0];", "", [(mx.float32, 1)],
                             [mx.float32], [("V", value)])


@pytest.fixture
def fake_nvrtc(tmp_path, monkeypatch):
    """NVRTC replaced by a recorder, the cache in tmp_path and a fresh pool of three threads."""
    from tiered.metal import nvrtc

    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TIERED_COMPILE_THREADS", "3")
    monkeypatch.setattr(ptx_cache, "_pool", None)
    monkeypatch.setattr(ptx_cache, "_pending", {})
    monkeypatch.setattr(ptx_cache, "_later", {})
    monkeypatch.setattr(ptx_cache, "_idle", {})
    monkeypatch.setitem(ptx_cache._state, "enabled", True)
    calls = []

    def install(body):
        def fake(text, module, kernel, ordinal=0):
            calls.append(module)
            body()
            return b"// code of " + module.encode(), kernel + "_lowered"

        monkeypatch.setattr(nvrtc, "compile_kernel", fake)
        return calls

    return install


def test_compiles_run_side_by_side_and_settle_waits_for_all(fake_nvrtc, tmp_path):
    gate = threading.Barrier(3, timeout=30)  # three compiles at once, or it breaks
    calls = fake_nvrtc(gate.wait)
    before = ptx_cache.compiled_here()  # before any job: the workers finish on their own
    jobs = [_probe_request(v) for v in range(3)]
    assert all(j is not None for j in jobs)
    again = _probe_request(0)  # the same entry while it is written: the same job
    assert again is None or again is jobs[0]
    ptx_cache.settle()
    assert not ptx_cache._pending
    assert len(calls) == 3 and len(set(calls)) == 3
    assert ptx_cache.compiled_here() - before == 3
    for module in calls:
        path = ptx_cache.ptx_path(module, tmp_path)
        assert path.read_bytes() == b"// code of " + module.encode()
        kernel, lowered = path.with_suffix(".txt").read_text().rstrip("\n").split("\t")
        assert lowered == kernel + "_lowered" and kernel.startswith("mlx::core::cu::")
    assert _probe_request(1) is None  # written: nothing to compile
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_failed_compile_turns_the_cache_off_with_a_warning(fake_nvrtc):
    def broken():
        raise RuntimeError("NVRTC could not compile")

    fake_nvrtc(broken)
    assert _probe_request(7) is not None
    with pytest.warns(RuntimeWarning, match="not cached on disk"):
        ptx_cache.settle()
    assert not ptx_cache._state["enabled"] and not ptx_cache._pending


def test_compiles_for_later_are_waited_for_where_asked(fake_nvrtc):
    """A compile requested for later (a layer's compression, prepared at its first chunk) is
    not waited for by settle; join_later waits for it, and so does the next settle once a
    request or a launch of the same entry asks for it now."""
    go = threading.Event()
    fake_nvrtc(lambda: go.wait(30))
    a = ptx_cache.request("probe", ["a"], ["o"], "o[0] = 1 + a[0];", "", [(mx.float32, 1)],
                          [mx.float32], [("V", 1)], later=True)
    b = ptx_cache.request("probe", ["a"], ["o"], "o[0] = 2 + a[0];", "", [(mx.float32, 1)],
                          [mx.float32], [("V", 2)], later=True)
    assert a is not None and b is not None and len(ptx_cache._later) == 2
    ptx_cache.settle()  # returns at once: nothing waits for them yet
    assert not a.done() and not ptx_cache._pending
    now = ptx_cache.request("probe", ["a"], ["o"], "o[0] = 1 + a[0];", "", [(mx.float32, 1)],
                            [mx.float32], [("V", 1)])  # asked for now: the next settle waits
    assert now is a
    assert list(ptx_cache._pending.values()) == [a] and list(ptx_cache._later.values()) == [b]
    go.set()
    ptx_cache.settle()
    assert a.done() and not ptx_cache._pending
    ptx_cache.join_later()
    assert b.done() and not ptx_cache._later and not ptx_cache._pending


def _held_probe(fake_nvrtc, monkeypatch):
    """(go, launched, a CachedKernel factory): compiles held until ``go``, launches recorded."""
    go = threading.Event()
    fake_nvrtc(lambda: go.wait(30))
    launched = []
    monkeypatch.setattr(ptx_cache, "NATIVE", False)
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **spec: lambda **kw: launched.append(kw))

    def kernel():
        return ptx_cache.CachedKernel(name="probe", input_names=["a"], output_names=["o"],
                                      source="o[0] = a[0];")
    return go, launched, kernel


def _launch(k, v: int):
    return k(inputs=[mx.zeros((2,))], output_dtypes=[mx.float32], output_shapes=[(2,)],
             grid=(1, 1, 1), threadgroup=(1, 1, 1), template=[("V", v)])


def test_a_launch_of_a_prepared_signature_waits_for_its_compile(fake_nvrtc, monkeypatch):
    go, launched, kernel = _held_probe(fake_nvrtc, monkeypatch)
    k = kernel()
    k.prepare([(mx.float32, 1)], [mx.float32], [("V", 3)])
    (job,) = ptx_cache._later.values()
    assert not ptx_cache._pending
    _launch(k, 3)
    assert launched and list(ptx_cache._pending.values()) == [job] and not ptx_cache._later
    go.set()
    ptx_cache.settle()
    assert job.done() and not k.later


def test_an_idle_compile_is_waited_for_by_its_launch_only(fake_nvrtc, monkeypatch):
    """Prepared idle (the decode step's kernels, under ptx_cache.ahead): neither settle nor a
    layer's compression (join_later) waits for it, nor does another idle request of the same
    entry make it one; a launch of its signature makes the next settle wait."""
    go, launched, kernel = _held_probe(fake_nvrtc, monkeypatch)
    k = kernel()
    with ptx_cache.ahead():
        out = _launch(k, 4)
        _launch(kernel(), 4)  # another kernel object, the same entry: still idle
    assert not launched and out[0].shape == (2,) and not out[0].any().item()
    (job,) = ptx_cache._idle.values()
    ptx_cache.settle()
    ptx_cache.join_later()  # both return at once (the compile is held until go)
    assert not job.done() and not ptx_cache._pending and not ptx_cache._later
    _launch(k, 4)
    assert launched and list(ptx_cache._pending.values()) == [job] and not ptx_cache._idle
    go.set()
    ptx_cache.settle()
    assert job.done() and not k.later
