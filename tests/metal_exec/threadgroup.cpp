// Runs one threadgroup of a Metal kernel on the CPU: its threads as fibers of one OS thread.
//
// A fiber switches only where Metal makes threads wait for each other: threadgroup_barrier
// and the simdgroup operations. Between two such points a fiber runs alone, so a thread that
// reads what another writes, without a barrier between them, sees it only if the writer
// happened to run first: the fibers run in a fresh pseudo-random order in every round, so a
// missing barrier shows as stale or poisoned reads. A simdgroup operation resumes its lanes
// only when every lane of the simdgroup that has not returned has reached it, with every
// lane's operand at hand: 32-lane lock-step results. Threadgroup memory is one arena per
// worker, poisoned where each declaration's array starts to be used.
#include <sys/mman.h>
#include <unistd.h>

#include <csetjmp>
#include <csignal>
#include <cstdio>
#include <cstring>

#include "worker.h"

#if TQX_ASM_SWITCH
// Saves the callee-saved registers and the SSE/x87 control words on the current stack,
// stores the stack pointer to *save, and resumes the context whose stack pointer is `load`
// (System V x86-64 ABI: everything else is caller-saved across this call).
extern "C" void tqx_swap(void** save, void* load);
asm(R"(
  .pushsection .text
  .globl tqx_swap
  .hidden tqx_swap
  .type tqx_swap, @function
tqx_swap:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size tqx_swap, .-tqx_swap
  .popsection
)");
#endif

namespace tqx {
namespace {

constexpr size_t kStackBytes = 256 * 1024;  // reserved per fiber; pages are touched lazily
constexpr uint32_t kPoison = 0x7FA5A5A5u;   // a NaN as float

thread_local Worker* tls;
thread_local sigjmp_buf* tls_fault;  // where a memory fault in a kernel thread lands
thread_local void* tls_fault_addr;
struct sigaction previous_segv, previous_bus;

void on_fault(int sig, siginfo_t* info, void*) {
  if (tls_fault == nullptr) {  // not a kernel's: let the previous handler see it again
    sigaction(sig, sig == SIGSEGV ? &previous_segv : &previous_bus, nullptr);
    return;
  }
  tls_fault_addr = info->si_addr;
  siglongjmp(*tls_fault, 1);
}

void to_scheduler(Worker& w) {
#if TQX_ASM_SWITCH
  tqx_swap(&w.fibers[w.current].sp, w.sched_sp);
#else
  swapcontext(&w.fibers[w.current].ctx, &w.sched);
#endif
}

void to_fiber(Worker& w, int t) {
  w.current = t;
#if TQX_ASM_SWITCH
  tqx_swap(&w.sched_sp, w.fibers[t].sp);
#else
  swapcontext(&w.sched, &w.fibers[t].ctx);
#endif
}

void fiber_main() {
  Worker& w = *tls;
  tqx_kernel_thread(w.buffers);
  w.fibers[w.current].state = kDone;
  to_scheduler(w);
  __builtin_trap();  // a finished fiber is never resumed
}

void start_fiber(Worker& w, int t) {
  char* top = w.stacks + (size_t(t) + 1) * w.stride;
#if TQX_ASM_SWITCH
  // The frame tqx_swap pops: control words, r15 .. rbp, then fiber_main as the return
  // address, entered with the stack aligned as after a call.
  uint64_t* sp = reinterpret_cast<uint64_t*>(top) - 9;
  uint32_t csr[2];
  asm volatile("stmxcsr %0" : "=m"(csr[0]));
  asm volatile("fnstcw %0" : "=m"(csr[1]));
  std::memcpy(&sp[0], csr, 8);
  for (int i = 1; i <= 6; ++i) sp[i] = 0;
  sp[7] = reinterpret_cast<uint64_t>(&fiber_main);
  sp[8] = 0;
  w.fibers[t].sp = sp;
#else
  ucontext_t& c = w.fibers[t].ctx;
  getcontext(&c);
  c.uc_stack.ss_sp = top - (w.stride - page_size());
  c.uc_stack.ss_size = w.stride - page_size();
  c.uc_link = nullptr;
  makecontext(&c, fiber_main, 0);
#endif
}

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Resumes every simdgroup whose remaining lanes all wait at one simdgroup operation.
bool resolve_simdgroups(Worker& w) {
  bool progress = false;
  for (int base = 0; base < w.n; base += kSimdWidth) {
    const int lanes = w.n - base < kSimdWidth ? w.n - base : kSimdWidth;
    unsigned active = 0;
    int live = 0, waiting = 0;
    SimdResolve fn = nullptr;
    for (int l = 0; l < lanes; ++l) {
      const Fiber& f = w.fibers[base + l];
      if (f.state == kDone) continue;
      ++live;
      active |= 1u << l;
      if (f.state != kAtSimd) continue;
      ++waiting;
      if (fn != nullptr && f.resolve != fn) {
        w.error = "simdgroup " + std::to_string(base / kSimdWidth) +
                  ": lanes wait at different simdgroup operations (divergent control flow)";
        return false;
      }
      fn = f.resolve;
    }
    if (waiting == 0 || waiting < live) continue;
    fn(&w.in[base], &w.out[base], lanes, active);
    for (int l = 0; l < lanes; ++l) {
      if (active >> l & 1u) w.fibers[base + l].state = kRunnable;
    }
    progress = true;
  }
  return progress;
}

bool run_fibers(Worker& w, const ThreadPos& first, uint64_t seed) {
  for (int s = 0; s < kMaxSites; ++s) w.site[s] = -1;
  w.used = 0;
  w.n = int(first.threads);
  for (int t = 0; t < w.n; ++t) {
    Fiber& f = w.fibers[t];
    f.state = kRunnable;
    f.pos = first;
    f.pos.index = unsigned(t);
    f.pos.in_group = {t % first.group_size.x, (t / first.group_size.x) % first.group_size.y,
                      t / (first.group_size.x * first.group_size.y)};
    f.pos.in_grid = {first.group.x * first.dispatch_size.x + f.pos.in_group.x,
                     first.group.y * first.dispatch_size.y + f.pos.in_group.y,
                     first.group.z * first.dispatch_size.z + f.pos.in_group.z};
    start_fiber(w, t);
    w.order[t] = t;
  }
  for (;;) {
    for (int i = w.n - 1; seed != 0 && i > 0; --i) {  // Fisher-Yates, a new order per round
      const int j = int(splitmix(seed) % uint64_t(i + 1));
      const int tmp = w.order[i];
      w.order[i] = w.order[j];
      w.order[j] = tmp;
    }
    for (int i = 0; i < w.n; ++i) {
      if (w.fibers[w.order[i]].state == kRunnable) to_fiber(w, w.order[i]);
      if (!w.error.empty()) return false;
    }
    if (resolve_simdgroups(w)) continue;
    if (!w.error.empty()) return false;
    int live = 0, at_barrier = 0;
    for (int t = 0; t < w.n; ++t) {
      live += w.fibers[t].state != kDone;
      at_barrier += w.fibers[t].state == kAtBarrier;
    }
    if (live == 0) return true;
    if (at_barrier < live) {
      w.error = "deadlock: lanes of a simdgroup wait at a simdgroup operation while others "
                "wait at threadgroup_barrier (divergent control flow)";
      return false;
    }
    if (live < w.n) {
      w.error = std::to_string(w.n - live) + " of " + std::to_string(w.n) +
                " threads returned while the others wait at threadgroup_barrier";
      return false;
    }
    for (int t = 0; t < w.n; ++t) w.fibers[t].state = kRunnable;
  }
}

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

}  // namespace

size_t page_size() { return size_t(sysconf(_SC_PAGESIZE)); }

void worker_begin(Worker& w, int max_threads, size_t smem_bytes, void* const* buffers) {
  tls = &w;
  const size_t page = page_size();
  w.stride = kStackBytes + page;
  w.mapped = w.stride * size_t(max_threads);
  w.stacks = static_cast<char*>(
      mmap(nullptr, w.mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  for (int t = 0; t < max_threads; ++t) mprotect(w.stacks + size_t(t) * w.stride, page, PROT_NONE);
  w.fibers.resize(size_t(max_threads));
  w.in.resize(size_t(max_threads));
  w.out.resize(size_t(max_threads));
  w.order.resize(size_t(max_threads));
  w.arena.resize(smem_bytes);
  w.buffers = buffers;
  w.alt_stack.ss_size = 65536;
  w.alt_stack.ss_sp = mmap(nullptr, w.alt_stack.ss_size, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  sigaltstack(&w.alt_stack, &w.old_alt_stack);
}

void worker_end(Worker& w) {
  sigaltstack(&w.old_alt_stack, nullptr);
  munmap(w.alt_stack.ss_sp, w.alt_stack.ss_size);
  munmap(w.stacks, w.mapped);
  tls = nullptr;
}

bool run_group(Worker& w, const ThreadPos& first, uint64_t seed) {
  sigjmp_buf fault;
  if (sigsetjmp(fault, 1) != 0) {
    tls_fault = nullptr;
    char msg[160];
    std::snprintf(msg, sizeof msg, "memory fault at %p in thread %d (a read past a buffer's "
                  "end, a write to an input, or a stack overflow)", tls_fault_addr, w.current);
    w.error = msg;
    return false;
  }
  tls_fault = &fault;
  const bool ok = run_fibers(w, first, seed);
  tls_fault = nullptr;
  return ok;
}

void install_fault_handler() {
  struct sigaction sa {};
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &previous_segv);
  sigaction(SIGBUS, &sa, &previous_bus);
}

void remove_fault_handler() {
  sigaction(SIGSEGV, &previous_segv, nullptr);
  sigaction(SIGBUS, &previous_bus, nullptr);
}

// The runtime.h interface, called from kernel threads.

const ThreadPos& self() { return tls->fibers[tls->current].pos; }

const SimdSlot& simd_exchange(const void* value, unsigned size, int arg, SimdResolve resolve) {
  Worker& w = *tls;
  const int t = w.current;
  std::memcpy(w.in[t].value, value, size);
  w.in[t].arg = arg;
  w.fibers[t].resolve = resolve;
  w.fibers[t].state = kAtSimd;
  to_scheduler(w);
  return w.out[t];
}

void threadgroup_wait() {
  Worker& w = *tls;
  w.fibers[w.current].state = kAtBarrier;
  to_scheduler(w);
}

void* threadgroup_alloc(int site, unsigned long bytes) {
  Worker& w = *tls;
  if (site < 0 || site >= kMaxSites) fail("too many threadgroup-memory declarations");
  if (w.site[site] < 0) {
    const size_t at = round_up(w.used, 16);
    if (at + bytes > w.arena.size()) {
      const std::string msg = "threadgroup memory: " + std::to_string(at + bytes) +
                              " bytes declared, over the limit of " +
                              std::to_string(w.arena.size());
      fail(msg.c_str());
    }
    for (size_t i = at; i + 4 <= at + round_up(bytes, 4); i += 4) {
      std::memcpy(&w.arena[i], &kPoison, 4);
    }
    w.site[site] = long(at);
    w.used = at + round_up(bytes, 16);
    w.peak = w.used > w.peak ? w.used : w.peak;
    w.reached |= uint64_t(1) << site;
  }
  return &w.arena[size_t(w.site[site])];
}

void fail(const char* message) {
  Worker& w = *tls;
  w.error = message;
  to_scheduler(w);
  __builtin_trap();
}

}  // namespace tqx
