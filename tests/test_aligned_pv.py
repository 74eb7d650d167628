"""ops.aligned_pv: the probabilities-times-values product cut at an aligned length equals the
plain product (float32 reference), for lengths below, at and past the alignment."""

import mlx.core as mx
import numpy as np
import pytest

from tiered.runtime import ops


@pytest.mark.parametrize("R", [5, 8, 61, 2048, 35437])
@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_aligned_pv_equals_the_plain_product(R, dtype):
    rng = np.random.default_rng(R)
    p = rng.random((3, 4, R)).astype(np.float32) / R
    v = rng.standard_normal((3, R, 64)).astype(np.float32)
    want = p @ v
    got = ops.aligned_pv(mx.array(p).astype(dtype), mx.array(v).astype(dtype), split=True)
    assert got.shape == want.shape and got.dtype == dtype
    tol = 2e-3 if dtype == mx.float16 else 1e-5
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, atol=tol, rtol=tol)
