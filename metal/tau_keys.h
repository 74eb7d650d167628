// Selection pass 2 of 3: per token of a kv head whether any of its REP query heads keeps it
// (pass 1b's thresholds), its max-over-heads log-probability, and this chunk's count
// histograms of that log-probability by class (the work: select_rank.h, tq_keys_chunk).
//
//   keep_j = any head with z >= theta; lmax_j = max over heads of (z - m - log s) <= 0;
//   class: 2 kept, 1 allowed but not kept, 0 excluded; lbin = bin of lmax on
//   [anchor - span_l, anchor] (NL bins, top first; the last bin also takes what lies below),
//   anchor = max over heads of -log s >= every lmax.
//
// Every output element is written by exactly one threadgroup (no atomics on global memory),
// so the launch needs no zero fill: each chunk writes its own histogram rows, and pass 3 sums
// them.
//
// Inputs (names as in tau.py):
//   z       float   (Hq, N)     scores (first n columns)
//   m, s, theta float (Hq,)     pass 1b
//   exclude ET      (H, E)      nonzero: never select (first n columns read)
//   params  int32_t [n, N, E, chunk, blocks]
//   fparams float   [span_l]
// Outputs:
//   code    uint32_t (H, n)              class << 16 | lbin
//   lhist   uint32_t (H, blocks, 2, NL)  this chunk's token counts by lbin: [.., 0, :] kept,
//                                        [.., 1, :] allowed but not kept
//   counts  uint32_t (H, blocks, 2)      this chunk's [kept, allowed]
// Template constants: NL (lmax bins), REP, ET (the exclude dtype).
// Grid: x = chunks of `chunk` tokens (blocks of them), y = kv head.
const int n = params[0];
const int N = params[1];
const int E = params[2];
const int chunk = params[3];
const int blocks = params[4];
const int h = tq_by;

TQ_SHARED_ATOMIC_U32(lhist_s, 2 * NL);
TQ_SHARED_ATOMIC_U32(cnt_s, 2);
TQ_SHARED(float, theta_s, REP);
TQ_SHARED(float, m_s, REP);
TQ_SHARED(float, logs_s, REP);
if (tq_tid < REP) {
  const int qh = h * REP + tq_tid;
  theta_s[tq_tid] = theta[qh];
  m_s[tq_tid] = m[qh];
  logs_s[tq_tid] = tq_log(s[qh]);
}
TQ_BARRIER();
const int j_begin = tq_bx * chunk;
const int j_end = (j_begin + chunk < n) ? j_begin + chunk : n;
tq_keys_chunk<REP, NL, ET>(z, N, exclude, E, h, n, j_begin, j_end, fparams[0], theta_s, m_s,
                           logs_s, lhist_s, cnt_s, code, lhist, counts,
                           int64_t(h) * blocks + tq_bx, tq_tid, tq_ntid);
