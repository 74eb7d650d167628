// Selection pass 3a: per chunk, how many tokens rank above the cap's boundary bin and how many
// lie in it, so that pass 3 knows where each chunk's selected tokens go in the index list
// (ascending, without a sort) and can take the boundary bin's first tokens in index order (a
// tie-break that does not depend on the order in which threads arrive; see select_common.h).
//
// Inputs (names as in tau.py):
//   code    uint32_t (H, n)      pass 2 (class << 16 | lmax bin)
//   lhist   uint32_t (H, 2, NL)  pass 2
//   counts  uint32_t (H, 2)      pass 2
//   params  int32_t  [n, cap, floor, chunk, blocks]
// Outputs:
//   bcount  uint32_t (H, blocks, 2) per chunk: tokens selected for ranking above the boundary
//                                   bin, and tokens in that bin (0 when no bin is cut)
// Template constants: NL.
// Grid: x = chunks of `chunk` tokens, y = kv head (the same chunks as pass 3).
const int n = params[0];
const int cap = params[1];
const int floor_ = params[2];
const int chunk = params[3];
const int blocks = params[4];
const int h = tq_by;

TQ_SHARED(float, lh_f, NL);
TQ_SHARED(float, scratch, 32);
TQ_SHARED(float, red, 64);
const tq_cut cut = tq_cap_boundary(lhist, int(counts[h * 2]), int(counts[h * 2 + 1]), h, NL,
                                   floor_, cap, lh_f, scratch, tq_tid, tq_ntid);

float c[2] = {0.0f, 0.0f};  // counts below 2^24 are exact in float
const int j_begin = tq_bx * chunk;
const int j_end = (j_begin + chunk < n) ? j_begin + chunk : n;
for (int j = j_begin + tq_tid; j < j_end; j += tq_ntid) {
  const int rk = tq_rank_class(code[int64_t(h) * n + j], cut);
  c[0] += rk > 0 ? 1.0f : 0.0f;
  c[1] += rk == 0 ? 1.0f : 0.0f;
}
const float t = tq_block_rows<2, false>(c, red, tq_tid, tq_ntid);
if (tq_tid < 2) {
  bcount[(int64_t(h) * blocks + tq_bx) * 2 + tq_tid] = uint32_t(t);
}
