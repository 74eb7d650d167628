// Waiting between threadgroups for the persistent selection kernel (tau_persistent.h); CUDA
// only (goes into that kernel's header).
//
// The kernel's threadgroups take units of work from a counter, in order: every unit of phase
// 0, then of phase 1, and so on. A unit of phase p waits until every unit of phase p - 1 is
// done; those were all taken before it, by threadgroups that are running, so the wait ends
// however many threadgroups the GPU holds at once: no co-residency is assumed, and two such
// kernels side by side (MLX's CUDA graphs run independent nodes concurrently) cannot
// deadlock. Metal lacks 64-bit atomics and a device-scope fence for this, so Apple GPUs keep
// the separate passes.

// Nanoseconds since an arbitrary origin, the same clock on every SM.
__device__ inline unsigned long long tq_globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A wait longer than this is taken for a fault (it cannot happen by design: see above): the
// kernel flags `status` and finishes with a wrong result rather than hang the GPU.
#define TQ_WAIT_NS 1000000000ull

// Every thread of the threadgroup waits here until `counter` reaches `expected`; what the
// threadgroups that counted wrote before counting is visible after it.
__device__ inline void tq_wait_count(uint32_t* counter, const uint32_t expected,
                                     uint32_t* status) {
  if (threadIdx.x == 0) {
    const unsigned long long t0 = tq_globaltimer();
    while (*reinterpret_cast<volatile uint32_t*>(counter) < expected) {
      if (tq_globaltimer() - t0 > TQ_WAIT_NS) {
        atomicExch(status, 1u);
        break;
      }
    }
    __threadfence();
  }
  __syncthreads();
}

// A fixed-point sum added to a global 64-bit word (order-independent, as the shared pairs).
__device__ inline void tq_global_add_u64(uint64_t* p, const tq_u64 v) {
  atomicAdd(reinterpret_cast<tq_u64*>(p), v);
}

#define TQ_PHASE_FN __noinline__ __device__

// Passes 2 and 3 as the persistent kernel's phases: the same functions behind a call that is
// not inlined (TQ_PHASE_FN), so that their registers are allocated apart from the other
// phases' (inlined, ptxas gave the kernel 80 registers per thread).
template <int REP, int NL, typename ET>
TQ_PHASE_FN void tq_keys_phase(
    const float* z, const int N, const ET* exclude, const int E, const int h, const int n,
    const int j_begin, const int j_end, const float span_l, const float* theta_s,
    const float* m_s, const float* logs_s, uint32_t* lhist_s, uint32_t* cnt_s, uint32_t* code,
    uint32_t* lhist, uint32_t* counts, const int64_t out_row, const int tid, const int ntid) {
  tq_keys_chunk<REP, NL, ET>(z, N, exclude, E, h, n, j_begin, j_end, span_l, theta_s, m_s,
                             logs_s, lhist_s, cnt_s, code, lhist, counts, out_row, tid, ntid);
}

template <int NL, int REP>
TQ_PHASE_FN void tq_compact_phase(
    const uint32_t* code, const uint32_t* lhist, const uint32_t* counts, const float* z,
    const int N, const int n, const int h, const int bx, const int blocks, const int chunk,
    const int cap, const int floor_, const int cap_alloc, const float* m_s, const float* s_s,
    float* lh_f, float* pre_f, float* scratch, float* red, uint32_t* idx, int32_t* count,
    float* mass, const int tid, const int ntid) {
  tq_compact_chunk<NL, REP>(code, lhist, counts, z, N, n, h, bx, blocks, chunk, cap, floor_,
                            cap_alloc, m_s, s_s, lh_f, pre_f, scratch, red, idx, count, mass,
                            tid, ntid);
}
