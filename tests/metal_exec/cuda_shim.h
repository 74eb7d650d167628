// The CUDA names tiered's raw CUDA kernels use (mx.fast.cuda_kernel bodies), on the executor
// of the Metal kernels (runtime.h): a block is a threadgroup, a warp a 32-lane simdgroup. The
// kernel text is MLX's generated source (tiered.metal.ptx_cache.kernel_source) with its
// includes replaced by this header; `__shared__` declarations are rewritten before
// compilation into one array per block (cuda.py), as the Metal front end does for
// `threadgroup`. Warp shuffles demand converged warps, as the Metal executor's simdgroup
// operations do: a warp whose lanes wait at different shuffles, or at a barrier, is an error.
#pragma once
#include <math.h>

#include <cstdint>

#undef INFINITY  // shim.h defines them as Metal's
#undef NAN
// uint4 loads at any 4-byte boundary: the device path's host pages, read by address, are MLX
// CPU arrays here (8-byte aligned), where on a GPU they are 256-byte aligned managed memory.
// A misaligned 16-byte load is therefore not caught here (a GPU faults on it).
#define TQX_UINT4_ALIGN 4
#include "shim.h"
#undef device
#undef constant
#undef thread

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __grid_constant__

namespace tqx_cuda {

struct Dim3 {
  unsigned x, y, z;
};
inline Dim3 dim(tqx::Dim3 d) { return Dim3{d.x, d.y, d.z}; }

inline unsigned lane() { return tqx::self().index % 32; }

template <typename T>
T shuffle_from(T v, int src) {  // every lane reads lane src's v (src may differ by lane)
  return metal::simd_ops<T>::run(v, src, &metal::simd_ops<T>::template shuffle<0>);
}

}  // namespace tqx_cuda

#define threadIdx (::tqx_cuda::dim(::tqx::self().in_group))
#define blockIdx (::tqx_cuda::dim(::tqx::self().group))
#define blockDim (::tqx_cuda::dim(::tqx::self().dispatch_size))
#define gridDim (::tqx_cuda::dim(::tqx::self().groups))

inline void __syncthreads() { tqx::threadgroup_wait(); }
// __syncthreads_or: a barrier whose result is whether any thread's predicate holds, through a
// word of the block's storage at the last declaration site (the kernels' own come first).
inline int __syncthreads_or(int pred) {
  int* any = static_cast<int*>(tqx::threadgroup_alloc(63, 16));
  tqx::threadgroup_wait();
  if (tqx::self().index == 0) *any = 0;
  tqx::threadgroup_wait();
  if (pred) __atomic_store_n(any, 1, __ATOMIC_RELAXED);
  tqx::threadgroup_wait();
  const int got = *any;
  tqx::threadgroup_wait();
  return got;
}

// Shuffles within segments of `width` lanes (CUDA's semantics); the mask must be every lane.
inline void tqx_full_mask(unsigned mask) {
  if (mask != 0xffffffffu) tqx::fail("a shuffle with a partial lane mask (not emulated)");
}
template <typename T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  tqx_full_mask(mask);
  const int l = int(tqx_cuda::lane());
  return tqx_cuda::shuffle_from(v, l / width * width + src % width);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  tqx_full_mask(mask);
  const int l = int(tqx_cuda::lane()), s = l ^ lane_mask;
  return tqx_cuda::shuffle_from(v, s / width == l / width ? s : l);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  tqx_full_mask(mask);
  const int l = int(tqx_cuda::lane()), s = l + int(delta);
  return tqx_cuda::shuffle_from(v, s / width == l / width ? s : l);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  tqx_full_mask(mask);
  const int l = int(tqx_cuda::lane()), s = l - int(delta);
  return tqx_cuda::shuffle_from(v, s >= 0 && s / width == l / width ? s : l);
}

struct alignas(8) uint2 {
  uint x, y;
};
struct alignas(8) float2 {
  float x, y;
};
inline uint4 make_uint4(uint x, uint y, uint z, uint w) { return uint4{x, y, z, w}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4(x, y, z, w); }
inline uint2 make_uint2(uint x, uint y) { return uint2{x, y}; }

// __half / __nv_bfloat16: storage and conversions through float, as the kernels use them.
struct __half {
  uint16_t bits;
  __half() = default;
  __half(float f) : bits(tqx::half_bits(f)) {}
  operator float() const { return tqx::half_value(bits); }
};
struct __nv_bfloat16 {
  uint16_t bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) {  // round to nearest even; NaN stays NaN
    const uint32_t x = tqx::bit_cast<uint32_t>(f);
    bits = (x & 0x7FFFFFFFu) > 0x7F800000u
               ? uint16_t((x >> 16) | 0x40u)
               : uint16_t((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
  }
  operator float() const { return tqx::bit_cast<float>(uint32_t(bits) << 16); }
};
struct alignas(4) __half2 {
  __half x, y;
};
inline float2 __half22float2(__half2 h) { return float2{float(h.x), float(h.y)}; }
inline float __half2float(__half h) { return float(h); }
inline __half __float2half(float f) { return __half(f); }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline float __fdiv_rn(float a, float b) { return a / b; }  // IEEE division, as on the host
inline float __uint_as_float(uint32_t u) { return tqx::bit_cast<float>(u); }
inline uint32_t __float_as_uint(float f) { return tqx::bit_cast<uint32_t>(f); }
inline float __int_as_float(int32_t i) { return tqx::bit_cast<float>(i); }
inline int __popc(uint32_t x) { return __builtin_popcount(x); }
// CUDA's integer and float min / max overloads (the usual arithmetic conversions)
template <typename A, typename B>
inline auto min(A a, B b) -> decltype(a + b) { return b < a ? b : a; }
template <typename A, typename B>
inline auto max(A a, B b) -> decltype(a + b) { return a < b ? b : a; }

// Atomics on one process's memory (relaxed, as the kernels need them).
template <typename T>
T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline float atomicAdd(float* p, float v) {
  float old = *p, want = old + v;
  while (!__atomic_compare_exchange(p, &old, &want, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    want = old + v;
  }
  return old;
}
template <typename T>
T atomicMin(T* p, T v) {
  T old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (v < old && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED,
                                                 __ATOMIC_RELAXED)) {
  }
  return old;
}
template <typename T>
T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
// PTX's %globaltimer (nanoseconds, one clock for every SM) as the host's monotonic clock.
#include <chrono>
inline unsigned long long tqx_cuda_globaltimer() {
  return (unsigned long long)std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}
