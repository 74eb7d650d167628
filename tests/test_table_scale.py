"""The codebook kernel's float16 table scale (metal/scale_common.h), compiled for the host with
g++: its helpers against Python's float decomposition, and the kernel's rule kept in range."""

from __future__ import annotations

import math
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from test_metal_syntax import needs_gxx

# The float16 table's scale (scale_common.h) runs only inside the codebook kernel; compiled
# here for the host, its two helpers are checked against Python's float decomposition.
SCALE_HOST_SHIM = r"""
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#define TQ_DEVICE_FN inline
typedef uint16_t tq_half;
inline float tq_as_float(uint32_t bits) { float f; std::memcpy(&f, &bits, 4); return f; }
inline uint32_t tq_as_uint(float x) { uint32_t b; std::memcpy(&b, &x, 4); return b; }
"""
SCALE_HOST_MAIN = r"""
int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    uint32_t bits = uint32_t(std::strtoul(argv[i], nullptr, 16));
    std::printf("%d\n", tq_pow2_exponent_above(tq_as_float(bits)));
  }
  for (int k = -126; k <= 127; ++k) {
    std::printf("%08x\n", tq_as_uint(tq_pow2(k)));
  }
  for (int i = 1; i < argc; ++i) {
    uint32_t bits = uint32_t(std::strtoul(argv[i], nullptr, 16));
    std::printf("%d\n", tq_pow2_exponent_above_sqrt(tq_as_float(bits)));
  }
  return 0;
}
"""


@needs_gxx
def test_table_scale_helpers_match_python():
    from tiered.metal._build import read_source

    values = np.array([0.0, 1e-45, 1e-40, 2.0**-126, 1e-30, 0.3, 1.0, 1.5, 2.0, 3.0, 65504.0,
                       1e5, 2.0**100, 3e38], np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "scale.cpp"
        src.write_text(SCALE_HOST_SHIM + read_source("scale_common.h") + SCALE_HOST_MAIN)
        exe = Path(tmp) / "scale"
        subprocess.run(["g++", "-std=c++17", "-O1", "-o", str(exe), str(src)], check=True)
        args = [f"{int(b):08x}" for b in values.view(np.uint32)]
        out = subprocess.run([str(exe), *args], capture_output=True, text=True, check=True)
    lines = out.stdout.split()
    exps = [int(x) for x in lines[: len(values)]]
    for v, e in zip(values.astype(np.float64), exps):
        if v < 2.0**-126:  # zero and subnormals
            assert e == -126, (v, e)
        else:
            assert 2.0 ** (e - 1) <= v < 2.0**e, (v, e)  # the smallest e with v < 2^e
    pows = np.array([int(x, 16) for x in lines[len(values):len(values) + 254]],
                    np.uint32).view(np.float32)
    np.testing.assert_array_equal(pows.astype(np.float64), 2.0 ** np.arange(-126, 128))
    roots = [int(x) for x in lines[len(values) + 254:]]
    assert len(roots) == len(values)
    for v, e in zip(values.astype(np.float64), roots):
        if v < 2.0**-126:
            assert e == -63, (v, e)
        else:
            assert 2.0 ** (e - 1) <= math.sqrt(v) < 2.0**e, (v, e)  # the smallest such e
    # The kernel's rule, sh = clamp(14 - e, -100, 100), e from a bound b on a head's entries
    # (tq_pow2_exponent_above_sqrt of b^2): b scaled lands in [2^13, 2^14), inside float16's
    # range, and so does every entry below it, wherever b^2 is a normal float (b from 2^-63
    # to 2^64); below that the scale is 2^77 and b * 2^77 < 2^14.
    for v, e in zip(values.astype(np.float64), roots):
        sh = min(100, max(-100, 14 - e))
        assert math.sqrt(v) * 2.0**sh < 2.0**14
        if v >= 2.0**-126:
            assert 2.0**13 <= math.sqrt(v) * 2.0**sh < 2.0**14 <= 65504.0
