"""The device path's door (tiered.step.device_decode.first_bad): the first token holding a NaN or
Inf in its keys or values, for a decode token and across a prompt chunk's blocks (on CUDA,
else on the kernel executor through the device_path fixture)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_door_kernel_finds_the_first_non_finite_token(dtype, device_path):
    """first_bad: the first token (from start) holding a NaN or Inf in keys or values, folded
    with the previous steps' value; NO_BAD when every entry is finite."""
    from tiered.step.device_decode import NO_BAD, first_bad

    rng = np.random.default_rng(0)
    H, L, dk, dv = 3, 5, 64, 32
    keys = rng.normal(size=(1, H, L, dk)).astype(np.float32)
    values = rng.normal(size=(1, H, L, dv)).astype(np.float32)
    read = lambda k, v, start, prev=None: int(  # noqa: E731
        first_bad(mx.array(k).astype(dtype), mx.array(v).astype(dtype), start, prev).item())
    assert read(keys, values, 10) == NO_BAD
    k2, v2 = keys.copy(), values.copy()
    k2[0, 2, 3, 7] = np.nan  # token 3 (head 2)
    v2[0, 0, 1, 5] = np.inf  # token 1 (head 0): the first
    assert read(k2, values, 10) == 13
    assert read(keys, v2, 10) == 11
    assert read(k2, v2, 10) == 11
    assert read(k2, v2, 10, mx.array([4], mx.int32)) == 4  # an earlier step's position stays
    assert read(keys, values, 10, mx.array([40], mx.int32)) == 40


def test_door_kernel_over_a_prompt_chunk(device_path):
    """A prompt chunk's door spans many blocks (each folds its minimum in): the first bad token
    wherever it lies, keys or values, late or early; the previous value when it is earlier."""
    from tiered.step.device_decode import NO_BAD, first_bad

    rng = np.random.default_rng(1)
    H, L, d = 8, 2048, 128
    keys = rng.normal(size=(1, H, L, d)).astype(np.float16)
    values = rng.normal(size=(1, H, L, d)).astype(np.float16)
    read = lambda k, v, prev=None: int(first_bad(  # noqa: E731
        mx.array(k), mx.array(v), 5000, prev).item())
    assert read(keys, values) == NO_BAD
    v2 = values.copy()
    v2[0, 7, 2040, 127] = np.inf  # the very last block's region
    assert read(keys, v2) == 5000 + 2040
    k2 = keys.copy()
    k2[0, 5, 1500, 3] = np.nan
    k2[0, 6, 1200, 0] = -np.inf
    assert read(k2, v2) == 5000 + 1200
    assert read(k2, v2, mx.array([17], mx.int32)) == 17
