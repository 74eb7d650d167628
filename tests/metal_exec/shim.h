// An executing shim of the Metal standard library, for the Metal names tiered's kernels use,
// so that a kernel wrapped as mx.fast.metal_kernel wraps it compiles as C++ and runs on the
// executor (runtime.cpp). Like MLX's prefix it ends with `using namespace metal`; it defines
// only Metal names (no expf, no CUDA names) beside the tqx namespace.
//
// Address spaces vanish: one process holds every buffer. Threadgroup-memory declarations are
// rewritten before compilation (build.py) into one shared array per threadgroup; `threadgroup`
// is left undefined, so a text that was not rewritten does not compile. Simdgroup
// operations and barriers suspend the calling thread (runtime.h). Atomics are relaxed and
// 32-bit only, as on Metal; 64-bit atomic types fail to compile.
#pragma once
#include <cstdint>

#include "runtime.h"

#define device
#define constant
#define thread
#define INFINITY (__builtin_inff())
#define NAN (__builtin_nanf(""))
#define FLT_MAX (__FLT_MAX__)

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef uint64_t ulong;

struct uint3 {
  uint x, y, z;
};
#ifndef TQX_UINT4_ALIGN
#define TQX_UINT4_ALIGN 16  // Metal's; the CUDA front end's host pages need less (cuda_shim.h)
#endif
struct alignas(TQX_UINT4_ALIGN) uint4 {
  uint x, y, z, w;
};

namespace tqx {

template <typename T, typename U>
inline T bit_cast(U u) {
  static_assert(sizeof(T) == sizeof(U), "as_type between types of different sizes");
  T t;
  __builtin_memcpy(&t, &u, sizeof(T));
  return t;
}

// IEEE binary16 from float, rounding to nearest even (Metal's conversion); NaN stays NaN.
inline uint16_t half_bits(float f) {
  const uint32_t x = bit_cast<uint32_t>(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return uint16_t(sign | 0x7E00u);
  if (ax >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // from 65520 up: infinity
  if (ax < 0x38800000u) {  // below 2^-14: a subnormal half, in units of 2^-24 (exact scaling)
    return uint16_t(sign | uint16_t(__builtin_rintf(bit_cast<float>(ax) * 16777216.0f)));
  }
  uint32_t h = ((ax >> 23) - 112u) << 10 | (ax & 0x7FFFFFu) >> 13;
  const uint32_t rest = ax & 0x1FFFu;
  h += (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ? 1u : 0u;  // may carry to inf
  return uint16_t(sign | h);
}

inline float half_value(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0) return bit_cast<float>(sign | bit_cast<uint32_t>(float(m) * 5.9604644775390625e-8f));
  if (e == 31) return bit_cast<float>(sign | 0x7F800000u | m << 13);
  return bit_cast<float>(sign | (e + 112u) << 23 | m << 13);
}

}  // namespace tqx

struct half {
  uint16_t bits;
  half() = default;
  half(float f) : bits(tqx::half_bits(f)) {}
  operator float() const { return tqx::half_value(bits); }
};
typedef half float16_t;
struct alignas(8) half4 {
  half x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
  float4() = default;
  float4(float a, float b, float c, float d) : x(a), y(b), z(c), w(d) {}
  explicit float4(half4 v) : x(v.x), y(v.y), z(v.z), w(v.w) {}
};
// Read as float (the upper half of a float's bits); kernels here never write bfloat16.
struct bfloat16_t {
  uint16_t bits;
  operator float() const { return tqx::bit_cast<float>(uint32_t(bits) << 16); }
};

inline uint3 tqx_uint3(tqx::Dim3 d) { return uint3{d.x, d.y, d.z}; }

namespace metal {

enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };

inline void threadgroup_barrier(mem_flags) { tqx::threadgroup_wait(); }

inline float exp(float x) { return __builtin_expf(x); }
inline float log(float x) { return __builtin_logf(x); }

template <typename T, typename U>
inline T as_type(U x) {
  return tqx::bit_cast<T>(x);
}

inline uint popcount(uint x) { return uint(__builtin_popcount(x)); }

// Simdgroup operations: each lane's result computed from every active lane's operand.
template <typename T>
struct simd_ops {
  static T get(const tqx::SimdSlot& s) {
    T v;
    __builtin_memcpy(&v, s.value, sizeof(T));
    return v;
  }
  static void put(tqx::SimdSlot& s, T v) { __builtin_memcpy(s.value, &v, sizeof(T)); }
  template <int KIND>  // 0 sum, 1 max, 2 min, 3 inclusive prefix sum, 4 exclusive prefix sum
  static void reduce(const tqx::SimdSlot* in, tqx::SimdSlot* out, int lanes, unsigned active) {
    T acc = T(0);
    bool any = false;
    for (int l = 0; l < lanes; ++l) {
      if (!(active >> l & 1u)) continue;
      const T v = get(in[l]);
      if (KIND == 4) put(out[l], acc);
      if (KIND == 1) acc = any ? (v > acc ? v : acc) : v;
      if (KIND == 2) acc = any ? (v < acc ? v : acc) : v;
      if (KIND == 0 || KIND == 3 || KIND == 4) acc += v;
      if (KIND == 3) put(out[l], acc);
      any = true;
    }
    for (int l = 0; KIND <= 2 && l < lanes; ++l) put(out[l], acc);
  }
  // 0: from lane arg; 1: from lane ^ arg; 2: from lane + arg (the top lanes keep their own);
  // 3: from lane - arg (the bottom lanes keep their own). A lane that has returned gives
  // the poison bits (a NaN as float): reading it is undefined on Metal.
  template <int KIND>
  static void shuffle(const tqx::SimdSlot* in, tqx::SimdSlot* out, int lanes, unsigned active) {
    for (int l = 0; l < lanes; ++l) {
      if (!(active >> l & 1u)) continue;
      const int a = in[l].arg;
      int src = KIND == 0 ? a : KIND == 1 ? (l ^ a) : KIND == 2 ? l + a : l - a;
      if ((KIND == 2 && src >= lanes) || (KIND == 3 && src < 0)) src = l;
      if (src < 0 || src >= lanes || !(active >> src & 1u)) {
        for (unsigned i = 0; i < sizeof(T); ++i) out[l].value[i] = i % 4 == 3 ? 0x7F : 0xA5;
      } else {
        put(out[l], get(in[src]));
      }
    }
  }
  static T run(T x, int arg, tqx::SimdResolve fn) {
    static_assert(sizeof(T) <= sizeof(tqx::SimdSlot::value), "operand too large");
    return get(tqx::simd_exchange(&x, sizeof(T), arg, fn));
  }
};

template <typename T>
T simd_sum(T x) { return simd_ops<T>::run(x, 0, &simd_ops<T>::template reduce<0>); }
template <typename T>
T simd_max(T x) { return simd_ops<T>::run(x, 0, &simd_ops<T>::template reduce<1>); }
template <typename T>
T simd_min(T x) { return simd_ops<T>::run(x, 0, &simd_ops<T>::template reduce<2>); }
template <typename T>
T simd_prefix_inclusive_sum(T x) { return simd_ops<T>::run(x, 0, &simd_ops<T>::template reduce<3>); }
template <typename T>
T simd_prefix_exclusive_sum(T x) { return simd_ops<T>::run(x, 0, &simd_ops<T>::template reduce<4>); }
template <typename T>
T simd_shuffle(T x, ushort lane) { return simd_ops<T>::run(x, lane, &simd_ops<T>::template shuffle<0>); }
template <typename T>
T simd_broadcast(T x, ushort lane) { return simd_shuffle(x, lane); }
template <typename T>
T simd_shuffle_xor(T x, ushort mask) { return simd_ops<T>::run(x, mask, &simd_ops<T>::template shuffle<1>); }
template <typename T>
T simd_shuffle_down(T x, ushort delta) { return simd_ops<T>::run(x, delta, &simd_ops<T>::template shuffle<2>); }
template <typename T>
T simd_shuffle_up(T x, ushort delta) { return simd_ops<T>::run(x, delta, &simd_ops<T>::template shuffle<3>); }

inline void simdgroup_noop(const tqx::SimdSlot*, tqx::SimdSlot*, int, unsigned) {}
inline void simdgroup_barrier(mem_flags) { tqx::simd_exchange(nullptr, 0, 0, &simdgroup_noop); }

// Atomics: relaxed, on 32-bit types only (Metal has no 64-bit atomic add).
enum memory_order { memory_order_relaxed };
template <typename T>
struct atomic {
  static_assert(sizeof(T) == 4, "Metal atomics hold 32-bit int, uint or float");
  T value;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
template <typename T>
struct same {
  typedef T type;
};
template <typename T>
struct addable {  // the types atomic_fetch_add_explicit takes
  static const bool value = false;
};
template <>
struct addable<int> {
  static const bool value = true;
};
template <>
struct addable<uint> {
  static const bool value = true;
};
template <typename T>
T atomic_load_explicit(const atomic<T>* p, memory_order) {
  T v;
  __atomic_load(&p->value, &v, __ATOMIC_RELAXED);
  return v;
}
template <typename T>
void atomic_store_explicit(atomic<T>* p, typename same<T>::type v, memory_order) {
  __atomic_store(&p->value, &v, __ATOMIC_RELAXED);
}
template <typename T>
T atomic_fetch_add_explicit(atomic<T>* p, typename same<T>::type v, memory_order) {
  static_assert(addable<T>::value, "atomic_fetch_add_explicit: int or uint only");
  return __atomic_fetch_add(&p->value, v, __ATOMIC_RELAXED);
}

}  // namespace metal
using namespace metal;
