"""Kernel parameter arrays (tiered.metal._build.device_ints / device_floats).

- any backend: inside ``traced_params`` (a compiled function's trace) the arrays hold the
  same values, shapes and dtypes as outside, are kept by value, and a compiled function
  whose body reads them (``traced``) gives the same result on every call;
- on MLX's CUDA backend they are copies made by a GPU op (device memory, not the managed
  memory of arrays made from host values) and reading them needs no wait for the stream the
  step is queued on.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tiered.metal import _build


@pytest.mark.parametrize("values", [(7,), (3, -4), (1, 2, 3), (5, 6, 7, 8, 9)])
def test_traced_params_equal_the_host_made_ones(values):
    plain_i, plain_f = _build.device_ints(*values), _build.device_floats(*values)
    with _build.traced_params():
        got_i, got_f = _build.device_ints(*values), _build.device_floats(*values)
        assert _build.device_ints(*values) is got_i  # kept by value
    for got, plain, dtype in ((got_i, plain_i, mx.int32), (got_f, plain_f, mx.float32)):
        assert got.dtype == dtype and got.shape == (len(values),)
        np.testing.assert_array_equal(np.array(got), np.array(plain))
        np.testing.assert_array_equal(np.array(got), np.array(values, np.float64))


def test_compiled_body_reads_its_traced_params():
    calls = []

    def body(x):
        calls.append(1)  # runs only while the trace is made
        return x * _build.device_floats(0.5, 2.0)[1] + _build.device_ints(3).astype(x.dtype)

    fn = mx.compile(_build.traced(body))
    x = mx.arange(6, dtype=mx.float32)
    for _ in range(3):
        np.testing.assert_array_equal(np.array(fn(x)), np.arange(6) * 2.0 + 3.0)
    assert len(calls) == 1
    assert not getattr(_build._traced, "depth", 0)  # the scope ended with the trace


def test_scope_nests_and_ends_on_error():
    with pytest.raises(RuntimeError):
        with _build.traced_params():
            with _build.traced_params():
                raise RuntimeError("inside")
    assert _build._traced.depth == 0
