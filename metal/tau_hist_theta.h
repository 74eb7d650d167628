// Selection passes 1 and 1b in one launch, for rows short enough that one threadgroup per
// query head reads its row fast (tau.py: SELECT_FUSED_TOKENS): the mass histogram of the
// whole row in shared memory (tq_mass_hist, as tau_hist.h), then m, s and theta from it
// (tau_theta.h's result, tq_write_theta). Same sums, same result as the two launches.
//
// Inputs (names as in tau.py):
//   z       float   (Hq, N)     scores; only the first n columns are read
//   zmax    float   (Hq, M)     maxima of blocks of z (any partition of the n columns)
//   params  int32_t [n, N, M]
//   fparams float   [tau, span_t]
// Outputs (every element written):
//   m_out, s_out, theta_out float (Hq,)
// Template constants: NB (bins), BPT (bins per thread: NB / threads), U (loads per thread in
// flight: one threadgroup reads the whole row).
// Grid: y = query head, one threadgroup each.
const int n = params[0];
const int N = params[1];
const int M = params[2];
const float tau = fparams[0];
const float span_t = fparams[1];
const int qh = tq_by;

TQ_SHARED_ATOMIC_U64(hist_s, NB);
TQ_SHARED(float, red, 32);
float mr[1];
tq_mass_hist<U, 1>(z, int64_t(qh) * N, N, n, 0, n, zmax, int64_t(qh) * M, M,
                   float(NB) / span_t, NB, hist_s, mr, red, tq_tid, tq_ntid);
const float m = mr[0];
TQ_BARRIER();
// The sums as floats, in place (CUDA's static shared memory holds 48 KB: the fixed-point pairs
// take 32 KB of it at NB = 4096): every thread reads its bins' pairs, and writes float b into
// word b only after all of them have read.
float mass[BPT];
TQ_UNROLL for (int i = 0; i < BPT; ++i) {
  const int b = tq_tid + i * tq_ntid;
  mass[i] = tq_mass_float(TQ_ATOMIC_LOAD(hist_s, 2 * b), TQ_ATOMIC_LOAD(hist_s, 2 * b + 1));
}
TQ_BARRIER();
TQ_TG float* hist_f = reinterpret_cast<TQ_TG float*>(hist_s);
TQ_UNROLL for (int i = 0; i < BPT; ++i) {
  hist_f[tq_tid + i * tq_ntid] = mass[i];
}
TQ_BARRIER();
tq_write_theta(hist_f, NB, m, tau, span_t, red, tq_tid, tq_ntid, qh, m_out, s_out, theta_out);
