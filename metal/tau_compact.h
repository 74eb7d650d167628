// Selection pass 3 of 3: the capped set per kv head, its indices and softmax mass.
//
//   k = min(clamp(kept, floor, cap), allowed). Tokens rank by class (kept first), then by
//   lmax bin (pass 2); the boundary bin is where the ranked count reaches k. Every token
//   ranked above it is selected, and the first arrivals of the boundary bin up to k: ties
//   within one bin (span_l / NL logits) are broken by arrival, not by lmax.
//
// Inputs (names as in tau.py):
//   code    uint32_t (H, n)      pass 2
//   lhist   uint32_t (H, 2, NL)  pass 2
//   counts  uint32_t (H, 2)      pass 2
//   z       float    (Hq, N)     scores
//   m, s    float    (Hq,)       softmax max and sum
//   params  int32_t  [n, N, cap, floor, cap_alloc, chunk] (cap >= floor)
// Outputs (zero-filled; atomic on Metal):
//   idx     uint32_t (H, cap_alloc)  selected token indices in arrival order, then
//                                    0xffffffff (an ascending sort leaves -1 as int32 last)
//   count   int32_t  (H,)
//   fill    uint32_t (H, 2)          [slots taken, boundary-bin arrivals]
//   mass    float    (Hq,)           softmax mass of the selection per query head
// Template constants: NL, REP.
// Grid: x = chunks of `chunk` tokens, y = kv head.
const int n = params[0];
const int N = params[1];
const int cap = params[2];
const int floor_ = params[3];
const int cap_alloc = params[4];
const int chunk = params[5];
const int h = tq_by;
const int nwarps = tq_ntid / TQ_SIMD;

TQ_SHARED(float, lh_f, NL);
TQ_SHARED(float, scratch, 32);
TQ_SHARED(float, red, 32 * REP);
const int n_keep = int(counts[h * 2]);
const int n_allowed = int(counts[h * 2 + 1]);
int k = n_keep < floor_ ? floor_ : n_keep;
k = k > cap ? cap : k;
k = k > n_allowed ? n_allowed : k;
const int bcls = k <= n_keep ? 2 : 1;
const int target = bcls == 2 ? k : k - n_keep;
const int64_t hrow = (int64_t(h) * 2 + (bcls == 2 ? 0 : 1)) * NL;
for (int b = tq_tid; b < NL; b += tq_ntid) {
  lh_f[b] = float(lhist[hrow + b]);
}
TQ_BARRIER();
const tq_bound bd = tq_boundary(lh_f, NL, 0.0f, float(target), scratch, tq_tid, tq_ntid);
const int bstar = (target > 0 && bd.found) ? bd.bin : -1;
const uint32_t take = uint32_t(bstar >= 0 ? target - int(bd.before) : 0);

float acc[REP];
TQ_UNROLL for (int r = 0; r < REP; ++r) {
  acc[r] = 0.0f;
}
const int j_begin = tq_bx * chunk;
const int j_end = (j_begin + chunk < n) ? j_begin + chunk : n;
for (int j = j_begin + tq_tid; j < j_end; j += tq_ntid) {
  const uint32_t c = code[int64_t(h) * n + j];
  const int cls = int(c >> 16);
  const int b = int(c & 0xffffu);
  bool sel = false;
  if (cls > bcls) {
    sel = true;
  } else if (cls == bcls && bstar >= 0) {
    if (b < bstar) {
      sel = true;
    } else if (b == bstar) {
      sel = TQ_ATOMIC_ADD_U32(fill, h * 2 + 1, 1u) < take;
    }
  }
  if (sel) {
    const uint32_t slot = TQ_ATOMIC_ADD_U32(fill, h * 2, 1u);
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
  if (t != 0.0f) {
    TQ_ATOMIC_ADD_F32(mass, h * REP + tq_tid, t);
  }
}
if (tq_bx == 0) {
  for (int t = k + tq_tid; t < cap_alloc; t += tq_ntid) {
    TQ_ATOMIC_STORE(idx, int64_t(h) * cap_alloc + t, 0xffffffffu);
  }
  if (tq_tid == 0) {
    TQ_ATOMIC_STORE(count, h, k);
  }
}
