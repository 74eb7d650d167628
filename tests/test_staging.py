"""Small uploads through the page-locked ring (tiered.runtime.staging).

- any backend: ``upload`` and ``upload_many`` give int32 arrays equal to their sources;
- on CUDA: a ring a few records long, lapped many times with every copy left lazy until the
  end, still gives every array its own values (a record is rewritten only after the copies
  that read it ran), across wraps that leave the end of the ring unused.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tiered.runtime import staging, uva

needs_cuda = pytest.mark.skipif(not uva.available(), reason="the ring needs MLX's CUDA backend")


@pytest.mark.parametrize("shape", [(1,), (3,), (8, 1, 64), (8, 513)])
def test_upload_equals_its_source(shape):
    a = np.random.default_rng(len(shape)).integers(-2**31, 2**31 - 1, shape).astype(np.int32)
    x = staging.upload(a)
    assert x.dtype == mx.int32 and x.shape == shape
    np.testing.assert_array_equal(np.array(x), a)


def test_upload_many_views_each_part():
    parts = [np.arange(6, dtype=np.int32).reshape(2, 3), np.array([7], np.int64),
             np.full((3, 1, 2), -5, np.int32)]
    views = staging.upload_many(parts)
    for v, a in zip(views, parts):
        assert v.shape == a.shape
        np.testing.assert_array_equal(np.array(v), a.astype(np.int32))


@needs_cuda
def test_ring_laps_keep_every_lazy_copy_right():
    ring = staging.Ring(ints=1024)
    rng = np.random.default_rng(0)
    sent, outs = [], []
    for i in range(300):  # sizes whose records leave the ring's end unused at most wraps
        a = rng.integers(0, 1 << 30, int(rng.integers(1, 200))).astype(np.int32)
        sent.append(a)
        outs.append(ring.upload(a))
    assert sum(4 + -(-a.size // 4) * 4 for a in sent) > 20 * ring.buf.size  # many laps
    mx.eval(*outs)
    for a, x in zip(sent, outs):
        np.testing.assert_array_equal(np.array(x), a)


@needs_cuda
def test_address_arrays_stay_one_per_granule():
    ring = staging.Ring(ints=1024)
    rng = np.random.default_rng(1)
    outs = [ring.upload(rng.integers(0, 9, int(rng.integers(1, 250))).astype(np.int32))
            for _ in range(100)]
    mx.eval(*outs)
    assert set(ring.addrs) <= set(range(0, 1024, staging.GRANULE))


@needs_cuda
def test_too_large_an_upload_is_made_on_the_host():
    ring = staging.Ring(ints=1024)
    a = np.arange(600, dtype=np.int32)  # over a quarter of the ring
    x = ring.upload(a)
    assert not ring.held
    np.testing.assert_array_equal(np.array(x), a)
