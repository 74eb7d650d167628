// Product-quantized key scores with score export (HCAttention's lookup-table scoring).
//
//   z[qh, j] = sum_i lut[qh, i, code_i(h, j)]     for j < n, kv head h = qh / REP
//
// Inputs (names as in codebook.py):
//   lut    float    (Hq, G, C)      per query head and group: q_group . centroid (scale folded in)
//   codes  uint32_t (H, n_cap, W)   the uint8/uint16 codes of each token, viewed as 32-bit words
//   params int32_t  [n, n_cap, block_len]
// Output:
//   z      float    (Hq, n)
// Template constants: G, C, W (= G * CODE_BITS / 32), CODE_BITS (8 or 16), REP (query heads
// per kv head), REP_TILE (query heads handled per threadgroup; divides REP), LUT_SHARED (1: the
// threadgroup's REP_TILE * G * C table is staged in shared memory; 0: read from global memory).
//
// Grid: x = blocks of block_len tokens (tq_bx), y = kv head x rep tile (tq_by). Each thread
// scores whole tokens: it reads a token's codes once and accumulates all REP_TILE query heads,
// so with REP_TILE == REP the codes (the bulk of the bytes) are read exactly once.
const int n = params[0];
const int n_cap = params[1];
const int block_len = params[2];
constexpr int CODES_PER_WORD = 32 / CODE_BITS;
constexpr uint32_t CODE_MASK = (1u << CODE_BITS) - 1u;
constexpr int LUT_FLOATS = REP_TILE * G * C;
constexpr int TILES = REP / REP_TILE;
const int h = tq_by / TILES;
const int qh0 = h * REP + (tq_by % TILES) * REP_TILE;
const int64_t lut_base = int64_t(qh0) * (G * C);

TQ_SHARED_LUT(float, lut_s, LUT_SHARED ? LUT_FLOATS : 1);
if (LUT_SHARED) {
  for (int t = tq_tid; t < LUT_FLOATS; t += tq_ntid) {
    lut_s[t] = lut[lut_base + t];
  }
}
TQ_BARRIER();

const int j_begin = tq_bx * block_len;
const int j_end = (j_begin + block_len < n) ? j_begin + block_len : n;
for (int j = j_begin + tq_tid; j < j_end; j += tq_ntid) {
  float acc[REP_TILE];
  TQ_UNROLL for (int r = 0; r < REP_TILE; ++r) {
    acc[r] = 0.0f;
  }
  const int64_t row = (int64_t(h) * n_cap + j) * W;
  TQ_UNROLL for (int w = 0; w < W; ++w) {
    const uint32_t word = codes[row + w];
    TQ_UNROLL for (int k = 0; k < CODES_PER_WORD; ++k) {
      const int i = w * CODES_PER_WORD + k;
      const int code = int((word >> (k * CODE_BITS)) & CODE_MASK);
      TQ_UNROLL for (int r = 0; r < REP_TILE; ++r) {
        const int e = (r * G + i) * C + code;
        float v;
        if (LUT_SHARED) {
          v = lut_s[e];
        } else {
          v = lut[lut_base + e];
        }
        acc[r] += v;
      }
    }
  }
  TQ_UNROLL for (int r = 0; r < REP_TILE; ++r) {
    z[int64_t(qh0 + r) * n + j] = acc[r];
  }
}
