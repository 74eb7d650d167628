"""Compile the kernel sources on the CPU so a typo cannot hide until someone runs a GPU.

This file holds the launch plans of every kernel (``_plans``, also used by the Metal shim's
tests, tests/test_metal_shim.py, and by tests/test_compact.py) and the CUDA checks: each kernel
is wrapped as ``mx.fast.cuda_kernel`` wraps it (mlx/backend/cuda/custom_kernel.cpp,
``build_kernel``) and compiled to PTX by nvcc, if present, against a stub of MLX's device
header; ptxas's registers per thread must fit the launches. The Metal form is checked by
``g++ -fsyntax-only`` against a shim of the Metal standard library (tests/test_metal_shim.py).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tiered.cpu import HostStore
from tiered.metal import persistent, slab_gather
from tiered.metal._build import KernelSpec
from tiered.metal.affine import AFFINE_SPEC, affine_launch
from tiered.metal.codebook import CODEBOOK_SPEC, codebook_launch
from tiered.metal.h2o import ACC_SPEC, acc_launch
from tiered.metal.select_passes import (COMPACT_SPEC, HIST_SPEC, HIST_THETA_SPEC, KEYS_SPEC,
                                        LMAX_BINS, THETA_SPEC, hist_theta_launch, rank_launches,
                                        threshold_launches)
from tiered.metal.threshold import TAU_SPEC, tau_launch

from metal_wrap import METAL_TYPES

CUDA_TYPES = {**METAL_TYPES, mx.float16: "__half", mx.bfloat16: "__nv_bfloat16"}

# Stands in for mlx/backend/cuda/device/utils.cuh (compiled into MLX, not shipped as a file).
CUDA_UTILS_STUB = r"""
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#define MAX_NDIM 10
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}  // namespace mlx::core::cu
"""


def cuda_source(spec: KernelSpec, header: str, source: str, plan) -> str:
    """The text MLX's cuda_kernel hands to NVRTC."""
    text = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
    text += header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    text += f"__global__ void custom_kernel_{spec.name}(\n"
    params = []
    for arg, arr in zip(spec.input_names, plan.inputs):
        params.append(f"    const {CUDA_TYPES[arr.dtype]}* {arg}")
        for suffix, ctype in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
            if arr.ndim > 0 and arg + suffix in source:
                params.append(f"    const __grid_constant__ {ctype} {arg}{suffix}")
    for arg, dt in zip(spec.output_names, plan.output_dtypes):
        params.append(f"    {CUDA_TYPES[dt]}* {arg}")
    text += ",\n".join(params) + ") {\n"
    for name, v in plan.template:
        if isinstance(v, bool):
            text += f"  constexpr bool {name} = {'true' if v else 'false'};\n"
        elif isinstance(v, int):
            text += f"  constexpr int {name} = {v};\n"
        else:
            text += f"  using {name} = {CUDA_TYPES[v]};\n"
    return text + "\n" + source + "\n}\n\n} // namespace mlx::core::cu\n"


def _codes(h, n_cap, g, dtype):
    return mx.zeros((h, n_cap, g), dtype=dtype)


def _plans(backend: str):
    """(label, spec, plan) for a spread of configurations of every kernel."""
    out = []
    for g, c, dtype, rep, rep_tile, gc, half in [
        (32, 256, mx.uint8, 4, None, 1, False),  # CUDA: whole table in shared memory
        (32, 256, mx.uint8, 4, None, 1, True),  # the same as a float16 table
        (32, 256, mx.uint8, 4, 1, 32, False),  # one head per threadgroup, a codebook per group
        (16, 4096, mx.uint16, 1, None, 1, False),  # table too big: built by MLX in global memory
        (8, 16, mx.uint8, 8, None, 8, False),  # 2 words per token: no vector loads
        (64, 256, mx.uint8, 3, None, 1, False),  # rep 3: scalar table reads
        (64, 256, mx.uint8, 3, None, 1, True),  # ... of float16 entries
    ]:
        words = _codes(2, 40, g, dtype).view(mx.uint32)
        q = mx.zeros((2 * rep, g * 4))
        cb = mx.zeros((2, gc, c, 4))
        lut = mx.zeros((2 * rep, g, c))
        plan = codebook_launch(
            q, cb, words, 33, rep=rep, code_bits=8 * dtype.size, backend=backend,
            rep_tile=rep_tile, lut=lut, lut_half=half,
        )
        label = f"codebook-g{g}-c{c}-rep{rep}-tile{rep_tile}" + ("-half" if half else "")
        out.append((label, CODEBOOK_SPEC, plan))
    for d, bits, gs, sdt, rep in [
        (128, 4, 32, mx.float16, 4), (64, 3, 32, mx.bfloat16, 1),
        (256, 8, 128, mx.float32, 8), (128, 2, 64, mx.float16, 3),
    ]:  # fmt: skip
        h = 2
        q = mx.zeros((h * rep, d))
        wq = mx.zeros((h, 40, d * bits // 32), dtype=mx.uint32)
        sc = mx.zeros((h, 40, d // gs), dtype=sdt)
        plan = affine_launch(q, wq, sc, sc, 33, rep=rep, group_size=gs, bits=bits)
        out.append((f"affine-d{d}-b{bits}-gs{gs}-{sdt}", AFFINE_SPEC, plan))
    out.append(("tau", TAU_SPEC, tau_launch(mx.zeros((8, 40)), 33, 0.9, backend=backend)))
    if backend == "cuda":  # the persistent kernels exist for CUDA only (persistent.py)
        for rep, hr, ex_dtype in [(4, 4, mx.bool_), (3, 3, mx.uint8), (8, 4, mx.bool_)]:
            z, ex = mx.zeros((2 * rep, 40)), mx.zeros((2, 40), dtype=ex_dtype)
            grid = persistent.Grid(chunk=17, blocks=2, hr=hr, smem=131072, groups=3)
            out.append((f"tau-persistent-rep{rep}", persistent.PERSISTENT_SPEC,
                        persistent._select_launch(
                            [z, mx.zeros((2 * rep, 3))], [("REP", rep)], grid, 33, 2, rep, 40, 3,
                            ex, 0.9, 16, 4, 16, stamps=rep == 4)))
        for g, rep, half in [(16, 4, True), (8, 4, False), (16, 3, True)]:  # tables <= 48 KB
            q, cb = mx.zeros((2 * rep, g * 4)), mx.zeros((2, 1, 256, 4))
            grid = persistent.Grid(chunk=17, blocks=2, hr=rep, smem=131072, groups=3)
            out.append((f"codebook-select-g{g}-rep{rep}" + ("-half" if half else ""),
                        persistent.FUSED_SPEC, persistent.fused_plan(
                            q, cb, _codes(2, 40, g, mx.uint8), 33, mx.zeros((2, 40), mx.bool_),
                            0.9, 16, 4, 16, rep=rep, lut_half=half, grid=grid)))
    for rep, ex_dtype in [(4, mx.bool_), (1, mx.uint8), (8, mx.bool_)]:
        z = mx.zeros((2 * rep, 40))
        ex = mx.zeros((2, 40), dtype=ex_dtype)
        hist, theta = threshold_launches(z, 33, mx.zeros((2 * rep, 3)), 0.9, backend=backend)
        keys, compact = rank_launches(z, 33, ex, 16, 4, 16, backend=backend)
        hq, chunks, nb = 2 * rep, hist.output_shapes[0][1], hist.output_shapes[0][2]
        f, u = mx.zeros((hq,)), mx.zeros((2, 1, 2), dtype=mx.uint32)
        code = mx.zeros((2, 33), dtype=mx.uint32)
        lh = mx.zeros((2, 1, 2, LMAX_BINS), dtype=mx.uint32)
        out.append((f"tau-hist-rep{rep}", HIST_SPEC, hist))
        out.append((f"tau-theta-rep{rep}", THETA_SPEC,
                    theta(mx.zeros((hq, chunks, nb, 2), dtype=mx.uint32))))
        out.append((f"tau-hist-theta-rep{rep}", HIST_THETA_SPEC,
                    hist_theta_launch(z, 33, mx.zeros((2 * rep, 3)), 0.9, backend=backend)))
        out.append((f"tau-keys-rep{rep}-{ex_dtype}", KEYS_SPEC, keys(f, f, f)))
        out.append((f"tau-compact-rep{rep}", COMPACT_SPEC, compact(code, lh, u, f, f)))
        out.append((f"h2o-acc-rep{rep}", ACC_SPEC, acc_launch(
            mx.zeros((2, 48)), mx.zeros((2 * rep, 40)), f, f, 33, rep, 0.95)))
    for dtype, d in (("float16", 128), ("float32", 64)):
        store = HostStore(2, d, page_size=16, dtype=dtype, pages_per_block=2, keys=False,
                          unified=True)
        store.append(np.zeros((1, 2, 40, d), np.float32))
        out.append((f"slab-gather-{dtype}-d{d}", slab_gather.SPEC, slab_gather.gather_launch(
            store.values, mx.zeros((2, 6), mx.int32), mx.zeros((2,), mx.int32),
            mx.zeros((3,), mx.int32), mx.zeros((2, 48), mx.uint8), 40, 8)))
    return out  # fmt: skip


def _cuda_file(text: str, workdir: Path, label: str) -> list[str]:
    """Write the kernel and the MLX header stub; the nvcc arguments that compile it."""
    inc = workdir / "include" / "mlx" / "backend" / "cuda" / "device"
    inc.mkdir(parents=True, exist_ok=True)
    (inc / "utils.cuh").write_text(CUDA_UTILS_STUB)
    path = workdir / f"{label}.cu"
    path.write_text(text)
    return ["nvcc", "-std=c++17", "-I", str(workdir / "include"), str(path)]


def _nvcc(text: str, workdir: Path, label: str) -> subprocess.CompletedProcess:
    cmd = _cuda_file(text, workdir, label)
    cmd += ["--ptx", "-arch=sm_80", "-o", str(workdir / f"{label}.ptx")]
    return subprocess.run(cmd, capture_output=True, text=True)


def _check_all(backend, wrap, compile_fn):
    plans = _plans(backend)
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(4) as pool:
        jobs = {}
        for label, spec, plan in plans:
            header, source = spec.sources(backend)
            text = wrap(spec, header, source, plan)
            jobs[label] = pool.submit(compile_fn, text, Path(tmp), label)
        failures = {k: j.result().stderr for k, j in jobs.items() if j.result().returncode != 0}
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())


def _broken(spec: KernelSpec, backend: str, old: str, new: str):
    header, source = spec.sources(backend)
    assert old in source, f"{old!r} not in the {spec.name} body: update this test"
    return header, source.replace(old, new, 1)


# Planted bugs: an undeclared identifier, a type error, and a CUDA-only name in Metal.
BROKEN = [
    ("best[r] = v > best[r] ? v : best[r];", "best[r] = v_typo;"),
    ("words[w] = codes[row + w];", "words[w] = codes;"),
    ("TQ_BARRIER();", "__syncthreads();"),
]

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")


@needs_nvcc
@pytest.mark.slow
def test_cuda_sources_compile_with_nvcc():
    """Every plan at the portable device's shared-memory limit (~37 s in CI: with the slow
    tests; CI compiles every kernel body at an H100's limit in
    test_cuda_launches_fit_the_register_file, the affine plans included)."""
    _check_all("cuda", cuda_source, _nvcc)


@needs_nvcc
def test_cuda_checker_rejects_broken_body():
    label, spec, plan = _plans("cuda")[0]
    header, source = _broken(spec, "cuda", *BROKEN[0])
    with tempfile.TemporaryDirectory() as tmp:
        bad = _nvcc(cuda_source(spec, header, source, plan), Path(tmp), "bad")
    assert bad.returncode != 0, "nvcc accepted an undeclared identifier"


def _ptxas_registers(text: str, workdir: Path, label: str) -> int:
    """Registers per thread that ptxas gives the kernel for sm_90 (what an H100 runs)."""
    cmd = _cuda_file(text, workdir, label)
    cmd += ["-cubin", "-arch=sm_90", "-Xptxas", "-v", "-o", str(workdir / f"{label}.cubin")]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    found = re.findall(r"Used (\d+) registers", out.stderr)
    assert len(found) == 1, out.stderr
    return int(found[0])


@needs_nvcc
@pytest.mark.parametrize("limit", [pytest.param(48 * 1024, marks=pytest.mark.slow),
                                   227 * 1024], ids=["48KB", "227KB"])
def test_cuda_launches_fit_the_register_file(monkeypatch, limit):
    """Threads per block times registers per thread must fit an SM's 64K registers, or the
    launch cannot run, and MLX reports nothing: the scores stay unwritten (an H100 gave
    wrong scores this way for the rep-8 tile at 1024 threads). Checked for the plans of
    every codebook and selection kernel at the shared-memory limits of a portable CUDA
    device and of an H100, which choose different tables (nvcc and ptxas stand in for the
    NVRTC that MLX compiles with). Each limit took ~45 s in CI: the portable device's runs
    with the slow tests (python -m pytest -m slow). The affine plans, whose registers are not
    counted here, are compiled beside them: CI's check that every kernel body compiles."""
    from tiered.metal import codebook

    monkeypatch.setattr(codebook, "shared_memory_limit", lambda backend: limit)
    codebook.lut_tiling.cache_clear()
    try:
        every = _plans("cuda")
        affine = [p for p in every if p[0].startswith("affine")]  # compiled, not counted
        plans = [p for p in every if not p[0].startswith("affine")]
        for rep in (1, 3, 4, 8):  # the benchmark's shape at every GQA ratio
            words = _codes(2, 40, 32, mx.uint8).view(mx.uint32)
            plans.append((f"codebook-d128-rep{rep}", CODEBOOK_SPEC, codebook_launch(
                mx.zeros((2 * rep, 128)), mx.zeros((2, 1, 256, 4)), words, 33, rep=rep,
                code_bits=8, backend="cuda")))
        with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(4) as pool:
            jobs = {label: (plan.threadgroup[0], pool.submit(
                _ptxas_registers, cuda_source(spec, *spec.sources("cuda"), plan), Path(tmp),
                label)) for label, spec, plan in plans}
            compiled = {label: pool.submit(_nvcc, cuda_source(spec, *spec.sources("cuda"), plan),
                                           Path(tmp), label) for label, spec, plan in affine}
            used = {label: (threads, job.result()) for label, (threads, job) in jobs.items()}
            failed = {k: j.result().stderr for k, j in compiled.items() if j.result().returncode}
    finally:
        codebook.lut_tiling.cache_clear()
    # Registers are allocated to a warp in units of 256, i.e. 8 per thread.
    assert not failed, "\n\n".join(f"{k}:\n{v}" for k, v in failed.items())
    over = {k: v for k, v in used.items() if v[0] * (-(-v[1] // 8) * 8) > 65536}
    assert not over, f"(threads, registers) over 64K registers per block: {over}"


def test_preludes_define_the_same_dialect():
    """Both preludes give the bodies the same macros, helpers and thread-index names."""
    from tiered.metal._build import prelude

    names = {}
    for backend in ("metal", "cuda"):
        header, prologue = prelude(backend)
        macros = set(re.findall(r"#define (TQ_\w+)", header))
        helpers = set(re.findall(r"\b(tq_\w+)\(", header))
        ints = set(re.findall(r"const int (tq_\w+)", prologue))
        names[backend] = (macros, helpers, ints)
    assert names["metal"] == names["cuda"]
    assert np.all([len(x) > 0 for x in names["metal"]])
