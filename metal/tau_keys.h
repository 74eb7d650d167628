// Selection pass 2 of 3: per token of a kv head whether any of its REP query heads keeps it
// (pass 1b's thresholds), its max-over-heads log-probability, and this chunk's count
// histograms of that log-probability by class.
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
const float span_l = fparams[0];
const int h = tq_by;
// Tokens per thread whose loads (REP scores each) are issued before any is used: 8 loads in
// flight, within 64 registers at 1024 threads.
constexpr int U = REP >= 8 ? 1 : 8 / REP;

TQ_SHARED_ATOMIC_U32(lhist_s, 2 * NL);
TQ_SHARED_ATOMIC_U32(cnt_s, 2);
for (int b = tq_tid; b < 2 * NL; b += tq_ntid) {
  TQ_ATOMIC_STORE(lhist_s, b, 0u);
}
if (tq_tid < 2) {
  TQ_ATOMIC_STORE(cnt_s, tq_tid, 0u);
}
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
float anchor = -TQ_INF;
for (int r = 0; r < REP; ++r) {
  anchor = -logs_s[r] > anchor ? -logs_s[r] : anchor;
}

const float inv_wl = float(NL) / span_l;
const int j_begin = tq_bx * chunk;
const int j_end = (j_begin + chunk < n) ? j_begin + chunk : n;
uint32_t n_keep = 0u;
uint32_t n_allowed = 0u;
for (int j0 = j_begin + tq_tid; j0 < j_end; j0 += U * tq_ntid) {
  float v[U][REP];
  bool allowed[U];
  TQ_UNROLL for (int u = 0; u < U; ++u) {
    const int j = j0 + u * tq_ntid;
    const bool inside = j < j_end;
    TQ_UNROLL for (int r = 0; r < REP; ++r) {
      v[u][r] = inside ? z[int64_t(h * REP + r) * N + j] : -TQ_INF;
    }
    allowed[u] = inside && exclude[int64_t(h) * E + (inside ? j : 0)] == ET(0);
  }
  TQ_UNROLL for (int u = 0; u < U; ++u) {
    const int j = j0 + u * tq_ntid;
    if (j < j_end) {
      bool keep = false;
      float lmax = -TQ_INF;
      TQ_UNROLL for (int r = 0; r < REP; ++r) {
        keep = keep || (v[u][r] >= theta_s[r]);
        const float lp = v[u][r] - m_s[r] - logs_s[r];
        lmax = lp > lmax ? lp : lmax;
      }
      const uint32_t cls = allowed[u] ? (keep ? 2u : 1u) : 0u;
      const float pos = (anchor - lmax) * inv_wl;
      const int b = pos >= float(NL - 1) ? NL - 1 : (pos > 0.0f ? int(pos) : 0);
      code[int64_t(h) * n + j] = (cls << 16) | uint32_t(b);
      if (allowed[u]) {
        TQ_SHARED_ATOMIC_ADD_U32(lhist_s, (keep ? 0 : NL) + b, 1u);
        n_allowed += 1u;
        n_keep += keep ? 1u : 0u;
      }
    }
  }
}
if (n_allowed > 0u) {
  TQ_SHARED_ATOMIC_ADD_U32(cnt_s, 0, n_keep);
  TQ_SHARED_ATOMIC_ADD_U32(cnt_s, 1, n_allowed);
}
TQ_BARRIER();
const int64_t out_row = int64_t(h) * blocks + tq_bx;
for (int b = tq_tid; b < 2 * NL; b += tq_ntid) {
  lhist[out_row * 2 * NL + b] = TQ_ATOMIC_LOAD(lhist_s, b);
}
if (tq_tid < 2) {
  counts[out_row * 2 + tq_tid] = TQ_ATOMIC_LOAD(cnt_s, tq_tid);
}
