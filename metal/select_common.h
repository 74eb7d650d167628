// Shared by the selection passes (tau_hist.h, tau_theta.h, tau_keys.h, tau_compact.h); goes
// into the kernel header.
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

// The maximum of one row of block maxima zmax (M, the same in every threadgroup: a maximum
// does not depend on the order), returned to every thread. red holds at least 32 floats.
TQ_DEVICE_FN float tq_row_max(TQ_GLOBAL const float* zmax, const int64_t at, const int M,
                              TQ_TG float* red, const int tid, const int ntid) {
  float mm = -TQ_INF;
  for (int t = tid; t < M; t += ntid) {
    const float v = zmax[at + t];
    mm = v > mm ? v : mm;
  }
  return tq_block_all<true>(mm, red, tid, ntid);
}

// Pass 1's histogram, in shared memory: hist (nb fixed-point sums) is zeroed, m = the maximum
// of the zmax row at `zat` (M block maxima), and the softmax masses exp(z_j - m) of the tokens
// j in [j_begin, j_end) of the z row at `row` are added, bin b holding (m - z_j) * inv_w in
// [b, b + 1) (the last bin also takes everything lower). U loads per thread are issued before
// any is used. Returns m to every thread; the caller puts a barrier before reading hist.
template <int U>
TQ_DEVICE_FN float tq_mass_hist(
    TQ_GLOBAL const float* z, const int64_t row, const int j_begin, const int j_end,
    TQ_GLOBAL const float* zmax, const int64_t zat, const int M, const float inv_w,
    const int nb, TQ_TG TQ_ATOMIC_U32* hist, TQ_TG float* red, const int tid, const int ntid) {
  for (int b = tid; b < nb; b += ntid) {
    tq_shared_zero_u64(hist, b);
  }
  const float m = tq_row_max(zmax, zat, M, red, tid, ntid);  // its barriers order the zeroing
  for (int j0 = j_begin + tid; j0 < j_end; j0 += U * ntid) {
    float vs[U];
    TQ_UNROLL for (int u = 0; u < U; ++u) {
      const int j = j0 + u * ntid;
      vs[u] = j < j_end ? z[row + j] : -TQ_INF;
    }
    TQ_UNROLL for (int u = 0; u < U; ++u) {
      if (j0 + u * ntid < j_end) {
        const float v = vs[u];
        const float pos = (m - v) * inv_w;
        const int b = pos >= float(nb - 1) ? nb - 1 : (pos > 0.0f ? int(pos) : 0);
        tq_shared_add_u64(hist, b, tq_mass_fixed(tq_exp(v - m)));
      }
    }
  }
  return m;
}

// A fixed-point sum stored as a uint32 (lo, hi) pair at p[2 i], as a float.
TQ_DEVICE_FN float tq_mass_float(const uint32_t lo, const uint32_t hi) {
  return float(hi) * 0.0625f + float(lo) * 1.4551915228366852e-11f;  // 2^-4, 2^-36
}

// Where the cap falls in the ranked tokens of one kv head, from pass 2's class counts:
// k = min(clamp(kept, floor, cap), allowed) tokens are selected, the last of them in class
// bcls (2 kept, 1 allowed but not kept), which must give target tokens. The caller finds the
// boundary bin of that class's lmax histogram (row (h, bcls == 2 ? 0 : 1)) with tq_boundary.
struct tq_cap {
  int k;
  int bcls;
  int target;
};

TQ_DEVICE_FN tq_cap tq_cap_plan(const int n_keep, const int n_allowed, const int floor_,
                                const int cap) {
  tq_cap c;
  int k = n_keep < floor_ ? floor_ : n_keep;
  k = k > cap ? cap : k;
  c.k = k > n_allowed ? n_allowed : k;
  c.bcls = c.k <= n_keep ? 2 : 1;
  c.target = c.bcls == 2 ? c.k : c.k - n_keep;
  return c;
}
//
// tq_boundary: the first bin b of v[0 .. nv) (bin 0 is the top) at which the running sum
// v[0] + ... + v[b] reaches target = scale * (sum of v) + offset. Every thread of the
// threadgroup must call it (it has barriers); v and scratch (>= 32 floats) are shared memory.
// Each warp sums one segment of bins, the segment is found from those sums, and each warp
// then scans that segment 32 bins at a time with a warp prefix sum: a few hundred cycles
// instead of a scan through all bins. Returns the bin, the sum of the bins before it, the
// total, and whether the target was reached (if not, bin = nv - 1).
struct tq_bound {
  int bin;
  float before;
  float total;
  bool found;
};

TQ_DEVICE_FN tq_bound tq_boundary(
    TQ_TG const float* v,
    const int nv,
    const float scale,
    const float offset,
    TQ_TG float* scratch,
    const int tid,
    const int ntid) {
  const int lane = tid % TQ_SIMD;
  const int warp = tid / TQ_SIMD;
  const int nw = ntid / TQ_SIMD;
  const int seg = (nv + nw - 1) / nw;
  const int seg_end = (warp + 1) * seg < nv ? (warp + 1) * seg : nv;
  float part = 0.0f;
  for (int b = warp * seg + lane; b < seg_end; b += TQ_SIMD) {
    part += v[b];
  }
  part = tq_warp_sum(part);
  if (lane == 0) {
    scratch[warp] = part;
  }
  TQ_BARRIER();
  float total = 0.0f;
  for (int w = 0; w < nw; ++w) {
    total += scratch[w];
  }
  const float target = scale * total + offset;
  tq_bound out;
  out.bin = nv - 1;
  out.before = 0.0f;
  out.total = total;
  out.found = false;
  float cum = 0.0f;
  int k = nw;
  for (int w = 0; w < nw; ++w) {
    if (cum + scratch[w] >= target) {
      k = w;
      break;
    }
    cum += scratch[w];
  }
  if (k < nw) {
    const int end = (k + 1) * seg < nv ? (k + 1) * seg : nv;
    for (int base = k * seg; base < end; base += TQ_SIMD) {
      const int b = base + lane;
      const float x = b < end ? v[b] : 0.0f;
      const float inc = tq_warp_prefix_sum(x);
      const float first = tq_warp_min((cum + inc >= target) ? float(lane) : 1e9f);
      if (first < 1e9f) {
        out.bin = base + int(first);
        out.before = cum + tq_warp_sum(lane < int(first) ? x : 0.0f);
        out.found = true;
        break;
      }
      cum += tq_warp_sum(x);
    }
  }
  TQ_BARRIER();
  return out;
}


// Pass 1b's result for query head qh from its float mass histogram hist_f (nb bins of width
// span_t / nb below m, shared memory): m, the sum s, and theta = the lower edge of the bin at
// which the mass accumulated from the top reaches tau * s, minus half a bin (-inf for
// tau >= 1 or a boundary in the last bin). Every thread must call it (tq_boundary).
TQ_DEVICE_FN void tq_write_theta(
    TQ_TG const float* hist_f, const int nb, const float m, const float tau, const float span_t,
    TQ_TG float* scratch, const int tid, const int ntid, const int qh, TQ_GLOBAL float* m_out,
    TQ_GLOBAL float* s_out, TQ_GLOBAL float* theta_out) {
  const tq_bound bd = tq_boundary(hist_f, nb, tau, 0.0f, scratch, tid, ntid);
  if (tid == 0) {
    const float w = span_t / float(nb);
    const bool all = tau >= 1.0f || !bd.found || bd.bin >= nb - 1;
    m_out[qh] = m;
    s_out[qh] = bd.total;
    theta_out[qh] = all ? -TQ_INF : m - (float(bd.bin) + 1.5f) * w;
  }
}

// The cap's boundary in one kv head's lmax ranking (pass 3): the cap plan from pass 2's class
// counts, the boundary class's histogram scan (tq_boundary with target cp.target), and the
// boundary bin, -1 when no bin is cut (target 0, or not reached).
struct tq_cut {
  tq_cap cp;
  tq_bound bd;
  int bstar;
};

// Where a token of pass 2's code (class << 16 | lmax bin) falls against the cap's boundary:
// 1 ranked above the boundary bin (selected), 0 in the boundary bin (selected up to the cap in
// index order), -1 below it (not selected).
TQ_DEVICE_FN int tq_rank_class(const uint32_t c, const tq_cut cut) {
  const int cls = int(c >> 16);
  const int b = int(c & 0xffffu);
  if (cls > cut.cp.bcls) {
    return 1;
  }
  if (cls < cut.cp.bcls || cut.bstar < 0) {
    return -1;
  }
  return b < cut.bstar ? 1 : (b == cut.bstar ? 0 : -1);
}
