"""Gather + partial attention from the paged host store (Numba), and the CPU prefill's causal
softmax (see :mod:`tiered.cpu.kernels` for the notation). The partial this returns merges with
others through :func:`tiered.runtime.primitives.merge_partials`."""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from ._numba import NATIVE_HALF, kernel
from .kernel_base import (DTYPE_CODES, F16_TO_F32, FLOAT16_NATIVE, INF32, c32, check_array,
                          check_out, row_max, fast_exp)
from .paged_rows import (PREFETCH_ROWS, check_pages, load_row, locate_rows, log2_exact,
                         prefetch_row)


@kernel(inf_safe=True, inline=True)
def _exact_logits(q, k, cnt, rep, addrs, scale_addrs, code, d, blk, rows, f16, row, w):
    """w[r, t] = q[k*rep + r] . key of the t-th selected token of kv head k (at blk[t],
    rows[t]: locate_rows); each key row is decoded once."""
    for t in range(cnt):
        if t + PREFETCH_ROWS < cnt:
            prefetch_row(addrs, code, d, blk[t + PREFETCH_ROWS], rows[t + PREFETCH_ROWS])
        load_row(addrs, scale_addrs, code, d, blk[t], rows[t], f16, row)
        for r in range(rep):
            acc = np.float32(0.0)
            for e in range(d):
                acc += q[k * rep + r, e] * row[e]
            w[r, t] = acc


@kernel(inf_safe=True, inline=True)
def _weighted_values(cnt, rep, addrs, scale_addrs, code, dv, blk, rows, f16, row, w, acc,
                     dropped):
    """acc[r*dv:(r+1)*dv] = sum_t w[r, t] * value of the t-th selected token (at blk[t],
    rows[t]); each value row is decoded once. acc is a flat local buffer: accumulating into the
    2-D output measured 1.5x slower. dropped: some head dropped a token (weight 0), see below."""
    acc[: rep * dv] = 0.0
    for t in range(cnt):
        if t + PREFETCH_ROWS < cnt:
            prefetch_row(addrs, code, dv, blk[t + PREFETCH_ROWS], rows[t + PREFETCH_ROWS])
        load_row(addrs, scale_addrs, code, dv, blk[t], rows[t], f16, row)
        for r in range(rep):
            p = w[r, t]
            for e in range(dv):
                acc[r * dv + e] += p * row[e]
    if dropped:
        _without_dropped(cnt, rep, addrs, scale_addrs, code, dv, blk, rows, f16, row, w, acc)


@kernel(inf_safe=True, inline=True)
def _without_dropped(cnt, rep, addrs, scale_addrs, code, dv, blk, rows, f16, row, w, acc):
    """Redo the sum of each head that came out not finite and that drops a token another head
    keeps (weight 0 here, positive there): that token's value row (NaN or Inf) was read for
    every head, and 0 times NaN is NaN. Rare: only behind a non-finite logit."""
    for r in range(rep):
        finite = True
        for e in range(dv):
            finite = finite and abs(acc[r * dv + e]) < INF32
        drops = False
        for t in range(cnt):
            drops = drops or w[r, t] == 0.0
        if finite or not drops:
            continue
        acc[r * dv:(r + 1) * dv] = 0.0
        for t in range(cnt):
            p = w[r, t]
            if p != 0.0:
                load_row(addrs, scale_addrs, code, dv, blk[t], rows[t], f16, row)
                for e in range(dv):
                    acc[r * dv + e] += p * row[e]


@kernel(inf_safe=True, inline=True)
def _weighted_only(w, blk, rows, rep, cnt):
    """Move the tokens t < cnt with a nonzero weight w[r, t] in some head to the front of w,
    blk and rows, in order; returns their count."""
    kept = 0
    for t in range(cnt):
        live = False
        for r in range(rep):
            live = live or w[r, t] != 0.0
        if live:
            blk[kept] = blk[t]
            rows[kept] = rows[t]
            for r in range(rep):
                w[r, kept] = w[r, t]
            kept += 1
    return kept


@kernel(
    "void(float32[:, ::1], float32[:, :], int32[:, ::1], int32[::1], int64, int64[::1], int64, "
    "int64, int64[::1], int64[::1], int64, int64, int64[::1], int64[::1], int64, int64, "
    "boolean, boolean, float32[::1], int64, int64, float32[:, ::1], float32[::1])",
    inf_safe=True,
)
def _gather_partial(q, z, idx, count, rep, page_ids, page_size, ppb, val_addrs,
                    val_scale_addrs, val_code, dv, key_addrs, key_scale_addrs, key_code, d,
                    rescore_exact, z_by_slot, f16, kv_start, kv_stop, o_out, lse_out):
    n_tokens = page_ids.shape[0] * page_size
    if not rescore_exact and not z_by_slot:
        n_tokens = min(n_tokens, z.shape[1])
    n_blocks = val_addrs.shape[0]
    if rescore_exact:
        n_blocks = min(n_blocks, key_addrs.shape[0])
    check_pages(idx, count, kv_start, kv_stop, n_tokens, page_ids, ppb, n_blocks)
    cmax = 0
    for k in range(kv_start, kv_stop):
        cmax = max(cmax, count[k])
    w = np.empty((rep, cmax), np.float32)
    row = np.empty(max(d, dv), np.float32)
    acc = np.empty(rep * dv, np.float32)
    blk = np.empty(cmax, np.int64)
    rows = np.empty(cmax, np.int64)
    H = idx.shape[0]
    shifts = (log2_exact(page_size), log2_exact(ppb))
    for k in range(kv_start, kv_stop):
        cnt = count[k]
        h0 = k * rep
        locate_rows(page_ids, page_size, ppb, shifts, H, k, idx, cnt, blk, rows)
        # Pass 1: logits of the rep heads. Literal dtype codes: see load_row.
        if not rescore_exact and z_by_slot:
            for t in range(cnt):
                for r in range(rep):
                    w[r, t] = z[h0 + r, t]
        elif not rescore_exact:
            for t in range(cnt):
                for r in range(rep):
                    w[r, t] = z[h0 + r, idx[k, t]]
        elif NATIVE_HALF and key_code == FLOAT16_NATIVE:
            _exact_logits(q, k, cnt, rep, key_addrs, key_scale_addrs, FLOAT16_NATIVE, d, blk,
                          rows, f16, row, w)
        elif key_code == 0:
            _exact_logits(q, k, cnt, rep, key_addrs, key_scale_addrs, 0, d, blk, rows, f16,
                          row, w)
        elif key_code == 1:
            _exact_logits(q, k, cnt, rep, key_addrs, key_scale_addrs, 1, d, blk, rows, f16,
                          row, w)
        else:
            _exact_logits(q, k, cnt, rep, key_addrs, key_scale_addrs, 2, d, blk, rows, f16,
                          row, w)
        # Softmax weights in place, in loops of their own so max and exp vectorize. A token
        # whose logit is not finite (a NaN or Inf in its key row or score) is dropped: counted
        # in the max loop, so that the exp loop stays as it was unless a head has one (a test
        # per logit there measured 45% slower per layer with exact rescoring).
        dropped = 0
        for r in range(rep):
            mx = -INF32
            bad = 0
            for t in range(cnt):
                v = w[r, t]
                mx = max(mx, v)  # skips NaN (see row_max)
                bad += 0 if abs(v) < INF32 else 1
            if bad > 0:  # rare: the max of the finite logits only
                mx = -INF32
                for t in range(cnt):
                    v = w[r, t]
                    mx = max(mx, v if v < INF32 else -INF32)
            total = 0.0
            if mx > -INF32 and bad == 0:
                for t in range(cnt):
                    p = fast_exp(w[r, t] - mx)
                    w[r, t] = p
                    total += p
            elif mx > -INF32:  # weight 0 for the non-finite logits
                for t in range(cnt):
                    v = w[r, t]
                    p = fast_exp(v - mx) if abs(v) < INF32 else np.float32(0.0)
                    w[r, t] = p
                    total += p
            dropped += bad
            if total > 0.0:
                lse_out[h0 + r] = mx + math.log(total)
                inv = np.float32(1.0 / total)
                for t in range(cnt):
                    w[r, t] *= inv
            else:  # nothing selected (or no finite logit): o = 0, lse = -inf
                lse_out[h0 + r] = -np.inf
                dropped += cnt
                for t in range(cnt):
                    w[r, t] = 0.0
        # A token dropped by every head is not read (0 times a NaN in its value row would be
        # NaN): the tokens weighted in some head move to the front. A weight-0 test in pass 2
        # instead measured 15% slower. (A token dropped by some heads only: _without_dropped.)
        if dropped > 0:
            cnt = _weighted_only(w, blk, rows, rep, cnt)
        # Pass 2: each value row is decoded once and accumulated into all rep heads.
        if NATIVE_HALF and val_code == FLOAT16_NATIVE:
            _weighted_values(cnt, rep, val_addrs, val_scale_addrs, FLOAT16_NATIVE, dv,
                             blk, rows, f16, row, w, acc, dropped > 0)
        elif val_code == 0:
            _weighted_values(cnt, rep, val_addrs, val_scale_addrs, 0, dv, blk, rows, f16,
                             row, w, acc, dropped > 0)
        elif val_code == 1:
            _weighted_values(cnt, rep, val_addrs, val_scale_addrs, 1, dv, blk, rows, f16,
                             row, w, acc, dropped > 0)
        else:
            _weighted_values(cnt, rep, val_addrs, val_scale_addrs, 2, dv, blk, rows, f16,
                             row, w, acc, dropped > 0)
        for r in range(rep):
            for e in range(dv):
                o_out[h0 + r, e] = acc[r * dv + e]


_EMPTY_ADDRS = np.zeros(0, np.int64)
_NO_QUERIES = np.zeros((0, 0), np.float32)


def gather_partial(q, z, idx, count, rep, page_ids, page_size, pages_per_block, val_addrs,
                   val_scale_addrs, val_dtype_code, dv, key_addrs, key_scale_addrs,
                   key_dtype_code, d, rescore_exact, o_out, lse_out, *, kv_heads=None,
                   native_half=NATIVE_HALF, z_by_slot=False):
    """Softmax-weighted sum of the selected host values, per query head (serial, nogil).

    For query head qh (kv head k = qh // rep) over tokens j in idx[k, :count[k]]: logits
    w_j = z[qh, j], or q[qh] . key_j read from the host keys when rescore_exact; writes
    o_out[qh] = sum_j softmax(w)_j v_j and lse_out[qh] = logsumexp_j w_j (0 and -inf for an
    empty selection). A token whose w_j is not finite (a NaN or Inf in its key row or score,
    a NaN query) is dropped from qh's partial: the partial of the others, whose value rows
    alone reach o_out[qh] (a NaN in a kept token's value row makes it NaN). Blocks are reached
    by address: block p // pages_per_block of val_addrs (fp16/fp32/int8 per DTYPE_CODES; int8
    scales at val_scale_addrs), page slot p % pages_per_block, shape (pages_per_block, H,
    page_size, dim).

    q: (Hq, d) float32 scaled queries (read only when rescore_exact); z: (Hq, >= n) float32
    scores (may be None when rescore_exact);
    idx: (H, cap_alloc) int32; count: (H,) int32; page_ids: (n_pages,) int64 physical page of
    each logical page; *_addrs: int64 block addresses (key_* unused unless rescore_exact);
    o_out: (Hq, dv) float32; lse_out: (Hq,) float32. kv_heads: (start, stop) to compute only
    those kv heads (split one step across workers); other rows are left untouched.
    native_half: decode float16 in hardware (default where available) instead of F16_TO_F32.
    z_by_slot: z is (Hq, >= cap) indexed by selection slot (z[qh, t] weighs idx[k, t]) rather
    than by token id: an accelerator hands over only the scores of the selected tokens.
    """
    check_array("idx", idx, (None, None), (np.dtype(np.int32),))
    H = idx.shape[0]
    Hq = H * int(rep)
    check_array("count", count, (H,), (np.dtype(np.int32),))
    if z is None and rescore_exact:
        z = np.zeros((Hq, 0), np.float32)
    check_array("z", z, (Hq, None), (np.dtype(np.float32),))
    check_out("o_out", o_out, (Hq, int(dv)), np.float32)
    check_out("lse_out", lse_out, (Hq,), np.float32)
    start, stop = (0, H) if kv_heads is None else (int(kv_heads[0]), int(kv_heads[1]))
    if not 0 <= start <= stop <= H:
        raise ValueError(f"Invalid kv_heads: {kv_heads} (H = {H})")
    if count.min(initial=0) < 0 or count.max(initial=0) > idx.shape[1]:
        raise ValueError(f"Invalid count: {count} (idx has {idx.shape[1]} columns)")
    val_addrs = np.asarray(val_addrs, np.int64)
    val_scale_addrs = _EMPTY_ADDRS if val_scale_addrs is None else np.asarray(val_scale_addrs,
                                                                               np.int64)
    if val_dtype_code not in (0, 1, 2) or (val_dtype_code == 2
                                           and val_scale_addrs.size < val_addrs.size):
        raise ValueError(f"Invalid val_dtype_code {val_dtype_code} (or int8 without scales)")
    if rescore_exact:
        check_array("q", q, (Hq, int(d)), (np.dtype(np.float32),))
        key_addrs = np.asarray(key_addrs, np.int64)
        key_scale_addrs = _EMPTY_ADDRS if key_scale_addrs is None else np.asarray(
            key_scale_addrs, np.int64)
        if key_dtype_code not in (0, 1, 2) or key_addrs.size == 0 or (
                key_dtype_code == 2 and key_scale_addrs.size < key_addrs.size):
            raise ValueError("rescore_exact needs host keys (key_addrs, and scales for int8)")
    else:
        q = _NO_QUERIES  # not read without rescoring
        key_addrs = key_scale_addrs = _EMPTY_ADDRS
        key_dtype_code = 1
    half = FLOAT16_NATIVE if native_half and NATIVE_HALF else 0
    val_dtype_code = half if val_dtype_code == 0 else val_dtype_code
    key_dtype_code = half if key_dtype_code == 0 else key_dtype_code
    _gather_partial(c32(q), z, idx, count, int(rep), np.asarray(page_ids, np.int64),
                    int(page_size), int(pages_per_block), val_addrs, val_scale_addrs,
                    int(val_dtype_code), int(dv), key_addrs, key_scale_addrs, int(key_dtype_code),
                    int(d), bool(rescore_exact), bool(z_by_slot), F16_TO_F32, start, stop, o_out,
                    lse_out)
    return o_out, lse_out


def host_store_args(store, b=0):
    """The paging arguments of :func:`gather_partial` for sequence b of a ``HostStore``:
    (page_ids, page_size, pages_per_block, val_addrs, val_scale_addrs, val_dtype_code, dv,
    key_addrs, key_scale_addrs, key_dtype_code, d). Read them again after the store grows."""
    v, k = store.values, store.keys
    return (store.logical_pages(b), store.page_size, v.pages_per_block, v.addrs, v.scale_addrs,
            DTYPE_CODES[v.dtype], store.value_dim,
            _EMPTY_ADDRS if k is None else k.addrs, _EMPTY_ADDRS if k is None else k.scale_addrs,
            1 if k is None else DTYPE_CODES[k.dtype], store.head_dim)


# ---- (d) causal softmax for the CPU prefill -------------------------------------------------
@kernel("void(float32[:, ::1], int64, int64, float32[::1], float32[::1])", parallel=True)
def causal_softmax_rows(S, block_rows, first_visible, inv_sum, lse):
    """In place: row r sees columns [0, first_visible + r % block_rows] (inclusive); there
    S <- exp(S - max), beyond it 0. inv_sum[r] = 1 / sum of the row (normalize after P @ V);
    lse[r] = the row's log-sum-exp over what it sees (a sharded cache merges partials by it)."""
    ncols = S.shape[1]
    for r in prange(S.shape[0]):
        vis = min(ncols, first_visible + r % block_rows + 1)
        mx = row_max(S[r], vis)
        acc = np.float32(0.0)
        for j in range(vis):
            e = fast_exp(S[r, j] - mx)
            S[r, j] = e
            acc += e
        for j in range(vis, ncols):
            S[r, j] = 0.0
        inv_sum[r] = np.float32(1.0) / acc
        lse[r] = mx + np.float32(math.log(acc))


@kernel("void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, ::1])",
        inf_safe=True)
def softmax_pv_rows(S, V, O, lse):
    """Per kv head h and query r: p = exp(S[h, r] - max) (a -inf entry exactly 0), O[h, r] =
    p @ V[h] / sum(p), lse[h, r] = log-sum-exp; a row of nothing but -inf: O 0, lse -inf. On
    the calling thread (the CPU step's gathers run beside it on the workers); S is overwritten
    with p."""
    H, rep, R = S.shape
    dv = V.shape[2]
    inv = np.empty(rep, np.float32)
    for h in range(H):
        for r in range(rep):
            mx = row_max(S[h, r], R)
            acc = np.float32(0.0)
            if mx == -INF32:
                for j in range(R):
                    S[h, r, j] = 0.0
            else:
                for j in range(R):
                    x = S[h, r, j]
                    e = fast_exp(x - mx) if x > -INF32 else np.float32(0.0)
                    S[h, r, j] = e
                    acc += e
            inv[r] = np.float32(1.0) / acc if acc > 0 else np.float32(0.0)
            lse[h, r] = mx + np.float32(math.log(acc)) if acc > 0 else -INF32
            for e in range(dv):
                O[h, r, e] = 0.0
        for j in range(R):
            for r in range(rep):
                p = S[h, r, j]
                if p != 0.0:
                    for e in range(dv):
                        O[h, r, e] += p * V[h, j, e]
        for r in range(rep):
            for e in range(dv):
                O[h, r, e] *= inv[r]
