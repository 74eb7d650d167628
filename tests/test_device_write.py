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


def test_int8_pages_written_and_gathered_by_the_device_match_the_host_store(device_path):
    """int8 host pages on the device path: the device quantizes the tokens it writes behind
    exactly as the host store does (the same bytes and scales as the same tokens appended by
    the CPU), and the chunk gather dequantizes into float16 what the CPU reads (the float32
    product rounded once), zeros where a chunk is not selected."""
    from tiered.step import device_q8
    from tiered.step.device_decode import CHUNK, gather_chunks, write_tokens

    H, d, P, n = 2, 64, 16, 70
    rng = np.random.default_rng(3)
    vals = rng.normal(size=(1, H, n, d)).astype(np.float16)
    keys = (3 * rng.normal(size=(1, H, n, d))).astype(np.float16)
    vals[0, 1, 5] = 0  # a zero row: scale 1
    cpu = HostStore(H, d, page_size=P, dtype="int8", pages_per_block=2)
    cpu.append(vals, keys)
    dev = HostStore(H, d, page_size=P, dtype="int8", pages_per_block=2)
    tables = DeviceTables()
    for lo, hi in ((0, 40), (40, 41), (41, n)):  # a prompt chunk, a decode token, the rest
        for t in write_tokens(tables, dev, mx.array(keys[:, :, lo:hi]), mx.array(vals[:, :, lo:hi])):
            mx.eval(t)
    dev.settle()
    for name in ("values", "keys"):
        a, b = getattr(cpu, name), getattr(dev, name)
        for blk in range(len(a.views)):
            np.testing.assert_array_equal(b.views[blk][:, :, :], a.views[blk][:, :, :])
            np.testing.assert_array_equal(b.scale_views[blk], a.scale_views[blk])
    idx = mx.array([[0, 3, 8, 0], [8, 2, 0, 0]], mx.int32)  # chunk 8 holds tokens 64..69
    count = mx.array([3, 2], mx.int32)
    flags = mx.zeros((H, n + 8), mx.uint8)
    rows, ok = gather_chunks(tables, dev, dev.values, idx, count, flags)
    rows, ok = np.array(rows), np.array(ok)
    assert rows.dtype == np.float16 and rows.shape == (H, 4 * CHUNK, d)
    tok = np.array(idx)[:, :, None] * CHUNK + np.arange(CHUNK)
    live = (np.arange(4)[None, :, None] < np.array(count)[:, None, None]) & (tok < n)
    want_tok = np.where(live, tok, -1).reshape(H, -1)
    want = cpu.gather_rows("values", 0, want_tok).astype(np.float16)
    np.testing.assert_array_equal(ok, want_tok >= 0)
    np.testing.assert_array_equal(rows, want)
    assert device_q8._kernel.built.get("gather") is not None
    cpu.close()
    dev.close()
