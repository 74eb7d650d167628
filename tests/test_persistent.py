"""The persistent selection kernel (tiered/metal/persistent.py, tau_persistent.h): its grid plan,
and on a CUDA device its results against the separate passes it replaces."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_accel_kernels import KERNEL_TOL, make_codebook_case, make_scores
from tiered.metal import accelerator, codebook_scores, persistent, tau_select

needs_cuda = pytest.mark.skipif(
    accelerator() != "cuda",
    reason=f"persistent kernels run on MLX's CUDA backend only: default device is "
    f"{mx.default_device()} ({accelerator()})",
)
FIELDS = ("idx", "count", "m", "s", "theta")


@pytest.fixture
def device_132(monkeypatch):
    """An H100's 132 SMs and 227 KB of shared memory, whatever machine runs the test."""
    monkeypatch.setattr(persistent, "cuda_sm_count", lambda index=0: 132)
    monkeypatch.setattr(persistent, "shared_memory_limit", lambda backend: 227 * 1024)
    monkeypatch.delenv("TIERED_PERSISTENT", raising=False)


@pytest.mark.parametrize("n", [1, 31, 1024, 1025, 4099, 131072, 131073, 2**20 + 7])
@pytest.mark.parametrize("h,rep", [(8, 4), (3, 3), (1, 1), (2, 8), (33, 4)])
def test_plan_grid_covers_every_token_once_within_the_sms(device_132, n, h, rep):
    grid = persistent.plan_grid(n, h, rep)
    assert grid is not None
    assert grid.groups == min(132, grid.blocks * h)  # one threadgroup per SM, or per unit
    assert grid.blocks * h <= 132  # about one unit per SM and phase
    assert (grid.blocks - 1) * grid.chunk < n <= grid.blocks * grid.chunk  # no empty chunk
    assert grid.blocks <= -(-n // persistent.MIN_CHUNK)  # chunks of about MIN_CHUNK or more
    assert rep % grid.hr == 0
    assert grid.hr * persistent.SELECT_BINS["cuda"] * 8 <= persistent.WORK_BYTES
    assert grid.smem <= 227 * 1024 - 4096


def test_plan_grid_declines_what_it_cannot_run(device_132, monkeypatch):
    assert persistent.plan_grid(4099, 133, 1) is None  # more kv heads than SMs
    assert persistent.plan_grid(0, 8, 4) is None
    # no shared memory left
    assert persistent.plan_grid(4099, 8, 4, table_bytes=224 * 1024) is None
    monkeypatch.setenv("TIERED_PERSISTENT", "0")
    assert persistent.plan_grid(4099, 8, 4) is None
    monkeypatch.setattr(persistent, "cuda_sm_count", lambda index=0: None)
    monkeypatch.delenv("TIERED_PERSISTENT")
    assert persistent.plan_grid(4099, 8, 4) is None  # no driver to ask


def _passes(monkeypatch, *args, **kw):
    """tau_select through the separate passes (the persistent path turned off)."""
    monkeypatch.setenv("TIERED_PERSISTENT", "0")
    try:
        return tau_select(*args, with_stats=True, use_kernel=True, **kw)
    finally:
        monkeypatch.delenv("TIERED_PERSISTENT")


def _assert_same(a, b):
    for f in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f)),
                                      err_msg=f)
    np.testing.assert_allclose(np.asarray(a.mass), np.asarray(b.mass), rtol=KERNEL_TOL,
                               atol=1e-6)


@pytest.mark.accelerator
@needs_cuda
@pytest.mark.parametrize(
    "n,rep,cap,floor,tau",
    [(31, 1, 64, 0, 1.0), (33, 3, 40, 10, 0.9), (4099, 4, 64, 8, 0.9), (4099, 8, 4096, 8, 0.5),
     (131072, 4, 2048, 32, 0.9), (131072, 8, 2048, 2100, 0.99), (300001, 1, 512, 0, 0.9)],
)  # fmt: skip
@pytest.mark.parametrize("exclude_dtype", [mx.bool_, mx.uint8])
def test_persistent_selection_equals_the_passes(monkeypatch, n, rep, cap, floor, tau,
                                                exclude_dtype):
    """Same thresholds, statistics, indices and counts as the four launches, bit for bit
    (fixed-point masses, integer counts); the selected mass to float rounding. No wait timed
    out (status 0)."""
    h = 2
    z = make_scores(h * rep, n, n + 5, seed=n + rep)  # NaN past n: reads past the end show
    exclude = mx.array(np.random.default_rng(7).random((h, n + 3)) < 0.1).astype(exclude_dtype)
    zmax = z[:, :n].max(axis=1, keepdims=True)
    grid = persistent.plan_grid(n, h, rep)
    assert grid is not None
    got = persistent.tau_select_persistent(z, n, exclude, tau, max(cap, floor), floor,
                                           max(cap, floor) + 3, zmax=zmax, grid=grid)
    mx.eval(got.sel, got.status)
    assert int(got.status.item()) == 0
    ref = _passes(monkeypatch, z, n, exclude, tau, cap, floor, cap_alloc=max(cap, floor) + 3)
    _assert_same(got.sel, ref)
    assert np.all(np.asarray(got.sel.idx)[:, max(cap, floor):] == -1)
    via = tau_select(z, n, exclude, tau, cap, floor, cap_alloc=max(cap, floor) + 3,
                     with_stats=True, use_kernel=True)  # the default path takes the kernel
    _assert_same(via, ref)


@pytest.mark.accelerator
@needs_cuda
@pytest.mark.parametrize(
    "h,rep,d,ds,n,half",
    [(8, 4, 128, 4, 131072, True), (2, 4, 128, 4, 4099, False), (3, 3, 64, 4, 33, True),
     (2, 1, 128, 4, 31, True), (4, 8, 128, 4, 65537, True)],
)  # fmt: skip
def test_codebook_select_equals_scores_then_selection(monkeypatch, h, rep, d, ds, n, half):
    """The fused launch's scores equal the codebook kernel's exactly (same table, same sums),
    and its selection equals the separate passes' on them."""
    q, cb, codes = make_codebook_case(h=h, rep=rep, d=d, ds=ds, c=256, n=n, n_cap=n + 9,
                                      per_group=False, code_dtype=np.uint8)
    exclude = mx.array(np.random.default_rng(3).random((h, n)) < 0.05)
    out = persistent.codebook_select(q, cb, codes, n, exclude, 0.9, 2048, 16, rep=rep,
                                     lut_half=half)
    assert out is not None, "the fused kernel should apply to this shape"
    z, got = out
    mx.eval(z, got.sel, got.status)
    assert int(got.status.item()) == 0
    z_ref = codebook_scores(q, cb, codes, n, rep=rep, use_kernel=True, lut_half=half)
    np.testing.assert_array_equal(np.asarray(z), np.asarray(z_ref))
    _assert_same(got.sel, _passes(monkeypatch, z_ref, n, exclude, 0.9, 2048, 16))


@pytest.mark.accelerator
@needs_cuda
def test_queued_persistent_launches_do_not_deadlock():
    """Independent launches in one evaluation (MLX may run independent graph nodes side by
    side, sharing the SMs) finish with no wait timed out and equal results."""
    n, h, rep = 65536, 8, 4
    z = make_scores(h * rep, n, n, seed=11)
    exclude = mx.zeros((h, n), dtype=mx.bool_)
    zmax = z.max(axis=1, keepdims=True)
    grid = persistent.plan_grid(n, h, rep)
    outs = [persistent.tau_select_persistent(z, n, exclude, 0.9, 2048, 0, 2048, zmax=zmax,
                                             grid=grid) for _ in range(12)]
    mx.eval([(o.sel, o.status) for o in outs])
    assert [int(o.status.item()) for o in outs] == [0] * 12
    for o in outs[1:]:
        _assert_same(o.sel, outs[0].sel)


@pytest.mark.accelerator
@needs_cuda
def test_long_rows_take_the_separate_passes(monkeypatch):
    """Above MAX_TOKENS the passes' wider grids are faster: the fused call declines, and
    tau_select launches no persistent kernel although the grid would fit."""
    n = persistent.MAX_TOKENS + 1
    q, cb, codes = make_codebook_case(h=2, rep=4, d=128, ds=4, c=256, n=n, n_cap=n,
                                      per_group=False, code_dtype=np.uint8)
    exclude = mx.zeros((2, n), dtype=mx.bool_)
    assert persistent.codebook_select(q, cb, codes, n, exclude, 0.9, 256, 0, rep=4) is None
    assert persistent.plan_grid(n, 2, 4) is not None
    z = make_scores(8, n, n, seed=2)
    launched, real = [], persistent.launch
    monkeypatch.setattr(persistent, "launch", lambda *a: launched.append(a[0].name) or real(*a))
    sel = tau_select(z, n, exclude, 0.9, 256, 0, with_stats=True, use_kernel=True)
    mx.eval(sel)
    assert launched == [] and sel.theta is not None  # the passes ran


@pytest.mark.accelerator
@needs_cuda
@pytest.mark.parametrize("groups", [1, 3])
def test_fewer_threadgroups_than_units_give_the_same_result(groups):
    """Units are taken in order and wait only for earlier phases, so even one threadgroup
    doing every unit in turn finishes, with the result of a threadgroup per SM."""
    n, h, rep = 20000, 4, 4
    z = make_scores(h * rep, n, n + 3, seed=5)
    exclude = mx.array(np.random.default_rng(9).random((h, n)) < 0.1)
    zmax = z[:, :n].max(axis=1, keepdims=True)
    grid = persistent.plan_grid(n, h, rep)
    assert grid.blocks * h > groups
    full = persistent.tau_select_persistent(z, n, exclude, 0.9, 512, 8, 512, zmax=zmax,
                                            grid=grid)
    few = persistent.tau_select_persistent(z, n, exclude, 0.9, 512, 8, 512, zmax=zmax,
                                           grid=grid._replace(groups=groups))
    mx.eval(full.sel, few.sel, full.status, few.status)
    assert int(full.status.item()) == 0 and int(few.status.item()) == 0
    _assert_same(few.sel, full.sel)
