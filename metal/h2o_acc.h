// H2O accumulator update of one decode step in one pass (the EMA of attention mass that picks
// the heavy hitters), instead of the half-dozen MLX ops and (Hq, n) temporaries it takes
// otherwise:
//
//   acc_out[h, j] = alpha acc[h, j] + (1 - alpha) / REP sum_r exp(z[h REP + r, j] - m[h REP + r])
//                                                      / s[h REP + r]        for j < n
//   acc_out[h, j] = acc[h, j]                                                 for n <= j < C
//
// Inputs (names as in h2o.py):
//   acc     float   (H, C)   the accumulators
//   z       float   (Hq, N)  scores; only the first n columns are read
//   m, s    float   (Hq,)    softmax max and sum of each query head's row
//   params  int32_t [n, N, C]
//   fparams float   [alpha]
// Output (every element written): acc_out float (H, C).
// A probability that is not finite (a NaN or Inf score, or a head without a finite score:
// m = -inf, s = 0) adds nothing, so finite accumulators stay finite.
// Template constant: REP (query heads per kv head).
// Grid: x = columns, one thread each; y = kv head.
const int n = params[0];
const int N = params[1];
const int C = params[2];
const float alpha = fparams[0];
const int h = tq_by;
const int j = tq_bx * tq_ntid + tq_tid;
if (j < C) {
  const int64_t at = int64_t(h) * C + j;
  float a = acc[at];
  if (j < n) {
    float p = 0.0f;
    TQ_UNROLL for (int r = 0; r < REP; ++r) {
      const int qh = h * REP + r;
      const float c = tq_exp(z[int64_t(qh) * N + j] - m[qh]) / s[qh];
      p += c < TQ_INF ? c : 0.0f;
    }
    a = alpha * a + (1.0f - alpha) * (p / float(REP));
  }
  acc_out[at] = a;
}
