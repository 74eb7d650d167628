"""Reads of a paged host store (:class:`cpu.pages.HostStore`) on the reference path: whole
ranges, one head's rows, every head's rows of chosen tokens, and a lazy MLX view of every token.
The kernels read the pages themselves (block addresses + ``logical_pages``).

Every read checks first that the store's page files still hold their blocks
(:meth:`PageReads.check_disk`, one fstat per file): a disk-tier file truncated under the cache
(through /proc/<pid>/fd, by this process or another) is then a DiskTierError, not a SIGBUS in
the middle of a copy. The CPU gather checks the same before its workers read
(:func:`tiered.runtime.ops.submit_gather`). A truncation racing the read itself still faults."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .block_alloc import MX_DTYPES, NP_DTYPES, shaped
from .host_tensor import HostTensor
from .memory_budget import SharedMemoryBudget
from .paged_rows import copy_rows


class PageReads:
    """Methods of :class:`cpu.pages.HostStore` (see the module docstring)."""

    def read(self, kind: str, b: int = 0, start: int = 0, stop: int | None = None) -> np.ndarray:
        """(H, stop-start, d) float32 copy of tokens [start, stop) of sequence b."""
        self.settle()
        self.check_disk()
        tensor = self._tensor(kind)
        stop = self.length if stop is None else stop
        if not 0 <= start <= stop <= self.length:
            raise ValueError(f"Invalid range [{start}, {stop}) of {self.length} tokens")
        out = np.empty((self.n_kv_heads, stop - start, tensor.head_dim), np.float32)
        t = start
        while t < stop:
            page, slot = divmod(t, self.page_size)
            take = min(self.page_size - slot, stop - t)
            out[:, t - start : t - start + take] = tensor.read(self._pages[b][page], slot, take)
            t += take
        return out

    def gather(self, kind: str, b: int, head: int, tokens: np.ndarray) -> np.ndarray:
        """(len(tokens), d) float32 rows of one head, in the order given (vectorized by block)."""
        self.settle()
        self.check_disk()
        tensor = self._tensor(kind)
        tokens = np.asarray(tokens, np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.length):
            raise IndexError(f"token index out of range [0, {self.length})")
        pages = self.logical_pages(b)[tokens // self.page_size]
        blocks, slots = np.divmod(pages, tensor.pages_per_block)
        offs = tokens % self.page_size
        out = np.empty((tokens.size, tensor.head_dim), np.float32)
        for blk in np.unique(blocks):
            sel = blocks == blk
            rows = tensor.views[blk][slots[sel], head, offs[sel]].astype(np.float32)
            if tensor.dtype == "int8":
                rows *= tensor.scale_views[blk][slots[sel], head, offs[sel], None]
            out[sel] = rows
        return out

    def gather_rows(self, kind: str, b: int, tokens: np.ndarray, wait: bool = True) -> np.ndarray:
        """(H, m, d) rows of tokens (H, m) (kv head h's row of token tokens[h, i]; -1 gives
        zeros) in the storage dtype: float16 and float32 rows are copied as stored, with no
        conversion; int8 rows come dequantized, as float32. ``wait=False``: without waiting for
        queued device work on the pages (rows no device writes: the disk tier's)."""
        if wait:
            self.settle()
        self.check_disk()
        tensor = self._tensor(kind)
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or tokens.shape[0] != self.n_kv_heads:
            raise ValueError(f"Invalid shape of tokens: expected ({self.n_kv_heads}, m), got "
                             f"{tokens.shape}")
        if tokens.size and (tokens.min() < -1 or tokens.max() >= self.length):
            raise IndexError(f"token index out of range [0, {self.length})")
        dt = np.dtype(NP_DTYPES[tensor.dtype])
        pages = self.logical_pages(b)
        raw = copy_rows(tensor.addrs, pages, self.page_size, tensor.pages_per_block, tokens,
                        tensor.head_dim * dt.itemsize)
        rows = raw.view(dt).reshape(tokens.shape + (tensor.head_dim,))
        if tensor.dtype != "int8":
            return rows
        # int8: each row times its scale, the scale blocks laid out as the rows (one float32
        # per row). A numpy loop over heads and blocks took 15.7 ms (this: 2.7) for 2048
        # tokens of 8 heads over 131k tokens on a 2-core CPU, per layer and prompt chunk of a
        # block-wise prefill with host keys.
        scales = copy_rows(tensor.scale_addrs, pages, self.page_size, tensor.pages_per_block,
                           tokens, 4).view(np.float32)
        return rows.astype(np.float32) * scales

    def lazy_tokens(self, kind: str, b: int = 0) -> mx.array:
        """(H, length, d) every token of sequence b as a lazy MLX graph over the blocks: no
        byte is read unless it is evaluated (disk-tier blocks are read here). int8 stores come
        dequantized (float32)."""
        self.settle()
        self.check_disk()
        tensor = self._tensor(kind)
        H, d = self.n_kv_heads, tensor.head_dim
        if self.length == 0:
            return mx.zeros((H, 0, d), MX_DTYPES[tensor.dtype] if tensor.dtype != "int8" else mx.float32)

        def block(i, scales=False):
            arr = (tensor.scale_blocks if scales else tensor.blocks)[i]
            if arr is None:
                return mx.array((tensor.scale_views if scales else tensor.views)[i])
            return shaped(arr, tensor.block_shape[:-1] if scales else tensor.block_shape)

        parts = []
        for page in self._pages[b]:
            blk, slot = divmod(page, tensor.pages_per_block)
            rows = block(blk)[slot]  # (H, P, d)
            if tensor.dtype == "int8":
                rows = rows.astype(mx.float32) * block(blk, scales=True)[slot][..., None]
            parts.append(rows)
        return mx.concatenate(parts, axis=1)[:, : self.length]

    def release_disk_reads(self) -> None:
        """The disk tier's pages that reads mapped into the process leave its RSS (they stay in
        the kernel's page cache): a block-wise prefill retrieving from pages on disk touched
        a little more of the page file at every chunk (+70 MiB over a 200k-token prefill)."""
        for t in self.tensors:
            for f in (t.disk, t.scale_disk):
                if f is not None:
                    f.release()

    def release_if_bounded(self) -> None:
        """:meth:`release_disk_reads` where a ``memory_budget`` bounds the process (the budget
        counts RSS, and a decode step's reads map ~1 OS page per chunk-head of the page file:
        at 32k tokens on the embedded model, 10 decode steps left 387 MiB of page-file pages
        in the process against a 360 MiB budget). Elsewhere the mapped pages stay: the next
        reads of the same pages then take no page fault."""
        if isinstance(self.values.budget, SharedMemoryBudget) and self.disk_bytes:
            self.release_disk_reads()

    def check_disk(self) -> None:
        """DiskTierError (naming the file and its sizes) when a page file of this store no
        longer holds every block mapped from it (see PageFile.check_size)."""
        for t in self.tensors:
            if t.disk is not None:
                t.disk.check_size()
                if t.scale_disk is not None:
                    t.scale_disk.check_size()

    def _tensor(self, kind) -> HostTensor:
        if kind == "values":
            t = self.values
        elif kind == "keys":
            if self.keys is None:
                raise ValueError("this HostStore does not keep keys (host_keys=False)")
            t = self.keys
        else:
            raise ValueError(f"Invalid kind {kind!r}: expected 'keys' or 'values'")
        if self.length and not t.views:  # close() gave its blocks back
            raise ValueError("this HostStore was closed: its pages are gone")
        return t
