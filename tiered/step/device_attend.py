"""The offloaded and resident attention of one device decode step in three launches (CUDA).

Issue 24 measured (bench/probes/device_kernel_profile.py, H200, 128k) that the step's time went to
~120 kernel launches per layer, most of them small MLX ops, rather than to the bytes moved.
This module replaces the gather of keys and values, the two exact partials and their merge
(with sinks and the step's statistics) by:

- :func:`gather_kv`: one launch reads the selected chunks' keys and values from the host
  pages (the two tensors on two grid rows) and says which tokens are attended;
- :func:`attend`: a split-K decode attention over the resident set and the gathered rows,
  every query head of a kv head in one block (flash-decoding), then one block per query head
  merges the splits, applies the sink and writes the output in the query dtype, with the
  resident share of the mass and the attended-token count for the statistics.

Splits never straddle the two sets, so the merge also yields the resident set's own
log-sum-exp. The MLX references are in :mod:`tiered.step.attend_reference` (tests compare the two).
"""

from __future__ import annotations

import mlx.core as mx

from ..metal import accelerator, device_ints
from .attend_reference import approx_attend_ops
from .chunk_word import CHUNK_WORD, KernelTable, page_fence
from .device_decode import CHUNK, DeviceTables, host_mx_dtype, kept

_GATHER_KV = r"""
    // grid.y selects the tensor (0 keys, 1 values); one thread per 16-byte word of its out
    // (H, CAPC, C, ROW bytes). ok (H, CAPC * C) written from the keys' row: the token is
    // selected, on the host pages and not resident; other rows are zeros (not read).
    const bool isv = blockIdx.y == 1;
    const uint32_t ROWB = isv ? ROWV : ROWK;
    const uint32_t WPR = ROWB / 16, WPC = WPR * C, ppb = isv ? PPBV : PPBK;
    const bool write_ok = !isv;
    const uint64_t* addrs_t = isv ? addrs_v : addrs_k;
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
""" + CHUNK_WORD + r"""
    if (isv) reinterpret_cast<uint4*>(vout)[tid] = val;
    else reinterpret_cast<uint4*>(kout)[tid] = val;
"""

# Both splits kernels' block, warp and split bounds (see _SPLITS_EXACT's comment).
_SPLITS_PROLOGUE = r"""
    constexpr int NW = 4, E = D / 32;
    const int NRES = dims[0], SPLIT = dims[1], NS = dims[2], NSR = dims[3];
    const int b = blockIdx.x, h = b / NS, s = b % NS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const bool res = s < NSR;
    const int len = res ? NRES : NGAT;
    const int lo = (res ? s : s - NSR) * SPLIT;
    const int hi = min(lo + SPLIT, len);"""

_SPLITS_EXACT = r"""
    // dims = [NRES, SPLIT, NS, NSR] (runtime). Block b: kv head h = b / NS, split s = b % NS;
    // splits [0, NSR) cover the NRES resident
    // slots, [NSR, NS) the NGAT gathered rows, SPLIT tokens each. NW warps stride the split's
    // tokens; a lane holds D / 32 consecutive dims of each of the REP query heads. Outputs
    // per (block, query head of h): the running max pm, the sum pl of exp(score - pm) and
    // po = sum exp(score - pm) v (not normalized), and the attended tokens cnt.""" \
    + _SPLITS_PROLOGUE + r"""
    float qv[REP][E], m[REP], l[REP], acc[REP][E];
    for (int r = 0; r < REP; ++r) {
        m[r] = -INFINITY; l[r] = 0.f;
        for (int e = 0; e < E; ++e) {
            qv[r][e] = q[(uint64_t)(h * REP + r) * D + lane * E + e];
            acc[r][e] = 0.f;
        }
    }
    int seen = 0;
    for (int j = lo + warp; j < hi; j += NW) {
        const bool valid = res ? rtok[(uint64_t)h * NRES + j] >= 0 : ok[(uint64_t)h * NGAT + j];
        if (!valid) continue;
        ++seen;
        const uint64_t row = ((uint64_t)h * len + j) * D + lane * E;
        float kf[E], vf[E];
        for (int e = 0; e < E; ++e) {
            kf[e] = res ? @RES_KEY@ : static_cast<float>(gk[row + e]);
            vf[e] = res ? static_cast<float>(rv[row + e]) : static_cast<float>(gv[row + e]);
        }
        for (int r = 0; r < REP; ++r) {
            float sc = 0.f;
            if (@RES_SCORE@) {
                @RES_READ@
            } else {  // uniform in the block: splits never straddle the two sets
                for (int e = 0; e < E; ++e) sc += qv[r][e] * kf[e];
                for (int o = 16; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o);
            }
            const float mn = fmaxf(m[r], sc);
            const float c = expf(m[r] - mn), p = expf(sc - mn);
            l[r] = l[r] * c + p;
            for (int e = 0; e < E; ++e) acc[r][e] = acc[r][e] * c + p * vf[e];
            m[r] = mn;
        }
    }
"""

_SPLITS_GIVEN = r"""
    // Approximate rescoring (no keys gathered): the exact splits' loop with the scores
    // given: the resident slots' sres (Hq, NRES) (-inf: an empty slot), the gathered rows'
    // from the code scores z (Hq, >= n) at their tokens (token j % C of chunk idx[h, j / C]).""" \
    + _SPLITS_PROLOGUE + r"""
    const uint64_t ZW = z_shape[1];
    float m[REP], l[REP], acc[REP][E];
    for (int r = 0; r < REP; ++r) {
        m[r] = -INFINITY; l[r] = 0.f;
        for (int e = 0; e < E; ++e) acc[r][e] = 0.f;
    }
    int seen = 0;
    for (int j = lo + warp; j < hi; j += NW) {
        const bool valid = res ? sres[(uint64_t)h * REP * NRES + j] > -INFINITY
                               : ok[(uint64_t)h * NGAT + j];
        if (!valid) continue;
        ++seen;
        const uint64_t row = ((uint64_t)h * len + j) * D + lane * E;
        float vf[E];
        for (int e = 0; e < E; ++e)
            vf[e] = res ? static_cast<float>(rv[row + e]) : static_cast<float>(gv[row + e]);
        const uint64_t t = res ? 0 : (uint64_t)max(idx[h * (NGAT / C) + j / C], 0) * C + j % C;
        for (int r = 0; r < REP; ++r) {
            const uint64_t qh = (uint64_t)(h * REP + r);
            const float sc = res ? sres[qh * NRES + j] : z[qh * ZW + t];
            if (sc == -INFINITY) continue;
            const float mn = fmaxf(m[r], sc);
            const float c = expf(m[r] - mn), p = expf(sc - mn);
            l[r] = l[r] * c + p;
            for (int e = 0; e < E; ++e) acc[r][e] = acc[r][e] * c + p * vf[e];
            m[r] = mn;
        }
    }
"""

_SPLITS_TAIL = r"""    __shared__ float sm[NW][REP], sl[NW][REP], sa[NW][REP][D];
    __shared__ int sn[NW];
    if (lane == 0) {
        sn[warp] = seen;
        for (int r = 0; r < REP; ++r) { sm[warp][r] = m[r]; sl[warp][r] = l[r]; }
    }
    for (int r = 0; r < REP; ++r)
        for (int e = 0; e < E; ++e) sa[warp][r][lane * E + e] = acc[r][e];
    __syncthreads();
    for (int i = threadIdx.x; i < REP * D; i += NW * 32) {
        const int r = i / D, e = i % D;
        float M = -INFINITY;
        for (int w = 0; w < NW; ++w) M = fmaxf(M, sm[w][r]);
        float L = 0.f, O = 0.f;
        if (M > -INFINITY) {
            for (int w = 0; w < NW; ++w) {
                const float c = expf(sm[w][r] - M);
                L += sl[w][r] * c;
                O += sa[w][r][e] * c;
            }
        }
        const uint64_t at = (uint64_t)b * REP + r;
        po[at * D + e] = O;
        if (e == 0) {
            pm[at] = M; pl[at] = L;
            cnt[at] = sn[0] + sn[1] + sn[2] + sn[3];
        }
    }
"""

_SPLITS = (_SPLITS_EXACT.replace("@RES_KEY@", "static_cast<float>(rk[row + e])")
           .replace("@RES_SCORE@", "false").replace("@RES_READ@", "") + _SPLITS_TAIL)
# The resident slots' scores read from the resident kernel's (Hq, R) output instead of
# computed again from their keys: the resident keys are then read once per step, not twice.
_SPLITS_SRES = (_SPLITS_EXACT.replace("@RES_KEY@", "0.f").replace("@RES_SCORE@", "res")
                .replace("@RES_READ@", "sc = sres[(uint64_t)(h * REP + r) * NRES + j];")
                + _SPLITS_TAIL)


_MERGE = r"""
    // One block per query head qh, D x G threads: merge its kv head's NS splits (the first
    // NSR resident), apply the sink, write the output in the query dtype and the stats
    // [attended tokens (gathered + resident), resident share of the mass]. Row g of the block
    // takes splits g, g + G, ...; the rows' maxima, then their sums, meet in shared memory (a
    // block of one row read its ~130 splits one after another: 37-49 us per layer on an H200).
    const int NS = dims[2], NSR = dims[3];
    const int qh = blockIdx.x, h = qh / REP, r = qh % REP, e = threadIdx.x, g = threadIdx.y;
    __shared__ float sM[G], sMr[G], sL[G], sLr[G], sO[G][D];
    __shared__ int sN[G];
    float M = -INFINITY, Mr = -INFINITY;
    for (int s = g; s < NS; s += G) {
        const float mm = pm[(uint64_t)(h * NS + s) * REP + r];
        M = fmaxf(M, mm);
        if (s < NSR) Mr = fmaxf(Mr, mm);
    }
    if (e == 0) { sM[g] = M; sMr[g] = Mr; }
    __syncthreads();
    for (int i = 0; i < G; ++i) { M = fmaxf(M, sM[i]); Mr = fmaxf(Mr, sMr[i]); }
    float L = 0.f, Lr = 0.f, O = 0.f;
    int ng = 0;
    for (int s = g; s < NS; s += G) {
        const uint64_t at = (uint64_t)(h * NS + s) * REP + r;
        if (s >= NSR) ng += cnt[at];
        const float mm = pm[at];
        if (mm == -INFINITY) continue;
        const float c = expf(mm - M);
        L += pl[at] * c;
        O += po[at * D + e] * c;
        if (s < NSR) Lr += pl[at] * expf(mm - Mr);
    }
    sO[g][e] = O;
    if (e == 0) { sL[g] = L; sLr[g] = Lr; sN[g] = ng; }
    __syncthreads();
    if (g != 0) return;
    L = 0.f; Lr = 0.f; O = 0.f; ng = 0;
    for (int i = 0; i < G; ++i) { L += sL[i]; Lr += sLr[i]; O += sO[i][e]; ng += sN[i]; }
    const float lse = L > 0.f ? M + logf(L) : 0.f;  // 0 when nothing is attended (unused then)
    float o = L > 0.f ? O / L : 0.f;
    if (HAS_SINK) o *= 1.f / (1.f + expf(sink[qh] - lse));
    out[(uint64_t)qh * D + e] = static_cast<OutT>(o);
    if (e == 0) {
        stats[qh * 2] = (float)ng;
        stats[qh * 2 + 1] = Lr > 0.f ? expf(Mr + logf(Lr) - lse) : 0.f;
    }
"""

MERGE_GROUPS = 8  # rows of threads of a merge block over the splits (1: the one-row merge before)
# The device step hands the resident kernel's scores to the exact splits (attend's s_r), so the
# resident keys are read once a step, not twice (34 MB a layer at 128k on the Llama-3-8B
# shape). H200, 128k, CUPTI over 2 steps (bench/probes/device_probe.py --toggle
# tiered.step.device_attend.RESIDENT_SCORES_GIVEN=0,1 beside RESIDENT_ITER): kernel time summed
# 33.2 -> 31.4 ms per token, the GPU busy 20.8 -> 20.0 ms; token rounds 26.8 / 24.7 / 26.0
# -> 24.0 / 25.0 / 25.0 ms.
RESIDENT_SCORES_GIVEN = True


_kernel = KernelTable({name: (f"tiered_{name}", *spec) for name, spec in {
    "gather_kv": (["idx", "count", "pages", "addrs_k", "addrs_v", "flags", "n_host", "after"],
                  ["kout", "vout", "ok"], _GATHER_KV),
    "splits": (["q", "rk", "rv", "rtok", "gk", "gv", "ok", "dims"], ["pm", "pl", "po", "cnt"],
               _SPLITS),
    "splits_sres": (["q", "sres", "rv", "rtok", "gk", "gv", "ok", "dims"],
                    ["pm", "pl", "po", "cnt"], _SPLITS_SRES),
    "splits_given": (["sres", "z", "idx", "rv", "gv", "ok", "dims"], ["pm", "pl", "po", "cnt"],
                     _SPLITS_GIVEN + _SPLITS_TAIL),
    "merge": (["pm", "pl", "po", "cnt", "sink", "dims"], ["out", "stats"], _MERGE),
}.items()})


def gather_kv(tables: DeviceTables, host, idx: mx.array, count: mx.array, flags: mx.array,
              where: tuple | None = None):
    """Keys and values (H, CAPC * CHUNK, d) of the selected chunks, read in place from the
    host pages in one launch, and which tokens are attended (see device_decode.gather_chunks,
    which reads one tensor). ``where``: (pages, key addresses, value addresses, n_host (1+,)
    int32, fence) as arrays the caller holds (a compiled step's inputs); the caller then
    records ``ok`` as the pages' fence (HostStore.device_op)."""
    H, capc = idx.shape
    kt, vt = host.keys, host.values
    kdt, vdt = host_mx_dtype(kt.dtype), host_mx_dtype(vt.dtype)
    rowk, rowv = kt.head_dim * kdt.size, vt.head_dim * vdt.size
    words = H * capc * CHUNK * max(rowk, rowv) // 16
    own = where is None
    if own:
        where = (tables.pages(host), tables.addrs(kt), tables.addrs(vt),
                 device_ints(host.length), page_fence(host))
    pages, addrs_k, addrs_v, n_host, fence = where
    kout, vout, ok = _kernel("gather_kv")(
        inputs=[idx, count, pages, addrs_k, addrs_v, flags, n_host, fence],
        output_shapes=[(H, capc * CHUNK, kt.head_dim), (H, capc * CHUNK, vt.head_dim),
                       (H, capc * CHUNK)],
        output_dtypes=[kdt, vdt, mx.bool_],
        grid=(-(-words // 256) * 256, 2, 1), threadgroup=(256, 1, 1),
        template=[("H", H), ("CAPC", capc), ("C", CHUNK), ("P", host.page_size),
                  ("PPBK", kt.pages_per_block), ("PPBV", vt.pages_per_block),
                  ("ROWK", rowk), ("ROWV", rowv)])
    if own:
        host.device_op(ok)  # a sibling: evaluated with the rows, and small to keep
    return kout, vout, ok


def approx_attend(z, s_r, vals, ok, idx, res_v, sinks, rep: int, out_dtype=mx.float32):
    """Approximate rescoring (no keys gathered): the selected chunks' tokens take their code
    scores from z (Hq, >= n), the resident set its exact scores s_r (Hq, R); one softmax over
    the gathered values vals (H, T, dv) (attended where ok (H, T)) and res_v, with the model's
    sink logits (Hq values, or None). Returns (o (Hq, dv) in out_dtype, stats (Hq, 2):
    [gathered tokens attended, resident share of the mass], as :func:`attend` gives them).

    On CUDA two launches (the splits kernel with the scores given, then :func:`attend`'s
    merge): as MLX ops it was ~45 primitives and two cuBLAS products per layer, each product
    a graph commit of its own (~0.4 ms of host time per layer at 1M tokens on an H200).
    :func:`tiered.step.attend_reference.approx_attend_ops` is the MLX reference."""
    H, T, D = vals.shape
    if accelerator() != "cuda" or D % 32:
        o, stats = approx_attend_ops(z, s_r, vals, ok, idx, res_v, sinks, rep)
        return o.astype(out_dtype), stats
    return _split_attend("splits_given", [s_r, z, idx, res_v, vals, ok], s_r.shape[0], H, D,
                         res_v.shape[1], T, sinks, out_dtype, [("C", CHUNK)])


def _split(R: int, T: int, H: int) -> int:
    """Tokens per split: about eight blocks of splits per multiprocessor (132 on an H200).
    A warp reads its tokens one after another, so the loads in flight are the warps': with
    two blocks per multiprocessor the approximate splits over 1M tokens' resident set took
    0.32 ms per layer, ~20x the time its bytes take at the device's bandwidth."""
    per_head = max(1, 1056 // H)
    return max(64, -(-((R + T) // per_head) // 64) * 64)


def attend(q, rk, rv, rtok, gk, gv, ok, sinks, out_dtype, s_r=None):
    """Softmax attention of q (Hq, D) float32 (scaled) over the resident set (rk, rv
    (H, R, D), slot empty where rtok (H, R) < 0) and the gathered rows (gk, gv (H, T, D),
    attended where ok (H, T)), with an optional sink logit per query head. Returns
    (o (Hq, D) in out_dtype, stats (Hq, 2) float32: [gathered tokens attended, resident share
    of the mass]). ``s_r`` (Hq, R) float32: the resident slots' scores q . k as
    :func:`tiered.step.device_resident.resident_scores` gives them; the kernel then reads those
    instead of rk (used where RESIDENT_SCORES_GIVEN is on)."""
    H, R, _ = rk.shape
    if s_r is None:
        return _split_attend("splits", [q, rk, rv, rtok, gk, gv, ok], q.shape[0], H,
                             q.shape[1], R, gk.shape[1], sinks, out_dtype)
    return _split_attend("splits_sres", [q, s_r, rv, rtok, gk, gv, ok], q.shape[0], H,
                         q.shape[1], R, gk.shape[1], sinks, out_dtype)


def _split_attend(splits: str, inputs: list, Hq: int, H: int, D: int, R: int, T: int, sinks,
                  out_dtype, extra: list = ()):
    """The splits kernel ``splits`` over R resident slots and T gathered rows (``inputs``, then
    the split plan), then the merge: (o (Hq, D) in out_dtype, stats (Hq, 2))."""
    rep = Hq // H
    split = _split(R, T, H)
    nsr, nsg = -(-R // split), max(1, -(-T // split))
    ns = nsr + nsg
    # The resident slots grow with the context (each refresh may change R): R and the split
    # plan are runtime values, so a refresh compiles nothing.
    dims = device_ints(R, split, ns, nsr)  # kept: the same in every layer
    tmpl = [("H", H), ("REP", rep), ("D", D), ("NGAT", T)]
    pm, pl, po, cnt = _kernel(splits)(
        inputs=inputs + [dims],
        output_shapes=[(H * ns, rep), (H * ns, rep), (H * ns, rep, D), (H * ns, rep)],
        output_dtypes=[mx.float32, mx.float32, mx.float32, mx.int32],
        grid=(H * ns * 128, 1, 1), threadgroup=(128, 1, 1), template=tmpl + list(extra))
    sink = kept((Hq,), 0.0) if sinks is None else mx.array(sinks).astype(mx.float32).reshape(Hq)
    groups = max(1, min(MERGE_GROUPS, 1024 // D))
    out, stats = _kernel("merge")(
        inputs=[pm, pl, po, cnt, sink, dims], output_shapes=[(Hq, D), (Hq, 2)],
        output_dtypes=[out_dtype, mx.float32], grid=(Hq * D, groups, 1),
        threadgroup=(D, groups, 1),
        template=tmpl + [("HAS_SINK", sinks is not None), ("OutT", out_dtype), ("G", groups)])
    return out, stats
