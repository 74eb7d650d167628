// Selection pass 1b: per query head, its softmax maximum, sum and tau-cumulative threshold
// from pass 1's mass histograms, summed over the chunks exactly in 64-bit integers (one
// threadgroup per head, so that pass 2's many threadgroups per kv head only read three numbers
// per query head).
//
//   m = max of the finite z (from the block maxima zmax, or z where one of them is NaN or
//   +inf, as pass 1 reduces them: tq_row_max); s = sum of the head's histogram; theta = the
//   lower edge of the boundary bin (the bin at which the mass accumulated from the top
//   reaches tau * s) minus half a bin, -inf for tau >= 1 or a boundary in the last bin, +inf
//   for a head without a finite score.
//
// Inputs (names as in tau.py):
//   hist    uint32_t (Hq, chunks, NB, 2) pass 1's fixed-point mass histograms, one per chunk
//                                        (bin width span_t / NB)
//   zmax    float   (Hq, M)     maxima of blocks of z (as given to pass 1)
//   z       float   (Hq, N)     scores (read only where zmax has a NaN or +inf)
//   params  int32_t [M, chunks, n, N]
//   fparams float   [tau, span_t]
// Outputs (every element written):
//   m_out, s_out, theta_out float (Hq,)
// Template constants: NB.
// Grid: y = query head, one threadgroup each.
const int M = params[0];
const int chunks = params[1];
const int n = params[2];
const int N = params[3];
const float tau = fparams[0];
const float span_t = fparams[1];
const int qh = tq_by;

TQ_SHARED(float, hist_f, NB);
TQ_SHARED(float, scratch, 32);
// The histograms' loads are issued before the maximum's reduction waits on its own. Each
// chunk's (lo, hi) pair is one little-endian u64; integer sums are exact in any order.
const int64_t row = int64_t(qh) * chunks * NB;
for (int b = tq_tid; b < NB; b += tq_ntid) {
  tq_u64 sum = 0;
  for (int c = 0; c < chunks; ++c) {
    const int64_t e = (row + int64_t(c) * NB + b) * 2;
    sum += tq_u64(hist[e]) | (tq_u64(hist[e + 1]) << 32);
  }
  hist_f[b] = tq_mass_float(uint32_t(sum & 0xffffffffu), uint32_t(sum >> 32));
}
const float m = tq_row_max(zmax, int64_t(qh) * M, M, z, int64_t(qh) * N, n, scratch, tq_tid,
                           tq_ntid);
tq_write_theta(hist_f, NB, m, tau, span_t, scratch, tq_tid, tq_ntid, qh, m_out, s_out, theta_out);
