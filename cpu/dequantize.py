"""Affine-quantized matrices (MLX's layout: ``bits``-bit codes packed low bits first into uint32
words, a float16 scale and bias per group) expanded to float32 on the CPU, as MLX's own
``mx.dequantize`` on float16 scales gives them, bit for bit, in a parallel pass.

MLX's CPU dequantization computes in float16 arithmetic: each product ``scale * code`` is rounded
to float16, then ``+ bias`` is rounded again. Numba has no float16 type on the CPU, so the two
roundings are done on float32 values by :func:`round_to_half` (every float16 is a float32, and a
float16 product or sum of float16 values computed in float32 and rounded once to float16 is the
float16 result). The embedded model's 134M weights took 2.0-2.3 s through ``mx.dequantize`` on
this 2-core host (``tiered.model.load_default``: most of a model load, at every CLI start).
"""

from __future__ import annotations

import numba
import numpy as np

from ._numba import float32_bits_as_int32, int32_bits_as_float32, kernel


@kernel(inline=True)
def round_to_half(x):
    """float32 ``x`` rounded to the nearest float16 (ties to even), as a float32. Magnitudes
    past float16's largest finite (65504) become infinities; NaN stays NaN."""
    b = float32_bits_as_int32(x)
    sign = b & np.int32(-0x80000000)
    mag = b & np.int32(0x7FFFFFFF)
    if mag >= np.int32(0x7F800000):  # inf or NaN
        return x
    if mag >= np.int32(0x477FF000):  # rounds past 65504
        return int32_bits_as_float32(sign | np.int32(0x7F800000))
    if mag < np.int32(0x38800000):  # below float16's smallest normal: steps of 2^-24
        y = abs(x) * np.float32(16777216.0)
        r = np.float32(np.floor(y))
        d = y - r
        if d > np.float32(0.5) or (d == np.float32(0.5) and np.int64(r) % 2 == 1):
            r += np.float32(1.0)
        r = r * np.float32(1.0 / 16777216.0)
        return -r if sign else r
    lsb = (mag >> 13) & 1
    mag = (mag + np.int32(0xFFF) + lsb) & np.int32(~0x1FFF)
    return int32_bits_as_float32(sign | mag)


@kernel(parallel=True)
def _dequantize(words, scales, biases, group, bits, out):
    rows = words.shape[0]
    groups = scales.shape[1]
    per_word = 32 // bits
    words_per_group = group // per_word
    mask = (1 << bits) - 1
    for r in numba.prange(rows):
        for g in range(groups):
            s = scales[r, g]
            b = biases[r, g]
            for wi in range(g * words_per_group, (g + 1) * words_per_group):
                w = words[r, wi]
                for k in range(per_word):
                    q = np.float32((w >> (k * bits)) & mask)
                    out[r, wi * per_word + k] = round_to_half(round_to_half(s * q) + b)


def dequantize_affine(words: np.ndarray, scales: np.ndarray, biases: np.ndarray,
                      group: int, bits: int) -> np.ndarray:
    """float32 (rows, groups * group) of uint32 ``words`` (rows, packed) with float16 ``scales``
    and ``biases`` (rows, groups): what ``mx.dequantize`` gives, bit for bit (module docstring).
    Higher dimensions are flattened into rows and come back."""
    if bits not in (2, 4, 8) or scales.dtype != np.float16 or biases.dtype != np.float16:
        raise ValueError(f"dequantize_affine takes 2-, 4- or 8-bit codes with float16 scales and "
                         f"biases, not {bits}-bit with {scales.dtype} / {biases.dtype}")
    lead = scales.shape[:-1]
    groups = scales.shape[-1]
    w = np.ascontiguousarray(words, np.uint32).reshape(-1, words.shape[-1])
    s = np.ascontiguousarray(scales, np.float32).reshape(-1, groups)
    b = np.ascontiguousarray(biases, np.float32).reshape(-1, groups)
    if (w.shape[0] != s.shape[0] or w.shape[1] * 32 != groups * group * bits
            or group % (32 // bits)):
        raise ValueError(f"dequantize_affine: words {words.shape} do not hold {groups} groups "
                         f"of {group} {bits}-bit codes per row")
    out = np.empty((w.shape[0], groups * group), np.float32)
    _dequantize(w, s, b, group, bits, out)
    return out.reshape(*lead, groups * group)
