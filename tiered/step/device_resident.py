"""The device step's start (CUDA): the query scaled and the resident set's exact scores.

:func:`resident_scores` gives the scaled query, every resident slot's exact score per query
head and the codebook-score column each replaces, in one launch. The MLX reference is
:func:`tiered.step.attend_reference.resident_scores_ops`.
"""

from __future__ import annotations

import mlx.core as mx

from ..metal import device_floats, device_ints
from .chunk_word import KernelTable

_RESIDENT = r"""
    // One warp per resident slot (h, r): the REP query heads of kv head h, scaled to float32
    // (written by the warps of slot 0), against the slot's key: s (Hq, R) the exact score,
    // -inf for an empty slot (token < 0), and cols (Hq, R) the token it replaces in the
    // codebook scores (nn[0], a spare column, for an empty slot).
    const uint64_t gid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint32_t R = rk_shape[1], lane = gid % 32;
    const uint64_t warp = gid / 32;
    if (warp >= (uint64_t)H * R) return;
    const uint32_t h = warp / R, r = warp % R;
    const float sc = scale[0];
    const int tok = rtok[(uint64_t)h * R + r];
    const auto* kr = rk + ((uint64_t)h * R + r) * D;
    float acc[REP];
    for (int j = 0; j < REP; ++j) acc[j] = 0.f;
    for (int e = lane; e < D; e += 32) {
        const float kv = (float)kr[e];
        for (int j = 0; j < REP; ++j) {
            const float qv = (float)queries[(h * REP + j) * D + e] * sc;
            acc[j] += qv * kv;
            if (r == 0) qout[(h * REP + j) * D + e] = qv;
        }
    }
    for (int j = 0; j < REP; ++j)
        for (int o = 16; o > 0; o >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
    if (lane < REP) {
        float v = acc[0];
        for (int j = 1; j < REP; ++j) if (j == (int)lane) v = acc[j];
        const uint64_t at = (uint64_t)(h * REP + lane) * R + r;
        s[at] = tok >= 0 ? v : -INFINITY;
        cols[at] = tok >= 0 ? tok : nn[0];
    }
"""

_RESIDENT_TILED = r"""
    // Block (tile, h): kv head h, resident slots [tile * TILE, + TILE). The REP query heads,
    // scaled to float32, go to shared memory (and to qout from the tile-0 blocks); a slot's
    // key is read by LPS lanes, 16 bytes each; each lane group reads ITER slots before it
    // computes, so those loads are in flight together. The one-warp-per-slot kernel
    // (_RESIDENT) waited on one 64-byte read at a time: 45-63 us per layer on an H200 at 128k
    // for 34 MB of keys. Scores meet in shared memory and each query head's row of the tile
    // is written in order.
    constexpr int VEC = 16 / sizeof(rk[0]), LPS = D / VEC, SPW = 32 / LPS, NW = 8;
    constexpr int TILE = NW * SPW * ITER;
    __shared__ float sq[REP * D], ss[REP][TILE];
    __shared__ int stok[TILE];
    const int h = blockIdx.y, r0 = blockIdx.x * TILE, R = rk_shape[1];
    const float sc = scale[0];
    for (int i = threadIdx.x; i < REP * D; i += blockDim.x) {
        const float v = static_cast<float>(queries[(uint64_t)h * REP * D + i]) * sc;
        sq[i] = v;
        if (blockIdx.x == 0) qout[(uint64_t)h * REP * D + i] = v;
    }
    for (int t = threadIdx.x; t < TILE; t += blockDim.x)
        stok[t] = r0 + t < R ? rtok[(uint64_t)h * R + r0 + t] : -1;
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sub = lane / LPS, k = lane % LPS;
    float qv[REP][VEC];
    for (int j = 0; j < REP; ++j)
        for (int e = 0; e < VEC; ++e) qv[j][e] = sq[j * D + k * VEC + e];
    uint4 raw[ITER];
    for (int it = 0; it < ITER; ++it) {
        const int r = r0 + (it * NW + warp) * SPW + sub;
        raw[it] = r < R ? reinterpret_cast<const uint4*>(rk + ((uint64_t)h * R + r) * D)[k]
                        : make_uint4(0u, 0u, 0u, 0u);
    }
    for (int it = 0; it < ITER; ++it) {
        const int t = (it * NW + warp) * SPW + sub;
        const auto* kv = reinterpret_cast<decltype(&rk[0])>(&raw[it]);
        float acc[REP];
        for (int j = 0; j < REP; ++j) {
            acc[j] = 0.f;
            for (int e = 0; e < VEC; ++e) acc[j] += qv[j][e] * static_cast<float>(kv[e]);
        }
        for (int o = LPS / 2; o > 0; o >>= 1)
            for (int j = 0; j < REP; ++j) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
        for (int j = 0; j < REP; ++j) if (j % LPS == k) ss[j][t] = acc[j];
    }
    __syncthreads();
    const int spare = nn[0];
    for (int i = threadIdx.x; i < REP * TILE; i += blockDim.x) {
        const int j = i / TILE, t = i % TILE, r = r0 + t;
        if (r >= R) continue;
        const int tok = stok[t];
        const uint64_t at = (uint64_t)(h * REP + j) * R + r;
        s[at] = tok >= 0 ? ss[j][t] : -INFINITY;
        cols[at] = tok >= 0 ? tok : spare;
    }
"""

# Slots each lane group of the tiled resident kernel reads before it computes (0: the
# one-warp-per-slot kernel, also what shapes the tiled one cannot take get). H200, alone
# (bench/probes/step_kernels.py, CUPTI, Llama-3-8B shape): 8192 slots a head 53-56 us with 0, 26 us
# with 4 (27 with 8); 16384 slots 76-83 us with 0, 34 with 4 (34 with 8). In a 128k decode
# step (bench/probes/device_probe.py --toggle, one process) 58.5 -> 34.3 us a layer (median), the
# GPU busy 19.26 -> 19.16 ms a token (18.57 with 8); token rounds host-bound there. (Earlier
# rounds had found no difference in the token, 2.12 against 1.96 ms of these kernels a token,
# beside other kernels of the step's start.)
RESIDENT_ITER = 4


_kernel = KernelTable({
    name: (f"tiered_{name}", ["queries", "scale", "rk", "rtok", "nn"], ["qout", "s", "cols"],
           _RESIDENT_TILED if name == "resident_tiled" else _RESIDENT)
    for name in ("resident", "resident_tiled")})


def resident_scores(queries, scale: float, rk, rtok, n: int):
    """The step's start in one launch: queries (1, Hq, 1, D) in any float dtype, scaled to
    q (Hq, D) float32; the resident set's exact scores s (Hq, R) float32 (-inf on empty
    slots); cols (Hq, R) int32, the token each score replaces in the codebook scores (n for
    an empty slot: a spare column). The MLX reference:
    :func:`tiered.step.attend_reference.resident_scores_ops`."""
    Hq, D = queries.shape[1], queries.shape[3]
    H, R = rtok.shape
    rep = Hq // H
    inputs = [queries, device_floats(scale), rk, rtok, device_ints(n)]
    shapes, dtypes = [(Hq, D), (Hq, R), (Hq, R)], [mx.float32, mx.float32, mx.int32]
    tmpl = [("H", H), ("REP", rep), ("D", D)]
    lps = tiled_lanes(D, rk.dtype, rep)
    if lps:
        tile = 8 * (32 // lps) * RESIDENT_ITER
        return _kernel("resident_tiled")(
            inputs=inputs, output_shapes=shapes, output_dtypes=dtypes,
            grid=(max(1, -(-R // tile)) * 256, H, 1), threadgroup=(256, 1, 1),
            template=tmpl + [("ITER", RESIDENT_ITER)])
    return _kernel("resident")(
        inputs=inputs, output_shapes=shapes, output_dtypes=dtypes,
        grid=(H * R * 32, 1, 1), threadgroup=(256, 1, 1), template=tmpl)


def tiled_lanes(D: int, dtype, rep: int) -> int:
    """Lanes per slot of the tiled resident kernel for keys of D elements of ``dtype``, or 0
    where it does not apply (RESIDENT_ITER 0; a row not whole 16-byte words; lanes per slot
    not a power of two up to 32; more than 64 query values a lane)."""
    vec = 16 // dtype.size if 16 % dtype.size == 0 else 0
    if not RESIDENT_ITER or not vec or D % vec:
        return 0
    lps = D // vec
    if lps > 32 or lps & (lps - 1) or rep * vec > 64:
        return 0
    return lps
