// Passes 2 and 3 of the selection (tau_keys.h, tau_compact.h, and the persistent kernel's
// last phases): each token of a kv head classed and binned by its max-over-heads
// log-probability, then the ranking cut at the cap and the indices written in ascending order.
// Goes into the kernel header after reduce_common.h and select_boundary.h; non-finite scores
// and determinism as select_mass.h says.

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

// Pass 2 (tau_keys.h, and tau_persistent.h's third phase) for the tokens [j_begin, j_end) of kv
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

// Pass 3 (tau_compact.h, and tau_persistent.h's last phase) for chunk bx of kv head h, the
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
