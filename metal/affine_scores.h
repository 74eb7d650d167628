// Scores against affine-quantized keys (mx.quantize layout) with score export.
//
//   z[qh, j] = sum_k q[qh, k] * (scale[h, j, k / GS] * w[h, j, k] + bias[h, j, k / GS])
//            = sum_g scale_g * (q_g . w_g) + bias_g * sum(q_g)         for j < n, h = qh / REP
//
// Inputs (names as in affine.py):
//   q      float    (Hq, D)                query, attention scale folded in
//   wq     uint32_t (H, n_cap, D*BITS/32)  packed keys: element k at bits [k*BITS, (k+1)*BITS)
//                                          of the row's little-endian bit stream (any BITS)
//   scales T        (H, n_cap, D/GS)       T = the keys' float dtype
//   biases T        (H, n_cap, D/GS)
//   params int32_t  [n, n_cap, block_len]
// Output:
//   z      float    (Hq, n)
// Template constants: D, BITS, GS (group size), REP.
//
// Grid: x = blocks of block_len tokens, y = kv head. The REP query rows and their per-group
// sums sit in shared memory; each thread reads one token's packed row once for all REP heads.
const int n = params[0];
const int n_cap = params[1];
const int block_len = params[2];
constexpr int NG = D / GS;
constexpr int WPR = D * BITS / 32;
constexpr int GW = GS * BITS / 32;
constexpr uint32_t MASK = (1u << BITS) - 1u;
const int h = tq_by;

// q as float4 so the inner loop reads four query values per shared-memory load.
TQ_SHARED(float4, q_s, REP * D / 4);
TQ_SHARED(float, qsum_s, REP * NG);
for (int t = tq_tid; t < REP * D / 4; t += tq_ntid) {
  const int64_t o = int64_t(h) * (REP * D) + 4 * t;
  q_s[t] = tq_float4(q[o], q[o + 1], q[o + 2], q[o + 3]);
}
TQ_BARRIER();
for (int t = tq_tid; t < REP * NG; t += tq_ntid) {
  float a = 0.0f;
  for (int k = 0; k < GS / 4; ++k) {
    const float4 v = q_s[t * (GS / 4) + k];
    a += (v.x + v.y) + (v.z + v.w);
  }
  qsum_s[t] = a;
}
TQ_BARRIER();

const int j_begin = tq_bx * block_len;
const int j_end = (j_begin + block_len < n) ? j_begin + block_len : n;
for (int j = j_begin + tq_tid; j < j_end; j += tq_ntid) {
  float acc[REP];
  TQ_UNROLL for (int r = 0; r < REP; ++r) {
    acc[r] = 0.0f;
  }
  const int64_t tok = int64_t(h) * n_cap + j;
  TQ_UNROLL for (int gi = 0; gi < NG; ++gi) {
    uint32_t wv[GW];
    TQ_UNROLL for (int u = 0; u < GW; ++u) {
      wv[u] = wq[tok * WPR + gi * GW + u];
    }
    float dot[REP];
    TQ_UNROLL for (int r = 0; r < REP; ++r) {
      dot[r] = 0.0f;
    }
    TQ_UNROLL for (int k4 = 0; k4 < GS / 4; ++k4) {
      float fv[4];
      TQ_UNROLL for (int u = 0; u < 4; ++u) {
        const int bit = (4 * k4 + u) * BITS;
        const int sh = bit % 32;
        uint32_t v = wv[bit / 32] >> sh;
        if (sh + BITS > 32) {
          v |= wv[bit / 32 + 1] << (32 - sh);
        }
        // int -> float without a conversion instruction: 2^23 + v, exact for v < 2^23.
        fv[u] = tq_as_float(0x4B000000u | (v & MASK)) - 8388608.0f;
      }
      TQ_UNROLL for (int r = 0; r < REP; ++r) {
        const float4 qv = q_s[r * (D / 4) + gi * (GS / 4) + k4];
        dot[r] += qv.x * fv[0] + qv.y * fv[1] + qv.z * fv[2] + qv.w * fv[3];
      }
    }
    const float sc = float(scales[tok * NG + gi]);
    const float bi = float(biases[tok * NG + gi]);
    TQ_UNROLL for (int r = 0; r < REP; ++r) {
      acc[r] += sc * dot[r] + bi * qsum_s[r * NG + gi];
    }
  }
  TQ_UNROLL for (int r = 0; r < REP; ++r) {
    z[int64_t(h * REP + r) * n + j] = acc[r];
  }
}
