"""Paged host store: keys and values of every token, in CPU memory, behind a CSR page table.

Layout (one store per attention layer):

- a *page* holds ``page_size`` consecutive tokens of one sequence, all KV heads:
  ``(n_kv_heads, page_size, head_dim)``;
- pages live in *blocks* of ``pages_per_block`` pages, each block one array of shape
  ``(pages_per_block, n_kv_heads, page_size, head_dim)``. Blocks are MLX arrays allocated on the
  CPU stream (so ``state`` hands them to ``mlx_lm.save_prompt_cache`` without a copy) and are
  read and written through zero-copy numpy views; Numba kernels reach them through the block
  address table :attr:`HostStore.addrs` (``physical page id -> block``, ``id // pages_per_block``);
- the page table is CSR as in flashinfer: sequence ``b`` owns physical pages
  ``indices[indptr[b]:indptr[b+1]]`` in logical order; its last page holds ``last_page_len``
  tokens.

Storage dtypes: ``float16`` (default), ``float32``, or ``int8`` (symmetric, one fp32 scale per
token and head; "8-bit values are nearly free").
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

HOST_DTYPES = ("float16", "float32", "int8")

_MX = {"float16": mx.float16, "float32": mx.float32, "int8": mx.int8}
_NP = {"float16": np.float16, "float32": np.float32, "int8": np.int8}


@dataclass
class PageTable:
    """CSR page table. indptr: (B+1,) int64; indices: (n_pages,) int64; last_page_len: (B,)."""

    indptr: np.ndarray
    indices: np.ndarray
    last_page_len: np.ndarray

    def pages_of(self, b: int) -> np.ndarray:
        return self.indices[self.indptr[b] : self.indptr[b + 1]]


def _alloc_block(shape, dtype: str):
    # Unwritten slots hold NaN (int8: 0, with NaN scales) so a read past the end shows up.
    fill = 0 if dtype == "int8" else float("nan")
    arr = mx.full(shape, fill, dtype=_MX[dtype], stream=mx.cpu)
    mx.eval(arr)
    return arr


def _host_copy(arr: mx.array) -> mx.array:
    out = mx.array(np.array(arr))
    mx.eval(out)
    return out


def _np_view(arr: mx.array) -> np.ndarray:
    view = np.array(arr, copy=False)
    if not view.flags.writeable or not view.flags.c_contiguous:
        raise RuntimeError("host block is not a writable contiguous buffer")
    return view


class HostTensor:
    """One paged tensor (keys or values) of a layer: blocks, views and the address table."""

    def __init__(self, n_kv_heads, page_size, head_dim, dtype, pages_per_block):
        if dtype not in HOST_DTYPES:
            raise ValueError(f"Invalid host dtype {dtype!r}: expected one of {HOST_DTYPES}")
        self.n_kv_heads, self.page_size, self.head_dim = n_kv_heads, page_size, head_dim
        self.dtype, self.pages_per_block = dtype, pages_per_block
        self.blocks: list[mx.array] = []
        self.scale_blocks: list[mx.array] = []  # int8 only: (ppb, H, page_size) fp32
        self.views: list[np.ndarray] = []
        self.scale_views: list[np.ndarray] = []
        self.addrs = np.zeros(0, np.int64)
        self.scale_addrs = np.zeros(0, np.int64)

    @property
    def block_shape(self):
        return (self.pages_per_block, self.n_kv_heads, self.page_size, self.head_dim)

    @property
    def capacity_pages(self) -> int:
        return len(self.blocks) * self.pages_per_block

    def grow(self):
        blk = _alloc_block(self.block_shape, self.dtype)
        self._adopt(blk, None)

    def _adopt(self, blk, scales):
        self.blocks.append(blk)
        view = _np_view(blk)
        self.views.append(view)
        self.addrs = np.append(self.addrs, np.int64(view.ctypes.data))
        if self.dtype == "int8":
            if scales is None:
                scales = _alloc_block(self.block_shape[:-1], "float32")  # NaN-filled
            self.scale_blocks.append(scales)
            sview = _np_view(scales)
            self.scale_views.append(sview)
            self.scale_addrs = np.append(self.scale_addrs, np.int64(sview.ctypes.data))

    def write(self, page: int, start: int, data: np.ndarray):
        """data: (H, n, d) float32/float16 tokens written at slots [start, start+n) of a page."""
        blk, slot = divmod(page, self.pages_per_block)
        n = data.shape[1]
        if self.dtype == "int8":
            amax = np.abs(data).max(axis=-1).astype(np.float32)
            scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
            q = np.rint(data / scale[..., None]).clip(-127, 127).astype(np.int8)
            self.views[blk][slot, :, start : start + n] = q
            self.scale_views[blk][slot, :, start : start + n] = scale
        else:
            self.views[blk][slot, :, start : start + n] = data

    def read(self, page: int, start: int, n: int) -> np.ndarray:
        """(H, n, d) float32 copy of slots [start, start+n) of a page."""
        blk, slot = divmod(page, self.pages_per_block)
        raw = self.views[blk][slot, :, start : start + n].astype(np.float32)
        if self.dtype == "int8":
            raw *= self.scale_views[blk][slot, :, start : start + n, None]
        return raw

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks) + sum(s.nbytes for s in self.scale_blocks)


class HostStore:
    """Keys (optional) and values of every token of one layer, in paged CPU memory.

    Args:
        n_kv_heads, head_dim: per-token geometry (head_dim of keys).
        value_dim: head_dim of values, when it differs from the keys'.
        page_size: tokens per page.
        dtype: storage dtype, one of ``HOST_DTYPES``.
        keys: also store full keys (for exact rescoring and promotion to the resident set).
        batch: number of sequences (rows of the page table).
        pages_per_block: pages per allocation; blocks are added as the store grows.
    """

    def __init__(
        self,
        n_kv_heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        page_size: int = 256,
        dtype: str = "float16",
        keys: bool = True,
        batch: int = 1,
        pages_per_block: int = 16,
    ):
        if page_size <= 0 or pages_per_block <= 0:
            raise ValueError(
                f"Invalid page geometry: page_size={page_size}, pages_per_block={pages_per_block}"
            )
        self.n_kv_heads, self.head_dim, self.page_size = n_kv_heads, head_dim, page_size
        self.value_dim = value_dim or head_dim
        self.batch = batch
        self.values = HostTensor(n_kv_heads, page_size, self.value_dim, dtype, pages_per_block)
        self.keys = (
            HostTensor(n_kv_heads, page_size, head_dim, dtype, pages_per_block) if keys else None
        )
        self.length = 0  # tokens per sequence
        self._pages: list[list[int]] = [[] for _ in range(batch)]
        self._free: list[int] = []
        self._next_page = 0

    # ---- page table -------------------------------------------------------------------
    @property
    def tensors(self):
        return [t for t in (self.keys, self.values) if t is not None]

    def page_table(self) -> PageTable:
        counts = [len(p) for p in self._pages]
        indptr = np.zeros(self.batch + 1, np.int64)
        indptr[1:] = np.cumsum(counts)
        indices = np.array([i for p in self._pages for i in p], np.int64)
        last = self.length - (counts[0] - 1) * self.page_size if counts and counts[0] else 0
        return PageTable(indptr, indices, np.full(self.batch, last, np.int64))

    def logical_pages(self, b: int = 0) -> np.ndarray:
        """Physical page id of each logical page of sequence b, as int64 (for kernels)."""
        return np.asarray(self._pages[b], np.int64)

    def _new_page(self) -> int:
        if self._free:
            return self._free.pop()
        page = self._next_page
        self._next_page += 1
        while page >= self.values.capacity_pages:
            for t in self.tensors:
                t.grow()
        return page

    # ---- writes -----------------------------------------------------------------------
    def append(self, values: np.ndarray, keys: np.ndarray | None = None):
        """Append tokens. values/keys: (B, H, L, d) arrays (float16 or float32)."""
        self._check(values, "values", self.value_dim)
        if self.keys is not None:
            if keys is None:
                raise ValueError("this HostStore keeps keys: append() needs keys")
            self._check(keys, "keys", self.head_dim)
            if keys.shape[2] != values.shape[2]:
                raise ValueError(
                    f"Invalid shape of keys: {keys.shape[2]} tokens, values have {values.shape[2]}"
                )
        n = values.shape[2]
        pos = 0
        while pos < n:
            slot = self.length % self.page_size
            if slot == 0:
                for b in range(self.batch):
                    self._pages[b].append(self._new_page())
            take = min(self.page_size - slot, n - pos)
            for b in range(self.batch):
                page = self._pages[b][-1]
                self.values.write(page, slot, values[b, :, pos : pos + take])
                if self.keys is not None:
                    self.keys.write(page, slot, keys[b, :, pos : pos + take])
            self.length += take
            pos += take

    def _check(self, x, name, dim):
        expected = (self.batch, self.n_kv_heads, None, dim)
        if x.ndim != 4 or any(e is not None and e != s for e, s in zip(expected, x.shape)):
            raise ValueError(
                f"Invalid shape of {name}: expected (B={self.batch}, H={self.n_kv_heads}, L, "
                f"d={dim}), got {tuple(x.shape)}"
            )

    def truncate(self, length: int):
        """Drop tokens past ``length``; pages that become empty return to the free list."""
        if not 0 <= length <= self.length:
            raise ValueError(f"Invalid length {length}: the store holds {self.length} tokens")
        keep = -(-length // self.page_size)
        for pages in self._pages:
            self._free.extend(pages[keep:])
            del pages[keep:]
        self.length = length

    # ---- reads (reference path; kernels use addrs + logical_pages) ---------------------
    def read(self, kind: str, b: int = 0, start: int = 0, stop: int | None = None) -> np.ndarray:
        """(H, stop-start, d) float32 copy of tokens [start, stop) of sequence b."""
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

    def _tensor(self, kind) -> HostTensor:
        if kind == "values":
            return self.values
        if kind == "keys":
            if self.keys is None:
                raise ValueError("this HostStore does not keep keys (host_keys=False)")
            return self.keys
        raise ValueError(f"Invalid kind {kind!r}: expected 'keys' or 'values'")

    # ---- accounting and persistence ----------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes allocated in host memory (whole blocks)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def used_bytes(self) -> int:
        per_token = sum(
            self.n_kv_heads * t.head_dim * np.dtype(_NP[t.dtype]).itemsize
            + (self.n_kv_heads * 4 if t.dtype == "int8" else 0)
            for t in self.tensors
        )
        return per_token * self.length * self.batch

    def state(self) -> dict:
        """Arrays (no copies) and scalars that rebuild this store with :meth:`from_state`."""
        st = {
            "meta": [
                self.n_kv_heads, self.head_dim, self.value_dim, self.page_size, self.values.dtype,
                int(self.keys is not None), self.batch, self.values.pages_per_block,
                self.length, self._next_page,
            ],
            "pages": mx.array(np.array(self._pages, np.int64).reshape(self.batch, -1)),
            "free": mx.array(np.array(self._free, np.int64)),
        }
        for name, t in (("values", self.values), ("keys", self.keys)):
            if t is not None:
                st[name] = list(t.blocks)
                if t.dtype == "int8":
                    st[name + "_scales"] = list(t.scale_blocks)
        return st

    @classmethod
    def from_state(cls, st: dict) -> "HostStore":
        H, d, dv, P, dtype, has_keys, batch, ppb, length, next_page = st["meta"]
        obj = cls(H, d, value_dim=dv, page_size=P, dtype=dtype, keys=bool(has_keys), batch=batch,
                  pages_per_block=ppb)
        for name, t in (("values", obj.values), ("keys", obj.keys)):
            if t is None:
                continue
            scales = st.get(name + "_scales", [None] * len(st[name]))
            for blk, sc in zip(st[name], scales):
                # Copy: the block must be host memory this store owns and may write in place.
                t._adopt(_host_copy(blk), None if sc is None else _host_copy(sc))
        pages = np.array(st["pages"], np.int64).reshape(batch, -1)
        obj._pages = [list(map(int, row)) for row in pages]
        obj._free = list(map(int, np.array(st["free"], np.int64)))
        obj.length, obj._next_page = int(length), int(next_page)
        return obj
