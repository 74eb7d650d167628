"""Kernels compiled in processes of their own (tiered.metal.nvrtc_child): the same bytes as a
compile in this process, NVRTC's errors raised here, and this process's compile where no child
can load NVRTC. NVRTC itself: on a machine with MLX's CUDA wheel, or from wheels unpacked under
``$TIERED_NVRTC_SITE`` (bench/probes/nvrtc_check.py says how), else those tests skip."""

from __future__ import annotations

import ctypes
import glob
import os
from pathlib import Path

import pytest

from tiered.metal import nvrtc

SOURCE = r"""
#include "mlx/backend/cuda/device/utils.cuh"
namespace mlx::core::cu {
__global__ void scaled_%(i)d(const float* a, float* b, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) b[i] = a[i] * %(i)d.0f + expf(a[i]);
}
}
"""


@pytest.fixture
def real_nvrtc(monkeypatch):
    """NVRTC and MLX's CUDA headers: this machine's, or those under $TIERED_NVRTC_SITE (then
    compiled for an sm_90 device)."""
    site = os.environ.get("TIERED_NVRTC_SITE")
    if site:
        libs = sorted(glob.glob(str(Path(site) / "nvidia/*/lib/libnvrtc.so*")))
        if not libs:
            pytest.skip(f"no libnvrtc under {site}")
        lib = ctypes.CDLL(libs[-1])
        monkeypatch.setattr(nvrtc, "libmlx", lambda: Path(site) / "mlx" / "lib" / "libmlx.so")
        monkeypatch.setattr(nvrtc, "compute_capability", lambda ordinal=0: (9, 0))
        monkeypatch.setattr(nvrtc, "_nvrtc", lambda: lib)
        nvrtc.embedded_headers.cache_clear()
        yield
        nvrtc.embedded_headers.cache_clear()
        return
    try:
        nvrtc._nvrtc(), nvrtc.embedded_headers(), nvrtc.compute_capability(0)
    except (OSError, RuntimeError, FileNotFoundError) as e:
        pytest.skip(f"no NVRTC and CUDA build of MLX here ({e})")
    yield


def _compile(i: int, processes: str, monkeypatch):
    monkeypatch.setattr(nvrtc, "_children", {"ok": True})
    monkeypatch.setenv("TIERED_COMPILE_PROCESSES", processes)
    return nvrtc.compile_kernel(SOURCE % {"i": i}, f"scaled_{i}", f"mlx::core::cu::scaled_{i}")


def test_a_child_compiles_the_bytes_this_process_compiles(real_nvrtc, monkeypatch):
    here = _compile(3, "0", monkeypatch)
    child = _compile(3, "1", monkeypatch)
    assert nvrtc._children == {"ok": True}  # the child compiled it, not this process after it
    assert child == here and here[1] == "_ZN3mlx4core2cu8scaled_3EPKfPfi"
    assert _compile(4, "1", monkeypatch)[0] != here[0]


def test_an_nvrtc_error_in_the_child_is_raised_here(real_nvrtc, monkeypatch):
    monkeypatch.setattr(nvrtc, "_children", {"ok": True})
    monkeypatch.setenv("TIERED_COMPILE_PROCESSES", "1")
    monkeypatch.setattr(nvrtc, "compile_program", lambda *a: pytest.fail("compiled here"))
    with pytest.raises(RuntimeError, match="NVRTC could not compile broken.*undefined"):
        nvrtc.compile_kernel("__global__ void k() { undefined_name(); }", "broken", "k")


def test_where_no_child_can_load_nvrtc_this_process_compiles(monkeypatch):
    """The child runs on the standard library alone (``python -I``): a library it cannot load
    hands the compile back (None), compile_kernel then compiles in this process, and no more
    children are started."""
    class Lib:
        _name = "/nonexistent/libnvrtc.so.99"

    monkeypatch.setattr(nvrtc, "_children", {"ok": True})
    assert nvrtc._in_child(Lib(), "", "m", "k", {}, [], False) is None
    assert nvrtc._children == {"ok": False}
    nvrtc._children["ok"] = True
    calls = []
    monkeypatch.setattr(nvrtc, "_nvrtc", lambda: Lib())
    monkeypatch.setattr(nvrtc, "compute_capability", lambda ordinal=0: (9, 0))
    monkeypatch.setattr(nvrtc, "_sass", lambda lib, cc: True)
    monkeypatch.setattr(nvrtc, "include_paths", lambda: [])
    monkeypatch.setattr(nvrtc, "embedded_headers", lambda: {"h.cuh": b"//"})
    monkeypatch.setattr(nvrtc, "compile_program",
                        lambda *a: calls.append(a[1:4]) or (b"code", "mangled"))
    monkeypatch.setenv("TIERED_COMPILE_PROCESSES", "1")
    assert nvrtc.compile_kernel("src", "mod", "k") == (b"code", "mangled")
    assert calls == [("src", "mod", "k")] and nvrtc._children == {"ok": False}
    monkeypatch.setattr(nvrtc, "_in_child", lambda *a: pytest.fail("a child after one failed"))
    assert nvrtc.compile_kernel("src2", "mod2", "k2") == (b"code", "mangled")
    assert calls[1] == ("src2", "mod2", "k2")


def test_a_library_loaded_by_name_is_handed_to_the_child_by_its_file():
    """A child's search path is not this process's (MLX loaded NVRTC from the wheel's own
    directory): the child gets the file this process mapped."""
    ctypes.CDLL("libc.so.6")
    path = nvrtc._library_path("libc.so.6")
    assert os.path.isabs(path) and os.path.exists(path)
    assert os.path.basename(path).startswith("libc.so")
    assert nvrtc._library_path("/some/abs/libnvrtc.so.13") == "/some/abs/libnvrtc.so.13"
    assert nvrtc._library_path("libnot-loaded-here.so.7") == "libnot-loaded-here.so.7"
