"""The decode token's write-behind kernel (tiered.step.device_append._write_one, CUDA): it writes
the token's rows into their host page, and a dry launch (token -1, the one that compiles the
kernel at a layer's first decode step) writes nothing."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tiered.step import device_append, device_compiled
from tiered.cpu import HostStore
from tiered.step.device_decode import DeviceTables


@pytest.mark.parametrize("host_keys", [True, False])
def test_write_one_writes_its_token_and_a_dry_launch_nothing(host_keys, device_path):
    # device_path (conftest): on the GPU, or on this machine with the kernel executor
    H, d, P, n = 2, 64, 16, 40
    rng = np.random.default_rng(0)
    store = HostStore(H, d, page_size=P, dtype="float16", keys=host_keys, pages_per_block=2)
    store.append(rng.normal(size=(1, H, n, d)).astype(np.float16),
                 rng.normal(size=(1, H, n, d)).astype(np.float16) if host_keys else None)
    names = ["values"] + (["keys"] if host_keys else [])
    before = {k: store.read(k).copy() for k in names}
    tables = DeviceTables()
    vt = store.values
    kt = store.keys if host_keys else vt
    vw = mx.array(rng.normal(size=(1, H, 1, d)).astype(np.float16))
    kw = mx.array(rng.normal(size=(1, H, 1, d)).astype(np.float16))
    fence = device_compiled._placeholder((1,), mx.int32)

    def write(token):
        done = device_append._write_one(
            vw, kw, tables.pages(store), device_compiled._step_ints(0, token),
            tables.addrs(vt), tables.addrs(kt), fence, P, vt.pages_per_block,
            kt.pages_per_block, kt.dtype, vt.dtype, host_keys)
        assert done.item() == 1

    write(-1)
    for k in names:
        np.testing.assert_array_equal(store.read(k), before[k])
    write(17)
    for k, src in zip(names, (vw, kw)):
        want = before[k].copy()
        want[:, 17] = np.array(src)[0, :, 0]
        np.testing.assert_array_equal(store.read(k), want)
    store.close()
