"""int8 host pages on the device path (tiered.step.device_decode's kernels for float pages): the
write-behind quantizes each token row on the device exactly as ``HostTensor.write`` does (scale =
max|x| / 127, q = rint(x / scale) within +-127, IEEE division), and the chunk gather dequantizes
into float16. Op by op only: the compiled chain refuses int8 pages
(tiered.step.device_compiled.why_not)."""

from __future__ import annotations

import mlx.core as mx

from ..metal import device_ints
from .chunk_word import CHUNK_SLOT, KernelTable, page_fence

GATHER = r"""
    // int8 host rows dequantized (row * its scale) into float16: one thread per 16-byte word
    // of out (H, CAPC, C, D), i.e. 8 bytes of a row; otherwise as tiered_host_gather.
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint32_t CAPC = idx_shape[1];
    constexpr uint32_t WPR = D / 8, WPC = WPR * C, ppb = PPB;
    constexpr bool write_ok = true;
""" + CHUNK_SLOT + r"""
    if (attended) {
        const int64_t pp = pages[t / P];
        const uint64_t row = ((uint64_t)(pp % ppb) * H + h) * P + t % P;
        const uint2 raw = *reinterpret_cast<const uint2*>(addrs[pp / ppb] + row * D
                                                           + (uint64_t)(w % WPR) * 8);
        const float s = reinterpret_cast<const float*>(scales[pp / ppb])[row];
        const signed char* q = reinterpret_cast<const signed char*>(&raw);
        uint32_t wv[4];
        for (int e = 0; e < 4; ++e)
            wv[e] = (uint32_t)__half_as_ushort(__float2half((float)q[2 * e] * s))
                    | ((uint32_t)__half_as_ushort(__float2half((float)q[2 * e + 1] * s)) << 16);
        val = make_uint4(wv[0], wv[1], wv[2], wv[3]);
    }
    reinterpret_cast<uint4*>(out)[tid] = val;
"""

WRITE = r"""
    // int8 pages: one thread per row of src (H, L, D) float32, token i of head h quantized as
    // the host store does (scale = max|x| / 127, 1 for a zero row; q = rint(x / scale) within
    // +-127) into slot slot[i] of physical page page[i], its scale beside it.
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint32_t L = src_shape[1];
    if (tid >= (uint64_t)H * L) return;
    const uint32_t h = tid / L, i = tid % L;
    const float* x = src + ((uint64_t)h * L + i) * D;
    float amax = 0.0f;
    for (uint32_t e = 0; e < D; ++e) amax = fmaxf(amax, fabsf(x[e]));
    const float s = amax > 0.0f ? __fdiv_rn(amax, 127.0f) : 1.0f;
    const int64_t pp = page[i];
    const uint64_t row = ((uint64_t)(pp % PPB) * H + h) * P + slot[i];
    signed char* dst = reinterpret_cast<signed char*>(addrs[pp / PPB] + row * D);
    for (uint32_t e = 0; e < D; ++e)
        dst[e] = (signed char)fminf(fmaxf(rintf(__fdiv_rn(x[e], s)), -127.0f), 127.0f);
    reinterpret_cast<float*>(scales[pp / PPB])[row] = s;
    if (tid == 0) done[0] = 1;
"""

_kernel = KernelTable({
    "gather": ("tiered_host_gather_q8",
               ["idx", "count", "pages", "addrs", "scales", "flags", "n_host", "after"],
               ["out", "ok"], GATHER),
    "write": ("tiered_host_write_q8", ["src", "page", "slot", "addrs", "scales", "after"],
              ["done"], WRITE),
})


def write(tables, host, tensor, x: mx.array, page, slot) -> mx.array:
    """Queue the write of tokens x (H, L, d) into int8 pages, quantized there (a thread per
    row: its scale, then its bytes); returns the launch's output (recorded as the fence)."""
    H, L, d = x.shape
    (done,) = _kernel("write")(
        inputs=[x.astype(mx.float32), page, slot, tables.addrs(tensor),
                tables.addrs(tensor, scales=True), page_fence(host)],
        output_shapes=[(1,)], output_dtypes=[mx.int32],
        grid=(-(-H * L // 64) * 64, 1, 1), threadgroup=(64, 1, 1),
        template=[("H", H), ("P", host.page_size), ("PPB", tensor.pages_per_block), ("D", d)])
    host.device_op(done)
    return done


def gather(tables, host, tensor, idx, count, flags, chunk, where):
    """gather_chunks of an int8 tensor: the rows dequantized into float16 by the kernel (the
    op-by-op step only: a compiled step's ``where`` holds no scale blocks)."""
    if where is not None:
        raise ValueError("int8 host pages are gathered op by op (no compiled step)")
    H, capc = idx.shape
    d = tensor.head_dim
    out, ok = _kernel("gather")(
        inputs=[idx, count, tables.pages(host), tables.addrs(tensor),
                tables.addrs(tensor, scales=True), flags, device_ints(host.length),
                page_fence(host)],
        output_shapes=[(H, capc * chunk, d), (H, capc * chunk)],
        output_dtypes=[mx.float16, mx.bool_],
        grid=(-(-H * capc * chunk * d // 8 // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
        template=[("H", H), ("C", chunk), ("P", host.page_size),
                  ("PPB", tensor.pages_per_block), ("D", d)])
    host.device_op(ok)
    return out, ok
