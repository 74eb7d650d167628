"""Point an already-loaded libmlx's BLAS and LAPACK calls at an optimized library (Linux, ELF).

CPython loads extensions with RTLD_NOW, so by the time ``mlx.core`` is imported every BLAS
call site of ``libmlx.so`` is bound, through its global offset table (GOT), to the reference
BLAS the wheel bundles. Preloading OpenBLAS first (``tiered.runtime._platform``) wins only when
tiered is imported before MLX. This module handles the other order: it reads libmlx's dynamic
relocations from the file, and for each function the optimized library also exports it writes
that function's address into the GOT slot (the page made writable for the write when RELRO
protects it, and its protection restored). Each slot is one aligned 8-byte store, so a call on
another thread sees either the old function or the new one, both complete implementations.
"""

from __future__ import annotations

import ctypes
import os
import re
import struct

R_X86_64_GLOB_DAT, R_X86_64_JUMP_SLOT = 6, 7
R_AARCH64_GLOB_DAT, R_AARCH64_JUMP_SLOT = 1025, 1026
_BIND = {R_X86_64_GLOB_DAT, R_X86_64_JUMP_SLOT, R_AARCH64_GLOB_DAT, R_AARCH64_JUMP_SLOT}
# BLAS/LAPACK entry points: cblas_* and the Fortran names (lowercase letters/digits + "_").
_NAME = re.compile(rb"^(cblas_[a-z0-9_]+|[a-z][a-z0-9]{2,12}_)$")
PROT_READ, PROT_WRITE, PROT_EXEC = 1, 2, 4


def _mapped(name: str) -> list[tuple[int, int, str, int, str]]:
    """(start, end, perms, file offset, path) of the mappings of files named ``name``."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and os.path.basename(parts[5]) == name:
                a, b = (int(x, 16) for x in parts[0].split("-"))
                out.append((a, b, parts[1], int(parts[2], 16), parts[5]))
    return out


def _relocations(path: str):
    """(GOT offset, symbol name) of libmlx's binding relocations, from its section headers."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    SHT_RELA, SHT_DYNSYM = 4, 11
    out = []
    for sh in sections:
        if sh[1] != SHT_RELA:
            continue
        symtab = sections[sh[6]]
        if symtab[1] != SHT_DYNSYM:
            continue
        strtab = sections[symtab[6]]
        for off in range(sh[4], sh[4] + sh[5], 24):
            r_offset, r_info, _ = struct.unpack_from("<QQq", data, off)
            if r_info & 0xFFFFFFFF not in _BIND:
                continue
            sym = symtab[4] + (r_info >> 32) * 24
            st_name, = struct.unpack_from("<I", data, sym)
            start = strtab[4] + st_name
            name = data[start : data.index(b"\0", start)]
            if _NAME.match(name):
                out.append((r_offset, name.decode()))
    return out


def _protection(addr: int, maps) -> int:
    for a, b, perms, _, _ in maps:
        if a <= addr < b:
            return ((PROT_READ if perms[0] == "r" else 0) | (PROT_WRITE if perms[1] == "w" else 0)
                    | (PROT_EXEC if perms[2] == "x" else 0))
    raise ValueError(f"address {addr:#x} is not in a mapping of libmlx")


def rebind(blas_path: str, library: str = "libmlx.so") -> int:
    """Rebind every BLAS/LAPACK function of the loaded ``library`` that ``blas_path`` exports.
    Returns the number of GOT slots written; raises OSError/ValueError when it cannot."""
    maps = _mapped(library)
    if not maps:
        raise ValueError(f"{library} is not loaded")
    path = maps[0][4]
    first = min((m for m in maps if m[3] == 0), key=lambda m: m[0], default=None)
    if first is None:
        raise ValueError(f"{library}: no mapping at file offset 0")
    base = first[0]  # shared objects link their first PT_LOAD at address 0
    blas = ctypes.CDLL(blas_path, mode=ctypes.RTLD_GLOBAL)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = os.sysconf("SC_PAGE_SIZE")
    written = 0
    for offset, name in _relocations(path):
        try:
            fn = ctypes.cast(getattr(blas, name), ctypes.c_void_p).value
        except AttributeError:
            continue
        slot = base + offset
        prot = _protection(slot, maps)
        start = slot & ~(page - 1)
        if not prot & PROT_WRITE and libc.mprotect(start, page, prot | PROT_WRITE) != 0:
            raise OSError(ctypes.get_errno(), f"mprotect of {library}'s GOT failed")
        ctypes.c_void_p.from_address(slot).value = fn
        if not prot & PROT_WRITE:
            libc.mprotect(start, page, prot)
        written += 1
    return written
