// The whole selection in one launch (CUDA only: persistent_cuda.h says why): the passes of
// tau_hist.h / tau_theta.h, tau_keys.h and tau_compact.h as phases of one kernel. Same sums,
// same thresholds, same selection as the separate passes (the masses are fixed-point, the
// counts integers); only the float sum of the selected mass per chunk follows this kernel's
// chunks.
//
// A unit of work is one (kv head, chunk) in one phase; threadgroups take units from a counter
// in order, and a unit of phase p > 0 first waits until all of phase p - 1 is done
// (tq_wait_count):
//   phase 0  zero the unit's share of the global mass histograms
//            [the fused kernel scores the chunk here, at the @inner line below]
//   phase 1  m = max of the zmax row (m_out); the chunk's mass histogram per query head in
//            shared memory (HR heads at a time), added to the global one with 64-bit atomics
//   phase 2  s, theta of the head's REP query heads from the global histograms (as pass 1b;
//            every unit of the head finds the same), then pass 2 on the chunk
//            (tq_keys_chunk): codes, class histograms and counts
//   phase 3  pass 3 on the chunk (tq_compact_chunk): indices in ascending order, masses
//
// Inputs (names as in persistent.py):
//   z        float    (Hq, N)   scores (the fused kernel: its own output), first n columns
//   zmax     float    (Hq, M)   maxima of blocks of z (any partition of the n columns)
//   exclude  ET       (H, E)    nonzero: never select
//   sync     uint32_t (8,)      zeros, which the kernel writes (a fresh array per launch):
//                               [next unit, units done per phase (4), timeout flag]
//   sparams  int32_t  [n, N, M, E, cap, floor, cap_alloc, chunk, blocks, H]
//   sfparams float    [tau, span_t, span_l]
// Outputs (every element written by the kernel):
//   m_out, s_out, theta_out float (Hq,)   as tau_theta.h
//   idx, count, mass                      as tau_compact.h (mass (Hq, blocks))
//   hist     uint64   (Hq, NB)            mass histograms (fixed point), scratch
//   code     uint32_t (H, n); lhist uint32_t (H, blocks, 2, NL); counts uint32_t (H, blocks, 2)
//                                          as tau_keys.h, scratch
//   status   uint32_t (1,)      0, or 1 if a wait timed out (the result is then wrong)
//   stamps   uint64   (S,)      STAMPS: globaltimer at the first unit's start and at the end
//                               of each phase's last unit
// Template constants: NB, NL, REP, ET, HR (query heads per histogram round, divides REP),
// STAMPS (0: stamps is a 1-element placeholder; 1: 5 stamps).
// Grid: any number of threadgroups (persistent.py: one per SM) of persistent.THREADS threads.
// Dynamic shared memory: at least max(HR * NB * 8, REP * NB * 4, 4 * NL * 4) bytes.
{
const int n = sparams[0];
const int N = sparams[1];
const int M = sparams[2];
const int E = sparams[3];
const int chunk = sparams[7];
const int blocks = sparams[8];
const int nheads = sparams[9];
const float tau = sfparams[0];
const float span_t = sfparams[1];
const int units = nheads * blocks;  // per phase: a (kv head, chunk) each
uint32_t* bar = const_cast<uint32_t*>(sync);  // [next unit, done per phase (4), status]

extern __shared__ float4 tq_dynamic_smem[];
TQ_TG TQ_ATOMIC_U32* work = reinterpret_cast<TQ_TG TQ_ATOMIC_U32*>(tq_dynamic_smem);
TQ_TG float* work_f = reinterpret_cast<TQ_TG float*>(tq_dynamic_smem);
TQ_SHARED(float, red, 32 * (REP > 2 ? REP : 2));
TQ_SHARED(float, scratch, 32);
TQ_SHARED(float, m_s, REP);
TQ_SHARED(float, s_s, REP);
TQ_SHARED(float, logs_s, REP);
TQ_SHARED(float, theta_s, REP);
TQ_SHARED_ATOMIC_U32(cnt_s, 2);
TQ_SHARED(int, unit_s, 1);
const float inv_w = float(NB) / span_t;

for (;;) {
  // Units are taken in order: phase 0's, then phase 1's ... A unit waits only for the units
  // of the phase before, all taken already, by threadgroups that are running.
  if (tq_tid == 0) {
    unit_s[0] = int(atomicAdd(bar, 1u));
    if (STAMPS && unit_s[0] == 0) {
      stamps[0] = tq_globaltimer();
    }
  }
  TQ_BARRIER();
  const int u = unit_s[0];
  TQ_BARRIER();
  if (u >= 4 * units) {
    break;
  }
  const int phase = u / units;
  const int c = u - phase * units;
  const int h = c / blocks;
  const int bx = c - h * blocks;
  const int j_begin = bx * chunk < n ? bx * chunk : n;
  const int j_end = (j_begin + chunk < n) ? j_begin + chunk : n;
  if (phase > 0) {
    tq_wait_count(bar + phase, uint32_t(units), bar + 5);
  }

  if (phase == 0) {
    // This unit's share of the mass histograms, zeroed (and, fused, its chunk scored).
    const int64_t total = int64_t(nheads) * REP * NB;
    const int64_t per = (total + units - 1) / units;
    const int64_t end = (int64_t(c) + 1) * per < total ? (int64_t(c) + 1) * per : total;
    for (int64_t i = int64_t(c) * per + tq_tid; i < end; i += tq_ntid) {
      hist[i] = 0ull;
    }
    {
      const int tq_bx = bx;  // the unit's chunk and kv head, as the scoring body reads them
      const int tq_by = h;
// @inner
    }
  } else if (phase == 1) {
    // The chunk's mass histograms (HR query heads per round), added to the global ones; the
    // head's chunk-0 unit writes m.
    for (int r0 = 0; r0 < REP; r0 += HR) {
      constexpr int U = HR >= 8 ? 1 : 8 / HR;  // tokens whose loads go out together
      float mr[HR];
      tq_mass_hist<U, HR>(z, int64_t(h * REP + r0) * N, N, n, j_begin, j_end, zmax,
                          int64_t(h * REP + r0) * M, M, inv_w, NB, work, mr, red, tq_tid,
                          tq_ntid);
      TQ_BARRIER();
      for (int b = tq_tid; b < HR * NB; b += tq_ntid) {
        const tq_u64 v = (tq_u64(TQ_ATOMIC_LOAD(work, 2 * b + 1)) << 32)
            | tq_u64(TQ_ATOMIC_LOAD(work, 2 * b));
        if (v != 0ull) {
          tq_global_add_u64(&hist[int64_t(h * REP + r0) * NB + b], v);
        }
      }
      if (bx == 0 && tq_tid == 0) {
        TQ_UNROLL for (int r = 0; r < HR; ++r) {
          m_out[h * REP + r0 + r] = mr[r];
        }
      }
      TQ_BARRIER();
    }
  } else if (phase == 2) {
    // The kv head's thresholds (every unit of the head finds the same ones from the same
    // sums; its chunk-0 unit writes them), then pass 2 on the chunk.
    for (int b = tq_tid; b < REP * NB; b += tq_ntid) {
      const tq_u64 v = hist[int64_t(h) * REP * NB + b];
      work_f[b] = tq_mass_float(uint32_t(v & 0xffffffffull), uint32_t(v >> 32));
    }
    if (tq_tid < REP) {
      m_s[tq_tid] = m_out[h * REP + tq_tid];
    }
    TQ_BARRIER();
    for (int r = 0; r < REP; ++r) {
      const tq_bound bd = tq_boundary(work_f + r * NB, NB, tau, 0.0f, scratch, tq_tid,
                                      tq_ntid);
      if (tq_tid == 0) {
        const float th = tq_theta_of(bd, NB, m_s[r], tau, span_t);
        logs_s[r] = tq_log(bd.total);
        theta_s[r] = th;
        if (bx == 0) {
          s_out[h * REP + r] = bd.total;
          theta_out[h * REP + r] = th;
        }
      }
    }
    TQ_BARRIER();
    tq_keys_phase<REP, NL, ET>(z, N, exclude, E, h, n, j_begin, j_end, sfparams[2], theta_s,
                               m_s, logs_s, work, cnt_s, code, lhist, counts, int64_t(c),
                               tq_tid, tq_ntid);
  } else {
    // Pass 3 on the chunk, with the head's m and s as its chunk-0 unit wrote them.
    if (tq_tid < REP) {
      m_s[tq_tid] = m_out[h * REP + tq_tid];
      s_s[tq_tid] = s_out[h * REP + tq_tid];
    }
    TQ_BARRIER();
    tq_compact_phase<NL, REP>(code, lhist, counts, z, N, n, h, bx, blocks, chunk, sparams[4],
                              sparams[5], sparams[6], m_s, s_s, work_f, work_f + NL, scratch,
                              red, idx, count, mass, tq_tid, tq_ntid);
  }
  // Done: the last unit of a phase stamps its end.
  TQ_BARRIER();
  if (tq_tid == 0) {
    __threadfence();
    const uint32_t before = atomicAdd(bar + 1 + phase, 1u);
    if (STAMPS && before + 1u == uint32_t(units)) {
      stamps[1 + phase] = tq_globaltimer();
    }
    if (phase == 3 && before + 1u == uint32_t(units)) {
      status[0] = *reinterpret_cast<volatile uint32_t*>(bar + 5);
    }
  }
}
}
