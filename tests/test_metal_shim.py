"""The Metal form of the kernel sources, compiled on the CPU: each kernel is wrapped exactly as
``mx.fast.metal_kernel`` wraps it (tests/metal_wrap.py) and checked by ``g++ -fsyntax-only``
against a small shim of the Metal standard library. The shim declares only what Metal has (no
``expf``, no CUDA names), so an undeclared identifier or a type error in a body fails; a
deliberately broken body proves it. The plans and the planted bugs are
tests/test_metal_syntax.py's.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest

from metal_wrap import metal_source
from test_metal_syntax import BROKEN, _broken, _check_all, _plans, needs_gxx

# What MLX prepends (metal::utils(): metal_stdlib, bf16, `using namespace metal`), reduced
# to declarations of the Metal names a kernel may use.
METAL_SHIM = r"""
#include <cstdint>
#define device
#define constant
#define threadgroup
#define thread
#define INFINITY (__builtin_inff())
#define NAN (__builtin_nanf(""))
#define FLT_MAX (__FLT_MAX__)
typedef unsigned int uint;
typedef unsigned long ulong;
typedef unsigned short ushort;
struct uint2 { uint x, y; };
struct uint3 { uint x, y, z; };
struct int2 { int x, y; };
struct int3 { int x, y, z; };
struct uint4 { uint x, y, z, w; };
struct float2 { float x, y; };
struct half {
  half() = default;
  half(float);
  operator float() const;
};
struct half4 { half x, y, z, w; };
struct float4 {
  float x, y, z, w;
  float4() = default;
  float4(float x, float y, float z, float w);
  explicit float4(half4 v);
};
struct bfloat16_t {
  bfloat16_t() = default;
  bfloat16_t(float);
  operator float() const;
};
typedef half float16_t;
namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };
void threadgroup_barrier(mem_flags flags);
void simdgroup_barrier(mem_flags flags);
float exp(float x);
float exp2(float x);
float log(float x);
float log2(float x);
float sqrt(float x);
float rsqrt(float x);
float floor(float x);
float ceil(float x);
float fabs(float x);
float fma(float a, float b, float c);
float fmax(float a, float b);
float fmin(float a, float b);
bool isnan(float x);
bool isinf(float x);
bool isfinite(float x);
template <typename T> T abs(T x);
template <typename T, typename U> T as_type(U x);
template <typename T> T popcount(T x);
template <typename T> T min(T a, T b);
template <typename T> T max(T a, T b);
template <typename T> T clamp(T x, T lo, T hi);
template <typename T> T select(T a, T b, bool c);
namespace precise { float exp(float x); float log(float x); }
namespace fast { float exp(float x); float log(float x); }
template <typename T> T simd_sum(T x);
template <typename T> T simd_max(T x);
template <typename T> T simd_min(T x);
template <typename T> T simd_prefix_exclusive_sum(T x);
template <typename T> T simd_prefix_inclusive_sum(T x);
template <typename T> T simd_shuffle(T x, ushort lane);
template <typename T> T simd_shuffle_xor(T x, ushort mask);
template <typename T> T simd_shuffle_down(T x, ushort delta);
template <typename T> T simd_broadcast(T x, ushort lane);
enum memory_order { memory_order_relaxed };
template <typename T> struct atomic { T value; };
typedef atomic<uint> atomic_uint;
typedef atomic<int> atomic_int;
template <typename T> struct same { typedef T type; };
template <typename T> T atomic_fetch_add_explicit(atomic<T>* p, typename same<T>::type v, memory_order o);
template <typename T> T atomic_load_explicit(atomic<T>* p, memory_order o);
template <typename T> void atomic_store_explicit(atomic<T>* p, typename same<T>::type v, memory_order o);
}  // namespace metal
using namespace metal;
"""


def _gxx(text: str, workdir: Path, label: str) -> subprocess.CompletedProcess:
    path = workdir / f"{label}.cpp"
    path.write_text(METAL_SHIM + text)
    flags = ["-std=c++17", "-fsyntax-only", "-Wno-attributes", "-Wno-unknown-pragmas"]
    cmd = ["g++", *flags, str(path)]
    return subprocess.run(cmd, capture_output=True, text=True)


@needs_gxx
def test_metal_sources_compile_against_shim():
    _check_all("metal", metal_source, _gxx)


@needs_gxx
@pytest.mark.parametrize("old,new", BROKEN)
def test_metal_checker_rejects_broken_body(old, new):
    label, spec, plan = _plans("metal")[0]
    header, source = _broken(spec, "metal", old, new)
    with tempfile.TemporaryDirectory() as tmp:
        good = _gxx(metal_source(spec, *spec.sources("metal"), plan), Path(tmp), "good")
        bad = _gxx(metal_source(spec, header, source, plan), Path(tmp), "bad")
    assert good.returncode == 0, good.stderr
    assert bad.returncode != 0, f"shim accepted a body with {new!r}"


def test_metal_signature_follows_mlx():
    """The wrapper reproduces MLX's conventions that the bodies rely on."""
    label, spec, plan = _plans("metal")[0]
    text = metal_source(spec, *spec.sources("metal"), plan)
    assert "const device float* q [[buffer(0)]]" in text
    assert "const constant int32_t* params [[buffer(4)]]" in text  # size < 8: constant space
    assert "uint3 threadgroup_position_in_grid [[threadgroup_position_in_grid]]" in text
    assert "thread_position_in_grid [[" not in text
