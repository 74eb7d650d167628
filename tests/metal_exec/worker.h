// Inside the executor's runtime: a worker (one OS thread) and the fibers that run the threads
// of its current threadgroup. threadgroup.cpp runs a threadgroup; launch.cpp runs a launch.
#pragma once
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "runtime.h"

#if defined(__x86_64__) && defined(__ELF__) && !defined(TQX_UCONTEXT)
#define TQX_ASM_SWITCH 1  // a hand-written switch: ~30x faster than swapcontext's syscall
#else
#define TQX_ASM_SWITCH 0
#include <ucontext.h>
#endif

namespace tqx {

constexpr int kMaxThreads = 1024;
constexpr int kMaxSites = 64;

enum State : unsigned char { kRunnable, kAtSimd, kAtBarrier, kDone };

struct Fiber {
#if TQX_ASM_SWITCH
  void* sp;
#else
  ucontext_t ctx;
#endif
  State state;
  SimdResolve resolve;
  ThreadPos pos;
};

struct Worker {
  char* stacks = nullptr;  // one mapping: per fiber a guard page, then its stack
  size_t stride = 0;
  size_t mapped = 0;
  stack_t alt_stack{};  // the fault handler's (a fiber's stack may be what overflowed)
  stack_t old_alt_stack{};
  std::vector<Fiber> fibers;
  std::vector<SimdSlot> in, out;
  std::vector<int> order;
  std::vector<unsigned char> arena;  // threadgroup memory, as large as the launch allows
  long site[kMaxSites];
  size_t used = 0;
  size_t peak = 0;
  uint64_t reached = 0;  // bit s: declaration site s was reached
  void* const* buffers = nullptr;
  int n = 0;  // threads of the current threadgroup
  int current = -1;
  std::string error;
#if TQX_ASM_SWITCH
  void* sched_sp = nullptr;
#else
  ucontext_t sched;
#endif
};

// Makes w the calling OS thread's worker, for threadgroups of up to max_threads threads and
// smem_bytes of threadgroup memory; worker_end releases what it took.
void worker_begin(Worker& w, int max_threads, size_t smem_bytes, void* const* buffers);
void worker_end(Worker& w);

// Runs one threadgroup (first: the position of its thread 0, with its size) to completion;
// false with w.error set on a kernel error. seed 0 runs the fibers in thread order.
bool run_group(Worker& w, const ThreadPos& first, uint64_t seed);

// While installed, a memory fault in a kernel thread ends its threadgroup with an error.
void install_fault_handler();
void remove_fault_handler();

size_t page_size();

}  // namespace tqx
