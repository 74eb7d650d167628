"""Kernel text and ordering shared by the kernels that read host pages by address
(tiered.step.device_decode, device_attend, device_q8)."""

from __future__ import annotations

import mlx.core as mx

from ..metal import device_ints
from ..metal.compact import compact
from ..metal.ptx_cache import cuda_kernel


class KernelTable:
    """A module's CUDA kernels, each built on its first use: ``specs`` maps a name to (kernel
    name, input names, output names, source); ``header`` goes before each; ``built`` holds
    those made so far (the kernel executor's tests empty it: tests/metal_exec/cuda.py)."""

    def __init__(self, specs: dict, header: str = ""):
        self.specs, self.header, self.built = specs, header, {}

    def __call__(self, name: str):
        kernel = self.built.get(name)
        if kernel is None:
            kname, inputs, outputs, source = self.specs[name]
            extra = {"header": self.header} if self.header else {}
            kernel = self.built[name] = cuda_kernel(
                name=kname, input_names=inputs, output_names=outputs, source=compact(source),
                **extra)
        return kernel

# The body the gather kernels share (device_decode's, device_attend's keys + values; the slot
# part alone: device_q8's int8 gather): given tid,
# ROWB (bytes per row), WPR / WPC (16-byte words per row / chunk), ppb (pages per block),
# addrs_t (the tensor's block addresses) and write_ok, it sets val to the word, zero where the
# token is not attended, and writes ok.
CHUNK_SLOT = r"""
    if (tid >= (uint64_t)H * CAPC * WPC) return;
    const uint32_t h = tid / (CAPC * WPC);
    const uint32_t rem = tid % (CAPC * WPC);
    const uint32_t slot = rem / WPC, w = rem % WPC;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    const bool selected = (int)slot < count[h];
    const int64_t t = selected ? (int64_t)idx[h * CAPC + slot] * C + w / WPR : -1;
    const bool attended =
        selected && t < n_host[0] && !flags[(uint64_t)h * flags_shape[1] + t];
    if (write_ok && w % WPR == 0) ok[(uint64_t)h * CAPC * C + slot * C + w / WPR] = attended;
"""
CHUNK_WORD = CHUNK_SLOT + r"""
    if (attended) {  // others stay zero (rows past the host pages were never written)
        const int64_t pp = pages[t / P];
        const uint64_t off = (((uint64_t)(pp % ppb) * H + h) * P + t % P) * ROWB
                             + (uint64_t)(w % WPR) * 16;
        val = *reinterpret_cast<const uint4*>(addrs_t[pp / ppb] + off);
    }
"""


def page_fence(host) -> mx.array:
    """The input that orders a kernel on ``host``'s pages after the ones queued before it
    (cpu.pages.HostStore.device_op)."""
    return device_ints(0) if host.fence is None else host.fence
