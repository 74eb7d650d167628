"""Accelerator decode with no host round trip inside a layer (issue 24; CUDA).

The host pages stay where they are, in host RAM, and the device reaches them in place: the
host store's blocks are MLX CPU-stream arrays (managed memory on CUDA) advised to stay on the
host and be mapped for the GPU (:mod:`tiered.runtime.uva`), and two kernels take their addresses:

- **write-behind** (:func:`write_tokens`): the tokens leaving the recent ring are written into
  their host pages by the device, queued with the step (the CPU no longer reads them back);
- **chunk gather** (:func:`gather_chunks`): the selected chunks of ``CHUNK`` consecutive tokens
  (2 KB of fp16 rows per head at head_dim 128) are read into device buffers, where attention
  over them runs.

A step is then one lazy graph, as ``KVCache``'s is (:mod:`tiered.step.device_step`); nothing
waits for the device until mlx-lm reads the token.

How a chunk is weighed for the selection: :mod:`tiered.step.device_chunks`.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..metal import device_ints
from ..runtime import dispatch, ops, staging, uva
from . import device_q8, disk_rows
from .chunk_word import CHUNK_WORD, KernelTable, page_fence

# The door's lazy flag: no non-finite position seen. A power of two: MLX passes a kernel's
# init_value as a float, and INT32_MAX is not one (it came back as INT32_MIN).
NO_BAD = 1 << 30

CHUNK = 8  # tokens per selected chunk (Quest / ShadowKV use 8-16)
SMALL_WRITE = 16  # tokens a write takes its page and slot ids for from the kept arrays
DOOR_TOKENS = 16  # appends of up to this many tokens: the door runs in the append's call

_GATHER = r"""
    // One thread per 16-byte word of out (H, CAPC, C, ROW_BYTES): chunk idx[h, slot] of
    // kv head h, read from its host page; slots past count[h] read nothing (zeros). ok
    // (H, CAPC * C): the token is selected, on the host pages and not resident (flags).
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint32_t CAPC = idx_shape[1];  // runtime: a refresh's row count varies
    constexpr uint32_t ROWB = ROW_BYTES, WPR = ROWB / 16, WPC = WPR * C, ppb = PPB;
    constexpr bool write_ok = true;
    const uint64_t* addrs_t = addrs;
""" + CHUNK_WORD + r"""
    reinterpret_cast<uint4*>(out)[tid] = val;
"""

_WRITE = r"""
    // One thread per 16-byte word of src (H, L, ROW_BYTES): token i goes to slot slot[i] of
    // physical page page[i], head h, in the block at addrs[page / PPB].
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    constexpr uint32_t WPR = ROW_BYTES / 16;
    const uint32_t L = src_shape[1];
    if (tid >= (uint64_t)H * L * WPR) return;
    const uint32_t h = tid / (L * WPR);
    const uint32_t rem = tid % (L * WPR);
    const uint32_t i = rem / WPR, w = rem % WPR;
    const int64_t pp = page[i];
    const uint64_t base = addrs[pp / PPB];
    const uint64_t off = (((uint64_t)(pp % PPB) * H + h) * P + slot[i]) * ROW_BYTES
                         + (uint64_t)w * 16;
    *reinterpret_cast<uint4*>(base + off) = reinterpret_cast<const uint4*>(src)[tid];
    if (tid == 0) done[0] = 1;
"""

_WRITE_ONE = r"""
    // A decode token written behind, keys and values in one launch (grid.y: 0 values,
    // 1 keys), its page looked up here: token ints[1] goes to slot ints[1] % P of logical
    // page ints[1] / P (physical pages[...]); ints[1] < 0 writes nothing (a launch that only
    // compiles the kernel). One thread per 16-byte word of a row (H, ROW).
    const bool isk = blockIdx.y == 1;
    const uint32_t ROWB = isk ? ROWK : ROWV, WPR = ROWB / 16, ppb = isk ? PPBK : PPBV;
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (tid >= (uint64_t)H * WPR) return;
    const uint32_t h = tid / WPR, w = tid % WPR;
    const int64_t t = ints[1];
    if (t < 0) {
        if (tid == 0 && !isk) done[0] = 1;
        return;
    }
    const int64_t pp = pages[t / P];
    const uint64_t base = (isk ? addrs_k : addrs_v)[pp / ppb];
    const uint64_t off = (((uint64_t)(pp % ppb) * H + h) * P + t % P) * ROWB + (uint64_t)w * 16;
    const uint4* src = isk ? reinterpret_cast<const uint4*>(kw) : reinterpret_cast<const
    uint4*>(vw);
    *reinterpret_cast<uint4*>(base + off) = src[tid];
    if (tid == 0 && !isk) done[0] = 1;
"""

_DOOR = r"""
    // The door (tiered.host_tier): bad[0] = min(prev[0], start + the first token of keys /
    // values (B, H, L, d) holding a NaN or Inf), NO_BAD when none. Blocks take tokens in
    // turn (no division per element: a flat index's token took a 64-bit division, 1.25 ms per
    // 2048-token chunk of a Llama-3-8B layer); a block folds the first it finds in with
    // atomicMin (bad[0] starts at NO_BAD: the launch's init_value).
    const uint32_t B = keys_shape[0], Hk = keys_shape[1], L = keys_shape[2], dk = keys_shape[3];
    const uint32_t Hv = values_shape[1], dv = values_shape[3];
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicMin(&bad[0], prev[0]);
    for (uint32_t t = blockIdx.x; t < L; t += gridDim.x) {
        bool found = false;
        for (uint32_t bh = 0; bh < B * Hk; ++bh) {
            const uint64_t row = ((uint64_t)bh * L + t) * dk;
            for (uint32_t e = threadIdx.x; e < dk; e += blockDim.x)
                found |= !isfinite(static_cast<float>(keys[row + e]));
        }
        for (uint32_t bh = 0; bh < B * Hv; ++bh) {
            const uint64_t row = ((uint64_t)bh * L + t) * dv;
            for (uint32_t e = threadIdx.x; e < dv; e += blockDim.x)
                found |= !isfinite(static_cast<float>(values[row + e]));
        }
        if (__syncthreads_or(found)) {  // the same answer in every thread of the block
            if (threadIdx.x == 0) atomicMin(&bad[0], start[0] + (int)t);
            return;  // this block's later tokens come after it
        }
    }
"""

_kernel = KernelTable({
    "gather": ("tiered_host_gather",
               ["idx", "count", "pages", "addrs", "flags", "n_host", "after"], ["out", "ok"],
               _GATHER),
    "door": ("tiered_door", ["keys", "values", "prev", "start"], ["bad"], _DOOR),
    "write_one": ("tiered_host_write_one",
                  ["vw", "kw", "pages", "ints", "addrs_v", "addrs_k", "after"], ["done"],
                  _WRITE_ONE),
    "write": ("tiered_host_write", ["src", "page", "slot", "addrs", "after"], ["done"], _WRITE),
})


def supported(layer) -> str | None:
    """Why ``layer`` (a CompressedLayer) cannot decode on this path, or None."""
    host = layer.parent.host
    cfg = layer.config
    if not uva.available():
        return "not on MLX's CUDA backend"
    if host is None:
        return "no host pages"
    if host.page_size % CHUNK:
        return f"page_size {host.page_size} is not a multiple of {CHUNK}"
    if (host.value_dim * np.dtype(host.values.dtype).itemsize) % 16:
        return "value rows are not a multiple of 16 bytes"
    if cfg.rescore == "exact" and host.keys is None:
        return "exact rescoring without host keys"
    dims = (host.values.head_dim,) + ((host.keys.head_dim,) if host.keys is not None else ())
    if any(d % 32 for d in dims):
        return f"head_dim {max(dims)}: the attention kernels take multiples of 32"
    if cfg.lookahead:
        return "lookahead=True (the CPU-gather path's buffer; the device path needs none)"
    return None


def _address_upload(addrs: np.ndarray) -> mx.array:
    """The uint64 device copy of block addresses: through the staging ring where it runs (an
    ``mx.array`` of host values takes its buffer from MLX's cache, moved to managed memory
    when it was a device buffer: ~1 ms per layer of a 1M-token prefill's chunks that grew the
    pages, 30-39 ms a chunk, bench/probes/prefill_profile.py --timers), else
    ``uva.address_array``."""
    if not staging.enabled() or not len(addrs):
        return uva.address_array(addrs)
    words = np.ascontiguousarray(addrs, np.uint64).view(np.int32)
    return mx.view(staging.upload(words), mx.uint64)


class DeviceTables:
    """Per host tensor: the device copies of its block addresses and of the page table,
    rebuilt only when a block or a page is added; blocks advised once (here, or off the main
    thread as they are allocated ahead: ``HostTensor.prepare``).

    A page table equal to the one another layer uploaded last is shared (:data:`_SHARED`):
    a prompt's layers take the same pages, so a chunk uploads one table, not one per layer
    (each upload waits for MLX's allocator and the driver beside the dispatcher thread)."""

    def __init__(self):
        self._addrs: dict[int, tuple[int, mx.array]] = {}
        self._pages: tuple[np.ndarray, mx.array] | None = None
        self._advised: set[int] = set()
        self._checked: dict = {}  # per (tensor, scales): the addresses advised so far

    def addrs(self, tensor, width: int | None = None, scales: bool = False) -> mx.array:
        """The block addresses (uint64 pairs); ``width``: padded with zeros to that many blocks
        (a shape kept while blocks are added); ``scales``: of an int8 tensor's scale blocks."""
        n = len(tensor.addrs)
        key = (n, tensor.moves)  # a block moved to the disk tier changes its address
        got = self._addrs.get((id(tensor), width, scales))
        if got is None or got[0] != key:
            # blocks allocated from now on are advised by the block maker's thread (int8 and
            # its scale blocks are never allocated ahead)
            tensor.prepare = uva.advise_host
            src, views = ((tensor.scale_addrs, tensor.scale_views) if scales
                          else (tensor.addrs, tensor.views))
            now = np.array(src[:n], np.uint64)
            before = self._checked.get((id(tensor), scales))
            start = len(before) if before is not None and len(before) <= n and \
                np.array_equal(before, now[: len(before)]) else 0  # only new blocks to look at
            for b in range(start, n):
                addr = int(now[b])
                if tensor.disk_index[b] >= 0:
                    continue  # the page file: the device gets the zero block (step.disk_rows)
                if addr not in self._advised and addr not in tensor.prepared:
                    uva.advise_host(views[b])
                    self._advised.add(addr)
            self._checked[(id(tensor), scales)] = now
            addrs = disk_rows.device_addresses(tensor, now, scales)  # disk: the zero block
            if width is not None and width > n:
                addrs = np.concatenate([addrs, np.zeros(width - n, np.uint64)])
            got = (key, _address_upload(addrs))
            self._addrs[(id(tensor), width, scales)] = got
        return got[1]

    def pages(self, host, width: int | None = None) -> mx.array:
        """The page table (physical page of each logical one); ``width``: padded with zeros to
        that many pages (a shape kept while pages are added; the kernels read only the pages
        below the host length)."""
        pages = host.logical_pages(0)  # the same object until the pages change
        if self._pages is None or self._pages[2] != width or self._pages[0] is not pages:
            self._pages = (pages, _shared_pages(pages, width), width)
        return self._pages[1]


_SHARED: dict = {}  # width -> (page ids, their device copy): the last table uploaded
SHARED_WIDTHS = 8


def _shared_pages(pages: np.ndarray, width: int | None) -> mx.array:
    """The device copy of ``pages`` padded to ``width``: the last one uploaded at that width if
    it holds the same ids (a copy is kept to compare: the host arrays are never written, but a
    layer's may be freed), else a new upload."""
    got = _SHARED.get(width)
    if got is not None and np.array_equal(got[0], pages):
        return got[1]
    padded = pages
    if width is not None and width > len(pages):
        padded = np.concatenate([pages, np.zeros(width - len(pages), pages.dtype)])
    arr = mx.array(padded)
    _SHARED.pop(width, None)
    _SHARED[width] = (pages.copy(), arr)
    while len(_SHARED) > SHARED_WIDTHS:  # the oldest widths go (a step's width grows)
        del _SHARED[next(iter(_SHARED))]
    return arr


_KEPT: dict = {}


def kept(shape: tuple, value: float) -> mx.array:
    """A float32 array of ``value``, made and evaluated once and shared (a fresh one per step
    would be a launch; a shared one also keeps compiled steps' constants the same)."""
    got = _KEPT.get((shape, value))
    if got is None:
        got = _KEPT[(shape, value)] = mx.full(shape, value, mx.float32)
        dispatch.eval(got)
    return got


def write_tokens(tables: DeviceTables, host, keys: mx.array, values: mx.array) -> list:
    """Queue the write of new tokens (1, H, L, d) into the host pages; the store's length
    advances now, the bytes land when the device runs the step. Returns the writes' outputs
    (to be evaluated with the step)."""
    L = values.shape[2]
    start = host.length
    host.reserve(L)
    P = host.page_size
    if L > SMALL_WRITE:
        # a prompt's many tokens: their pages and slots worked out on the device from the
        # page table (two arrays made from host values per layer and chunk waited for the
        # allocator's lock beside the dispatcher thread: see tiered.step.undo._slot_index)
        t = mx.arange(start, start + L, dtype=mx.int32)
        page, slot = mx.take(tables.pages(host), t // P).astype(mx.int32), t % P
    else:
        # a decode step's token ids are the same in every layer: kept device arrays, not
        # fresh ones (see metal._build.device_ints)
        t = np.arange(start, start + L)
        pages_np = host.logical_pages(0)
        page, slot = device_ints(*pages_np[t // P]), device_ints(*(t % P))
    out = []
    for tensor, x in ((host.values, values), (host.keys, keys)):
        if tensor is None:
            continue
        if tensor.dtype == "int8":
            out.append(device_q8.write(tables, host, tensor, ops.batch0(x), page, slot))
            continue
        x = ops.batch0(x).astype(host_mx_dtype(tensor.dtype))
        row = x.shape[-1] * x.dtype.size
        (done,) = _kernel("write")(
            inputs=[x, page, slot, tables.addrs(tensor), page_fence(host)],
            output_shapes=[(1,)], output_dtypes=[mx.int32], grid=(x.shape[0] * L * row // 16, 1, 1),
            threadgroup=(256, 1, 1),
            template=[("H", x.shape[0]), ("P", host.page_size),
                      ("PPB", tensor.pages_per_block), ("ROW_BYTES", row)])
        out.append(done)
        host.device_op(done)  # the keys' write comes after the values' (both are tiny)
    return out


DOOR_BLOCKS = 2048  # a prompt chunk's door: blocks of 128 threads, a token each in turn


def first_bad(keys: mx.array, values: mx.array, start: int, prev: mx.array | None) -> mx.array:
    """(1,) int32, lazy: the first position of a non-finite key or value so far (``prev``, then
    tokens [start, start + L) of keys / values (B, H, L, d)), NO_BAD when none: the door's
    check and its fold in one launch (for a decode token six MLX ops, and a chain that grew
    every step; for a 2048-token prompt chunk of a Llama-3-8B layer ~8 MLX launches and
    0.44 ms of GPU time on an H200, bench/probes/prefill_profile.py)."""
    prev = device_ints(NO_BAD) if prev is None else prev
    blocks = max(1, min(DOOR_BLOCKS, keys.shape[2]))
    (bad,) = _kernel("door")(
        inputs=[keys, values, prev, device_ints(start)], output_shapes=[(1,)],
        output_dtypes=[mx.int32], grid=(128 * blocks, 1, 1), threadgroup=(128, 1, 1),
        init_value=NO_BAD)
    return bad


def gather_chunks(tables: DeviceTables, host, tensor, idx: mx.array, count: mx.array,
                  flags: mx.array, chunk: int = CHUNK, where: tuple | None = None):
    """The selected chunks' rows (H, CAPC * chunk, d) in the host dtype, read in place from
    the host pages, and which tokens are attended here (H, CAPC * chunk): selected, on the
    host pages, not resident. Rows of tokens not attended are zeros (not read). ``chunk=1``
    reads single tokens (a refresh's promoted rows). ``where``: (pages, the tensor's block
    addresses, n_host (1+,) int32, fence) as arrays the caller holds (a compiled step's
    inputs); the caller then records ``ok`` as the pages' fence (HostStore.device_op)."""
    H, capc = idx.shape
    d = tensor.head_dim
    if tensor.dtype == "int8":
        return device_q8.gather(tables, host, tensor, idx, count, flags, chunk, where)
    dtype = host_mx_dtype(tensor.dtype)
    row = d * dtype.size
    own = where is None
    if own:
        where = (tables.pages(host), tables.addrs(tensor), device_ints(host.length),
                 page_fence(host))
    pages, addrs, n_host, fence = where
    out, ok = _kernel("gather")(
        inputs=[idx, count, pages, addrs, flags, n_host, fence],
        output_shapes=[(H, capc * chunk, d), (H, capc * chunk)],
        output_dtypes=[dtype, mx.bool_],
        grid=(H * capc * chunk * row // 16, 1, 1), threadgroup=(256, 1, 1),
        template=[("H", H), ("C", chunk), ("P", host.page_size),
                  ("PPB", tensor.pages_per_block), ("ROW_BYTES", row)])
    if own:
        host.device_op(ok)  # a sibling: evaluated with the rows, and small to keep
    return out, ok


def host_mx_dtype(name: str):
    """The MLX dtype of host pages stored as ``name`` (float16 / float32)."""
    return {"float16": mx.float16, "float32": mx.float32}[name]
