"""The device path over a disk tier (issue 62): selected chunks whose pages lie in the page file.

A kernel reads host pages by address, and the disk tier's blocks are a read-only file mapping,
neither pinned nor managed memory: on an H200 with driver 580 (no pageable memory access, no
HMM) a kernel that follows such an address faults, and page-locking the mapping would hold the
whole file in RAM (bench/probes/disk_uva_probe.py). So the device never reads the page file:

- the block addresses it takes point every disk block at one block of zeros
  (:func:`zero_block`), so the gather kernels read zeros there and still say which tokens are
  attended (``ok`` depends on the selection, the flags and the length, not on the bytes);
- the selected disk chunks' rows come from the CPU and are added to what the kernel gathered
  (:func:`add`): exact, since the kernel's rows are zeros there and these rows are zeros
  elsewhere. By default a worker thread copies them as the device reaches the layer, without a
  host wait (:mod:`tiered.step.disk_stage`); with ``TIERED_DISK_ROWS=sync`` the layer waits
  for its selection (a sync per such layer and token) and the main thread copies them here
  (:func:`read`, the store's gather: the OS page cache, or the disk).

New pages are always in RAM blocks where the device writes (``HostStore.device_writes``), and the
oldest RAM blocks move to disk as the store grows, so the write-behind never meets the file.
How often and how much the CPU read is counted in :data:`COUNTS` (with the worker's:
``disk_stage.counts()``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..cpu import block_alloc
from ..cpu.block_maker import np_view
from ..runtime import dispatch, uva

# per process: layer-steps that read disk rows, chunks read, and their bytes
COUNTS = {"layer_steps": 0, "chunks": 0, "bytes": 0}

_ZERO: dict = {}


def zero_block(shape: tuple, dtype: str) -> int:
    """The address of a block of zeros of this shape and dtype, readable by the device
    (managed memory kept on the host and mapped), made once per shape and dtype."""
    key = (tuple(shape), dtype)
    got = _ZERO.get(key)
    if got is None:
        arr = block_alloc.full_block(shape, dtype, 0)
        mx.eval(arr)
        view = np_view(arr, shape)
        if uva.available():
            uva.advise_host(view)
        got = _ZERO[key] = (arr, view, int(view.ctypes.data))
    return got[2]


def device_addresses(tensor, addrs: np.ndarray, scales: bool = False) -> np.ndarray:
    """``addrs`` (the tensor's block addresses, uint64, or its scale blocks' with ``scales``)
    with every disk block's replaced by the zero block's."""
    disk = np.asarray(tensor.disk_index[: len(addrs)]) >= 0
    if not disk.any():
        return addrs
    out = addrs.copy()
    shape = tensor.block_shape[:-1] if scales else tensor.block_shape
    out[disk] = zero_block(shape, "float32" if scales else tensor.dtype)
    return out


def disk_tokens(host, idx: np.ndarray, count: np.ndarray, chunk: int) -> np.ndarray:
    """(H, capc * chunk) tokens of the selected chunks (``idx`` (H, capc), the first
    ``count[h]`` of row h) that lie in disk blocks of the values, -1 elsewhere."""
    H, capc = idx.shape
    P, tensor = host.page_size, host.values
    tok = idx[:, :, None].astype(np.int64) * chunk + np.arange(chunk)
    live = (np.arange(capc)[None, :] < count[:, None])[:, :, None] & (tok < host.length)
    tok = np.where(live, tok, 0)
    pages = host.logical_pages(0)
    blk = pages[tok // P] // tensor.pages_per_block
    on_disk = np.asarray(tensor.disk_index) >= 0
    return np.where(live & on_disk[blk], tok, -1).reshape(H, capc * chunk)


def read(host, idx: mx.array, count: mx.array, chunk: int, names: tuple) -> dict | None:
    """Waits for the selection and reads the disk chunks' rows of ``names`` (tensor name ->
    (H, capc * chunk, d) in the host dtype, zeros elsewhere), or None when no selected chunk
    lies on disk. No wait for the pages' queued device work: the device never writes a disk
    block (HostStore.device_writes), so these bytes are final."""
    dispatch.eval(idx, count)
    tok = disk_tokens(host, np.array(idx), np.array(count), chunk)
    keep = tok >= 0
    if not keep.any():
        return None
    COUNTS["layer_steps"] += 1
    COUNTS["chunks"] += int(keep.sum()) // chunk
    out = {}
    for name in names:
        tensor = getattr(host, name)
        out[name] = mx.array(host.gather_rows(name, 0, tok, wait=False))  # int8: dequantized
        scale = 4 if tensor.dtype == "int8" else 0  # a float32 scale per int8 row
        COUNTS["bytes"] += int(keep.sum()) * (tensor.head_dim * tensor.views[0].itemsize + scale)
    return out


def add(rows: mx.array, extra: mx.array, ok: mx.array) -> mx.array:
    """The kernel's ``rows`` (zeros on disk blocks) with the disk chunks' rows ``extra`` where
    attended (``ok``): exact, each position holds one of the two or zero."""
    return rows + mx.where(ok[..., None], extra.astype(rows.dtype), 0)
