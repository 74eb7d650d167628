"""The stores and mailboxes that tests/test_disk_stage.py and tests/test_disk_serve.py stage
rows from: blocks in the host layout with a shuffled page table and their reference rows."""

from __future__ import annotations

import numpy as np

from tiered.cpu.disk_serve import FLOAT16, INT8

H, P, PPB, D, C = 2, 4, 2, 8, 4  # kv heads, page size, pages per block, head dim, chunk


def address(buf):
    return buf.ctypes.data


def store(rng, code, blocks=3):
    """Blocks (PPB, H, P, D) of a tensor in the host layout (int8 with a scale per row), a
    shuffled page table, and the reference rows (H, tokens, D) as float32."""
    shape = (PPB, H, P, D)
    if code == INT8:
        data = [rng.integers(-127, 128, shape).astype(np.int8) for _ in range(blocks)]
        scales = [rng.uniform(0.01, 1, shape[:3]).astype(np.float32) for _ in range(blocks)]
    else:
        dt = np.float16 if code == FLOAT16 else np.float32
        data = [rng.normal(size=shape).astype(dt) for _ in range(blocks)]
        scales = []
    pages = rng.permutation(blocks * PPB).astype(np.int64)
    n = len(pages) * P
    ref = np.zeros((H, n, D), np.float32)
    for t in range(n):
        phys = pages[t // P]
        b, slot = phys // PPB, phys % PPB
        row = data[b][slot, :, t % P].astype(np.float32)
        if code == INT8:
            row = row * scales[b][slot, :, t % P][:, None]
        ref[:, t] = row
    return data, scales, pages, ref
