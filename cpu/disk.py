"""Disk tier: host blocks that no longer fit the host budget, in a memory-mapped page file.

A :class:`PageFile` holds whole blocks (the same ``(pages_per_block, H, page_size, dim)``
layout as a host block), written once with ``pwrite`` into space reserved up front with
``posix_fallocate`` (a full disk is an ``OSError`` before anything is overwritten or freed, never
a SIGBUS later), then mapped read-only: kernels read them through the same block address table
as RAM blocks. Every page carries a CRC32, verified on read in debug mode and by
:meth:`PageFile.verify`. The file lives in ``directory`` and is removed on close unless kept.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import threading
import uuid
import weakref
import zlib

import numpy as np

ALIGN = mmap.ALLOCATIONGRANULARITY
# Where reopen() looks for a page file whose recorded path is gone (a saved cache directory's
# pages/ folder while it is loaded; see tiered.persist).
REOPEN_DIR: str | None = None


class DiskTierError(OSError):
    """The disk tier cannot take the data (unwritable directory, disk full)."""


def check_directory(directory: str) -> str:
    """Create ``directory`` if needed and prove it writable; a clear error otherwise."""
    directory = os.path.abspath(os.path.expanduser(directory))
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".tiered-probe-{uuid.uuid4().hex}")
        with open(probe, "wb") as f:
            f.write(b"x")
        os.remove(probe)
    except OSError as e:
        raise DiskTierError(
            e.errno or errno.EACCES,
            f"disk tier directory {directory!r} is not writable ({e.strerror or e}); choose "
            "another disk_dir",
        ) from None
    return directory


_FD_LIMIT_RAISED = False


def raise_open_files_limit() -> int:
    """Lift the soft limit on open files to the hard limit (once): every mapped block holds a
    descriptor (Python's mmap keeps a duplicate), and a million-token document maps thousands.
    Returns the soft limit now in force."""
    global _FD_LIMIT_RAISED
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if not _FD_LIMIT_RAISED:
        _FD_LIMIT_RAISED = True
        want = hard if hard != resource.RLIM_INFINITY else 1 << 20
        if soft != resource.RLIM_INFINITY and soft < want:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
                soft = want
            except (ValueError, OSError):
                pass
    return soft


class PageFile:
    """Append-only file of blocks; each block mapped read-only once written."""

    def __init__(self, directory: str, name: str, block_shape: tuple, dtype, *, keep=False,
                 path: str | None = None):
        raise_open_files_limit()
        self.block_shape = tuple(block_shape)
        self.dtype = np.dtype(dtype)
        self.block_bytes = int(np.prod(self.block_shape)) * self.dtype.itemsize
        self.stride = -(-self.block_bytes // ALIGN) * ALIGN  # mmap offsets must be aligned
        self.keep = keep
        self._lock = threading.Lock()
        if path is None:
            directory = check_directory(directory)
            path = os.path.join(directory, f"tiered-{os.getpid()}-{uuid.uuid4().hex[:12]}-{name}.pages")
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        else:
            flags = os.O_RDWR
        self.path = path
        self.fd = os.open(path, flags, 0o600)
        self.maps: list[mmap.mmap] = []
        self.views: list[np.ndarray] = []
        self.crc: list[list[int]] = []  # per block, per page
        self._finalizer = weakref.finalize(self, PageFile._cleanup, self.fd, path, keep, self.maps)

    # ---- writes ----------------------------------------------------------------------------
    def append(self, block: np.ndarray) -> int:
        """Write a whole block; returns its index in the file. Raises DiskTierError (nothing
        written, nothing freed) when the disk cannot hold it."""
        if block.shape != self.block_shape or block.dtype != self.dtype:
            raise ValueError(f"Invalid block: expected {self.block_shape} {self.dtype}, got "
                             f"{block.shape} {block.dtype}")
        with self._lock:
            index = len(self.maps)
            offset = index * self.stride
            free = shutil.disk_usage(os.path.dirname(self.path)).free
            if free < self.stride:
                raise DiskTierError(
                    errno.ENOSPC,
                    f"disk tier full: {self.stride} bytes needed in {os.path.dirname(self.path)!r}, "
                    f"{free} free; lower the document size, raise host_budget or free disk space",
                )
            try:
                os.posix_fallocate(self.fd, offset, self.stride)
            except OSError as e:
                raise DiskTierError(e.errno, f"disk tier: cannot reserve {self.stride} bytes in "
                                             f"{self.path!r} ({e.strerror})") from None
            data = np.ascontiguousarray(block).view(np.uint8).reshape(-1)
            written = 0
            while written < data.size:
                written += os.pwrite(self.fd, memoryview(data[written:]), offset + written)
            try:
                mm = mmap.mmap(self.fd, self.stride, flags=mmap.MAP_SHARED,
                               prot=mmap.PROT_READ, offset=offset)
            except OSError as e:  # the RAM block is still held by the caller: nothing lost
                raise DiskTierError(e.errno, f"disk tier: cannot map block {index} of "
                                    f"{self.path!r} ({e.strerror}); with EMFILE raise the "
                                    "open-files limit (ulimit -n) or host_budget") from None
            view = np.frombuffer(mm, dtype=self.dtype, count=int(np.prod(self.block_shape)))
            view = view.reshape(self.block_shape)
            self.maps.append(mm)
            self.views.append(view)
            self.crc.append([zlib.crc32(np.ascontiguousarray(block[p]).view(np.uint8))
                             for p in range(self.block_shape[0])])
            return index

    def write_page(self, index: int, slot: int, start: int, rows: np.ndarray):
        """Overwrite tokens [start, start + n) of one page of a written block (page reuse)."""
        page = np.array(self.views[index][slot])  # copy, patched, then written back whole
        page[:, start : start + rows.shape[1]] = rows
        offset = index * self.stride + slot * page.nbytes
        data = page.view(np.uint8).reshape(-1)
        with self._lock:
            os.pwrite(self.fd, memoryview(data), offset)
            self.crc[index][slot] = zlib.crc32(data)

    # ---- reads -----------------------------------------------------------------------------
    def address(self, index: int) -> int:
        return int(self.views[index].ctypes.data)

    def verify(self, index: int, slots=None) -> None:
        """Raise ValueError naming the page when a page's bytes don't match its checksum."""
        slots = range(self.block_shape[0]) if slots is None else slots
        for s in slots:
            got = zlib.crc32(np.ascontiguousarray(self.views[index][s]).view(np.uint8))
            if got != self.crc[index][s]:
                raise ValueError(
                    f"Corrupt page in disk tier file {self.path!r}: block {index}, page {s} "
                    f"(crc32 {got:#010x}, expected {self.crc[index][s]:#010x})"
                )

    def prefetch(self, index: int, slots) -> None:
        """Ask the kernel to read these pages ahead (the policy is likely to select them)."""
        page_bytes = self.block_bytes // self.block_shape[0]
        mm = self.maps[index]
        for s in slots:
            try:
                mm.madvise(mmap.MADV_WILLNEED, s * page_bytes - (s * page_bytes) % mmap.PAGESIZE,
                           page_bytes + (s * page_bytes) % mmap.PAGESIZE)
            except (OSError, ValueError, AttributeError):
                return

    @property
    def nbytes(self) -> int:
        return len(self.maps) * self.stride

    # ---- lifetime --------------------------------------------------------------------------
    def state(self) -> dict:
        return {"path": self.path, "blocks": len(self.maps), "crc": [list(c) for c in self.crc],
                "shape": list(self.block_shape), "dtype": self.dtype.str}

    @classmethod
    def reopen(cls, st: dict, *, keep: bool = True) -> "PageFile":
        """Map a page file written earlier (e.g. saved with a cache), checking its size."""
        path = st["path"]
        if not os.path.exists(path) and REOPEN_DIR is not None:
            moved = os.path.join(REOPEN_DIR, os.path.basename(path))
            path = moved if os.path.exists(moved) else path
        if not os.path.exists(path):
            raise ValueError(f"disk tier file {path!r} is gone: a cache with a disk tier can be "
                             "reopened only while its page file exists (save it with "
                             "TieredCacheList.save or keep_disk=True)")
        pf = cls("", "", tuple(st["shape"]), np.dtype(st["dtype"]), keep=keep, path=path)
        size = os.fstat(pf.fd).st_size
        if size < int(st["blocks"]) * pf.stride:
            raise ValueError(f"Corrupt disk tier file {path!r}: {size} bytes, expected at least "
                             f"{int(st['blocks']) * pf.stride}")
        for i in range(int(st["blocks"])):
            mm = mmap.mmap(pf.fd, pf.stride, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ,
                           offset=i * pf.stride)
            view = np.frombuffer(mm, dtype=pf.dtype, count=int(np.prod(pf.block_shape)))
            pf.maps.append(mm)
            pf.views.append(view.reshape(pf.block_shape))
        pf.crc = [list(c) for c in st["crc"]]
        return pf

    @staticmethod
    def _cleanup(fd, path, keep, maps):
        for mm in maps:
            try:
                mm.close()
            except (BufferError, ValueError):
                pass  # a numpy view still exports it; the mapping dies with the process
        try:
            os.close(fd)
        except OSError:
            pass
        if not keep:
            try:
                os.remove(path)
            except OSError:
                pass

    def close(self):
        self.views.clear()
        self._finalizer()


class HostBudget:
    """Bytes of host RAM the host tier may hold, shared by every tensor of every layer."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> bool:
        with self._lock:
            if self.limit is not None and self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            return True

    def charge(self, nbytes: int):
        """Count bytes already held (even past the limit: the next growth spills instead)."""
        with self._lock:
            self.used += nbytes
            self.peak = max(self.peak, self.used)

    def release(self, nbytes: int):
        with self._lock:
            self.used -= nbytes
