// Softmax statistics and the tau-cumulative threshold of one query head per threadgroup,
// without a sort: a max pass, then PASSES histogram passes, each splitting the boundary bin
// of the previous pass into NB finer log-domain bins.
//
//   m = max_j z_j,  s = sum_j exp(z_j - m),  theta = the logit of the smallest kept token when
//   tokens are kept by descending z until their softmax mass reaches tau; over the finite z_j
//   only (m = -inf, s = 0, theta = +inf for a row without one)
//
// Inputs (names as in tau.py):
//   z       float   (Hq, N)    scores; only the first n columns are read
//   params  int32_t [n, N]
//   fparams float   [tau, span]
// Outputs:
//   m_out, s_out, theta_out  float (Hq,)
// Template constants: NB (bins per pass), PASSES.
//
// Pass p bins z on [lo, lo + NB * w) with w = span / NB^(p+1); slot 0 collects the mass below
// lo and slot NB + 1 the mass at or above the range, so each pass is self-contained: the
// boundary bin is the lowest bin at which the mass accumulated from the top reaches tau * s.
// The first pass covers [m - span, m) and yields s as the total of its slots. The final
// threshold is the lower edge of the last boundary bin, minus half a bin so that rounding
// never drops a token of that bin: it keeps at most the tokens within ~1.5 final bin widths
// (span / NB^PASSES logits) below the exact threshold in addition to the exact set.
constexpr int NS = NB + 2;
const int n = params[0];
const int N = params[1];
const float tau = fparams[0];
const float span = fparams[1];
const int qh = tq_by;
const int64_t base = int64_t(qh) * N;

TQ_SHARED(float, red, 32 * NS);
TQ_SHARED(float, hist, NS);

// Each thread loads UNROLL scores before using any, to keep enough loads in flight: one
// threadgroup streams a whole head. Out-of-range slots read as -inf, which adds exp(-inf) = 0
// to the "below" slot and nothing else.
constexpr int UNROLL = 8;
float zmax = -TQ_INF;
for (int j0 = tq_tid; j0 < n; j0 += UNROLL * tq_ntid) {
  TQ_UNROLL for (int u = 0; u < UNROLL; ++u) {
    const int j = j0 + u * tq_ntid;
    const float v = j < n ? z[base + j] : -TQ_INF;
    zmax = (v > zmax && v < TQ_INF) ? v : zmax;  // finite scores only: NaN, +-inf are absent
  }
}
const float m = tq_block_all<true>(zmax, red, tq_tid, tq_ntid);

float lo = m - span;
float w = span / float(NB);
float s = 0.0f;
float theta = lo;
for (int pass = 0; pass < PASSES; ++pass) {
  const float inv_w = 1.0f / w;
  float acc[NS];
  TQ_UNROLL for (int k = 0; k < NS; ++k) {
    acc[k] = 0.0f;
  }
  for (int j0 = tq_tid; j0 < n; j0 += UNROLL * tq_ntid) {
    float vs[UNROLL];
    TQ_UNROLL for (int u = 0; u < UNROLL; ++u) {
      const int j = j0 + u * tq_ntid;
      vs[u] = j < n ? z[base + j] : -TQ_INF;
    }
    TQ_UNROLL for (int u = 0; u < UNROLL; ++u) {
      const float v = vs[u];
      float e = tq_exp(v - m);
      e = e < TQ_INF ? e : 0.0f;  // NaN or +inf for a non-finite score: no mass
      const float pos = (v - lo) * inv_w;
      if (pos >= float(NB)) {
        acc[NS - 1] += e;
      } else if (pos < 0.0f) {
        acc[0] += e;
      } else {
        const int b = int(pos) + 1;
        TQ_UNROLL for (int k = 1; k <= NB; ++k) {
          acc[k] += (b == k) ? e : 0.0f;
        }
      }
    }
  }
  const float t = tq_block_rows<NS, false>(acc, red, tq_tid, tq_ntid);
  if (tq_tid < NS) {
    hist[tq_tid] = t;
  }
  TQ_BARRIER();
  // Every thread scans the NS totals itself, so all of them agree without a broadcast.
  if (pass == 0) {
    for (int k = 0; k < NS; ++k) {
      s += hist[k];
    }
  }
  const float target = tau * s;
  float cum = hist[NS - 1];
  int bstar = NB;  // mass above the range already reaches tau (rounding): refine the top bin
  if (cum < target) {
    bstar = 1;  // never reached inside the range (tau ~ 1): refine the bottom bin
    for (int k = NB; k >= 1; --k) {
      cum += hist[k];
      if (cum >= target) {
        bstar = k;
        break;
      }
    }
  }
  theta = lo + float(bstar - 1) * w;
  lo = theta;
  w = w / float(NB);
  TQ_BARRIER();
}

if (tq_tid == 0) {
  m_out[qh] = m;
  s_out[qh] = s;
  theta_out[qh] = s > 0.0f ? theta - 0.5f * float(NB) * w : TQ_INF;  // no finite score: none
}
