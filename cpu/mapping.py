"""Read-only shared mappings of a file's ranges that hold no file descriptor.

Python's ``mmap.mmap`` keeps a duplicate of the file's descriptor for each mapping (until
Python 3.13's ``trackfd=False``). The disk tier maps its page file block by block, so it held
one descriptor a block: a 4M-token document with int8 values on the disk tier reached an H200
host's limit of 20,000 open files at 3.2M tokens (``bench/gpu_session.sh fourm``). A
:class:`Mapping` comes from libc's ``mmap`` through ctypes instead: the kernel keeps the file
alive while any mapping of it exists, and no descriptor stays open for it.

The numpy views of a mapping (:meth:`Mapping.array`) hold the mapping itself as their base, so
it is unmapped only once nothing reads it any more: a view that outlives its page file stays
valid, never a dangling address.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int64]  # off_t: 64 bits on Linux x86_64 and macOS
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_FAILED = ctypes.c_void_p(-1).value


class Mapping:
    """``length`` bytes of the file ``fd`` from ``offset`` (a multiple of
    ``mmap.ALLOCATIONGRANULARITY``), mapped shared and read-only. OSError where the system
    refuses (the errno of ``mmap``)."""

    __slots__ = ("__array_interface__", "address", "length")

    def __init__(self, fd: int, length: int, offset: int):
        if length <= 0 or offset < 0 or offset % mmap.ALLOCATIONGRANULARITY:
            raise ValueError(f"Invalid mapping: {length} bytes at offset {offset}")
        addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
        if addr is None or addr == _FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {length} bytes at offset {offset}: {os.strerror(err)}")
        self.address, self.length = addr, length
        # numpy takes this object as the base of every view: it lives while they do
        self.__array_interface__ = {"shape": (length,), "typestr": "|u1", "version": 3,
                                    "data": (addr, True)}

    def array(self, dtype, shape: tuple) -> np.ndarray:
        """The mapping's first bytes as a read-only array of ``shape`` and ``dtype``."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        if count * dtype.itemsize > self.length:
            raise ValueError(f"{shape} {dtype} needs {count * dtype.itemsize} bytes; the "
                             f"mapping holds {self.length}")
        return np.asarray(self)[: count * dtype.itemsize].view(dtype).reshape(shape)

    def madvise(self, advice: int, start: int = 0, length: int | None = None) -> bool:
        """``madvise`` over [start, start + length) of the mapping (start rounded down to a
        page); False where the system refuses it."""
        length = self.length - start if length is None else length
        lead = start % mmap.PAGESIZE
        return _libc.madvise(self.address + start - lead, length + lead, advice) == 0

    def __del__(self):
        if getattr(self, "address", None) is not None:  # unset: the mmap call failed
            _libc.munmap(self.address, self.length)
