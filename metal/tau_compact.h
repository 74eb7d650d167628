// Selection pass 3 of 3: the capped set per kv head, its indices and softmax mass.
//
//   k = min(clamp(kept, floor, cap), allowed). Tokens rank by class (kept first), then by
//   lmax bin (pass 2); the boundary bin is where the ranked count reaches k. Every token
//   ranked above it is selected, and the boundary bin's tokens in index order up to k: ties
//   within one bin (span_l / NL logits) go to the lower token index, in every run (the
//   chunks' boundary counts come from pass 3a, ranks within a chunk from a block scan).
//
// Inputs (names as in tau.py):
//   code    uint32_t (H, n)      pass 2
//   lhist   uint32_t (H, 2, NL)  pass 2
//   counts  uint32_t (H, 2)      pass 2
//   bcount  uint32_t (H, blocks) pass 3a
//   z       float    (Hq, N)     scores
//   m, s    float    (Hq,)       softmax max and sum
//   params  int32_t  [n, N, cap, floor, cap_alloc, chunk, blocks] (cap >= floor)
// Outputs (zero-filled; atomic on Metal):
//   idx     uint32_t (H, cap_alloc)  selected token indices in arrival order, then
//                                    0xffffffff (an ascending sort leaves -1 as int32 last);
//                                    the set is the same in every run, the order is not
//   count   int32_t  (H,)
//   fill    uint32_t (H,)            slots taken
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
const int nwarps = tq_ntid / TQ_SIMD;

TQ_SHARED(float, lh_f, NL);
TQ_SHARED(float, scratch, 32);
TQ_SHARED(float, red, 32 * REP);
TQ_SHARED(float, wsum, 32);
const tq_cut cut = tq_cap_boundary(lhist, int(counts[h * 2]), int(counts[h * 2 + 1]), h, NL,
                                   floor_, cap, lh_f, scratch, tq_tid, tq_ntid);
const int k = cut.cp.k;
const int bcls = cut.cp.bcls;
const int bstar = cut.bstar;
const float take = float(bstar >= 0 ? cut.cp.target - int(cut.bd.before) : 0);
// Boundary-bin tokens of the chunks before this one (pass 3a), in a fixed order.
float rank0 = 0.0f;
for (int c = 0; c < tq_bx; ++c) {
  rank0 += float(bcount[int64_t(h) * blocks + c]);
}

float acc[REP];
TQ_UNROLL for (int r = 0; r < REP; ++r) {
  acc[r] = 0.0f;
}
const int j_begin = tq_bx * chunk;
const int j_end = (j_begin + chunk < n) ? j_begin + chunk : n;
// Rounds of tq_ntid consecutive tokens, so that a block scan ranks the boundary bin's tokens
// by index (every thread takes part in each round: the scan has barriers).
for (int base = j_begin; base < j_end; base += tq_ntid) {
  const int j = base + tq_tid;
  bool sel = false;
  float in_bin = 0.0f;
  if (j < j_end) {
    const uint32_t c = code[int64_t(h) * n + j];
    const int cls = int(c >> 16);
    const int b = int(c & 0xffffu);
    if (cls > bcls) {
      sel = true;
    } else if (cls == bcls && bstar >= 0) {
      sel = b < bstar;
      in_bin = b == bstar ? 1.0f : 0.0f;
    }
  }
  if (bstar >= 0) {
    const float inc = tq_warp_prefix_sum(in_bin);
    if (tq_lane == TQ_SIMD - 1) {
      wsum[tq_warp] = inc;
    }
    TQ_BARRIER();
    float before = 0.0f;
    float round_total = 0.0f;
    for (int wp = 0; wp < nwarps; ++wp) {
      before += wp < tq_warp ? wsum[wp] : 0.0f;
      round_total += wsum[wp];
    }
    TQ_BARRIER();  // wsum is rewritten by the next round
    if (in_bin > 0.0f) {
      sel = rank0 + before + inc - 1.0f < take;
    }
    rank0 += round_total;
  }
  if (sel) {
    const uint32_t slot = TQ_ATOMIC_ADD_U32(fill, h, 1u);
    TQ_ATOMIC_STORE(idx, int64_t(h) * cap_alloc + slot, uint32_t(j));
    TQ_UNROLL for (int r = 0; r < REP; ++r) {
      const int qh = h * REP + r;
      acc[r] += tq_exp(z[int64_t(qh) * N + j] - m[qh]) / s[qh];
    }
  }
}
TQ_UNROLL for (int r = 0; r < REP; ++r) {
  const float t = tq_warp_sum(acc[r]);
  if (tq_lane == 0) {
    red[tq_warp * REP + r] = t;
  }
}
TQ_BARRIER();
if (tq_tid < REP) {
  float t = 0.0f;
  for (int wp = 0; wp < nwarps; ++wp) {
    t += red[wp * REP + tq_tid];
  }
  TQ_ATOMIC_STORE(mass, int64_t(h * REP + tq_tid) * blocks + tq_bx, t);
}
if (tq_bx == 0) {
  for (int t = k + tq_tid; t < cap_alloc; t += tq_ntid) {
    TQ_ATOMIC_STORE(idx, int64_t(h) * cap_alloc + t, 0xffffffffu);
  }
  if (tq_tid == 0) {
    TQ_ATOMIC_STORE(count, h, k);
  }
}
