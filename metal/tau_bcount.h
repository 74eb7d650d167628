// Selection pass 3a: how many tokens of each chunk lie in the cap's boundary bin, so that pass
// 3 can take that bin's first tokens in index order (a tie-break that does not depend on the
// order in which threads arrive; see select_common.h).
//
// Inputs (names as in tau.py):
//   code    uint32_t (H, n)      pass 2 (class << 16 | lmax bin)
//   lhist   uint32_t (H, 2, NL)  pass 2
//   counts  uint32_t (H, 2)      pass 2
//   params  int32_t  [n, cap, floor, chunk, blocks]
// Outputs:
//   bcount  uint32_t (H, blocks) boundary-bin tokens per chunk (0 when no bin is cut)
// Template constants: NL.
// Grid: x = chunks of `chunk` tokens, y = kv head (the same chunks as pass 3).
const int n = params[0];
const int cap = params[1];
const int floor_ = params[2];
const int chunk = params[3];
const int blocks = params[4];
const int h = tq_by;
const int nwarps = tq_ntid / TQ_SIMD;

TQ_SHARED(float, lh_f, NL);
TQ_SHARED(float, scratch, 32);
TQ_SHARED(float, red, 32);
const tq_cut cut = tq_cap_boundary(lhist, int(counts[h * 2]), int(counts[h * 2 + 1]), h, NL,
                                   floor_, cap, lh_f, scratch, tq_tid, tq_ntid);
const int bstar = cut.bstar;
const uint32_t want = (uint32_t(cut.cp.bcls) << 16) | uint32_t(bstar < 0 ? 0 : bstar);

float c = 0.0f;  // counts below 2^24 are exact in float
if (bstar >= 0) {
  const int j_begin = tq_bx * chunk;
  const int j_end = (j_begin + chunk < n) ? j_begin + chunk : n;
  for (int j = j_begin + tq_tid; j < j_end; j += tq_ntid) {
    c += code[int64_t(h) * n + j] == want ? 1.0f : 0.0f;
  }
}
c = tq_warp_sum(c);
if (tq_lane == 0) {
  red[tq_warp] = c;
}
TQ_BARRIER();
if (tq_tid == 0) {
  float t = 0.0f;
  for (int wp = 0; wp < nwarps; ++wp) {
    t += red[wp];
  }
  bcount[int64_t(h) * blocks + tq_bx] = uint32_t(t);
}
