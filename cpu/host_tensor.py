"""One paged tensor of the host store (keys or values of a layer): its blocks in host RAM
or in the disk tier, their numpy views and the block address table Numba kernels read (see
:mod:`tiered.cpu.pages` for the layout)."""

from __future__ import annotations

import json
import tempfile

import mlx.core as mx
import numpy as np

from . import block_alloc
from .block_alloc import NP_DTYPES, shaped
from .block_maker import POOL, Ticket
from .block_maker import np_view as _np_view
from .disk import DiskTierError, PageFile
from .slabs import SlabPool

_ITEMSIZE = {name: np.dtype(dt).itemsize for name, dt in NP_DTYPES.items()}

HOST_DTYPES = ("float16", "float32", "int8")


# Allocate each tensor's next RAM blocks ahead of need. On MLX's CUDA backend a block is managed
# memory, allocated and NaN-filled on the thread that needed it (H200, 1M-token prefill: the
# chunks that grew the pages took 0.35 s against 0.15, ~6 ms more per layer; idle, an 8 MB
# block's allocation and fill take 0.66 ms: bench/host_block_probe.py, in git history). Its first read waits
# for the GPU work queued before it (see tiered.cpu.block_maker), so the block maker's thread
# takes that wait. One block ahead per tensor: with two, a spare held budget a tight host
# budget needed for data (GPU tests: tests/test_disk.py spilled every block).
AHEAD = block_alloc.CUDA


def _host_copy(arr: mx.array) -> mx.array:
    out = mx.array(np.array(arr))
    mx.eval(out)
    return out


class HostTensor:
    """One paged tensor (keys or values) of a layer: blocks, views and the address table.

    A block lives in host RAM (an MLX CPU array, ``blocks[b]``) or, once the shared host
    budget is spent, in the disk tier (``disk.views[disk_index[b]]``); ``views[b]`` and
    ``addrs[b]`` point at wherever it is, so page ids never change when a block moves.
    """

    def __init__(self, n_kv_heads, page_size, head_dim, dtype, pages_per_block, *,
                 budget=None, disk_dir=None, disk_budget=None, name="tensor", ahead=None,
                 unified=False):
        if dtype not in HOST_DTYPES:
            raise ValueError(f"Invalid host dtype {dtype!r}: expected one of {HOST_DTYPES}")
        if unified and dtype == "int8":
            raise ValueError("Invalid host dtype 'int8' with unified=True: int8 pages are not "
                             "read in place by the GPU")
        self.n_kv_heads, self.page_size, self.head_dim = n_kv_heads, page_size, head_dim
        self.dtype, self.pages_per_block = dtype, pages_per_block
        self.budget, self.disk_dir, self.name = budget, disk_dir, name
        self.disk_budget = disk_budget
        self.blocks: list[mx.array | None] = []
        self.scale_blocks: list[mx.array | None] = []  # int8 only: (ppb, H, page_size) fp32
        self.views: list[np.ndarray] = []
        self.scale_views: list[np.ndarray] = []
        self.addrs = np.zeros(0, np.int64)
        self.scale_addrs = np.zeros(0, np.int64)
        self.disk_index: list[int] = []  # -1: in RAM
        self.moves = 0  # blocks moved to the disk tier so far (their addresses changed)
        self.disk = None  # PageFile of the data blocks
        self.scale_disk = None
        # ahead: the next RAM block is allocated in the background once one is adopted (its
        # bytes reserved in the host budget; float dtypes). None: where it pays (AHEAD).
        self.ahead = AHEAD if ahead is None else bool(ahead)
        self._spare: Ticket | None = None
        # prepare(view): run on each block allocated ahead before it is adopted, off the main
        # thread (the device path's advice); the addresses it ran on are in ``prepared``.
        self.prepare = None
        self.prepared: set[int] = set()
        # unified: RAM blocks carved from slabs a GPU kernel takes as inputs (tiered.cpu.slabs;
        # Apple silicon), allocated when a block is needed, never spilled: past the budget new
        # blocks start on disk
        self.slabs = SlabPool(self.block_shape, dtype, budget) if unified else None
        if unified:
            self.ahead = False

    @property
    def block_shape(self):
        return (self.pages_per_block, self.n_kv_heads, self.page_size, self.head_dim)

    @property
    def capacity_pages(self) -> int:
        return len(self.blocks) * self.pages_per_block

    @property
    def block_bytes(self) -> int:
        rows = self.pages_per_block * self.n_kv_heads * self.page_size  # Python ints: a step's
        n = rows * self.head_dim * _ITEMSIZE[self.dtype]  # budget check reads this per layer
        if self.dtype == "int8":
            n += rows * 4
        return n

    @property
    def spare_bytes(self) -> int:
        """Bytes of the block allocated ahead (reserved in the host budget, not adopted)."""
        return 0 if self._spare is None else self.block_bytes

    @property
    def pooled_bytes(self) -> int:
        """Bytes of blocks made ahead in the process's pool for this tensor's shape, dtype and
        budget (tiered.cpu.block_maker.BlockPool; reserved in the budget already)."""
        return POOL.held_bytes(self.block_shape, self.dtype, self.budget) if self.ahead else 0

    def plan_pool(self, blocks: int, prepare=None) -> int:
        """Plan ``blocks`` blocks of this tensor's shape in the process's pool (made by
        ``POOL.top_up`` within the host budget), for this tensor or any other of the same
        shape to grow into; returns how many were planned. Float dtypes only, where blocks
        are allocated ahead."""
        if self.dtype == "int8" or not self.ahead:
            return 0
        shape, dtype = self.block_shape, self.dtype
        return POOL.plan(shape, dtype, blocks, self.block_bytes, self.budget,
                         lambda: block_alloc.block_ahead(shape, dtype, prepare))

    def _from_pool(self):
        if self._spare is None and self.ahead and self.dtype != "int8":
            self._spare = POOL.take(self.block_shape, self.dtype, self.budget)

    def grow(self, ahead: bool = True, ram: bool = False):
        """One more block: in RAM while the host budget allows, else the oldest RAM block of
        this tensor moves to disk first (written and checked before its RAM is freed).
        ``ahead=False``: the next block ahead is left to the caller (:meth:`next_ahead`, once
        every tensor that grows with this one has its block: HostStore._new_page).
        ``ram``: the block must be in RAM (the device path writes it by address, and the disk
        tier's mapping is read-only): where this tensor has no RAM block to move to disk and
        the budget is spent, it is taken past the budget (charged: the next growth spills)."""
        if self.slabs is not None:
            return self._grow_unified()
        b = self.budget
        self._from_pool()
        if self._spare is not None:  # allocated ahead, its bytes reserved then
            ticket, self._spare = self._spare, None
            try:
                view = ticket.result()
            except BaseException:
                if b is not None:  # the block is dropped: its bytes go back
                    b.release(self.block_bytes)
                raise
            self._adopt(ticket.arr, None, view)
            if ticket.prepared:
                self.prepared.add(view.ctypes.data)
            if ahead:
                self.next_ahead()
            return
        if b is None or b.reserve(self.block_bytes):
            self._adopt(block_alloc.alloc_block(self.block_shape, self.dtype), None)
            if ahead:
                self.next_ahead()
            return
        held = [i for i, d in enumerate(self.disk_index) if d < 0]
        if held:
            self.spill(held[0])
            if b.reserve(self.block_bytes):
                self._adopt(block_alloc.alloc_block(self.block_shape, self.dtype), None)
                return
        if ram and self.slabs is None:
            b.charge(self.block_bytes)
            self._adopt(block_alloc.alloc_block(self.block_shape, self.dtype), None)
            return
        self._new_on_disk()

    def _grow_unified(self):
        if self.slabs.ensure(len(self.blocks) + 1):
            arr, view = self.slabs.block(len(self.blocks))
            self._adopt(arr, None, view)
        else:
            self._new_on_disk()

    def _new_on_disk(self):
        """A new block that starts on disk (no RAM block of ours to give back)."""
        fill = np.zeros(self.block_shape, NP_DTYPES[self.dtype]) if self.dtype == "int8" else np.full(
            self.block_shape, np.nan, NP_DTYPES[self.dtype])
        sfill = np.full(self.block_shape[:-1], np.nan, np.float32) if self.dtype == "int8" else None
        self._adopt_disk(fill, sfill)

    def next_ahead(self):
        """Start allocating the next RAM block when the host budget has room for it too."""
        if not self.ahead or self.dtype == "int8" or self._spare is not None:
            return
        self._from_pool()
        if self._spare is not None:
            return
        if self.budget is None or self.budget.reserve(self.block_bytes):
            self._spare = block_alloc.block_ahead(self.block_shape, self.dtype, self.prepare)

    def _drop_spare(self):
        if self._spare is not None:
            self._spare.done.wait()  # the worker lets go of it first
            self._spare = None
            if self.budget is not None:
                self.budget.release(self.block_bytes)

    def _files(self):
        if self.disk is None:
            d = self.disk_dir or tempfile.gettempdir()
            self.disk = PageFile(d, self.name, self.block_shape, NP_DTYPES[self.dtype])
            if self.dtype == "int8":
                self.scale_disk = PageFile(d, self.name + "-scales", self.block_shape[:-1],
                                           np.float32)
        return self.disk, self.scale_disk

    def _adopt_disk(self, data: np.ndarray, scales: np.ndarray | None, at: int | None = None):
        disk, sdisk = self._files()
        need = disk.stride + (sdisk.stride if sdisk is not None else 0)
        if self.disk_budget is not None and not self.disk_budget.reserve(need):
            raise DiskTierError(
                28, f"disk tier budget full: {self.disk_budget.used} of {self.disk_budget.limit} "
                f"bytes used, {need} more needed; raise disk_budget or host_budget")
        i = disk.append(data)
        if sdisk is not None:
            j = sdisk.append(scales)
            assert i == j
        if at is None:
            self.blocks.append(None)
            self.views.append(disk.views[i])
            self.addrs = np.append(self.addrs, np.int64(disk.address(i)))
            self.disk_index.append(i)
            if sdisk is not None:
                self.scale_blocks.append(None)
                self.scale_views.append(sdisk.views[i])
                self.scale_addrs = np.append(self.scale_addrs, np.int64(sdisk.address(i)))
        else:
            self.moves += 1
            self.views[at] = disk.views[i]
            self.addrs[at] = disk.address(i)
            self.disk_index[at] = i
            if sdisk is not None:
                self.scale_views[at] = sdisk.views[i]
                self.scale_addrs[at] = sdisk.address(i)

    def spill(self, blk: int):
        """Move RAM block ``blk`` to the disk tier. Its RAM is released only after the disk
        holds it (a DiskTierError leaves everything as it was)."""
        if self.slabs is not None:
            raise RuntimeError("blocks of slabs are not spilled (their slab stays allocated)")
        scales = self.scale_views[blk] if self.dtype == "int8" else None
        ram = int(self.addrs[blk])
        self._adopt_disk(self.views[blk], scales, at=blk)
        self.prepared.discard(ram)  # its memory may serve another block, unprepared
        self.blocks[blk] = None
        if self.dtype == "int8":
            self.scale_blocks[blk] = None
        if self.budget is not None:
            self.budget.release(self.block_bytes)

    def _adopt(self, blk, scales, view=None):
        self.blocks.append(blk)
        view = _np_view(blk, self.block_shape) if view is None else view
        self.views.append(view)
        self.addrs = np.append(self.addrs, np.int64(view.ctypes.data))
        self.disk_index.append(-1)
        if self.dtype == "int8":
            if scales is None:
                scales = block_alloc.alloc_block(self.block_shape[:-1], "float32")  # NaN-filled
            self.scale_blocks.append(scales)
            sview = _np_view(scales, self.block_shape[:-1])
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
        else:
            q, scale = data, None
        d = self.disk_index[blk]
        if d >= 0:  # a page of a block on disk (a freed page reused): rewrite it there
            self.disk.write_page(d, slot, start, q.astype(NP_DTYPES[self.dtype]))
            if scale is not None:
                self.scale_disk.write_page(d, slot, start, scale)
            return
        self.views[blk][slot, :, start : start + n] = q
        if scale is not None:
            self.scale_views[blk][slot, :, start : start + n] = scale

    def read(self, page: int, start: int, n: int) -> np.ndarray:
        """(H, n, d) float32 copy of slots [start, start+n) of a page."""
        blk, slot = divmod(page, self.pages_per_block)
        raw = self.views[blk][slot, :, start : start + n].astype(np.float32)
        if self.dtype == "int8":
            raw *= self.scale_views[blk][slot, :, start : start + n, None]
        return raw

    def verify(self, pages) -> None:
        """Check the CRC32 of those physical pages that live on disk (ValueError if corrupt)."""
        for p in pages:
            blk, slot = divmod(int(p), self.pages_per_block)
            d = self.disk_index[blk]
            if d >= 0:
                self.disk.verify(d, [slot])
                if self.scale_disk is not None:
                    self.scale_disk.verify(d, [slot])

    def prefetch(self, pages) -> None:
        by_block: dict[int, list[int]] = {}
        for p in pages:
            blk, slot = divmod(int(p), self.pages_per_block)
            if self.disk_index[blk] >= 0:
                by_block.setdefault(self.disk_index[blk], []).append(slot)
        for d, slots in by_block.items():
            self.disk.prefetch(d, sorted(set(slots)))

    @property
    def nbytes(self) -> int:
        """Bytes of host RAM held: the RAM blocks' (their scales included), as the budget
        counts them (a block's pad, PAD_BYTES, is not)."""
        if self.slabs is not None:
            return self.slabs.nbytes  # reserved per slab, used or not
        return sum(b is not None for b in self.blocks) * self.block_bytes

    @property
    def disk_bytes(self) -> int:
        return sum(f.nbytes for f in (self.disk, self.scale_disk) if f is not None)

    def close(self):
        """Give back the RAM blocks and the page files now, even while this tensor is still
        referenced: the views of disk blocks go first (a mapping that numpy still exports
        cannot be closed, and it keeps the file's disk space and a descriptor)."""
        if self.budget is not None:
            self.budget.release(self.nbytes)
        self._drop_spare()
        if self.slabs is not None:
            self.slabs.close()
        self.blocks.clear()
        self.scale_blocks.clear()
        self.views.clear()
        self.scale_views.clear()
        self.addrs = self.scale_addrs = np.zeros(0, np.int64)
        self.disk_index.clear()
        files, self.disk, self.scale_disk = (self.disk, self.scale_disk), None, None
        for f in files:
            if f is not None:
                f.close()

    # ---- persistence (HostStore.state / from_state) ---------------------------------------
    def state(self, name: str) -> dict:
        """This tensor's entries of the store's state: RAM blocks as they are (no copies),
        disk-tier blocks by reference (page file, block index, checksums)."""
        st = {name: [shaped(b, self.block_shape) if b is not None else mx.zeros((0,), mx.int8)
                     for b in self.blocks]}
        if self.dtype == "int8":
            st[name + "_scales"] = [shaped(b, self.block_shape[:-1]) if b is not None
                                    else mx.zeros((0,), mx.int8) for b in self.scale_blocks]
        if self.disk is not None:
            st[name + "_disk"] = json.dumps({
                "index": self.disk_index, "data": self.disk.state(),
                "scales": self.scale_disk.state() if self.scale_disk is not None else None})
        return st

    def restore(self, st: dict, name: str, disk_dir, budget) -> None:
        """Blocks from a store's state: disk-tier blocks adopted (copied at load, see
        :meth:`PageFile.adopt`), RAM blocks copied into memory this tensor owns."""
        disk = json.loads(st[name + "_disk"]) if name + "_disk" in st else None
        if disk is not None:
            work = disk_dir or tempfile.gettempdir()
            self.disk = PageFile.adopt(disk["data"], work)
            if disk["scales"] is not None:
                self.scale_disk = PageFile.adopt(disk["scales"], work)
        scales = st.get(name + "_scales", [None] * len(st[name]))
        for b, (blk, sc) in enumerate(zip(st[name], scales)):
            di = disk["index"][b] if disk is not None else -1
            if di >= 0:
                self.blocks.append(None)
                self.views.append(self.disk.views[di])
                self.addrs = np.append(self.addrs, np.int64(self.disk.address(di)))
                self.disk_index.append(di)
                if self.scale_disk is not None:
                    self.scale_blocks.append(None)
                    self.scale_views.append(self.scale_disk.views[di])
                    self.scale_addrs = np.append(self.scale_addrs,
                                                 np.int64(self.scale_disk.address(di)))
                continue
            # Copy: the block must be host memory this store owns and may write in place;
            # beyond the host budget it goes to the disk tier, as a growing store's would.
            if self.slabs is not None:
                if self.slabs.ensure(len(self.blocks) + 1):
                    arr, view = self.slabs.block(len(self.blocks))
                    view[...] = np.array(blk).reshape(self.block_shape)
                    self._adopt(arr, None, view)
                else:
                    self._adopt_disk(np.array(blk).reshape(self.block_shape), None)
            elif budget is None or budget.reserve(self.block_bytes):
                self._adopt(_host_copy(blk), None if sc is None else _host_copy(sc))
            else:
                self._adopt_disk(np.array(blk).reshape(self.block_shape), None if sc is None
                                 else np.array(sc).reshape(self.block_shape[:-1]))
