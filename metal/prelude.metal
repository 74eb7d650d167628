// tiered.metal -- Metal prelude for the shared kernel bodies (*.h in this folder).
//
// The text above the "@body-prologue" line is passed to mx.fast.metal_kernel as `header`; the
// text below it is prepended to every kernel body. MLX adds a thread-position attribute to the
// generated signature only when the attribute's name occurs in the body text itself, so the
// thread indices are read in the body prologue rather than through a header macro.
//
// Every body may use: TQ_SIMD, TQ_BARRIER(), TQ_SHARED(type, name, count) (static
// threadgroup array), TQ_SHARED_LUT(type, name, count) (the one large array of a kernel:
// static here, dynamic shared memory on CUDA), TQ_UNROLL, TQ_INF, the helpers tq_exp, tq_log,
// tq_as_float / tq_as_uint (bit casts), tq_popcount, tq_float4, tq_warp_sum, tq_warp_max,
// tq_warp_min, tq_warp_prefix_sum (inclusive), vector loads TQ_LOAD_UINT4 /
// TQ_SHARED_FLOAT4, the 16-bit float tq_half and tq_shared_load4 (4 float or tq_half entries
// of a shared table as a float4), atomics (TQ_SHARED_ATOMIC_*, TQ_ATOMIC_U32,
// TQ_ATOMIC_LOAD/STORE), the 64-bit integer tq_u64, the type
// float4 (.x .y .z .w), and the ints tq_tid, tq_ntid, tq_bx, tq_by, tq_lane, tq_warp.
#ifndef TIERED_PRELUDE_METAL
#define TIERED_PRELUDE_METAL

#define TQ_SIMD 32
#define TQ_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define TQ_SHARED(type, name, count) threadgroup type name[count]
#define TQ_TG threadgroup  // address space of shared-memory pointers
#define TQ_GLOBAL device  // address space of global-memory pointers
#define TQ_THREAD thread  // address space of a thread's own arrays
#define TQ_DEVICE_FN inline  // a helper function of the kernel header
// Declared as float4 so that the table can be read with 16-byte vector loads.
#define TQ_SHARED_LUT(type, name, count)                                 \
  threadgroup float4 name##_vec[((count) * sizeof(type) + 15) / 16];     \
  threadgroup type* name = (threadgroup type*)(name##_vec)
#define TQ_UNROLL _Pragma("clang loop unroll(full)")
#define TQ_INF INFINITY
#define TQ_LOAD_UINT4(ptr, i) (((const device uint4*)(ptr))[(i)])
#define TQ_SHARED_FLOAT4(ptr, i) (((const threadgroup float4*)(ptr))[(i)])
// Relaxed atomics: shared arrays are declared threadgroup atomic<T> by the body through
// TQ_SHARED_ATOMIC_U32 and added to atomically; outputs of a kernel built with
// atomic_outputs=True are device atomic<T>* and only loaded and stored (no kernel adds
// atomically to global memory).
#define TQ_SHARED_ATOMIC_ADD_U32(ptr, i, v) atomic_fetch_add_explicit(&(ptr)[(i)], (v), memory_order_relaxed)
#define TQ_SHARED_ATOMIC_U32(name, count) threadgroup TQ_ATOMIC_U32 name[count]
#define TQ_ATOMIC_U32 atomic_uint  // element type of those arrays (CUDA: uint32_t)
#define TQ_ATOMIC_I32 atomic_int  // int32 and float outputs of such kernels (CUDA: plain)
#define TQ_ATOMIC_F32 atomic<float>
#define TQ_ATOMIC_LOAD(ptr, i) atomic_load_explicit(&(ptr)[(i)], memory_order_relaxed)
#define TQ_ATOMIC_STORE(ptr, i, v) atomic_store_explicit(&(ptr)[(i)], (v), memory_order_relaxed)

// 64-bit sums for deterministic histograms (see select_mass.h, tq_mass_fixed): integer adds
// commute exactly, so atomics give the same sums whatever order the threads arrive in. Metal
// has no 64-bit atomic add: a shared sum is a (lo, hi) pair of atomic_uint, added to by
// select_mass.h's tq_shared_add_u64, common to both backends.
typedef ulong tq_u64;

inline float tq_exp(float x) {
  return metal::exp(x);
}

inline float tq_log(float x) {
  return metal::log(x);
}

inline float tq_as_float(uint32_t bits) {
  return as_type<float>(bits);
}

inline uint32_t tq_as_uint(float x) {
  return as_type<uint32_t>(x);
}

inline int tq_popcount(uint32_t x) {
  return int(metal::popcount(x));
}

// 16-bit floats in shared tables (scale_common.h), and 4 consecutive table entries as a float4
// with one 16-byte (float) or 8-byte (half) threadgroup-memory load.
typedef half tq_half;

inline float4 tq_shared_load4(const threadgroup float* p, int i) {
  return ((const threadgroup float4*)p)[i];
}

inline float4 tq_shared_load4(const threadgroup half* p, int i) {
  return float4(((const threadgroup half4*)p)[i]);
}

inline float4 tq_float4(float x, float y, float z, float w) {
  return float4(x, y, z, w);
}

inline float tq_warp_sum(float x) {
  return simd_sum(x);
}

inline float tq_warp_max(float x) {
  return simd_max(x);
}

inline float tq_warp_min(float x) {
  return simd_min(x);
}

inline float tq_warp_prefix_sum(float x) {
  return simd_prefix_inclusive_sum(x);
}

#endif  // TIERED_PRELUDE_METAL
// @body-prologue
const int tq_tid = int(thread_position_in_threadgroup.x);
const int tq_ntid = int(threads_per_threadgroup.x);
const int tq_bx = int(threadgroup_position_in_grid.x);
const int tq_by = int(threadgroup_position_in_grid.y);
const int tq_lane = tq_tid % TQ_SIMD;
const int tq_warp = tq_tid / TQ_SIMD;
