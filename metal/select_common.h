// Shared by the selection passes (tau_hist.h, tau_theta.h, tau_keys.h, tau_compact.h); goes
// into the kernel header.
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
// The bins split into 32 segments, each summed by one warp (a warp takes segments w, w + nw,
// ...), the segment is found from those sums, and each warp then scans that segment 32 bins
// at a time with a warp prefix sum: a few hundred cycles instead of a scan through all bins.
// The float sums follow the segments, not the warps, so every threadgroup size gets the same
// result (the persistent kernel's 512 threads and the passes' 1024 agree bit for bit). Returns the bin, the sum of the bins before it, the
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
  constexpr int NSEG = TQ_SIMD;  // a segment per lane when the segment sums are scanned
  const int seg = (nv + NSEG - 1) / NSEG;
  for (int g = warp; g < NSEG; g += nw) {
    const int seg_end = (g + 1) * seg < nv ? (g + 1) * seg : nv;
    float part = 0.0f;
    for (int b = g * seg + lane; b < seg_end; b += TQ_SIMD) {
      part += v[b];
    }
    part = tq_warp_sum(part);
    if (lane == 0) {
      scratch[g] = part;
    }
  }
  TQ_BARRIER();
  // Every warp scans the segment sums alike (lane g holds segment g): the total, and the first
  // segment whose running sum reaches the target (a loop over the sums unrolled into 32
  // loads held in registers pushed a 1024-thread kernel over 64 registers per thread).
  const float part = scratch[lane];
  const float inc = tq_warp_prefix_sum(part);
  const float total = tq_warp_max(lane == TQ_SIMD - 1 ? inc : -TQ_INF);
  const float target = scale * total + offset;
  tq_bound out;
  out.bin = nv - 1;
  out.before = 0.0f;
  out.total = total;
  out.found = false;
  const float kf = tq_warp_min(inc >= target ? float(lane) : 1e9f);
  const int k = kf < 1e9f ? int(kf) : NSEG;
  float cum = tq_warp_max(lane == k ? inc - part : -TQ_INF);
  if (k < NSEG) {
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

// Pass 2 (tau_keys.h, and tau_persist.h's third phase) for the tokens [j_begin, j_end) of kv
// head h: per token whether any of the REP query heads keeps it, its max-over-heads
// log-probability's bin and its class, written to code[h, j] (code is (H, n)), and the
// chunk's class histograms and counts, written to lhist[out_row] (2 x NL) and
// counts[out_row] (2). theta_s, m_s, logs_s: the REP heads' thresholds, maxima and log-sums
// (shared memory, filled and behind a barrier before the call); lhist_s (2 NL) and cnt_s (2)
// shared scratch. Every thread must call it (barriers).
template <int REP, int NL, typename ET>
TQ_DEVICE_FN void tq_keys_chunk(
    TQ_GLOBAL const float* z, const int N, TQ_GLOBAL const ET* exclude, const int E,
    const int h, const int n, const int j_begin, const int j_end, const float span_l,
    TQ_TG const float* theta_s, TQ_TG const float* m_s, TQ_TG const float* logs_s,
    TQ_TG TQ_ATOMIC_U32* lhist_s, TQ_TG TQ_ATOMIC_U32* cnt_s, TQ_GLOBAL uint32_t* code,
    TQ_GLOBAL uint32_t* lhist, TQ_GLOBAL uint32_t* counts, const int64_t out_row,
    const int tid, const int ntid) {
  // Tokens per thread whose loads (REP scores each) are issued before any is used: 8 loads in
  // flight, within 64 registers at 1024 threads.
  constexpr int U = REP >= 8 ? 1 : 8 / REP;
  for (int b = tid; b < 2 * NL; b += ntid) {
    TQ_ATOMIC_STORE(lhist_s, b, 0u);
  }
  if (tid < 2) {
    TQ_ATOMIC_STORE(cnt_s, tid, 0u);
  }
  float anchor = -TQ_INF;  // over the heads with mass (a head without has log s = -inf)
  for (int r = 0; r < REP; ++r) {
    const float a = -logs_s[r];
    anchor = (a > anchor && a < TQ_INF) ? a : anchor;
  }
  TQ_BARRIER();
  const float inv_wl = float(NL) / span_l;
  uint32_t n_keep = 0u;
  uint32_t n_allowed = 0u;
  for (int j0 = j_begin + tid; j0 < j_end; j0 += U * ntid) {
    float v[U][REP];
    bool allowed[U];
    TQ_UNROLL for (int u = 0; u < U; ++u) {
      const int j = j0 + u * ntid;
      const bool inside = j < j_end;
      TQ_UNROLL for (int r = 0; r < REP; ++r) {
        v[u][r] = inside ? z[int64_t(h * REP + r) * N + j] : -TQ_INF;
      }
      allowed[u] = inside && exclude[int64_t(h) * E + (inside ? j : 0)] == ET(0);
    }
    TQ_UNROLL for (int u = 0; u < U; ++u) {
      const int j = j0 + u * ntid;
      if (j < j_end) {
        // A head where the score is not finite neither keeps nor ranks the token; a token
        // without a finite score in any head is absent (class 0, as if excluded).
        bool keep = false;
        bool present = false;
        float lmax = -TQ_INF;
        TQ_UNROLL for (int r = 0; r < REP; ++r) {
          const bool finite = v[u][r] > -TQ_INF && v[u][r] < TQ_INF;
          present = present || finite;
          keep = keep || (finite && v[u][r] >= theta_s[r]);
          const float lp = v[u][r] - m_s[r] - logs_s[r];
          lmax = (finite && lp > lmax) ? lp : lmax;
        }
        const bool live = allowed[u] && present;
        const uint32_t cls = live ? (keep ? 2u : 1u) : 0u;
        const float pos = (anchor - lmax) * inv_wl;
        const int b = pos >= float(NL - 1) ? NL - 1 : (pos > 0.0f ? int(pos) : 0);
        code[int64_t(h) * n + j] = (cls << 16) | uint32_t(b);
        if (live) {
          TQ_SHARED_ATOMIC_ADD_U32(lhist_s, (keep ? 0 : NL) + b, 1u);
          n_allowed += 1u;
          n_keep += keep ? 1u : 0u;
        }
      }
    }
  }
  if (n_allowed > 0u) {
    TQ_SHARED_ATOMIC_ADD_U32(cnt_s, 0, n_keep);
    TQ_SHARED_ATOMIC_ADD_U32(cnt_s, 1, n_allowed);
  }
  TQ_BARRIER();
  for (int b = tid; b < 2 * NL; b += ntid) {
    lhist[out_row * 2 * NL + b] = TQ_ATOMIC_LOAD(lhist_s, b);
  }
  if (tid < 2) {
    counts[out_row * 2 + tid] = TQ_ATOMIC_LOAD(cnt_s, tid);
  }
}

// Pass 3 (tau_compact.h, and tau_persist.h's last phase) for chunk bx of kv head h, the
// tokens [bx * chunk, min(n, (bx + 1) * chunk)): the capped set's indices from pass 2's
// code and per-chunk histograms and counts (the `blocks` chunks of the head), written to
// idx[h, slot] in ascending order; the selection's softmax mass of this chunk per query head
// to mass[qh, bx]; chunk 0 also writes count[h] and the -1 padding of idx. m_s, s_s: the REP
// heads' maxima and sums (shared memory, filled and behind a barrier before the call);
// lh_f, pre_f (NL floats each), scratch (32) and red (32 * max(REP, 2)) shared scratch.
// Every thread must call it (barriers).
template <int NL, int REP>
TQ_DEVICE_FN void tq_compact_chunk(
    TQ_GLOBAL const uint32_t* code, TQ_GLOBAL const uint32_t* lhist,
    TQ_GLOBAL const uint32_t* counts, TQ_GLOBAL const float* z, const int N, const int n,
    const int h, const int bx, const int blocks, const int chunk, const int cap,
    const int floor_, const int cap_alloc, TQ_TG const float* m_s, TQ_TG const float* s_s,
    TQ_TG float* lh_f, TQ_TG float* pre_f, TQ_TG float* scratch, TQ_TG float* red,
    TQ_GLOBAL TQ_ATOMIC_U32* idx, TQ_GLOBAL TQ_ATOMIC_I32* count,
    TQ_GLOBAL TQ_ATOMIC_F32* mass, const int tid, const int ntid) {
  constexpr int TPT = 8;  // consecutive tokens per thread and round
  // The kv head's class counts, and the kept tokens of the chunks before this one (a thread
  // per chunk, then three block sums; counts below 2^24 are exact in float).
  float kc = 0.0f;
  float ac = 0.0f;
  float kb = 0.0f;
  for (int c = tid; c < blocks; c += ntid) {
    const int64_t at = (int64_t(h) * blocks + c) * 2;
    const float kept = float(counts[at]);
    kc += kept;
    ac += float(counts[at + 1]);
    kb += c < bx ? kept : 0.0f;
  }
  const int n_keep = int(tq_block_all<false>(kc, red, tid, ntid));
  const int n_allowed = int(tq_block_all<false>(ac, red, tid, ntid));
  const int keep_before = int(tq_block_all<false>(kb, red, tid, ntid));
  tq_cut cut;
  cut.cp = tq_cap_plan(n_keep, n_allowed, floor_, cap);
  const int k = cut.cp.k;
  // The boundary class's lmax histogram: over all chunks (lh_f) and over the earlier ones
  // (pre_f). Counts below 2^24 are exact in float.
  const int cls_row = cut.cp.bcls == 2 ? 0 : 1;
  constexpr int UC = 8;  // chunks whose loads are issued before any is added
  for (int b = tid; b < NL; b += ntid) {
    uint32_t all = 0u;
    uint32_t pre = 0u;
    for (int c0 = 0; c0 < blocks; c0 += UC) {
      uint32_t v[UC];
      TQ_UNROLL for (int u = 0; u < UC; ++u) {
        const int c = c0 + u < blocks ? c0 + u : blocks - 1;
        v[u] = lhist[((int64_t(h) * blocks + c) * 2 + cls_row) * NL + b];
      }
      TQ_UNROLL for (int u = 0; u < UC; ++u) {
        all += c0 + u < blocks ? v[u] : 0u;
        pre += c0 + u < bx ? v[u] : 0u;
      }
    }
    lh_f[b] = float(all);
    pre_f[b] = float(pre);
  }
  TQ_BARRIER();
  cut.bd = tq_boundary(lh_f, NL, 0.0f, float(cut.cp.target), scratch, tid, ntid);
  cut.bstar = (cut.cp.target > 0 && cut.bd.found) ? cut.bd.bin : -1;
  // Boundary-bin tokens to take, and what the earlier chunks hold: tokens ranked above the
  // boundary bin (a higher class, or a higher bin of the boundary class) and boundary-bin
  // tokens, of which they take the first (index order).
  const float take = float(cut.bstar >= 0 ? cut.cp.target - int(cut.bd.before) : 0);
  float above = 0.0f;
  for (int b = tid; b < cut.bstar; b += ntid) {
    above += pre_f[b];
  }
  above = tq_block_all<false>(above, red, tid, ntid);
  float rank0 = cut.bstar >= 0 ? pre_f[cut.bstar] : 0.0f;
  float slot0 = (cut.cp.bcls == 1 ? float(keep_before) : 0.0f) + above
      + (take < rank0 ? take : rank0);

  float acc[REP];
  TQ_UNROLL for (int r = 0; r < REP; ++r) {
    acc[r] = 0.0f;
  }
  const int j_begin = bx * chunk;
  const int j_end = (j_begin + chunk < n) ? j_begin + chunk : n;
  const int64_t crow = int64_t(h) * n;
  // Every thread takes part in each round (the scan has barriers). A boundary-bin token is
  // taken while its rank in the bin is below `room`; a selected token's slot counts the
  // selected tokens before it.
  for (int base = j_begin; base < j_end; base += TPT * ntid) {
    const int j0 = base + tid * TPT;
    uint32_t ups = 0u;  // bit u: token j0 + u ranks above the boundary bin
    uint32_t ins = 0u;  // bit u: it is in the boundary bin
    TQ_UNROLL for (int u = 0; u < TPT; ++u) {
      const int j = j0 + u;
      const int rk = j < j_end ? tq_rank_class(code[crow + j], cut) : -1;
      ups |= rk > 0 ? (1u << u) : 0u;
      ins |= rk == 0 ? (1u << u) : 0u;
    }
    float before[2] = {float(tq_popcount(ups)), float(tq_popcount(ins))};
    float total[2];
    tq_block_scan<2>(before, total, red, tid, ntid);
    float room = take - rank0;
    room = room < 0.0f ? 0.0f : room;
    float ab = before[0];  // tokens of this round before this one, ranked above the boundary
    float ib = before[1];  // and in the boundary bin
    TQ_UNROLL for (int u = 0; u < TPT; ++u) {
      const bool is_up = (ups >> u) & 1u;
      const bool is_in = (ins >> u) & 1u;
      if (is_up || (is_in && ib < room)) {
        const int j = j0 + u;
        const int slot = int(slot0 + ab + (room < ib ? room : ib));
        if (slot < cap_alloc) {
          TQ_ATOMIC_STORE(idx, int64_t(h) * cap_alloc + slot, uint32_t(j));
        }
        TQ_UNROLL for (int r = 0; r < REP; ++r) {
          // NaN or +inf where head r's score is not finite (or r has none): no mass
          const float p = tq_exp(z[int64_t(h * REP + r) * N + j] - m_s[r]) / s_s[r];
          acc[r] += p < TQ_INF ? p : 0.0f;
        }
      }
      ab += is_up ? 1.0f : 0.0f;
      ib += is_in ? 1.0f : 0.0f;
    }
    slot0 += total[0] + (room < total[1] ? room : total[1]);
    rank0 += total[1];
  }
  const float t = tq_block_rows<REP, false>(acc, red, tid, ntid);
  if (tid < REP) {
    TQ_ATOMIC_STORE(mass, int64_t(h * REP + tid) * blocks + bx, t);
  }
  if (bx == 0) {
    for (int i = k + tid; i < cap_alloc; i += ntid) {
      TQ_ATOMIC_STORE(idx, int64_t(h) * cap_alloc + i, 0xffffffffu);
    }
    if (tid == 0) {
      TQ_ATOMIC_STORE(count, h, k);
    }
  }
}
