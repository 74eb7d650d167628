"""The affine key scores of tiered.metal (4-bit and other widths): the MLX-op reference
against float64 numpy, the kernel against both, and the benchmark's choice between the kernel
and mx.quantized_matmul (kernels only where the default device is a Metal or CUDA GPU)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from test_accel_kernels import (
    KERNEL_TOL,
    TOL,
    assert_scores_close,
    make_affine_case,
    needs_accel,
    np_affine_scores,
)

from tiered.metal import accelerator, affine_scores, affine_scores_ops

AFFINE_CASES = [
    # d, bits, group_size, dtype, rep, n
    (128, 4, 32, mx.float16, 4, 4099),
    (128, 8, 64, mx.float32, 1, 33),
    (64, 2, 32, mx.bfloat16, 3, 31),
    (256, 3, 32, mx.float16, 8, 33),
    (256, 4, 128, mx.bfloat16, 4, 31),
    (64, 6, 64, mx.float32, 8, 4099),
]


@pytest.mark.parametrize("d,bits,group_size,dtype,rep,n", AFFINE_CASES)
def test_affine_ops_matches_numpy(d, bits, group_size, dtype, rep, n):
    q, wq, scales, biases = make_affine_case(
        h=2, rep=rep, d=d, n=n, n_cap=n + 7, group_size=group_size, bits=bits, dtype=dtype
    )
    z = affine_scores_ops(q, wq, scales, biases, n, rep=rep, group_size=group_size, bits=bits)
    expected, mag = np_affine_scores(q, wq, scales, biases, n, rep, group_size, bits)
    assert_scores_close(z, expected, mag, TOL[mx.float32])


def test_affine_bench_hook_reports_a_choice(monkeypatch):
    """bench/probes/affine_choice.py (benchmark code, outside the package) times both paths."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench" / "probes"))
    from affine_choice import bench_affine_scores

    q, wq, scales, biases = make_affine_case(
        h=2, rep=4, d=128, n=256, n_cap=300, group_size=64, bits=4, dtype=mx.float16
    )
    res = bench_affine_scores(
        q, wq, scales, biases, 256, rep=4, group_size=64, bits=4, iters=3, warmup=1
    )
    assert res.ops_s > 0
    if accelerator() == "cpu":
        assert res.kernel_s is None and res.use_kernel is False
    else:
        assert res.kernel_s > 0 and res.use_kernel == (res.kernel_s < res.ops_s)


@pytest.mark.accelerator
@needs_accel
@pytest.mark.parametrize(
    "d,bits,group_size,dtype,rep,n", AFFINE_CASES + [(128, 4, 64, mx.float16, 4, 131072)]
)
def test_affine_kernel_matches_ops(d, bits, group_size, dtype, rep, n):
    q, wq, scales, biases = make_affine_case(
        h=2, rep=rep, d=d, n=n, n_cap=n + 7, group_size=group_size, bits=bits, dtype=dtype
    )
    kw = dict(rep=rep, group_size=group_size, bits=bits)
    z = affine_scores(q, wq, scales, biases, n, use_kernel=True, **kw)
    ref = affine_scores_ops(q, wq, scales, biases, n, **kw)
    expected, mag = np_affine_scores(q, wq, scales, biases, n, rep, group_size, bits)
    assert_scores_close(z, expected, mag, KERNEL_TOL)
    assert_scores_close(ref, expected, mag, KERNEL_TOL)
