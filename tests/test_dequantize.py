"""tiered.cpu.dequantize: MLX's affine dequantization (float16 arithmetic) bit for bit, and the
float16 rounding it is built on."""

from __future__ import annotations

import mlx.core as mx
import numba
import numpy as np
import pytest

from tiered.cpu.dequantize import dequantize_affine, round_to_half


@numba.njit
def _round_all(x):
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = round_to_half(x[i])
    return out


def test_round_to_half_is_numpys_float16_rounding():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(200_000).astype(np.float32) * s
                        for s in (1e-8, 1e-6, 1e-4, 1.0, 300.0, 4e4, 9e4)])
    edges = [65504, 65519.996, 65520, 65536, -65520, 6.1035156e-05, 6.1e-05, 5.9604645e-08,
             2.9802322e-08, 2.9802326e-08, 8.940697e-08, 0.0, -0.0, 1.0009766, 1.0004883]
    x = np.concatenate([x, np.array(edges, np.float32), np.array([np.inf, -np.inf, np.nan],
                                                                  np.float32)])
    got = _round_all(x)
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16).astype(np.float32)
    same = (got == ref) | (np.isnan(got) & np.isnan(ref))
    assert same.all(), (x[~same][:5], got[~same][:5], ref[~same][:5])
    assert np.signbit(got[x == 0]).tolist() == np.signbit(x[x == 0]).tolist()


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 32), (2, 64)])
def test_dequantize_affine_equals_mlx(bits, group):
    rng = np.random.default_rng(bits * 100 + group)
    rows, cols = 37, 4 * group
    w = rng.integers(0, 2**32, (2, rows, cols * bits // 32), dtype=np.uint64).astype(np.uint32)
    scales = (rng.standard_normal((2, rows, cols // group)) * 0.02).astype(np.float16)
    biases = (rng.standard_normal((2, rows, cols // group)) * 0.1).astype(np.float16)
    scales[0, 0, 0], biases[0, 0, 0] = 3e-6, -2e-7  # products and sums in float16's subnormals
    scales[0, 1, 0], biases[0, 1, 0] = 2000.0, 30000.0  # and past its largest finite
    ref = mx.dequantize(mx.array(w), mx.array(scales), mx.array(biases), group_size=group,
                        bits=bits).astype(mx.float32)
    got = dequantize_affine(w, scales, biases, group, bits)
    assert got.shape == ref.shape and got.dtype == np.float32
    np.testing.assert_array_equal(got, np.array(ref))


def test_dequantize_affine_refuses_what_it_does_not_compute():
    w = np.zeros((2, 4), np.uint32)
    s = np.ones((2, 1), np.float16)
    with pytest.raises(ValueError, match="float16 scales"):
        dequantize_affine(w, s.astype(np.float32), s, 32, 4)
    with pytest.raises(ValueError, match="2-, 4- or 8-bit"):
        dequantize_affine(w, s, s, 32, 3)
    with pytest.raises(ValueError, match="do not hold"):
        dequantize_affine(w, s, s, 64, 4)
