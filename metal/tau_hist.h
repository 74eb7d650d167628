// Selection pass 1 of 3: softmax mass histograms of one query head's scores, one per chunk of
// its tokens (a threadgroup each).
//
//   m = max z (reduced from per-block maxima, e.g. the codebook kernel's zmax),
//   hist[qh, c, b] = sum of exp(z_j - m) over the tokens j of chunk c with (m - z_j) / w in
//   [b, b + 1), w = span / NB; bin NB - 1 also takes everything below m - span. Sums in fixed
//   point (tq_mass_fixed, select_common.h): the same in every run.
//
// Each threadgroup writes every bin of its own row, so the launch needs no zero fill and no
// atomics on global memory (pass 1b sums the rows).
//
// Inputs (names as in tau.py):
//   z       float   (Hq, N)     scores; only the first n columns are read
//   zmax    float   (Hq, M)     maxima of blocks of z (any partition of the n columns)
//   params  int32_t [n, N, M, chunk, chunks]
//   fparams float   [span]
// Output (every element written):
//   hist    uint32_t (Hq, chunks, NB, 2) fixed-point sums as (lo, hi) pairs
// (pass 1b reduces the same zmax row to the same m: a maximum does not depend on the order.)
// Template constants: NB (bins).
// Grid: x = chunks of `chunk` tokens (tq_bx), y = query head (tq_by).
const int n = params[0];
const int N = params[1];
const int M = params[2];
const int chunk = params[3];
const int chunks = params[4];
const float span = fparams[0];
const int qh = tq_by;

TQ_SHARED_ATOMIC_U64(hist_s, NB);
TQ_SHARED(float, red, 32);
for (int b = tq_tid; b < NB; b += tq_ntid) {
  tq_shared_zero_u64(hist_s, b);
}
float mm = -TQ_INF;
for (int t = tq_tid; t < M; t += tq_ntid) {
  const float v = zmax[int64_t(qh) * M + t];
  mm = v > mm ? v : mm;
}
const float m = tq_block_all<true>(mm, red, tq_tid, tq_ntid);

const float inv_w = float(NB) / span;
const int j_begin = tq_bx * chunk;
const int j_end = (j_begin + chunk < n) ? j_begin + chunk : n;
const int64_t row = int64_t(qh) * N;
constexpr int U = 8;  // tokens per thread whose loads are issued before any is used
for (int j0 = j_begin + tq_tid; j0 < j_end; j0 += U * tq_ntid) {
  float vs[U];
  TQ_UNROLL for (int u = 0; u < U; ++u) {
    const int j = j0 + u * tq_ntid;
    vs[u] = j < j_end ? z[row + j] : -TQ_INF;
  }
  TQ_UNROLL for (int u = 0; u < U; ++u) {
    if (j0 + u * tq_ntid < j_end) {
      const float v = vs[u];
      const float pos = (m - v) * inv_w;
      const int b = pos >= float(NB - 1) ? NB - 1 : (pos > 0.0f ? int(pos) : 0);
      tq_shared_add_u64(hist_s, b, tq_mass_fixed(tq_exp(v - m)));
    }
  }
}
TQ_BARRIER();
const int64_t out = (int64_t(qh) * chunks + tq_bx) * NB * 2;
for (int i = tq_tid; i < 2 * NB; i += tq_ntid) {
  hist[out + i] = TQ_ATOMIC_LOAD(hist_s, i);  // the (lo, hi) words, as tq_shared_add_u64 left them
}
