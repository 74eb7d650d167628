// Passes 1 and 1b of the selection (tau_hist.h, tau_theta.h, tau_hist_theta.h, and the
// persistent kernel's first phases): each query head's softmax mass histogrammed in fixed point,
// and its threshold. Goes into the kernel header after reduce_common.h and select_boundary.h;
// select_rank.h holds passes 2 and 3.
//
// What every selection pass keeps to (select_rank.h too):
//
// Non-finite scores (NaN, +-inf) are absent: never selected, no softmax mass, no count; a row
// (query head) without a finite score has m = -inf, s = 0 and theta = +inf, and selects
// nothing. Each pass skips them with a comparison that is false for NaN (Metal and CUDA keep
// IEEE comparisons: MLX builds these kernels without fast math), in the loop it already runs.
//
// Determinism: every sum that decides which tokens are selected is order-independent, so a
// selection is the same in every run (the overlap scheduler's results must not depend on how
// many workers ran or how the GPU scheduled its threads). Softmax masses are histogrammed in
// fixed point (tq_mass_fixed: 2^36 per unit, exact integer atomics), token counts are integers,
// and the tokens of the cap's boundary bin are taken in index order (tau_compact.h).

// exp(v - m) in (0, 1] as a fixed-point integer (2^36 per unit; below 1.5e-11 rounds to 0).
// Sums of up to 2^28 tokens fit 64 bits.
TQ_DEVICE_FN tq_u64 tq_mass_fixed(const float e) {
  return tq_u64(e * 68719476736.0f);
}

// Fixed-point sums in shared memory: name[2 i] and name[2 i + 1] hold sum i's low and high
// 32 bits, added with 32-bit atomics (native on both backends); an add that wraps the low word
// carries one into the high word, so the pair is exact whatever order the adds come in.
#define TQ_SHARED_ATOMIC_U64(name, count) TQ_SHARED_ATOMIC_U32(name, 2 * (count))

TQ_DEVICE_FN void tq_shared_zero_u64(TQ_TG TQ_ATOMIC_U32* p, const int i) {
  TQ_ATOMIC_STORE(p, 2 * i, 0u);
  TQ_ATOMIC_STORE(p, 2 * i + 1, 0u);
}

TQ_DEVICE_FN void tq_shared_add_u64(TQ_TG TQ_ATOMIC_U32* p, const int i, const tq_u64 v) {
  const uint32_t lo = uint32_t(v & 0xffffffffu);
  uint32_t hi = uint32_t(v >> 32);
  if (lo != 0u) {
    const uint32_t old = TQ_SHARED_ATOMIC_ADD_U32(p, 2 * i, lo);
    hi += (old + lo < old) ? 1u : 0u;
  }
  if (hi != 0u) {
    TQ_SHARED_ATOMIC_ADD_U32(p, 2 * i + 1, hi);
  }
}

// The maximum of the finite scores of one row (-inf if none), returned to every thread: from
// the row's block maxima zmax[at .. at + M) (the same in every threadgroup: a maximum does
// not depend on the order). A block maximum that is NaN or +inf (MLX's max propagates them)
// hides its block's finite maximum: then the row's scores z[zrow .. zrow + n) are read
// instead (every thread sees the same reduced flag, so the branch and its barriers are
// uniform). red holds at least 32 floats.
TQ_DEVICE_FN float tq_row_max(TQ_GLOBAL const float* zmax, const int64_t at, const int M,
                              TQ_GLOBAL const float* z, const int64_t zrow, const int n,
                              TQ_TG float* red, const int tid, const int ntid) {
  float mm = -TQ_INF;
  for (int t = tid; t < M; t += ntid) {
    const float v = zmax[at + t];
    mm = v < TQ_INF ? (v > mm ? v : mm) : TQ_INF;  // +inf flags NaN and +inf
  }
  float m = tq_block_all<true>(mm, red, tid, ntid);
  if (m == TQ_INF) {
    mm = -TQ_INF;
    for (int j = tid; j < n; j += ntid) {
      const float v = z[zrow + j];
      mm = (v > mm && v < TQ_INF) ? v : mm;
    }
    m = tq_block_all<true>(mm, red, tid, ntid);
  }
  return m;
}

// Pass 1's histograms of R consecutive rows (query heads), in shared memory: hist (R x nb
// fixed-point sums, row r at r * nb) is zeroed, m[r] = the maximum of the finite scores of z
// row row + r * N (n scores; from zmax row zat + r * M, M block maxima each: tq_row_max),
// and the softmax masses exp(z_j - m[r]) of the tokens j in [j_begin, j_end) of that row are
// added, bin b holding (m[r] - z_j) * inv_w in [b, b + 1) (the last bin also takes
// everything lower; a non-finite z_j adds nothing). U tokens' loads per thread are issued
// before any is used. Every thread gets m; the caller puts a barrier before reading hist.
template <int U, int R>
TQ_DEVICE_FN void tq_mass_hist(
    TQ_GLOBAL const float* z, const int64_t row, const int64_t N, const int n,
    const int j_begin, const int j_end, TQ_GLOBAL const float* zmax, const int64_t zat,
    const int M, const float inv_w, const int nb, TQ_TG TQ_ATOMIC_U32* hist,
    TQ_THREAD float* m, TQ_TG float* red, const int tid, const int ntid) {
  for (int b = tid; b < R * nb; b += ntid) {
    tq_shared_zero_u64(hist, b);
  }
  TQ_UNROLL for (int r = 0; r < R; ++r) {  // its barriers order the zeroing
    m[r] = tq_row_max(zmax, zat + r * M, M, z, row + r * N, n, red, tid, ntid);
  }
  for (int j0 = j_begin + tid; j0 < j_end; j0 += U * ntid) {
    float vs[U][R];
    TQ_UNROLL for (int u = 0; u < U; ++u) {
      const int j = j0 + u * ntid;
      TQ_UNROLL for (int r = 0; r < R; ++r) {
        vs[u][r] = j < j_end ? z[row + r * N + j] : -TQ_INF;
      }
    }
    TQ_UNROLL for (int u = 0; u < U; ++u) {
      if (j0 + u * ntid < j_end) {
        TQ_UNROLL for (int r = 0; r < R; ++r) {
          const float v = vs[u][r];
          const float pos = (m[r] - v) * inv_w;  // NaN for NaN: bin 0, with no mass
          const int b = pos >= float(nb - 1) ? nb - 1 : (pos > 0.0f ? int(pos) : 0);
          const float e = tq_exp(v - m[r]);  // NaN or +inf for a non-finite score: skipped
          tq_shared_add_u64(hist, r * nb + b, e < TQ_INF ? tq_mass_fixed(e) : tq_u64(0));
        }
      }
    }
  }
}

// A fixed-point sum stored as a uint32 (lo, hi) pair at p[2 i], as a float.
TQ_DEVICE_FN float tq_mass_float(const uint32_t lo, const uint32_t hi) {
  return float(hi) * 0.0625f + float(lo) * 1.4551915228366852e-11f;  // 2^-4, 2^-36
}

// The threshold from a mass histogram's boundary (tq_boundary with scale tau): the lower edge
// of the boundary bin minus half a bin, -inf for tau >= 1 or a boundary in the last bin; +inf
// for a row without mass (no finite score: it keeps nothing).
TQ_DEVICE_FN float tq_theta_of(const tq_bound bd, const int nb, const float m, const float tau,
                               const float span_t) {
  if (!(bd.total > 0.0f)) {
    return TQ_INF;
  }
  const bool all = tau >= 1.0f || !bd.found || bd.bin >= nb - 1;
  return all ? -TQ_INF : m - (float(bd.bin) + 1.5f) * (span_t / float(nb));
}

// Pass 1b's result for query head qh from its float mass histogram hist_f (nb bins of width
// span_t / nb below m, shared memory): m, the sum s, and theta = the lower edge of the bin at
// which the mass accumulated from the top reaches tau * s, minus half a bin (-inf for
// tau >= 1 or a boundary in the last bin, +inf for a row without mass). Every thread must call
// it (tq_boundary).
TQ_DEVICE_FN void tq_write_theta(
    TQ_TG const float* hist_f, const int nb, const float m, const float tau, const float span_t,
    TQ_TG float* scratch, const int tid, const int ntid, const int qh, TQ_GLOBAL float* m_out,
    TQ_GLOBAL float* s_out, TQ_GLOBAL float* theta_out) {
  const tq_bound bd = tq_boundary(hist_f, nb, tau, 0.0f, scratch, tid, ntid);
  if (tid == 0) {
    m_out[qh] = m;
    s_out[qh] = bd.total;
    theta_out[qh] = tq_theta_of(bd, nb, m, tau, span_t);
  }
}
