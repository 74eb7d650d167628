// Selection pass 2 of 3: per query head the tau-cumulative threshold (from pass 1's mass
// histogram), then per token of a kv head whether any of its REP query heads keeps it, its
// max-over-heads log-probability, and count histograms of that log-probability by class.
//
//   s = sum of the head's histogram; theta = the lower edge of the boundary bin (the bin at
//   which the mass accumulated from the top reaches tau * s) minus half a bin, -inf for
//   tau >= 1 or a boundary in the last bin; keep_j = any head with z >= theta;
//   lmax_j = max over heads of (z - m - log s) <= 0; class: 2 kept, 1 allowed but not kept,
//   0 excluded; lbin = bin of lmax on [anchor - span_l, anchor] (NL bins, top first; the last
//   bin also takes what lies below), anchor = max over heads of -log s >= every lmax.
//
// Inputs (names as in tau.py):
//   z       float   (Hq, N)     scores (first n columns)
//   hist    uint32_t (Hq, NB, 2) pass 1's fixed-point mass histogram (bin width span_t / NB)
//   m       float   (Hq,)       pass 1's maxima
//   exclude ET      (H, E)      nonzero: never select (first n columns read)
//   params  int32_t [n, N, E, chunk]
//   fparams float   [tau, span_t, span_l]
// Outputs (zero-filled; atomic on Metal):
//   code    uint32_t (H, n)      class << 16 | lbin
//   lhist   uint32_t (H, 2, NL)  token counts by lbin: [h, 0] kept, [h, 1] allowed not kept
//   counts  uint32_t (H, 2)      [kept, allowed]
//   s_out, theta_out float (Hq,)
// Template constants: NB (mass bins), NL (lmax bins), REP, ET (the exclude dtype).
// Grid: x = chunks of `chunk` tokens, y = kv head.
const int n = params[0];
const int N = params[1];
const int E = params[2];
const int chunk = params[3];
const float tau = fparams[0];
const float span_t = fparams[1];
const float span_l = fparams[2];
const int h = tq_by;
const int nwarps = tq_ntid / TQ_SIMD;

TQ_SHARED(float, theta_s, REP);
TQ_SHARED(float, m_s, REP);
TQ_SHARED(float, logs_s, REP);
TQ_SHARED(float, s_s, REP);
TQ_SHARED(float, hist_f, NB);
TQ_SHARED(float, scratch, 32);
TQ_SHARED_ATOMIC_U32(lhist_s, 2 * NL);
TQ_SHARED_ATOMIC_U32(cnt_s, 2);
for (int b = tq_tid; b < 2 * NL; b += tq_ntid) {
  TQ_ATOMIC_STORE(lhist_s, b, 0u);
}
if (tq_tid < 2) {
  TQ_ATOMIC_STORE(cnt_s, tq_tid, 0u);
}

// Per query head: stage its mass histogram, then the first bin (from the top) where the
// accumulated mass reaches tau * s.
for (int r = 0; r < REP; ++r) {
  const int qh = h * REP + r;
  for (int b = tq_tid; b < NB; b += tq_ntid) {
    const int64_t e = (int64_t(qh) * NB + b) * 2;
    hist_f[b] = tq_mass_float(hist[e], hist[e + 1]);
  }
  TQ_BARRIER();
  const tq_bound bd = tq_boundary(hist_f, NB, tau, 0.0f, scratch, tq_tid, tq_ntid);
  if (tq_tid == 0) {
    const float mq = m[qh];
    const float w = span_t / float(NB);
    const bool all = tau >= 1.0f || !bd.found || bd.bin >= NB - 1;
    theta_s[r] = all ? -TQ_INF : mq - (float(bd.bin) + 1.5f) * w;
    m_s[r] = mq;
    s_s[r] = bd.total;
    logs_s[r] = tq_log(bd.total);
  }
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
for (int j = j_begin + tq_tid; j < j_end; j += tq_ntid) {
  bool keep = false;
  float lmax = -TQ_INF;
  TQ_UNROLL for (int r = 0; r < REP; ++r) {
    const float v = z[int64_t(h * REP + r) * N + j];
    keep = keep || (v >= theta_s[r]);
    const float lp = v - m_s[r] - logs_s[r];
    lmax = lp > lmax ? lp : lmax;
  }
  const bool allowed = exclude[int64_t(h) * E + j] == ET(0);
  const uint32_t cls = allowed ? (keep ? 2u : 1u) : 0u;
  const float pos = (anchor - lmax) * inv_wl;
  const int b = pos >= float(NL - 1) ? NL - 1 : (pos > 0.0f ? int(pos) : 0);
  TQ_ATOMIC_STORE(code, int64_t(h) * n + j, (cls << 16) | uint32_t(b));
  if (allowed) {
    TQ_SHARED_ATOMIC_ADD_U32(lhist_s, (keep ? 0 : NL) + b, 1u);
    n_allowed += 1u;
    n_keep += keep ? 1u : 0u;
  }
}
if (n_allowed > 0u) {
  TQ_SHARED_ATOMIC_ADD_U32(cnt_s, 0, n_keep);
  TQ_SHARED_ATOMIC_ADD_U32(cnt_s, 1, n_allowed);
}
TQ_BARRIER();
for (int b = tq_tid; b < 2 * NL; b += tq_ntid) {
  const uint32_t c = TQ_ATOMIC_LOAD(lhist_s, b);
  if (c != 0u) {
    TQ_ATOMIC_ADD_U32(lhist, int64_t(h) * 2 * NL + b, c);
  }
}
if (tq_tid < 2) {
  const uint32_t c = TQ_ATOMIC_LOAD(cnt_s, tq_tid);
  if (c != 0u) {
    TQ_ATOMIC_ADD_U32(counts, h * 2 + tq_tid, c);
  }
}
if (tq_bx == 0 && tq_tid < REP) {
  TQ_ATOMIC_STORE(s_out, h * REP + tq_tid, s_s[tq_tid]);
  TQ_ATOMIC_STORE(theta_out, h * REP + tq_tid, theta_s[tq_tid]);
}
