// Product-quantized key scores with score export (HCAttention's lookup-table scoring).
//
//   z[qh, j] = sum_i lut[qh, i, code_i(h, j)]     for j < n, kv head h = qh / REP
//   lut[qh, i, k] = q[qh, i*DS:(i+1)*DS] . codebook[h, GC == 1 ? 0 : i, k]
//
// Inputs (names as in codebook.py):
//   q        float    (Hq, G * DS)    queries, attention scale folded in
//   codebook float    (H, GC, C, DS)  centroids (GC = 1: one codebook for all groups)
//   lut      float    (Hq, G, C)      the table built by MLX ops (read only when LUT_SHARED == 0;
//                                     a 1-element placeholder otherwise)
//   codes    uint32_t (H, n_cap, W)   the uint8/uint16 codes of each token, as 32-bit words
//   params   int32_t  [n, n_cap, block_len]
// Outputs:
//   z        float    (Hq, n)         the exported scores
//   zmax     float    (Hq, n_blocks)  max of the finite z over each block's tokens (-inf for
//                                     none), which the selection kernels reduce instead of
//                                     re-reading z (they skip non-finite scores: a NaN or Inf
//                                     here would make them re-read the row)
// Template constants: G, C, DS, GC, W (= G * CODE_BITS / 32), CODE_BITS (8 or 16), REP (query
// heads per kv head), REP_TILE (query heads per threadgroup; divides REP), LUT_SHARED (1: the
// threadgroup builds its REP_TILE heads' table in shared memory from q and the codebook, laid
// out [group][centroid][head] so one vector load fetches every head's entry; 0: the table is
// read from `lut` in global memory), LUT_HALF (1, with LUT_SHARED: the shared table holds
// float16 entries, half the shared-memory traffic per lookup, which bounds this kernel; each
// head's entries are scaled by a power of two that puts a bound on them (largest query group
// norm times largest centroid norm) below 2^14, so none overflows, and the sums are scaled
// back exactly: every entry is rounded to 11 significant bits, sums accumulate in float32),
// VEC4 (1: W % 4 == 0, a token's codes are read as 16-byte vectors).
//
// Grid: x = blocks of block_len tokens (tq_bx), y = kv head x rep tile (tq_by). Each thread
// scores whole tokens: it reads a token's codes once and accumulates all REP_TILE query heads,
// so with REP_TILE == REP the codes (the bulk of the bytes) are read exactly once.
const int n = params[0];
const int n_cap = params[1];
const int block_len = params[2];
const int n_blocks = (n + block_len - 1) / block_len;
constexpr int CODES_PER_WORD = 32 / CODE_BITS;
constexpr uint32_t CODE_MASK = (1u << CODE_BITS) - 1u;
constexpr int TILES = REP / REP_TILE;
constexpr int D = G * DS;
constexpr int LUT_FLOATS = LUT_SHARED ? REP_TILE * G * C : 1;
constexpr int QUADS = (REP_TILE % 4 == 0) ? REP_TILE / 4 : 0;  // float4 loads per lookup
const int h = tq_by / TILES;
const int qh0 = h * REP + (tq_by % TILES) * REP_TILE;

typedef typename tq_lut_type<LUT_HALF == 1>::type lut_t;
TQ_SHARED_LUT(lut_t, lut_s, LUT_FLOATS);
TQ_SHARED(float, red, 32 * REP_TILE);
TQ_SHARED(float, q_s, LUT_SHARED ? REP_TILE * D : 1);
TQ_SHARED(float, scale_s, 2 * REP_TILE);  // per head: the table's scale, and its inverse
if (LUT_SHARED) {
  // Stage the tile's queries, then build the table: entry (i, k, r) = q[qh0 + r, group i] .
  // centroid k of group i (the codebook rows come through the L1 cache). A float16 table's
  // scale comes first, from a bound on each head's entries (below).
  for (int t = tq_tid; t < REP_TILE * D; t += tq_ntid) {
    q_s[t] = q[int64_t(qh0) * D + t];
  }
  TQ_BARRIER();
  if (LUT_HALF) {
    // |entry| <= |q group| |centroid| (Cauchy-Schwarz): each head's largest squared group norm
    // times the largest squared centroid norm of the kv head bounds its entries' squares. The
    // scale puts that bound below 2^14 (float16 overflows at 65504), a pass over the small
    // codebook instead of a pass that computes every entry twice. Norms that are not finite
    // (a NaN or Inf input) are left out of the bound: they would scale every entry to zero;
    // their own entries come out NaN or Inf, as in a float32 table.
    float cn = 0.0f;
    for (int t = tq_tid; t < GC * C; t += tq_ntid) {
      const int64_t row = (int64_t(h) * GC * C + t) * DS;
      float s2 = 0.0f;
      TQ_UNROLL for (int s = 0; s < DS; ++s) {
        const float v = codebook[row + s];
        s2 += v * v;
      }
      cn = (s2 > cn && s2 < TQ_INF) ? s2 : cn;
    }
    float qn[REP_TILE];
    TQ_UNROLL for (int r = 0; r < REP_TILE; ++r) {
      qn[r] = 0.0f;
    }
    for (int i = tq_tid; i < G; i += tq_ntid) {
      TQ_UNROLL for (int r = 0; r < REP_TILE; ++r) {
        float s2 = 0.0f;
        TQ_UNROLL for (int s = 0; s < DS; ++s) {
          const float v = q_s[r * D + i * DS + s];
          s2 += v * v;
        }
        qn[r] = (s2 > qn[r] && s2 < TQ_INF) ? s2 : qn[r];
      }
    }
    const float cmax = tq_block_all<true>(cn, red, tq_tid, tq_ntid);
    const float qmax = tq_block_rows<REP_TILE, true>(qn, red, tq_tid, tq_ntid);
    if (tq_tid < REP_TILE) {
      const int e = tq_pow2_exponent_above_sqrt(qmax * cmax);  // bound < 2^e
      const int sh = (14 - e) < -100 ? -100 : ((14 - e) > 100 ? 100 : 14 - e);
      scale_s[tq_tid] = tq_pow2(sh);
      scale_s[REP_TILE + tq_tid] = tq_pow2(-sh);
    }
    TQ_BARRIER();
  }
  for (int t = tq_tid; t < G * C; t += tq_ntid) {
    const int i = t / C;
    const int k = t - i * C;
    const int64_t cb_row = ((int64_t(h) * GC + (GC == 1 ? 0 : i)) * C + k) * DS;
    float cv[DS];
    TQ_UNROLL for (int s = 0; s < DS; ++s) {
      cv[s] = codebook[cb_row + s];
    }
    TQ_UNROLL for (int r = 0; r < REP_TILE; ++r) {
      float acc = 0.0f;
      TQ_UNROLL for (int s = 0; s < DS; ++s) {
        acc += q_s[r * D + i * DS + s] * cv[s];
      }
      lut_s[t * REP_TILE + r] = lut_t(LUT_HALF ? acc * scale_s[r] : acc);
    }
  }
}
TQ_BARRIER();
// The factor that undoes each head's table scale (exact: a power of two), held in registers.
float inv_scale[REP_TILE];
TQ_UNROLL for (int r = 0; r < REP_TILE; ++r) {
  inv_scale[r] = (LUT_SHARED && LUT_HALF) ? scale_s[REP_TILE + r] : 1.0f;
}

float best[REP_TILE];
TQ_UNROLL for (int r = 0; r < REP_TILE; ++r) {
  best[r] = -TQ_INF;
}
const int j_begin = tq_bx * block_len;
const int j_end = (j_begin + block_len < n) ? j_begin + block_len : n;
for (int j = j_begin + tq_tid; j < j_end; j += tq_ntid) {
  float acc[REP_TILE];
  TQ_UNROLL for (int r = 0; r < REP_TILE; ++r) {
    acc[r] = 0.0f;
  }
  const int64_t row = (int64_t(h) * n_cap + j) * W;
  uint32_t words[W];
  if (VEC4) {
    TQ_UNROLL for (int w4 = 0; w4 < W / 4; ++w4) {
      const uint4 v = TQ_LOAD_UINT4(codes, row / 4 + w4);
      words[4 * w4 + 0] = v.x;
      words[4 * w4 + 1] = v.y;
      words[4 * w4 + 2] = v.z;
      words[4 * w4 + 3] = v.w;
    }
  } else {
    TQ_UNROLL for (int w = 0; w < W; ++w) {
      words[w] = codes[row + w];
    }
  }
  TQ_UNROLL for (int w = 0; w < W; ++w) {
    TQ_UNROLL for (int k = 0; k < CODES_PER_WORD; ++k) {
      const int i = w * CODES_PER_WORD + k;
      const int code = int((words[w] >> (k * CODE_BITS)) & CODE_MASK);
      if (LUT_SHARED && QUADS > 0) {
        TQ_UNROLL for (int u = 0; u < QUADS; ++u) {
          const float4 v = tq_shared_load4(lut_s, (i * C + code) * QUADS + u);
          acc[4 * u + 0] += v.x;
          acc[4 * u + 1] += v.y;
          acc[4 * u + 2] += v.z;
          acc[4 * u + 3] += v.w;
        }
      } else {
        TQ_UNROLL for (int r = 0; r < REP_TILE; ++r) {
          if (LUT_SHARED) {
            acc[r] += float(lut_s[(i * C + code) * REP_TILE + r]);
          } else {
            acc[r] += lut[(int64_t(qh0 + r) * G + i) * C + code];
          }
        }
      }
    }
  }
  TQ_UNROLL for (int r = 0; r < REP_TILE; ++r) {
    const float v = acc[r] * inv_scale[r];
    z[int64_t(qh0 + r) * n + j] = v;
    best[r] = v > best[r] ? v : best[r];  // NaN never wins
  }
}
// A +inf score (rare) hides the finite maximum: this thread's own scores again, without it
// (a test in the loop above pushed a 1024-thread CUDA variant over 64 registers per thread).
TQ_UNROLL for (int r = 0; r < REP_TILE; ++r) {
  if (best[r] == TQ_INF) {
    float b = -TQ_INF;
    const int jb = tq_bx * params[2];  // (from params again: nothing more held in the loop)
    const int je = (jb + params[2] < params[0]) ? jb + params[2] : params[0];
    for (int j = jb + tq_tid; j < je; j += tq_ntid) {
      const float v = z[int64_t(qh0 + r) * params[0] + j];
      b = (v > b && v < TQ_INF) ? v : b;
    }
    best[r] = b;
  }
}

// Block maxima per query head.
const float block_max = tq_block_rows<REP_TILE, true>(best, red, tq_tid, tq_ntid);
if (tq_tid < REP_TILE && tq_bx < n_blocks) {  // (a persistent grid may have spare blocks)
  zmax[int64_t(qh0 + tq_tid) * n_blocks + tq_bx] = block_max;
}
