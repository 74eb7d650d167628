// Selection pass 1 of 3: softmax mass histograms of one query head's scores, one per chunk of
// its tokens (a threadgroup each).
//
//   m = max of the finite z (reduced from per-block maxima, e.g. the codebook kernel's zmax;
//   from z itself where a block maximum is NaN or +inf, tq_row_max),
//   hist[qh, c, b] = sum of exp(z_j - m) over the tokens j of chunk c with (m - z_j) / w in
//   [b, b + 1), w = span / NB; bin NB - 1 also takes everything below m - span (a non-finite
//   z_j adds nothing: select_mass.h). Sums in fixed
//   point (tq_mass_fixed, select_mass.h): the same in every run.
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
const int j_begin = tq_bx * chunk;
const int j_end = (j_begin + chunk < n) ? j_begin + chunk : n;
float m[1];
tq_mass_hist<8, 1>(z, int64_t(qh) * N, N, n, j_begin, j_end, zmax, int64_t(qh) * M, M,
                   float(NB) / span, NB, hist_s, m, red, tq_tid, tq_ntid);
TQ_BARRIER();
const int64_t out = (int64_t(qh) * chunks + tq_bx) * NB * 2;
for (int i = tq_tid; i < 2 * NB; i += tq_ntid) {  // the (lo, hi) words as they are
  hist[out + i] = TQ_ATOMIC_LOAD(hist_s, i);
}
