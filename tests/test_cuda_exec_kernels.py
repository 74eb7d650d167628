"""The shared kernels of tiered.metal in their CUDA form (prelude.cu), executed on the CPU
(tests/metal_exec/cuda.py), against the references test_metal_exec_kernels checks their
Metal form with.

tiered.metal resolves to CUDA and MLX's ``cuda_kernel`` is the executor: each launch runs
the source MLX would compile for an NVIDIA GPU (the CUDA prelude's macros, warp shuffles,
dynamic shared memory, CUDA's launch shapes and bin widths), so a kernel's CUDA side is
checked without a GPU. The selection runs as passes (a machine without a GPU has no SM count
to plan the persistent kernel with, so tau.tau_select takes the passes, as on a GPU with
TIERED_PERSISTENT=0), and as the persistent kernel where a test gives it an SM count and an
H100's shared memory.
"""

from __future__ import annotations

import numpy as np
import pytest

import metal_exec
from metal_exec import cuda as executor
from test_metal_exec_kernels import (
    CODEBOOKS,
    KERNEL_MODULES,
    SELECTIONS,
    check_acc,
    check_codebook,
    check_selection,
    check_threshold,
)
from tiered.metal import _build, h2o, select_passes, threshold

pytestmark = metal_exec.needs_compiler


class CudaOnCpu:
    """MLX's ``cuda_kernel`` run by the executor, recording each launch's kernel name and
    applying ``edits`` ((old, new) text replacements, for planted bugs) to its sources."""

    def __init__(self):
        self.launches, self.edits, self.applied = [], [], set()

    def cuda_kernel(self, **spec):
        def launch(**plan):
            edited = dict(spec)
            for old, new in self.edits:
                for part in ("header", "source"):
                    if old in edited.get(part, ""):
                        edited[part] = edited[part].replace(old, new, 1)
                        self.applied.add(old)
            self.launches.append(spec["name"])
            return executor.cuda_kernel(**edited)(**plan)
        return launch


@pytest.fixture
def cuda(monkeypatch):
    backend = CudaOnCpu()
    monkeypatch.setattr(_build, "cuda_kernel", backend.cuda_kernel)
    _build.build_kernel.cache_clear()
    for module in KERNEL_MODULES:
        if hasattr(module, "resolve_backend"):
            monkeypatch.setattr(module, "resolve_backend",
                                lambda use_kernel, name: None if use_kernel is False else "cuda")
    yield backend
    _build.build_kernel.cache_clear()


@pytest.mark.parametrize("layout", list(CODEBOOKS))
@pytest.mark.parametrize("n,rep,d", [(33, 4, 128), (4099, 1, 64), (4099, 8, 128)])
def test_codebook_scores(cuda, n, rep, d, layout):
    check_codebook(n, rep, d, layout, backend="cuda")
    assert cuda.launches and set(cuda.launches) <= {"tiered_codebook_scores"}


@pytest.mark.parametrize("tau_", [0.5, 0.9, 1.0])
@pytest.mark.parametrize("n,rep", [(33, 4), (4099, 1), (4099, 8)])
def test_tau_threshold(cuda, n, rep, tau_):
    check_threshold(n, rep, tau_)
    assert cuda.launches == [threshold.TAU_SPEC.name]


@pytest.mark.parametrize("cap,floor,tau_,ex_dtype", SELECTIONS)
@pytest.mark.parametrize("n,rep", [(31, 1), (4099, 4), (select_passes.SELECT_FUSED_TOKENS, 8)])
def test_tau_select_passes(cuda, n, rep, cap, floor, tau_, ex_dtype):
    check_selection(n, rep, cap, floor, tau_, ex_dtype, backend="cuda")
    assert select_passes.KEYS_SPEC.name in cuda.launches


@pytest.mark.parametrize("n,rep", [(31, 1), (4099, 4)])
def test_acc_update(cuda, n, rep):
    check_acc(n, rep)
    assert cuda.launches == [h2o.ACC_SPEC.name]


def test_planted_bug_in_the_cuda_prelude_is_caught(cuda):
    """A warp prefix sum that skips lane o (prelude.cu only: the Metal prelude uses simd
    prefix sums) breaks the selection's scans."""
    old, new = "if (lane >= o) {\nx += y;", "if (lane > o) {\nx += y;"  # compacted source
    args = (4099, 4) + SELECTIONS[0]
    check_selection(*args, backend="cuda")
    cuda.edits = [(old, new)]
    with pytest.raises(AssertionError):
        check_selection(*args, backend="cuda")
    assert cuda.applied == {old}, "the edit matched no launched kernel: update the plant"


@pytest.mark.parametrize("cap,floor,tau_,ex_dtype", SELECTIONS)
@pytest.mark.parametrize("n,rep,sms", [(4099, 4, 4), (20000, 8, 3), (33, 1, 2)])
def test_persistent_selection_equals_the_passes(cuda, monkeypatch, n, rep, sms, cap, floor,
                                                tau_, ex_dtype):
    """The persistent kernel (tau_persistent.h: threadgroups take units in order and wait for
    the phase before; here as many as `sms` pretends the GPU has SMs, run on the executor's
    OS threads) selects as the passes do: the same ids, counts and thresholds, and the rule
    holds (a wait that timed out would have left a wrong selection)."""
    from tiered.metal import persistent
    monkeypatch.setattr(persistent, "cuda_sm_count", lambda index=0: sms)
    # the shared memory an H100 / H200 block may opt into (no device here to ask)
    monkeypatch.setattr(persistent, "shared_memory_limit",
                        lambda backend: _build._CUDA_SHARED_BYTES[(9, 0)])
    one = check_selection(n, rep, cap, floor, tau_, ex_dtype, backend="cuda")
    assert persistent.PERSISTENT_SPEC.name in cuda.launches
    monkeypatch.setenv("TIERED_PERSISTENT", "0")
    cuda.launches.clear()
    passes = check_selection(n, rep, cap, floor, tau_, ex_dtype, backend="cuda")
    assert persistent.PERSISTENT_SPEC.name not in cuda.launches
    for field in ("idx", "count", "m", "s", "theta"):
        np.testing.assert_array_equal(np.asarray(getattr(one, field)),
                                      np.asarray(getattr(passes, field)), err_msg=field)
