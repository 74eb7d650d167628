// Selection pass 3 of 3: the capped set per kv head, its indices and softmax mass.
//
//   k = min(clamp(kept, floor, cap), allowed). Tokens rank by class (kept first), then by
//   lmax bin (pass 2); the boundary bin is where the ranked count reaches k. Every token
//   ranked above it is selected, and the boundary bin's tokens in index order up to k: ties
//   within one bin (span_l / NL logits) go to the lower token index, in every run.
//
// Each threadgroup sums pass 2's per-chunk histograms of its kv head, both over all chunks
// (to find the boundary bin) and over the chunks before its own (where its first selected
// token goes, and how many boundary-bin tokens those chunks already took). Its tokens then
// go in rounds of TPT consecutive tokens per thread: one block scan per round ranks them, so
// the indices come out in ascending order without atomics or a sort.
//
// Inputs (names as in tau.py):
//   code    uint32_t (H, n)              pass 2
//   lhist   uint32_t (H, blocks, 2, NL)  pass 2, per chunk
//   counts  uint32_t (H, blocks, 2)      pass 2, per chunk
//   z       float    (Hq, N)             scores
//   m, s    float    (Hq,)               softmax max and sum
//   params  int32_t  [n, N, cap, floor, cap_alloc, chunk, blocks] (cap >= floor; the chunks
//                    of pass 2)
// Outputs (every element written, so no fill before the launch; atomic on Metal):
//   idx     uint32_t (H, cap_alloc)  the k selected token indices in ascending order, then
//                                    0xffffffff (-1 as int32)
//   count   int32_t  (H,)            k
//   mass    float    (Hq, blocks)    softmax mass of the selection per query head and chunk
//                                    (summed by the caller, in a fixed order)
// Template constants: NL, REP.
// Grid: x = chunks of `chunk` tokens, y = kv head.
const int n = params[0];
const int N = params[1];
const int cap = params[2];
const int floor_ = params[3];
const int cap_alloc = params[4];
const int chunk = params[5];
const int blocks = params[6];
const int h = tq_by;
constexpr int TPT = 8;  // consecutive tokens per thread and round

TQ_SHARED(float, lh_f, NL);
TQ_SHARED(float, pre_f, NL);
TQ_SHARED(float, scratch, 32);
TQ_SHARED(float, red, 32 * (REP > 2 ? REP : 2));
TQ_SHARED(float, m_s, REP);
TQ_SHARED(float, s_s, REP);
if (tq_tid < REP) {
  m_s[tq_tid] = m[h * REP + tq_tid];
  s_s[tq_tid] = s[h * REP + tq_tid];
}

// The kv head's class counts, and the kept tokens of the chunks before this one (a thread per
// chunk, then three block sums; counts below 2^24 are exact in float).
float kc = 0.0f;
float ac = 0.0f;
float kb = 0.0f;
for (int c = tq_tid; c < blocks; c += tq_ntid) {
  const int64_t at = (int64_t(h) * blocks + c) * 2;
  const float kept = float(counts[at]);
  kc += kept;
  ac += float(counts[at + 1]);
  kb += c < tq_bx ? kept : 0.0f;
}
const int n_keep = int(tq_block_all<false>(kc, red, tq_tid, tq_ntid));
const int n_allowed = int(tq_block_all<false>(ac, red, tq_tid, tq_ntid));
const int keep_before = int(tq_block_all<false>(kb, red, tq_tid, tq_ntid));
tq_cut cut;
cut.cp = tq_cap_plan(n_keep, n_allowed, floor_, cap);
const int k = cut.cp.k;
// The boundary class's lmax histogram: over all chunks (lh_f) and over the earlier ones
// (pre_f). Counts below 2^24 are exact in float.
const int cls_row = cut.cp.bcls == 2 ? 0 : 1;
constexpr int UC = 8;  // chunks whose loads are issued before any is added
for (int b = tq_tid; b < NL; b += tq_ntid) {
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
      pre += c0 + u < tq_bx ? v[u] : 0u;
    }
  }
  lh_f[b] = float(all);
  pre_f[b] = float(pre);
}
TQ_BARRIER();
cut.bd = tq_boundary(lh_f, NL, 0.0f, float(cut.cp.target), scratch, tq_tid, tq_ntid);
cut.bstar = (cut.cp.target > 0 && cut.bd.found) ? cut.bd.bin : -1;
// Boundary-bin tokens to take, and what the earlier chunks hold: tokens ranked above the
// boundary bin (a higher class, or a higher bin of the boundary class) and boundary-bin
// tokens, of which they take the first (index order).
const float take = float(cut.bstar >= 0 ? cut.cp.target - int(cut.bd.before) : 0);
float above = 0.0f;
for (int b = tq_tid; b < cut.bstar; b += tq_ntid) {
  above += pre_f[b];
}
above = tq_block_all<false>(above, red, tq_tid, tq_ntid);
float rank0 = cut.bstar >= 0 ? pre_f[cut.bstar] : 0.0f;
float slot0 = (cut.cp.bcls == 1 ? float(keep_before) : 0.0f) + above
    + (take < rank0 ? take : rank0);

float acc[REP];
TQ_UNROLL for (int r = 0; r < REP; ++r) {
  acc[r] = 0.0f;
}
const int j_begin = tq_bx * chunk;
const int j_end = (j_begin + chunk < n) ? j_begin + chunk : n;
const int64_t crow = int64_t(h) * n;
// Every thread takes part in each round (the scan has barriers). A boundary-bin token is taken
// while its rank in the bin is below `room`; a selected token's slot counts the selected tokens
// before it.
for (int base = j_begin; base < j_end; base += TPT * tq_ntid) {
  const int j0 = base + tq_tid * TPT;
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
  tq_block_scan<2>(before, total, red, tq_tid, tq_ntid);
  float room = take - rank0;
  room = room < 0.0f ? 0.0f : room;
  float ab = before[0];  // tokens of this round before this one, ranked above the boundary bin
  float ib = before[1];  // and in it
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
        acc[r] += tq_exp(z[int64_t(h * REP + r) * N + j] - m_s[r]) / s_s[r];
      }
    }
    ab += is_up ? 1.0f : 0.0f;
    ib += is_in ? 1.0f : 0.0f;
  }
  slot0 += total[0] + (room < total[1] ? room : total[1]);
  rank0 += total[1];
}
const float t = tq_block_rows<REP, false>(acc, red, tq_tid, tq_ntid);
if (tq_tid < REP) {
  TQ_ATOMIC_STORE(mass, int64_t(h * REP + tq_tid) * blocks + tq_bx, t);
}
if (tq_bx == 0) {
  for (int i = k + tq_tid; i < cap_alloc; i += tq_ntid) {
    TQ_ATOMIC_STORE(idx, int64_t(h) * cap_alloc + i, 0xffffffffu);
  }
  if (tq_tid == 0) {
    TQ_ATOMIC_STORE(count, h, k);
  }
}
