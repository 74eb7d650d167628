// tiered.metal -- Metal prelude for the shared kernel bodies (*.h in this folder).
//
// The text above the "@body-prologue" line is passed to mx.fast.metal_kernel as `header`; the
// text below it is prepended to every kernel body. MLX adds a thread-position attribute to the
// generated signature only when the attribute's name occurs in the body text itself, so the
// thread indices are read in the body prologue rather than through a header macro.
//
// Every body may use: TQ_SIMD, TQ_BARRIER(), TQ_SHARED(type, name, count) (static
// threadgroup array), TQ_SHARED_LUT(type, name, count) (the one large array of a kernel:
// static here, dynamic shared memory on CUDA), TQ_UNROLL, TQ_INF, the helpers tq_exp,
// tq_as_float (bit cast), tq_float4, tq_warp_sum, tq_warp_max, the type float4 (.x .y .z .w),
// and the ints tq_tid, tq_ntid, tq_bx, tq_by, tq_lane, tq_warp.
#ifndef TIERED_PRELUDE_METAL
#define TIERED_PRELUDE_METAL

#define TQ_SIMD 32
#define TQ_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define TQ_SHARED(type, name, count) threadgroup type name[count]
#define TQ_SHARED_LUT(type, name, count) threadgroup type name[count]
#define TQ_UNROLL _Pragma("clang loop unroll(full)")
#define TQ_INF INFINITY

inline float tq_exp(float x) {
  return metal::exp(x);
}

inline float tq_as_float(uint32_t bits) {
  return as_type<float>(bits);
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

#endif  // TIERED_PRELUDE_METAL
// @body-prologue
const int tq_tid = int(thread_position_in_threadgroup.x);
const int tq_ntid = int(threads_per_threadgroup.x);
const int tq_bx = int(threadgroup_position_in_grid.x);
const int tq_by = int(threadgroup_position_in_grid.y);
const int tq_lane = tq_tid % TQ_SIMD;
const int tq_warp = tq_tid / TQ_SIMD;
