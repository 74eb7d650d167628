"""Disk tier: host blocks that no longer fit the host budget, in a memory-mapped page file.

A :class:`PageFile` holds whole blocks (the same ``(pages_per_block, H, page_size, dim)``
layout as a host block), written once with ``pwrite`` into space reserved up front with
``posix_fallocate`` (a full disk is an ``OSError`` before anything is overwritten or freed, never
a SIGBUS later), then mapped read-only: kernels read them through the same block address table
as RAM blocks. Every page carries a CRC32, verified on read in debug mode and by
:meth:`PageFile.verify`.

A page file is anonymous: created in ``directory`` and unlinked at once, so it lives exactly as
long as the process holds it (nothing is left behind by a crash, SIGTERM or SIGKILL) and no
other path reaches it. A save copies its blocks into the cache directory
(:meth:`PageFile.copy_to`); a load copies them from there into a new anonymous file
(:meth:`PageFile.adopt`), so a saved cache and a live one never share a file. Before reads
(HostStore.check_disk), on growth and when mapping, :meth:`PageFile.check_size` turns a file
that shrank under the cache into an error (a read past a mapped file's end is a SIGBUS).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import mmap
import os
import re
import shutil
import sys
import threading
import uuid
import weakref
import zlib

import numpy as np

from . import open_files
from .mapping import Mapping

ALIGN = mmap.ALLOCATIONGRANULARITY
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform == "linux" else None)
MADV_RANDOM = getattr(mmap, "MADV_RANDOM", 1)
MADV_SEQUENTIAL = getattr(mmap, "MADV_SEQUENTIAL", 2)
COPY_CHUNK = 64 << 20  # bytes per copy_file_range call
# The saved cache directory's pages/ folder while tiered.persistence.persist loads from it: the only
# place a state's disk blocks are read from (by bare name).
PAGES_SOURCE: contextvars.ContextVar[str | None] = contextvars.ContextVar("pages_source",
                                                                         default=None)
_STALE = re.compile(r"^tiered-(\d+)-[0-9a-f]{12}-.*\.pages$")
_swept: set[str] = set()


class DiskTierError(OSError):
    """The disk tier cannot take the data (unwritable directory, disk full)."""


def check_directory(directory: str, what: str = "disk tier directory",
                    fix: str = "choose another disk_dir") -> str:
    """Create ``directory`` if needed and prove it writable; a clear error otherwise (a full
    disk named as one, with its free bytes), naming the directory as ``what`` and ending with
    ``fix``. The probe leaves nothing behind: an unnamed file (O_TMPFILE) where the file
    system has them, else a named one removed whatever happens."""
    directory = os.path.abspath(os.path.expanduser(directory))
    try:
        os.makedirs(directory, exist_ok=True)
        _probe(directory)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            free = shutil.disk_usage(directory).free if os.path.isdir(directory) else 0
            raise DiskTierError(e.errno, f"{what} {directory!r} is full ({free} "
                                f"bytes free; {e.strerror or e}): free disk space there or "
                                f"{fix}") from None
        if e.errno in (errno.EMFILE, errno.ENFILE):
            raise DiskTierError(e.errno, f"{what} {directory!r}: no file can be opened "
                                f"({e.strerror}; {open_files.describe()}): raise the limit "
                                "(`ulimit -n`, or the hard limit where it stops)") from None
        raise DiskTierError(
            e.errno or errno.EACCES,
            f"{what} {directory!r} is not writable ({e.strerror or e}); {fix}",
        ) from None
    return directory


def _probe(directory: str) -> None:
    """Write one byte to a new file in ``directory`` (OSError where it cannot be done)."""
    fd = None
    if hasattr(os, "O_TMPFILE"):
        try:
            fd = os.open(directory, os.O_TMPFILE | os.O_WRONLY, 0o600)
        except OSError as e:  # not supported by this file system: a named probe below
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    path = None
    if fd is None:
        path = os.path.join(directory, f".tiered-probe-{uuid.uuid4().hex}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, b"x")
    finally:
        os.close(fd)
        if path is not None:
            os.remove(path)


def disk_room(directory: str | None, nbytes: int, budget=None) -> None:
    """DiskTierError unless the disk tier can take ``nbytes`` more: within ``budget`` (a
    HostBudget of disk bytes) and the free space of ``directory`` (the temp dir when None)."""
    import tempfile

    directory = directory or tempfile.gettempdir()
    if budget is not None and budget.limit is not None and budget.used + nbytes > budget.limit:
        raise DiskTierError(errno.ENOSPC, f"disk tier budget full: {budget.used} of "
                            f"{budget.limit} bytes used, {nbytes} more needed for this step; "
                            "raise disk_budget or host_budget, then run the step again")
    free = shutil.disk_usage(check_directory(directory)).free
    if free < nbytes:
        raise DiskTierError(errno.ENOSPC, f"disk tier full: {nbytes} bytes needed for this step "
                            f"in {directory!r}, {free} free; free disk space (or raise "
                            "host_budget), then run the step again")


def sweep_stale(directory: str) -> list[str]:
    """Remove page files a dead process left in ``directory`` (files of tiered 0.1, which kept
    named page files, or of a process killed between creating and unlinking one). Once per
    directory and process; returns the removed paths."""
    directory = os.path.abspath(directory)
    if directory in _swept:
        return []
    _swept.add(directory)
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _STALE.match(name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # its owner is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        try:
            os.remove(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass
    return removed


def copy_range(src_fd: int, dst_fd: int, nbytes: int) -> None:
    """Copy the first nbytes of src_fd to dst_fd at offset 0 (in kernel; reflinks where the
    file system can)."""
    done = 0
    while done < nbytes:
        n = os.copy_file_range(src_fd, dst_fd, min(COPY_CHUNK, nbytes - done), done, done)
        if n == 0:
            raise DiskTierError(errno.EIO, f"short copy: {done} of {nbytes} bytes")
        done += n


class PageFile:
    """Append-only anonymous file of blocks; each block mapped read-only once written."""

    def __init__(self, directory: str, name: str, block_shape: tuple, dtype):
        open_files.raise_limit()
        self.block_shape = tuple(block_shape)
        self.dtype = np.dtype(dtype)
        self.block_bytes = int(np.prod(self.block_shape)) * self.dtype.itemsize
        self.stride = -(-self.block_bytes // ALIGN) * ALIGN  # mmap offsets must be aligned
        self.name = f"{name}.pages"  # a bare name: the file's name in a saved cache
        self.directory = check_directory(directory)
        sweep_stale(self.directory)
        path = os.path.join(self.directory, f"tiered-{os.getpid()}-{uuid.uuid4().hex[:12]}-{name}.pages")
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(path)  # anonymous from now on
        self._lock = threading.Lock()
        self.maps: list[Mapping] = []  # one a block, no descriptor each
        self.views: list[np.ndarray] = []
        self._populated = 0  # blocks mapped in by populate()
        self.crc: list[list[int]] = []  # per block, per page
        self._finalizer = weakref.finalize(self, PageFile._cleanup, self.fd, self.maps)

    def _map(self, index: int) -> np.ndarray:
        self.check_size(index + 1)  # mapped past the file's end, a read would be a SIGBUS
        mm = Mapping(self.fd, self.stride, index * self.stride)
        # Reads of a block are a few rows here and there: a page fault reads its page alone,
        # not the 32 around it (`python bench/probes/disk_stage_rate.py --gib 2 --cold`, 2-core
        # machine: a 1M layer's request of 1,024 chunk-heads from a page file out of the page
        # cache, one fault after another, 1,145-1,377 ms plain, 48-80 ms so). What reads a
        # block whole (verify, populate) says so first (_sequential).
        mm.madvise(MADV_RANDOM)
        self.maps.append(mm)
        self.views.append(mm.array(self.dtype, self.block_shape))
        return self.views[-1]

    # ---- writes ----------------------------------------------------------------------------
    def append(self, block: np.ndarray) -> int:
        """Write a whole block; returns its index in the file. Raises DiskTierError (nothing
        written, nothing freed) when the disk cannot hold it."""
        if block.shape != self.block_shape or block.dtype != self.dtype:
            raise ValueError(f"Invalid block: expected {self.block_shape} {self.dtype}, got "
                             f"{block.shape} {block.dtype}")
        with self._lock:
            self.check_size()  # on growth: the blocks held are all still there
            index = len(self.maps)
            offset = index * self.stride
            free = shutil.disk_usage(self.directory).free
            if free < self.stride:
                raise DiskTierError(
                    errno.ENOSPC,
                    f"disk tier full: {self.stride} bytes needed in {self.directory!r}, "
                    f"{free} free; lower the document size, raise host_budget or free disk space",
                )
            try:
                os.posix_fallocate(self.fd, offset, self.stride)
            except OSError as e:
                os.ftruncate(self.fd, offset)  # give back what the failed reservation took
                raise DiskTierError(e.errno, f"disk tier: cannot reserve {self.stride} bytes in "
                                             f"{self.directory!r} ({e.strerror})") from None
            data = np.ascontiguousarray(block).view(np.uint8).reshape(-1)
            written = 0
            while written < data.size:
                written += os.pwrite(self.fd, memoryview(data[written:]), offset + written)
            try:
                self._map(index)
            except OSError as e:  # the RAM block is still held by the caller: nothing lost
                os.ftruncate(self.fd, offset)
                raise DiskTierError(e.errno, f"disk tier: cannot map block {index} of a page "
                                    f"file in {self.directory!r} ({e.strerror}); with ENOMEM "
                                    "raise the mappings limit (vm.max_map_count) or "
                                    "host_budget") from None
            self.crc.append([zlib.crc32(np.ascontiguousarray(block[p]).view(np.uint8))
                             for p in range(self.block_shape[0])])
            return index

    def write_page(self, index: int, slot: int, start: int, rows: np.ndarray):
        """Overwrite tokens [start, start + n) of one page of a written block (page reuse)."""
        self.check_size()
        shape = self.block_shape[1:]
        nbytes = int(np.prod(shape)) * self.dtype.itemsize
        offset = index * self.stride + slot * nbytes
        # read, patched, written back whole; read with pread, not through the mapping: a page
        # read there stays mapped, in the process's RSS (a layer-by-layer prefill writing its
        # pages on disk one chunk at a time held them all, 160 MiB at 8k tokens)
        with self._lock:
            page = np.frombuffer(bytearray(os.pread(self.fd, nbytes, offset)),
                                 self.dtype).reshape(shape)
        page[:, start : start + rows.shape[1]] = rows
        data = page.view(np.uint8).reshape(-1)
        with self._lock:
            os.pwrite(self.fd, memoryview(data), offset)
            self.crc[index][slot] = zlib.crc32(data)

    # ---- reads -----------------------------------------------------------------------------
    def address(self, index: int) -> int:
        return int(self.views[index].ctypes.data)

    def check_size(self, blocks: int | None = None) -> None:
        """DiskTierError when the file no longer holds every mapped block (or ``blocks``
        blocks): it was truncated under the cache, and reading the lost part through the
        mapping would raise SIGBUS. One fstat."""
        need = (len(self.maps) if blocks is None else blocks) * self.stride
        size = os.fstat(self.fd).st_size
        if size < need:
            raise DiskTierError(errno.EIO, f"disk tier page file {self.name} (unlinked, in "
                                f"{self.directory!r}) shrank to {size} bytes under the cache, "
                                f"which holds {need} bytes of blocks in it: they are lost; "
                                "make a new cache (or load a saved one)")

    def verify(self, index: int, slots=None) -> None:
        """Raise ValueError naming the page when a page's bytes don't match its checksum."""
        whole = slots is None
        slots = range(self.block_shape[0]) if whole else slots
        with self._sequential(index, whole):
            for s in slots:
                got = zlib.crc32(np.ascontiguousarray(self.views[index][s]).view(np.uint8))
                if got != self.crc[index][s]:
                    raise ValueError(
                        f"Corrupt page in disk tier file {self.name}: block {index}, page {s} "
                        f"(crc32 {got:#010x}, expected {self.crc[index][s]:#010x})"
                    )

    @contextlib.contextmanager
    def _sequential(self, index: int, on: bool = True):
        """Block ``index`` read whole meanwhile: its faults read ahead (MADV_SEQUENTIAL), then
        the rows-here-and-there advice again (see _map)."""
        if not on:
            yield
            return
        mm = self.maps[index]
        mm.madvise(MADV_SEQUENTIAL)
        try:
            yield
        finally:
            mm.madvise(MADV_RANDOM)

    def prefetch(self, index: int, slots) -> None:
        """Ask the kernel to read these pages ahead (the policy is likely to select them)."""
        page_bytes = self.block_bytes // self.block_shape[0]
        mm = self.maps[index]
        for s in slots:
            if not mm.madvise(mmap.MADV_WILLNEED, s * page_bytes, page_bytes):
                return

    def populate(self) -> int:
        """Map the blocks not done before into the process (MADV_POPULATE_READ, Linux 5.14+):
        reads through the mapping then take no page faults. Returns the blocks done."""
        done = 0
        while MADV_POPULATE_READ is not None and self._populated < len(self.maps):
            with self._sequential(self._populated):
                if not self.maps[self._populated].madvise(MADV_POPULATE_READ):
                    return done
            self._populated += 1
            done += 1
        return done

    def release(self) -> None:
        """Unmap the pages reads touched: they stay in the page cache, out of the RSS."""
        self._populated = 0
        for mm in self.maps:
            if not mm.madvise(mmap.MADV_DONTNEED):
                return

    @property
    def nbytes(self) -> int:
        return len(self.maps) * self.stride

    # ---- saving and loading ----------------------------------------------------------------
    def state(self) -> dict:
        return {"name": self.name, "blocks": len(self.maps), "crc": [list(c) for c in self.crc],
                "shape": list(self.block_shape), "dtype": self.dtype.str}

    def copy_to(self, path: str) -> int:
        """Write every block into a new file at ``path`` (flushed); returns its size."""
        self.check_size()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            copy_range(self.fd, fd, self.nbytes)
            os.fsync(fd)
        finally:
            os.close(fd)
        return self.nbytes

    @classmethod
    def adopt(cls, st: dict, directory: str) -> "PageFile":
        """A new anonymous page file in ``directory`` holding the blocks of the saved file
        ``st["name"]``, read from the saved cache's pages folder (PAGES_SOURCE): copied, so
        nothing later written reaches the saved cache. Checks the saved file's size, every
        page's CRC32 and that it is a regular file inside that folder."""
        source = PAGES_SOURCE.get()
        if source is None:
            raise ValueError("this cache state has a disk tier, whose pages are saved beside it: "
                             "load it with TieredCacheList.load(directory, model)")
        name = st["name"]
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise ValueError(f"Invalid page file name {name!r} in a saved cache: a bare file name "
                             "inside its pages folder was expected")
        path = os.path.join(source, name)
        if os.path.islink(path) or not os.path.isfile(path):
            raise ValueError(f"page file {name!r} of the saved cache is missing or not a "
                             "regular file")
        shape, dtype, blocks = tuple(int(x) for x in st["shape"]), np.dtype(st["dtype"]), int(st["blocks"])
        pf = cls(directory, name[: -len(".pages")] if name.endswith(".pages") else name, shape,
                 dtype)
        src = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            size = os.fstat(src).st_size
            if size < blocks * pf.stride:
                raise ValueError(f"Corrupt page file {name!r} in a saved cache: {size} bytes, "
                                 f"expected {blocks * pf.stride}")
            copy_range(src, pf.fd, blocks * pf.stride)
        finally:
            os.close(src)
        for i in range(blocks):
            pf._map(i)
        pf.crc = [[int(c) for c in row] for row in st["crc"]]
        if len(pf.crc) != blocks or any(len(r) != shape[0] for r in pf.crc):
            raise ValueError(f"Invalid saved page file {name!r}: checksums for "
                             f"{len(pf.crc)} blocks, {blocks} expected")
        for i in range(blocks):
            pf.verify(i)
        return pf

    # ---- lifetime --------------------------------------------------------------------------
    @staticmethod
    def _cleanup(fd, maps):
        maps.clear()  # each block is unmapped once no view of it is left (tiered.cpu.mapping)
        try:
            os.close(fd)  # the file lives on while a mapping of it does
        except OSError:
            pass

    def close(self):
        self.views.clear()
        self._finalizer()
