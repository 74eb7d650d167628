// What a Metal kernel thread, running as a fiber on the CPU, asks of the executor's runtime
// (runtime.cpp). Included by shim.h into the kernel's translation unit, which otherwise sees
// only the Metal names the shim defines.
#pragma once

namespace tqx {

struct Dim3 {
  unsigned x, y, z;
};

// The running thread's place in the launch, from which shim.h answers Metal's attributes.
struct ThreadPos {
  Dim3 in_group;       // thread_position_in_threadgroup
  Dim3 group_size;     // threads_per_threadgroup (smaller at a non-uniform grid's edge)
  Dim3 dispatch_size;  // dispatch_threads_per_threadgroup (as launched)
  Dim3 group;          // threadgroup_position_in_grid
  Dim3 groups;         // threadgroups_per_grid
  Dim3 grid;           // threads_per_grid
  Dim3 in_grid;        // thread_position_in_grid
  unsigned index;      // thread_index_in_threadgroup
  unsigned threads;    // threads in this threadgroup
};

constexpr int kSimdWidth = 32;

// One lane's operand of a simdgroup operation, and its result.
struct SimdSlot {
  alignas(16) unsigned char value[16];
  int arg;  // a lane index or offset (shuffles)
};

// Computes every active lane's result from every active lane's operand: `active` has bit l
// set for each lane l of the simdgroup that has not returned; `lanes` is the simdgroup's size.
typedef void (*SimdResolve)(const SimdSlot* in, SimdSlot* out, int lanes, unsigned active);

const ThreadPos& self();

// Publishes this lane's operand and suspends until every lane of its simdgroup that has not
// returned is suspended in a simdgroup operation with the same resolve; returns this lane's
// result. Lanes of one simdgroup that wait at different operations, or at a barrier, are an
// error (the executor demands converged simdgroups).
const SimdSlot& simd_exchange(const void* value, unsigned size, int arg, SimdResolve resolve);

// Suspends until every thread of the threadgroup waits here (threadgroup_barrier). A thread
// that returns while others wait is an error.
void threadgroup_wait();

// The threadgroup's storage for the threadgroup-memory declaration at `site` (one per
// declaration in the kernel), `bytes` long, 16-byte aligned: the same for every thread of a
// threadgroup, filled with a poison pattern when the first thread reaches the declaration.
void* threadgroup_alloc(int site, unsigned long bytes);

// Reports a kernel error and ends the launch with it.
[[noreturn]] void fail(const char* message);

}  // namespace tqx

// Defined by the generated kernel translation unit: runs one thread of the kernel.
extern "C" void tqx_kernel_thread(void* const* buffers);
