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

from tiered.runtime import streams
from tiered.options.option_rules import check_block_bytes

from .block_alloc import NP_DTYPES
from .host_tensor import HOST_DTYPES, HostTensor  # noqa: F401 (HOST_DTYPES re-exported)
from .device_writes import DeviceWrites
from .page_reads import PageReads


@dataclass
class PageTable:
    """CSR page table. indptr: (B+1,) int64; indices: (n_pages,) int64; last_page_len: (B,)."""

    indptr: np.ndarray
    indices: np.ndarray
    last_page_len: np.ndarray

    def pages_of(self, b: int) -> np.ndarray:
        return self.indices[self.indptr[b] : self.indptr[b + 1]]


class HostStore(DeviceWrites, PageReads):
    """Keys (optional) and values of every token of one layer, in paged CPU memory.

    Args:
        n_kv_heads, head_dim: per-token geometry (head_dim of keys).
        value_dim: head_dim of values, when it differs from the keys'.
        page_size: tokens per page.
        dtype: storage dtype, one of ``HOST_DTYPES``.
        keys: also store full keys (for exact rescoring and promotion to the resident set).
        batch: number of sequences (rows of the page table).
        pages_per_block: pages per allocation; blocks are added as the store grows.
        budget: a shared :class:`tiered.cpu.memory_budget.HostBudget`; blocks beyond it go to the
            disk tier, in anonymous page files under ``disk_dir`` (see tiered.cpu.disk).
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
        budget=None,
        disk_dir: str | None = None,
        disk_budget=None,
        name: str = "layer",
        unified: bool = False,
    ):
        if page_size <= 0 or pages_per_block <= 0:
            raise ValueError(
                f"Invalid page geometry: page_size={page_size}, pages_per_block={pages_per_block}"
            )
        if dtype in NP_DTYPES:  # (an unknown dtype is refused by HostTensor, naming it)
            check_block_bytes(page_size, pages_per_block * page_size * n_kv_heads * (
                head_dim + (value_dim or head_dim)) * np.dtype(NP_DTYPES[dtype]).itemsize)
        self.n_kv_heads, self.head_dim, self.page_size = n_kv_heads, head_dim, page_size
        self.value_dim = value_dim or head_dim
        self.batch = batch
        # unified: RAM blocks in slabs a GPU kernel takes as inputs (tiered.cpu.slabs)
        tier = dict(budget=budget, disk_dir=disk_dir, disk_budget=disk_budget, unified=unified)
        self.values = HostTensor(n_kv_heads, page_size, self.value_dim, dtype, pages_per_block,
                                 name=f"{name}-values", **tier)
        self.keys = (
            HostTensor(n_kv_heads, page_size, head_dim, dtype, pages_per_block,
                       name=f"{name}-keys", **tier) if keys else None
        )
        self.length = 0  # tokens per sequence
        # A small output (lazy) of the last device kernel that read or wrote these pages by
        # address (tiered.step.device_decode): the next such kernel takes it as an input, so they
        # run in the order they were queued (see :meth:`device_op`).
        self.fence = None
        self._pages: list[list[int]] = [[] for _ in range(batch)]
        self._free: list[int] = []
        self.device_writes = False  # set by the device path: new pages only in RAM blocks
        self._next_page = 0
        self._shrunk = 0  # bumped when a page list shrinks in place (logical_pages' cache)
        self._logical: dict = {}

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
        """Physical page id of each logical page of sequence b, as int64 (for kernels). The
        same array object until the pages change (callers may compare by identity; a fresh
        array from the list of ~8k pages at 128k tokens cost ~0.07 ms per layer and step on
        the device path). Not to be written (Numba kernels take it as it is).

        Pages appended since the last call are copied onto the end of a buffer kept with
        spare room (a view of it is returned), so a prompt chunk costs its new pages, not all
        of them (H200, 1M-token prefill: the whole list's conversion was 5% of the main
        thread's samples at 900k tokens). A view once returned never changes: a shrink starts
        a new buffer, and growth writes only past every view's end."""
        pages = self._pages[b]
        got = self._logical.get(b)
        n = len(pages)
        if got is not None and got[0] is pages and got[1] == n and got[2] == self._shrunk:
            return got[3]
        buf, have = (got[4], got[1]) if got is not None and got[0] is pages \
            and got[2] == self._shrunk and got[1] <= n else (None, 0)
        if buf is None or n > len(buf):
            grown = np.empty(max(16, 2 * n), np.int64)
            if have:
                grown[:have] = buf[:have]
            buf = grown
        buf[have:n] = pages[have:n]
        view = buf[:n]
        self._logical[b] = (pages, n, self._shrunk, view, buf)
        return view

    def _new_page(self) -> int:
        # the device writes pages by address, and the disk tier's mapping is read-only
        device = self.device_writes or self.fence is not None
        if self._free:
            if not device:
                return self._free.pop()
            for i in range(len(self._free) - 1, -1, -1):
                if not self._on_disk(self._free[i]):
                    return self._free.pop(i)
        page = self._next_page
        while device and page < self.values.capacity_pages and self._on_disk(page):
            self._free.append(page)  # the rest of a block that started on disk: the CPU's
            page += 1
        self._next_page = page + 1
        while page >= self.values.capacity_pages:
            b = self.values.budget
            if self.fence is not None and b is not None and b.limit is not None and (
                    b.used + self._new_reservations(1) > b.limit):
                self.settle()  # the CPU copies a block to disk: queued device writes land first
            # every tensor takes its block before any reserves its next one ahead (which could
            # take the room a tensor after it needed: _new_reservations foretells this order)
            for t in self.tensors:
                t.grow(ahead=False, ram=device)
            for t in self.tensors:
                t.next_ahead()
        return page

    # ---- writes -----------------------------------------------------------------------
    def append(self, values: np.ndarray, keys: np.ndarray | None = None):
        """Append tokens. values/keys: (B, H, L, d) arrays (float16 or float32)."""
        self.settle()
        self.check_array(values, "values", self.value_dim)
        if self.keys is not None:
            if keys is None:
                raise ValueError("this HostStore keeps keys: append() needs keys")
            self.check_array(keys, "keys", self.head_dim)
            if keys.shape[2] != values.shape[2]:
                raise ValueError(
                    f"Invalid shape of keys: {keys.shape[2]} tokens, values have {values.shape[2]}"
                )
        self._advance(values.shape[2], values, keys)

    def _advance(self, n: int, values, keys):
        pos = 0
        # All or nothing: a block that cannot be had (disk tier full) leaves the store as it was
        # (pages written past the old length are unreachable, their blocks reused later).
        # pages are only appended here: the lengths undo it (a copy of every list cost
        # ~30 us per layer and decode write at 128k tokens)
        undo = (self.length, [len(p) for p in self._pages], list(self._free), self._next_page)
        try:
            while pos < n:
                slot = self.length % self.page_size
                if slot == 0:
                    for b in range(self.batch):
                        self._pages[b].append(self._new_page())
                take = min(self.page_size - slot, n - pos)
                for b in range(self.batch if values is not None else 0):
                    page = self._pages[b][-1]
                    self.values.write(page, slot, values[b, :, pos : pos + take])
                    if self.keys is not None:
                        self.keys.write(page, slot, keys[b, :, pos : pos + take])
                self.length += take
                pos += take
        except BaseException:
            self.length, lengths, self._free, self._next_page = undo
            for pages, m in zip(self._pages, lengths):
                del pages[m:]
            self._shrunk += 1
            raise

    def _blocks_to_append(self, tokens: int) -> int:
        held = sum(len(p) for p in self._pages)
        logical = -(-(self.length + tokens) // self.page_size) * self.batch - held
        physical = max(0, logical - len(self._free))
        over = self._next_page + physical - self.values.capacity_pages
        return -(-max(0, over) // self.values.pages_per_block)

    def bytes_to_append(self, tokens: int) -> int:
        """Host bytes (RAM or disk) the next ``tokens`` appended tokens allocate: whole blocks."""
        blocks = self._blocks_to_append(tokens)  # 0 at most steps: the blocks hold them
        return blocks * sum(t.block_bytes for t in self.tensors) if blocks else 0

    def _new_reservations(self, blocks: int) -> int:
        """Bytes that growing every tensor by ``blocks`` blocks reserves anew in the host
        budget: each tensor's spare and the pool's blocks of its shape serve first (the pool is
        shared, by keys and values of one shape too). The spares taken again between blocks
        are spent by the next block; the last ones only where the budget has room."""
        groups: dict = {}
        for t in self.tensors:
            groups.setdefault((t.block_shape, t.dtype), []).append(t)
        new = 0
        for ts in groups.values():
            bb = ts[0].block_bytes
            have = sum(1 for t in ts if t.spare_bytes) + ts[0].pooled_bytes // bb
            new += max(0, blocks * len(ts) - have) * bb
        return new

    def spills_to_append(self, tokens: int) -> bool:
        """Whether appending ``tokens`` moves a block to the disk tier (the host budget cannot
        hold the blocks it allocates; those allocated ahead, spares and pooled, are held
        already)."""
        blocks = self._blocks_to_append(tokens)
        b = self.values.budget
        if not blocks or b is None or b.limit is None:
            return False
        return b.used + self._new_reservations(blocks) > b.limit

    def blocks_to_hold(self, tokens: int) -> int:
        """Blocks per tensor still to allocate for ``tokens`` tokens per sequence in all (the
        spare allocated ahead counted as held)."""
        pages = -(-tokens // self.page_size) * self.batch
        t = self.values
        have = t.capacity_pages + (t.pages_per_block if t.spare_bytes else 0)
        return -(-max(0, pages - have) // t.pages_per_block)

    def plan_pool(self, tokens: int, prepare=None) -> int:
        """Plan in the process's block pool the blocks :meth:`blocks_to_hold` names for each
        tensor (made within the host budget by ``POOL.top_up``: tiered.prefill over a long
        prompt). Returns the blocks planned."""
        n = self.blocks_to_hold(tokens)
        return sum(t.plan_pool(n, prepare) for t in self.tensors)

    def check_array(self, x, name, dim):
        expected = (self.batch, self.n_kv_heads, None, dim)
        if x.ndim != 4 or any(e is not None and e != s for e, s in zip(expected, x.shape)):
            raise ValueError(
                f"Invalid shape of {name}: expected (B={self.batch}, H={self.n_kv_heads}, L, "
                f"d={dim}), got {tuple(x.shape)}"
            )

    @property
    def rewrites(self) -> int:
        """How often a page list changed in place (a truncation, an undone append, a page
        moved for a device write): a stored token's rows can differ only after it grew."""
        return self._shrunk

    def truncate(self, length: int):
        """Drop tokens past ``length``; pages that become empty return to the free list."""
        if not 0 <= length <= self.length:
            raise ValueError(f"Invalid length {length}: the store holds {self.length} tokens")
        keep = -(-length // self.page_size)
        for pages in self._pages:
            self._free.extend(pages[keep:])
            del pages[keep:]
        self._shrunk += 1
        self.length = length

    # ---- accounting and persistence ----------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes allocated in host memory (whole blocks)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def disk_bytes(self) -> int:
        return sum(t.disk_bytes for t in self.tensors)

    def verify_tokens(self, b: int, tokens: np.ndarray) -> None:
        """Debug/test check: the CRC32 of every disk page holding these tokens."""
        self.settle()
        self.check_disk()
        pages = np.unique(self.logical_pages(b)[np.asarray(tokens, np.int64) // self.page_size])
        for t in self.tensors:
            t.verify(pages)

    def prefetch_tokens(self, b: int, tokens: np.ndarray) -> None:
        """Read ahead the disk pages of these tokens (madvise WILLNEED)."""
        tokens = np.asarray(tokens, np.int64)
        tokens = tokens[(tokens >= 0) & (tokens < self.length)]
        if not tokens.size or not any(t.disk is not None for t in self.tensors):
            return
        pages = np.unique(self.logical_pages(b)[tokens // self.page_size])
        for t in self.tensors:
            t.prefetch(pages)

    def rebudget(self, budget, disk_budget=None, *, disk_dir=None):
        """Count this store's RAM blocks (and disk blocks) against other shared budgets, and
        spill future blocks to ``disk_dir`` (the layers of a loaded cache join their model's
        budgets again)."""
        for t in self.tensors:
            if t.budget is not None:
                t.budget.release(t.nbytes)
            if t.disk_budget is not None:
                t.disk_budget.release(t.disk_bytes)
            t.budget, t.disk_budget, t.disk_dir = budget, disk_budget, disk_dir
            if budget is not None:
                budget.charge(t.nbytes)
            if disk_budget is not None:
                disk_budget.charge(t.disk_bytes)

    def close(self):
        """Release host RAM and the page files, once the MLX work still queued has run: it may
        read them (mlx-lm's generate leaves a step queued; tiered.runtime.streams)."""
        streams.drain()
        for t in self.tensors:
            t.close()

    @property
    def used_bytes(self) -> int:
        per_token = sum(
            self.n_kv_heads * t.head_dim * np.dtype(NP_DTYPES[t.dtype]).itemsize
            + (self.n_kv_heads * 4 if t.dtype == "int8" else 0)
            for t in self.tensors
        )
        return per_token * self.length * self.batch

    def state(self) -> dict:
        """Arrays (no copies) and scalars that rebuild this store with :meth:`from_state`.

        RAM blocks are the MLX arrays themselves; blocks in the disk tier are referenced (page
        file path, block index, checksums), not copied: mlx-lm evaluates ``state`` after every
        prefill chunk. A page file must outlive what was saved from it."""
        self.settle()
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
                st.update(t.state(name))
        return st

    @classmethod
    def from_state(cls, st: dict, *, budget=None, disk_dir=None, disk_budget=None) -> "HostStore":
        H, d, dv, P, dtype, has_keys, batch, ppb, length, next_page = st["meta"]
        obj = cls(H, d, value_dim=dv, page_size=P, dtype=dtype, keys=bool(has_keys), batch=batch,
                  pages_per_block=ppb, budget=budget, disk_dir=disk_dir, disk_budget=disk_budget)
        for name, t in (("values", obj.values), ("keys", obj.keys)):
            if t is not None:
                t.restore(st, name, disk_dir, budget)
        pages = np.array(st["pages"], np.int64).reshape(batch, -1)
        obj._pages = [list(map(int, row)) for row in pages]
        obj._free = list(map(int, np.array(st["free"], np.int64)))
        obj.length, obj._next_page = int(length), int(next_page)
        return obj
