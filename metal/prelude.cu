// tiered.metal -- CUDA prelude for the shared kernel bodies (*.h in this folder).
//
// Same contract as prelude.metal: the text above the "@body-prologue" line is passed to
// mx.fast.cuda_kernel as `header` (it lands before MLX's `namespace mlx::core::cu`), the text
// below it is prepended to every kernel body. Helpers carry __device__ explicitly although
// MLX compiles with --device-as-default-execution-space, so that plain nvcc accepts them too.
#ifndef TIERED_PRELUDE_CUDA
#define TIERED_PRELUDE_CUDA

#define TQ_SIMD 32
#define TQ_BARRIER() __syncthreads()
#define TQ_SHARED(type, name, count) __shared__ type name[count]
#define TQ_TG  // address space of shared-memory pointers (Metal: threadgroup)
#define TQ_GLOBAL  // address space of global-memory pointers (Metal: device)
#define TQ_THREAD  // address space of a thread's own arrays (Metal: thread)
#define TQ_DEVICE_FN __device__ inline  // a helper function of the kernel header
// Dynamic shared memory: the launch asks for the bytes (cuda_kernel's shared_memory), which
// lets a lookup table grow past the 48 KB static limit.
#define TQ_SHARED_LUT(type, name, count)          \
  extern __shared__ float4 tq_dynamic_smem[];     \
  type* name = reinterpret_cast<type*>(tq_dynamic_smem)
#define TQ_UNROLL _Pragma("unroll")
// Vector loads: 16 bytes of a global uint32 array, 16 bytes of the shared (float) table.
#define TQ_LOAD_UINT4(ptr, i) (reinterpret_cast<const uint4*>(ptr)[(i)])
#define TQ_SHARED_FLOAT4(ptr, i) (reinterpret_cast<const float4*>(ptr)[(i)])
// Relaxed atomic adds on shared arrays (no kernel adds atomically to global memory).
#define TQ_SHARED_ATOMIC_ADD_U32(ptr, i, v) atomicAdd(&(ptr)[(i)], (v))
// Shared arrays updated atomically, and plain loads/stores of atomically updated arrays
// (shared ones, and outputs, which Metal declares atomic in kernels built with
// atomic_outputs=True).
#define TQ_SHARED_ATOMIC_U32(name, count) __shared__ TQ_ATOMIC_U32 name[count]
#define TQ_ATOMIC_U32 uint32_t  // element type of those arrays (Metal: atomic_uint)
#define TQ_ATOMIC_I32 int32_t  // int32 and float outputs of such kernels (Metal: atomic)
#define TQ_ATOMIC_F32 float
#define TQ_ATOMIC_LOAD(ptr, i) ((ptr)[(i)])
#define TQ_ATOMIC_STORE(ptr, i, v) ((ptr)[(i)] = (v))
#define TQ_INF __int_as_float(0x7f800000)

// 64-bit sums for deterministic histograms (see select_mass.h, tq_mass_fixed): integer adds
// commute exactly, so atomics give the same sums whatever order the threads arrive in. Shared
// sums are uint32 (lo, hi) pairs (select_mass.h's tq_shared_*_u64, common to both backends):
// on sm_90 a 64-bit shared atomicAdd compiles to a compare-and-swap loop
// (ATOMS.CAST.SPIN.64), two 32-bit adds to native ones.
typedef unsigned long long tq_u64;

__device__ inline float tq_exp(float x) {
  return expf(x);
}

__device__ inline float tq_log(float x) {
  return logf(x);
}

__device__ inline float tq_as_float(uint32_t bits) {
  return __uint_as_float(bits);
}

__device__ inline uint32_t tq_as_uint(float x) {
  return __float_as_uint(x);
}

__device__ inline int tq_popcount(uint32_t x) {
  return __popc(x);
}

// 16-bit floats in shared tables (scale_common.h), and 4 consecutive table entries as a float4
// with one 16-byte (float) or 8-byte (half) shared-memory load.
typedef __half tq_half;

__device__ inline float4 tq_shared_load4(const float* p, int i) {
  return reinterpret_cast<const float4*>(p)[i];
}

__device__ inline float4 tq_shared_load4(const tq_half* p, int i) {
  const uint2 u = reinterpret_cast<const uint2*>(p)[i];
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}

__device__ inline float4 tq_float4(float x, float y, float z, float w) {
  return make_float4(x, y, z, w);
}

__device__ inline float tq_warp_sum(float x) {
  for (int o = TQ_SIMD / 2; o > 0; o >>= 1) {
    x += __shfl_xor_sync(0xffffffffu, x, o);
  }
  return x;
}

__device__ inline float tq_warp_max(float x) {
  for (int o = TQ_SIMD / 2; o > 0; o >>= 1) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  }
  return x;
}

__device__ inline float tq_warp_min(float x) {
  for (int o = TQ_SIMD / 2; o > 0; o >>= 1) {
    x = fminf(x, __shfl_xor_sync(0xffffffffu, x, o));
  }
  return x;
}

// Inclusive prefix sum over the lanes of a warp.
__device__ inline float tq_warp_prefix_sum(float x) {
  const int lane = int(threadIdx.x) % TQ_SIMD;
  for (int o = 1; o < TQ_SIMD; o <<= 1) {
    const float y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) {
      x += y;
    }
  }
  return x;
}

#endif  // TIERED_PRELUDE_CUDA
// @body-prologue
const int tq_tid = int(threadIdx.x);
const int tq_ntid = int(blockDim.x);
const int tq_bx = int(blockIdx.x);
const int tq_by = int(blockIdx.y);
const int tq_lane = tq_tid % TQ_SIMD;
const int tq_warp = tq_tid / TQ_SIMD;
