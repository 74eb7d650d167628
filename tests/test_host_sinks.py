"""The offloaded layout's host sinks: the first tokens join every selection (issue 25)."""

from __future__ import annotations

import numpy as np

from tiered import ops


def test_host_sinks_join_the_selection_once_in_order():
    idx = np.array([[2, 7, 9, -1], [0, 5, -1, -1], [-1, -1, -1, -1]], np.int32)
    count = np.array([3, 2, 0], np.int32)
    out, got = ops.with_host_sinks(idx, count, 4)
    assert out.shape == (3, 8)
    assert got.tolist() == [6, 5, 4]
    assert out[0, :6].tolist() == [0, 1, 2, 3, 7, 9]
    assert out[1, :5].tolist() == [0, 1, 2, 3, 5]
    assert out[2, :4].tolist() == [0, 1, 2, 3]
    assert (out[0, 6:] == -1).all() and (out[2, 4:] == -1).all()
    for h in range(3):  # ascending, no repeats: what the gather kernels read
        row = out[h, : got[h]]
        assert (np.diff(row) > 0).all()


def test_host_sinks_leave_out_resident_tokens():
    idx = np.array([[6, -1]], np.int32)
    count = np.array([1], np.int32)
    exclude = np.zeros((1, 8), np.uint8)
    exclude[0, 1] = 1  # token 1 is resident: scored exactly on the accelerator already
    out, got = ops.with_host_sinks(idx, count, 3, exclude)
    assert out[0, : got[0]].tolist() == [0, 2, 6]
