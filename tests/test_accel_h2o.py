"""The H2O accumulator update of tiered.metal: the MLX-op reference against float64 numpy,
the one-pass kernel against it (kernels only where the default device is a Metal or CUDA GPU).
The inputs are shared with tests/test_metal_exec_kernels.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_accel_kernels import KERNEL_TOL, needs_accel

from tiered.metal import acc_update, acc_update_ops


def _acc_inputs(n, rep, h=3, slack=7, seed=0):
    """acc (H, n + slack) with live columns past n; z (H rep, n + 5) NaN past n; m, s from z."""
    rng = np.random.default_rng(seed + n + rep)
    acc = rng.random((h, n + slack)).astype(np.float32)
    z = (rng.standard_normal((h * rep, n + 5)) * 4).astype(np.float32)
    z[:, n:] = np.nan
    m = z[:, :n].max(axis=1) if n else np.zeros(h * rep, np.float32)
    s = np.exp(z[:, :n].astype(np.float64) - m[:, None]).sum(axis=1) if n else np.ones(h * rep)
    return acc, z, m.astype(np.float32), s.astype(np.float32)


def np_acc_update(acc, z, m, s, n, rep, alpha):
    h = acc.shape[0]
    p = np.exp(z[:, :n].astype(np.float64) - m[:, None]) / s[:, None]
    out = acc.astype(np.float64).copy()
    out[:, :n] = alpha * out[:, :n] + (1 - alpha) * p.reshape(h, rep, n).mean(axis=1)
    return out


@pytest.mark.parametrize("n", [0, 1, 31, 33, 4099])
@pytest.mark.parametrize("rep", [1, 3, 4, 8])
def test_acc_update_ops_matches_numpy(n, rep):
    acc, z, m, s = _acc_inputs(n, rep)
    out = acc_update_ops(mx.array(acc), mx.array(z), mx.array(m), mx.array(s), n, rep, 0.95)
    np.testing.assert_allclose(np.array(out), np_acc_update(acc, z, m, s, n, rep, 0.95),
                               rtol=1e-5, atol=1e-7)


def test_acc_update_rejects_bad_arguments():
    acc, z, m, s = (mx.array(a) for a in _acc_inputs(33, 4))
    with pytest.raises(ValueError, match="Invalid shapes for rep"):
        acc_update(acc, z, m, s, 33, 3, 0.9)
    with pytest.raises(ValueError, match="Invalid n"):
        acc_update(acc, z, m, s, 39, 4, 0.9)
    with pytest.raises(ValueError, match="Invalid alpha"):
        acc_update(acc, z, m, s, 33, 4, 1.5)


@pytest.mark.accelerator
@needs_accel
@pytest.mark.parametrize("n", [1, 31, 33, 4099, 131072])
@pytest.mark.parametrize("rep", [1, 3, 4, 8])
def test_acc_update_kernel_matches_ops(n, rep):
    """One pass, NaN scores past n: any read there would poison the row."""
    acc, z, m, s = (mx.array(a) for a in _acc_inputs(n, rep))
    out = acc_update(acc, z, m, s, n, rep, 0.95, use_kernel=True)
    ref = acc_update_ops(acc, z, m, s, n, rep, 0.95)
    assert out.shape == acc.shape
    np.testing.assert_allclose(np.array(out), np.array(ref), rtol=KERNEL_TOL, atol=1e-7)
    np.testing.assert_array_equal(np.array(out)[:, n:], np.array(acc)[:, n:])
