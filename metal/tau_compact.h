// Selection pass 3 of 3: the capped set per kv head, its indices and softmax mass (the work:
// select_rank.h, tq_compact_chunk).
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
const int h = tq_by;

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
TQ_BARRIER();
tq_compact_chunk<NL, REP>(code, lhist, counts, z, N, n, h, tq_bx, params[6], params[5],
                          params[2], params[3], params[4], m_s, s_s, lh_f, pre_f, scratch, red,
                          idx, count, mass, tq_tid, tq_ntid);
