// Selection pass 3 of 3: the capped set per kv head, its indices and softmax mass.
//
//   k = min(clamp(kept, floor, cap), allowed). Tokens rank by class (kept first), then by
//   lmax bin (pass 2); the boundary bin is where the ranked count reaches k. Every token
//   ranked above it is selected, and the boundary bin's tokens in index order up to k: ties
//   within one bin (span_l / NL logits) go to the lower token index, in every run. Pass 3a's
//   per-chunk counts say where each chunk's tokens go, and a block scan ranks the tokens of a
//   chunk, so the indices come out in ascending order without atomics or a sort.
//
// Inputs (names as in tau.py):
//   code    uint32_t (H, n)         pass 2
//   lhist   uint32_t (H, 2, NL)     pass 2
//   counts  uint32_t (H, 2)         pass 2
//   bcount  uint32_t (H, blocks, 2) pass 3a
//   z       float    (Hq, N)        scores
//   m, s    float    (Hq,)          softmax max and sum
//   params  int32_t  [n, N, cap, floor, cap_alloc, chunk, blocks] (cap >= floor)
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

TQ_SHARED(float, lh_f, NL);
TQ_SHARED(float, scratch, 32);
TQ_SHARED(float, red, 32 * (REP > 2 ? REP : 2));
const tq_cut cut = tq_cap_boundary(lhist, int(counts[h * 2]), int(counts[h * 2 + 1]), h, NL,
                                   floor_, cap, lh_f, scratch, tq_tid, tq_ntid);
const int k = cut.cp.k;
// Boundary-bin tokens to take (counts below 2^24 are exact in float).
const float take = float(cut.bstar >= 0 ? cut.cp.target - int(cut.bd.before) : 0);
// The chunks before this one, in a fixed order (pass 3a): their selected tokens (slot0, where
// this chunk's first selected token goes) and their boundary-bin tokens (rank0).
float slot0 = 0.0f;
float rank0 = 0.0f;
for (int c = 0; c < tq_bx; ++c) {
  const int64_t at = (int64_t(h) * blocks + c) * 2;
  const float in_bin = float(bcount[at + 1]);
  const float room = take - rank0;
  slot0 += float(bcount[at]) + (room <= 0.0f ? 0.0f : (room < in_bin ? room : in_bin));
  rank0 += in_bin;
}

float acc[REP];
TQ_UNROLL for (int r = 0; r < REP; ++r) {
  acc[r] = 0.0f;
}
const int j_begin = tq_bx * chunk;
const int j_end = (j_begin + chunk < n) ? j_begin + chunk : n;
// Rounds of tq_ntid consecutive tokens (every thread takes part in each round: the scan has
// barriers). A boundary-bin token is taken while its rank in the bin is below `take`; a
// selected token's slot counts the selected tokens before it.
for (int base = j_begin; base < j_end; base += tq_ntid) {
  const int j = base + tq_tid;
  const int rk = j < j_end ? tq_rank_class(code[int64_t(h) * n + j], cut) : -1;
  float before[2] = {rk > 0 ? 1.0f : 0.0f, rk == 0 ? 1.0f : 0.0f};
  float total[2];
  tq_block_scan<2>(before, total, red, tq_tid, tq_ntid);
  float room = take - rank0;
  room = room < 0.0f ? 0.0f : room;
  if (rk > 0 || (rk == 0 && before[1] < room)) {
    const int slot = int(slot0 + before[0] + (room < before[1] ? room : before[1]));
    if (slot < cap_alloc) {
      TQ_ATOMIC_STORE(idx, int64_t(h) * cap_alloc + slot, uint32_t(j));
    }
    TQ_UNROLL for (int r = 0; r < REP; ++r) {
      const int qh = h * REP + r;
      acc[r] += tq_exp(z[int64_t(qh) * N + j] - m[qh]) / s[qh];
    }
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
