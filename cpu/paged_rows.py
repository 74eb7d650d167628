"""Rows of the paged host store as Numba kernels reach them: locating a token's row through
the block address table, loading and prefetching it, copying rows out, and the lookahead
buffer's update (see :mod:`tiered.cpu.kernels` for the notation)."""

from __future__ import annotations

import numpy as np

from ._numba import address_as_pointer, half_bits_as_float32, kernel, prefetch_address
from .kernel_base import FLOAT16_NATIVE, check_array, check_out


@kernel(inf_safe=True)
def check_pages(idx, count, kv_start, kv_stop, n_tokens, page_ids, ppb, n_blocks):
    """Raise IndexError unless every selected token is one of n_tokens and every page id lies
    in the n_blocks allocated blocks: the kernels below read raw addresses unchecked."""
    for lp in range(page_ids.shape[0]):
        if page_ids[lp] < 0 or page_ids[lp] // ppb >= n_blocks:
            raise IndexError("page id outside the allocated blocks")
    for k in range(kv_start, kv_stop):
        lo = 0
        hi = 0
        for t in range(count[k]):
            lo = min(lo, idx[k, t])
            hi = max(hi, idx[k, t])
        if lo < 0 or hi >= n_tokens:
            raise IndexError("selected token outside the pages (or scores) of the sequence")


# ---- (c) gather + partial attention from the paged host store ------------------------------
@kernel(inline=True)
def log2_exact(x):
    """log2(x) for a power of two x >= 1, else -1."""
    if x < 1 or (x & (x - 1)) != 0:
        return -1
    s = 0
    while (1 << s) < x:
        s += 1
    return s


@kernel(inf_safe=True, inline=True)
def _row_location(page_ids, page_size, ppb, shifts, H, k, j):
    """(block, row) of token j of kv head k: the row's index within its block, counted in
    rows of one head (block shape (ppb, H, page_size, dim)). shifts: (log2 page_size,
    log2 ppb) from log2_exact, or a -1 for sizes that are not powers of two. A 64-bit
    division costs tens of cycles, most of a gathered row's arithmetic; shifts do not."""
    if shifts[0] >= 0 and shifts[1] >= 0:
        lp = j >> shifts[0]
        phys = page_ids[lp]
        blk = phys >> shifts[1]
    else:
        lp = j // page_size
        phys = page_ids[lp]
        blk = phys // ppb
    return blk, ((phys - blk * ppb) * H + k) * page_size + (j - lp * page_size)


@kernel(inf_safe=True, inline=True)
def locate_rows(page_ids, page_size, ppb, shifts, H, k, idx, cnt, blk, row):
    """blk[t], row[t] = _row_location of token idx[k, t], t < cnt: computed once per token for
    the key and the value pass and their prefetches."""
    for t in range(cnt):
        blk[t], row[t] = _row_location(page_ids, page_size, ppb, shifts, H, k, idx[k, t])


@kernel(inf_safe=True, inline=True)
def load_row(addrs, scale_addrs, code, dim, blk, row, f16, out):
    """Decode row ``row`` of block ``blk`` (see _row_location) into out (dim,) float32.

    Inlined with a literal code, so only one decode loop remains and it vectorizes (a runtime
    code measured 2x slower per row). No bounds checks here (they cost 25% per row): the
    caller checks tokens and page ids once (check_pages)."""
    if code == 0:
        p16 = address_as_pointer(addrs[blk] + 2 * row * dim, np.uint16)
        for e in range(dim):
            out[e] = f16[p16[e]]
    elif code == FLOAT16_NATIVE:
        p16 = address_as_pointer(addrs[blk] + 2 * row * dim, np.uint16)
        for e in range(dim):
            out[e] = half_bits_as_float32(p16[e])
    elif code == 1:
        p32 = address_as_pointer(addrs[blk] + 4 * row * dim, np.float32)
        for e in range(dim):
            out[e] = p32[e]
    else:
        p8 = address_as_pointer(addrs[blk] + row * dim, np.int8)
        scale = address_as_pointer(scale_addrs[blk] + 4 * row, np.float32)[0]
        for e in range(dim):
            out[e] = np.float32(p8[e]) * scale


# Rows ahead of the one being decoded whose cache lines are requested early: a selected row is
# a scattered 256-byte read, so a serial loop waits a full memory latency per row otherwise.
PREFETCH_ROWS = 8


@kernel(inf_safe=True, inline=True)
def prefetch_row(addrs, code, dim, blk, row):
    """Request the cache lines of row ``row`` of block ``blk`` (no load, no fault)."""
    width = 4 if code == 1 else (1 if code == 2 else 2)
    start = addrs[blk] + width * row * dim
    for off in range(0, width * dim, 64):
        prefetch_address(start + off)


@kernel("void(int64[::1], int64[::1], int64, int64, int32[:, ::1], uint8[:, :, ::1])",
        inf_safe=True)
def _copy_rows(addrs, page_ids, page_size, ppb, tokens, out):
    """out[h, i] = the stored bytes of token tokens[h, i]'s row of kv head h (zeros for a
    negative token). The caller checks tokens and page ids (as check_pages does)."""
    H = tokens.shape[0]
    width = out.shape[2]
    shifts = (log2_exact(page_size), log2_exact(ppb))
    for h in range(H):
        for i in range(tokens.shape[1]):
            j = tokens[h, i]
            if j < 0:
                for e in range(width):
                    out[h, i, e] = 0
                continue
            blk, row = _row_location(page_ids, page_size, ppb, shifts, H, h, j)
            src = address_as_pointer(addrs[blk] + width * row, np.uint8)
            for e in range(width):
                out[h, i, e] = src[e]


def copy_rows(addrs, page_ids, page_size, pages_per_block, tokens, row_bytes):
    """(H, m, row_bytes) uint8: the stored rows of tokens (H, m) int32 (-1: zeros), each kv
    head h from its own rows; view the result as the storage dtype. Raises IndexError for a
    token past the pages or a page outside the blocks."""
    tokens = np.ascontiguousarray(tokens, np.int32)
    page_ids = np.asarray(page_ids, np.int64)
    addrs = np.asarray(addrs, np.int64)
    valid = np.ascontiguousarray(tokens[tokens >= 0].reshape(1, -1))
    check_pages(valid, np.array([valid.shape[1]], np.int32), 0, 1,
                 page_ids.shape[0] * int(page_size), page_ids, int(pages_per_block), len(addrs))
    out = np.empty(tokens.shape + (int(row_bytes),), np.uint8)
    _copy_rows(addrs, page_ids, int(page_size), int(pages_per_block), tokens, out)
    return out


@kernel("void(int32[:, ::1], int32[::1], int32[:, ::1], int64, boolean, int32[:, ::1], "
        "uint8[::1], int32[:, ::1], int32[:, ::1], int32[::1])")
def _spill_changes(idx, count, res_tok, n, shift, spill_tok, mark, slots, toks, n_changes):
    H, C = spill_tok.shape
    for h in range(H):
        # mark: 1 resident, 2 wanted, 3 wanted and already held; 0 elsewhere (reset below).
        for r in range(res_tok.shape[1]):
            j = res_tok[h, r]
            if 0 <= j < n:
                mark[j] = 1
        wanted = 0
        for pass_ in range(2 if shift else 1):  # the selection first, then its successors
            for t in range(count[h]):
                j = idx[h, t] + pass_
                if wanted < C and 0 <= j < n and mark[j] == 0:
                    mark[j] = 2
                    wanted += 1
        free = 0  # slots [0, free) of toks[h] list the slots to fill, in order
        for s in range(C):
            j = spill_tok[h, s]
            if 0 <= j < n and mark[j] == 2:
                mark[j] = 3
            else:
                slots[h, free] = s
                free += 1
        used = 0
        for pass_ in range(2 if shift else 1):
            for t in range(count[h]):
                j = idx[h, t] + pass_
                if 0 <= j < n and mark[j] == 2:
                    mark[j] = 3
                    s = slots[h, used]
                    toks[h, used] = j
                    spill_tok[h, s] = j
                    used += 1
        m = used
        for f in range(used, free):  # freed slots nothing moved into: emptied
            s = slots[h, f]
            if spill_tok[h, s] != -1:
                slots[h, m] = s
                toks[h, m] = -1
                spill_tok[h, s] = -1
                m += 1
        n_changes[h] = m
        for r in range(res_tok.shape[1]):
            j = res_tok[h, r]
            if 0 <= j < n:
                mark[j] = 0
        for pass_ in range(2 if shift else 1):
            for t in range(count[h]):
                j = idx[h, t] + pass_
                if 0 <= j < n:
                    mark[j] = 0


def spill_changes(idx, count, res_tok, n, spill_tok, *, shift=True):
    """Bring an accelerator-side buffer of offloaded tokens up to date with a selection.

    The buffer holds, per kv head, the tokens ``spill_tok`` (H, C) int32 (-1: empty slot). The
    wanted set of head h is its selection ``idx[h, :count[h]]`` and, with ``shift``, each selected
    token's successor (a head that copies moves one token forward per generated token), minus
    the tokens of ``res_tok`` (H, R) (already resident) and anything outside [0, n); at most C,
    the selection first. Held tokens keep their slots, new ones take freed slots, unwanted
    ones are emptied. Updates ``spill_tok`` in place and returns ``(slots, toks)`` (H, M) int32:
    the changed slots and their new tokens (-1: emptied), padded with slot C (a slot past the
    buffer) and token -1."""
    check_array("idx", idx, (None, None), (np.dtype(np.int32),))
    H = idx.shape[0]
    check_array("count", count, (H,), (np.dtype(np.int32),))
    check_array("res_tok", res_tok, (H, None), (np.dtype(np.int32),))
    check_out("spill_tok", spill_tok, (H, None), np.int32)
    if count.min(initial=0) < 0 or count.max(initial=0) > idx.shape[1]:
        raise ValueError(f"Invalid count: {count} (idx has {idx.shape[1]} columns)")
    C = spill_tok.shape[1]
    mark = np.zeros(n + 1, np.uint8)  # the kernel's per-token scratch (left zeroed)
    slots = np.empty((H, C), np.int32)
    toks = np.empty((H, C), np.int32)
    n_changes = np.zeros(H, np.int32)
    _spill_changes(np.ascontiguousarray(idx), np.ascontiguousarray(count),
                   np.ascontiguousarray(res_tok), int(n), bool(shift), spill_tok, mark, slots,
                   toks, n_changes)
    M = int(n_changes.max(initial=0))
    cols = np.arange(M)[None, :] < n_changes[:, None]
    return (np.where(cols, slots[:, :M], C).astype(np.int32),
            np.where(cols, toks[:, :M], -1).astype(np.int32))
