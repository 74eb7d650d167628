"""Key codes in one CUDA launch: a decode token's or a prompt chunk's (issue 24).

The nearest centroid of each of the key's g groups, by the arithmetic of
:func:`tiered.codecs.pq.encode_mx` (distance = |c|^2 - 2 x.c in float32, the lowest index on
ties): there it took eight MLX primitives per layer and token (a reshape, two casts, two
transposes, a matmul, the fused subtract, the argmin), each dispatched by the host, which
bounds an accelerator step (tiered.step.device_append). One warp per (kv head, token, group) scans
the codebook's c centroids.

The centroids' squared norms come from the caller (kept per codebook), computed by MLX as the
reference computes them. The dot products are summed in order here and by a matmul there, so a
centroid within a rounding of the nearest can win on one path and not the other; the test
bounds the distance of the code chosen here by the reference's (tests/test_device_decode.py).
"""

from __future__ import annotations

import mlx.core as mx

from ..metal.compact import compact
from ..metal.ptx_cache import cuda_kernel

MAX_CENTROIDS = 4096  # a warp scans them all; larger codebooks take the MLX ops

# The warp's scan for the nearest centroid of x[DS] (kv head h, codebook group gi): ``arg``,
# the lowest index on ties. Shared with tiered.step.native_append's in-place append.
NEAREST = r"""
    const uint64_t row = ((uint64_t)h * GC + gi) * C;
    float best = INFINITY;
    int arg = 0;
    for (int k = lane; k < C; k += 32) {
        const float* cb = codebook + (row + k) * DS;
        float dot = 0.f;
        for (int e = 0; e < DS; ++e) dot += x[e] * cb[e];
        const float dist = norms[row + k] - 2.f * dot;
        if (dist < best) { best = dist; arg = k; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oa = __shfl_xor_sync(0xffffffffu, arg, o);
        if (ob < best || (ob == best && oa < arg)) { best = ob; arg = oa; }
    }
"""

_SOURCE = r"""
    // One warp per (kv head h, token t, group i): code = argmin_k norms[h, gi, k] -
    // 2 x_i . cb[h, gi, k] (gi = i, or 0 for a shared codebook), x_i = the DS values of group
    // i of token t's key, keys (H, L, G * DS).
    const uint64_t gid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t warp = gid / 32;
    const uint32_t lane = gid % 32;
    const uint32_t H = keys_shape[0], L = keys_shape[1];
    if (warp >= (uint64_t)H * L * G) return;
    const uint32_t i = warp % G, gi = GC == 1 ? 0 : i;
    const uint64_t ht = warp / G;  // h * L + t
    const uint32_t h = ht / L;
    float x[DS];
    for (int e = 0; e < DS; ++e) x[e] = static_cast<float>(keys[ht * G * DS + i * DS + e]);
""" + NEAREST + r"""    if (lane == 0) codes[warp] = static_cast<OutT>(arg);
"""

_kernel = None


def applicable(codebook: mx.array) -> bool:
    """Whether this kernel encodes against ``codebook`` (H, Gc, c, ds) on this backend."""
    from ..runtime import uva

    return uva.available() and codebook.shape[2] <= MAX_CENTROIDS


def norms(codebook: mx.array) -> mx.array:
    """The centroids' squared norms (H, Gc, c) float32, as the reference computes them."""
    cb = codebook.astype(mx.float32)
    return (cb * cb).sum(axis=-1)


def kernel():
    """The encoder (one per process; the kernel executor's tests reset ``_kernel``)."""
    global _kernel
    if _kernel is None:
        _kernel = cuda_kernel(name="tiered_encode", input_names=["keys", "codebook", "norms"],
                              output_names=["codes"], source=compact(_SOURCE))
    return _kernel


def encode(keys: mx.array, codebook: mx.array, sq_norms: mx.array, out_dtype) -> mx.array:
    """Codes (H, L, g) in ``out_dtype`` of keys (H, L, d) (any float dtype, read as float32)
    against ``codebook`` (H, Gc, c, ds) float32 with ``sq_norms`` from :func:`norms`: a decode
    token's, or a prompt chunk's (there the reference's MLX ops took ~20 ms of an H200's time
    per 2048-token chunk of a Llama-3-8B, most in an argmin over a (H, g, L, c) float32
    distance tensor; bench/probes/prefill_profile.py)."""
    H, Gc, c, ds = codebook.shape
    L = keys.shape[1]
    g = keys.shape[-1] // ds
    (codes,) = kernel()(
        inputs=[keys, codebook, sq_norms], output_shapes=[(H, L, g)], output_dtypes=[out_dtype],
        grid=(-(-H * L * g * 32 // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
        template=[("G", g), ("C", c), ("DS", ds), ("GC", Gc),
                  ("OutT", out_dtype)])
    return codes
