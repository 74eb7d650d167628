"""Every Metal kernel of tiered.metal, executed on the CPU (tests/metal_exec), against its
MLX reference.

The public functions run with their Metal dispatch: ``resolve_backend`` answers "metal" and
``launch`` hands each plan to the executor, so the kernels run with the launch shapes,
template arguments and glue (table built by MLX, passes chained, masses summed) that an Apple
GPU would get. Every launch is checked against Metal's limits (32 KB of threadgroup memory as
the executor measures the kernel's declarations, 1024 threads per threadgroup). Inputs past
n are NaN (scores, centroids, scales), so a read past the end cannot pass. Planted bugs (a
barrier removed, a wrong simdgroup lane) in copies of the real sources make the same checks
fail.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np
import pytest

import metal_exec
from test_accel_h2o import _acc_inputs
from test_accel_kernels import (
    KERNEL_TOL,
    assert_scores_close,
    make_affine_case,
    make_codebook_case,
    make_scores,
    np_affine_scores,
    np_codebook_scores,
)
from test_accel_tau import assert_kernel_selection, assert_kernel_threshold
from tiered.metal import affine, codebook, h2o, select_passes, slab_gather, tau, threshold
from tiered.metal._build import METAL_SHARED_BYTES

pytestmark = [metal_exec.needs_compiler, pytest.mark.metal]

SIZES = [31, 33, 4099]
# The selection passes also at SELECT_FUSED_TOKENS, the longest row Metal selects with one
# launch of passes 1 and 1b: chunks of 4096 tokens, so pass 3 scans all 8 warps of a
# threadgroup, in two rounds.
SELECT_SIZES = SIZES + [select_passes.SELECT_FUSED_TOKENS]
REPS = [1, 4, 8]
DIMS = [64, 128]
H = 2  # kv heads


class MetalOnCpu:
    """Stands in for MLX's Metal backend: runs each launch on the executor (its fibers in the
    order ``seed`` draws), after applying ``edits`` ((old, new) text replacements, for
    planted bugs) to the kernel's sources."""

    def __init__(self):
        self.launches = []
        self.edits = []
        self.applied = set()
        self.seed = 1

    def launch(self, spec, backend, plan):
        assert backend == "metal"
        header, source = spec.sources("metal")
        for old, new in self.edits:
            if old in header:
                header = header.replace(old, new, 1)
                self.applied.add(old)
            elif old in source:
                source = source.replace(old, new, 1)
                self.applied.add(old)
        run = metal_exec.run(spec, plan, header=header, source=source, seed=self.seed)
        assert run.threadgroup_bytes <= METAL_SHARED_BYTES, (spec.name, run.threadgroup_bytes)
        assert run.threads <= metal_exec.MAX_THREADS, (spec.name, run.threads)
        self.launches.append((spec.name, plan.grid, plan.threadgroup, run.threadgroup_bytes))
        return [mx.array(o) for o in run.outputs]


# The modules of tiered.metal that pick a backend (resolve_backend) or launch a kernel (launch).
KERNEL_MODULES = (affine, codebook, h2o, threshold, tau, select_passes, slab_gather)


def _metal_dispatch(backend: MetalOnCpu):
    """(module, name, value) of every replacement that sends tiered.metal's kernels to backend."""
    def resolve(use_kernel, name):
        return None if use_kernel is False else "metal"

    return [(module, name, value) for module in KERNEL_MODULES
            for name, value in (("launch", backend.launch), ("resolve_backend", resolve))
            if hasattr(module, name)]


@contextlib.contextmanager
def metal_on_cpu(fused_tokens: int | None = None):
    """tiered.metal dispatching to Metal, its launches run by the executor (a MetalOnCpu,
    yielded); fused_tokens replaces select_passes.SELECT_FUSED_TOKENS (0: passes 1 and 1b in
    two launches). For code outside a test function (a child process); tests take the fixture."""
    backend = MetalOnCpu()
    swaps = _metal_dispatch(backend)
    if fused_tokens is not None:
        swaps.append((select_passes, "SELECT_FUSED_TOKENS", fused_tokens))
    saved = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    for module, name, value in swaps:
        setattr(module, name, value)
    try:
        yield backend
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


@pytest.fixture
def metal(monkeypatch):
    backend = MetalOnCpu()
    for module, name, value in _metal_dispatch(backend):
        monkeypatch.setattr(module, name, value)
    return backend


# ----------------------------------------------------------------------------- scores
# (centroids c, dims per group ds, one codebook per group, code dtype, float16 table): with
# Metal's 32 KB the dispatcher builds the table in shared memory for whole groups of query
# heads (c16: 4 heads' entries per vector load), for fewer heads per threadgroup (c256 at
# head_dim 64), or leaves it to MLX ops in global memory (c256 at head_dim 128, uint16 codes).
CODEBOOKS = {
    "c256": (256, 4, False, np.uint8, False),
    "c16-per-group": (16, 8, True, np.uint8, False),
    "c1024-uint16": (1024, 4, False, np.uint16, False),
    "c256-half": (256, 4, True, np.uint8, True),
    "c16-half": (16, 8, False, np.uint8, True),
}


def check_codebook(n, rep, d, layout, backend="metal"):
    c, ds, per_group, code_dtype, half = CODEBOOKS[layout]
    q, cb, codes = make_codebook_case(h=H, rep=rep, d=d, ds=ds, c=c, n=n, n_cap=n + 40,
                                      per_group=per_group, code_dtype=code_dtype, seed=n + rep)
    z, zmax, notes = codebook.codebook_scores_and_max(q, cb, codes, n, rep=rep,
                                                      backend=backend, lut_half=half)
    expected, mag = np_codebook_scores(q, cb, codes, n, rep)
    tol = 2.0**-11 + KERNEL_TOL if notes["lut_half"] else KERNEL_TOL
    assert_scores_close(z, expected, mag, tol)
    if not notes["lut_half"]:
        ref = codebook.codebook_scores_ops(q, cb, codes, n, rep=rep)
        np.testing.assert_allclose(np.asarray(z), np.asarray(ref), rtol=tol, atol=tol)
    zn, block = np.asarray(z), notes["block"]
    for b in range(notes["n_blocks"]):
        np.testing.assert_array_equal(np.asarray(zmax)[:, b],
                                      zn[:, b * block:(b + 1) * block].max(axis=1))
    return notes


@pytest.mark.parametrize("layout", list(CODEBOOKS))
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("rep", REPS)
@pytest.mark.parametrize("n", SIZES)
def test_codebook_scores(metal, n, rep, d, layout):
    notes = check_codebook(n, rep, d, layout)
    assert notes["lut_half"] == (CODEBOOKS[layout][4] and notes["lut_shared"])
    assert [name for name, *_ in metal.launches] == [codebook.CODEBOOK_SPEC.name]


QUANTS = [(4, 64, mx.float16), (3, 32, mx.bfloat16), (8, 32, mx.float32)]


def check_affine(n, rep, d, bits, group_size, dtype):
    q, wq, scales, biases = make_affine_case(h=H, rep=rep, d=d, n=n, n_cap=n + 7,
                                             group_size=group_size, bits=bits, dtype=dtype)
    kw = dict(rep=rep, group_size=group_size, bits=bits)
    z = affine.affine_scores(q, wq, scales, biases, n, use_kernel=True, **kw)
    expected, mag = np_affine_scores(q, wq, scales, biases, n, rep, group_size, bits)
    assert_scores_close(z, expected, mag, KERNEL_TOL)
    ref = affine.affine_scores_ops(q, wq, scales, biases, n, **kw)
    np.testing.assert_allclose(np.asarray(z), np.asarray(ref), rtol=KERNEL_TOL, atol=KERNEL_TOL)


@pytest.mark.parametrize("bits,group_size,dtype", QUANTS)
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("rep", REPS)
@pytest.mark.parametrize("n", SIZES)
def test_affine_scores(metal, n, rep, d, bits, group_size, dtype):
    check_affine(n, rep, d, bits, group_size, dtype)
    assert [name for name, *_ in metal.launches] == [affine.AFFINE_SPEC.name]


# ----------------------------------------------------------------------------- selection
def check_threshold(n, rep, tau_):
    z = make_scores(H * rep, n, n + 5, seed=n + rep)
    assert_kernel_threshold(z, n, tau_, *threshold.tau_threshold(z, n, tau_, use_kernel=True))


@pytest.mark.parametrize("tau_", [0.5, 0.9, 1.0])
@pytest.mark.parametrize("rep", REPS)
@pytest.mark.parametrize("n", SELECT_SIZES)
def test_tau_threshold(metal, n, rep, tau_):
    check_threshold(n, rep, tau_)
    assert [name for name, *_ in metal.launches] == [threshold.TAU_SPEC.name]


# (cap, floor, tau, exclude dtype): the cap cutting through the kept set, a floor above it.
SELECTIONS = [(16, 4, 0.9, mx.bool_), (4096, 40, 0.5, mx.uint8), (64, 0, 1.0, mx.bool_)]


def select(n, rep, cap, floor, tau_, ex_dtype, seed=0):
    z = make_scores(H * rep, n, n + 5, seed=n + rep + seed)
    rng = np.random.default_rng(n + seed)
    exclude = mx.array(rng.random((H, n + 3)) < 0.1).astype(ex_dtype)
    sel = tau.tau_select(z, n, exclude, tau_, cap, floor, with_stats=True, use_kernel=True)
    return z, exclude, sel


def check_selection(n, rep, cap, floor, tau_, ex_dtype, backend="metal"):
    z, exclude, sel = select(n, rep, cap, floor, tau_, ex_dtype)
    assert_kernel_selection(z, n, exclude, sel, tau_, cap, floor, rep, backend)
    return sel


@pytest.mark.parametrize("cap,floor,tau_,ex_dtype", SELECTIONS)
@pytest.mark.parametrize("rep", REPS)
@pytest.mark.parametrize("n", SELECT_SIZES)
def test_tau_select_one_launch_thresholds(metal, n, rep, cap, floor, tau_, ex_dtype):
    """Passes 1 and 1b in one launch (tau_hist_theta.h, Metal's choice up to
    SELECT_FUSED_TOKENS tokens), then tau_keys.h and tau_compact.h."""
    check_selection(n, rep, cap, floor, tau_, ex_dtype)
    names = [name for name, *_ in metal.launches]
    assert names == [select_passes.HIST_THETA_SPEC.name, select_passes.KEYS_SPEC.name,
                     select_passes.COMPACT_SPEC.name]


@pytest.mark.parametrize("rep", REPS)
@pytest.mark.parametrize("n", SELECT_SIZES)
def test_tau_select_two_launch_thresholds(metal, monkeypatch, n, rep):
    """Passes 1 and 1b as two launches (tau_hist.h split across threadgroups, tau_theta.h:
    Metal's choice for longer rows): the rule holds, and everything equals the one-launch
    selection bit for bit (the same fixed-point sums)."""
    args = (n, rep) + SELECTIONS[0]
    one = check_selection(*args)
    monkeypatch.setattr(select_passes, "SELECT_FUSED_TOKENS", 0)
    metal.launches.clear()
    two = check_selection(*args)
    names = [name for name, *_ in metal.launches]
    assert names == [select_passes.HIST_SPEC.name, select_passes.THETA_SPEC.name,
                     select_passes.KEYS_SPEC.name, select_passes.COMPACT_SPEC.name]
    for field in ("idx", "count", "m", "s", "theta", "mass"):
        np.testing.assert_array_equal(np.asarray(getattr(one, field)),
                                      np.asarray(getattr(two, field)), err_msg=field)


# ----------------------------------------------------------------------------- H2O
def check_acc(n, rep):
    acc, z, m, s = (mx.array(a) for a in _acc_inputs(n, rep, h=H))
    out = h2o.acc_update(acc, z, m, s, n, rep, 0.95, use_kernel=True)
    ref = h2o.acc_update_ops(acc, z, m, s, n, rep, 0.95)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=KERNEL_TOL, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(out)[:, n:], np.asarray(acc)[:, n:])


@pytest.mark.parametrize("rep", REPS)
@pytest.mark.parametrize("n", SIZES)
def test_acc_update(metal, n, rep):
    check_acc(n, rep)
    assert [name for name, *_ in metal.launches] == [h2o.ACC_SPEC.name]


# ----------------------------------------------------------------------------- schedules
def test_selection_is_the_same_in_every_schedule(metal):
    """The passes' sums that decide the selection are order-independent (select_mass.h):
    the threads of each threadgroup run in other orders (and threadgroups on other workers),
    and every output is the same, bit for bit."""
    runs = []
    for seed in (0, 1, 2):
        metal.seed = seed
        runs.append(select(select_passes.SELECT_FUSED_TOKENS, 4, *SELECTIONS[1])[2])
    for other in runs[1:]:
        for field in ("idx", "count", "m", "s", "theta", "mass"):
            np.testing.assert_array_equal(np.asarray(getattr(runs[0], field)),
                                          np.asarray(getattr(other, field)), err_msg=field)


# ----------------------------------------------------------------------------- planted bugs
# Each edits a copy of a real source; the check that passes on the real source must fail.
PLANTS = {
    "affine: no barrier between staging q and its group sums": (
        "q_s[t] = tq_float4(q[o], q[o + 1], q[o + 2], q[o + 3]);\n}\nTQ_BARRIER();",
        "q_s[t] = tq_float4(q[o], q[o + 1], q[o + 2], q[o + 3]);\n}\n",
        lambda: check_affine(4099, 4, 128, 4, 64, mx.float16),
    ),
    "tq_block_all: no barrier before the warps' partials are read": (
        "    red[tid / TQ_SIMD] = v;\n  }\n  TQ_BARRIER();",
        "    red[tid / TQ_SIMD] = v;\n  }\n",
        lambda: check_threshold(4099, 4, 0.9),
    ),
    "tq_block_scan: a warp's total from lane 30": (
        "if (lane == TQ_SIMD - 1) {\n      red[warp * R + r] = inc;",
        "if (lane == TQ_SIMD - 2) {\n      red[warp * R + r] = inc;",
        lambda: check_selection(select_passes.SELECT_FUSED_TOKENS, 4, 100000, 0, 0.99,
                                mx.bool_),
    ),
    "tq_boundary: the running sum from lane k + 1": (
        "tq_warp_max(lane == k ? inc - part : -TQ_INF)",
        "tq_warp_max(lane == k + 1 ? inc - part : -TQ_INF)",
        lambda: check_selection(4099, 4, *SELECTIONS[0]),
    ),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_bug_is_caught(metal, plant):
    old, new, check = PLANTS[plant]
    check()  # the real source passes
    metal.edits = [(old, new)]
    with pytest.raises(AssertionError):
        check()
    assert metal.applied == {old}, "the edit matched no launched kernel: update the plant"
