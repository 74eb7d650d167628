// Selected chunks read from host pages held in slabs (tiered.cpu.slabs): the device step's
// gather where the GPU takes host memory as kernel inputs (unified memory, Apple silicon),
// not at raw addresses (CUDA: tiered.step.device_decode).
//
//   out[h, slot * C + j, e] = the token t = idx[h, slot] * C + j of kv head h, element e,
//                             where slot < count[h], t < n_host and t is not resident
//                             (flags[h, t] == 0); else 0 (nothing read)
//   ok[h, slot * C + j]     = whether it was read (attended from the host pages)
//
// Inputs (names as in slab_gather.py):
//   idx     int32   (H, CAPC)   selected chunk ids (rows past count[h] are not read)
//   count   int32   (H,)        chunks selected per kv head
//   pages   int32   (>= pages of n_host)  physical page of each logical page
//   flags   bool / uint8 (H, F) resident tokens (1: attended from the resident set)
//   params  int32   [CAPC, F, n_host]
//   table   int32   (NSLAB + 1) first block of each slab, then the capacity (repeated)
//   s0..s9  the slabs, flat, the host dtype: block i of a slab is (PPB, H, P, D) at i * PPB*H*P*D
//   after   a fence (not read): orders this launch after the kernels that wrote the pages
// Outputs (every element written): out (H, CAPC * C, D) host dtype, ok bool (H, CAPC * C).
// Template constants: H, C (tokens per chunk), P (page size), PPB (pages per block), D.
// Grid: x = one thread per element of out (rows of D consecutive threads).
const int CAPC = params[0];
const int F = params[1];
const int n_host = params[2];
const int64_t gid = int64_t(tq_bx) * tq_ntid + tq_tid;
const int64_t rows_h = int64_t(CAPC) * C;
if (gid < int64_t(H) * rows_h * D) {
  const int e = int(gid % D);
  const int64_t row = gid / D;
  const int h = int(row / rows_h);
  const int rem = int(row % rows_h);
  const int slot = rem / C;
  const int j = rem % C;
  const bool selected = slot < count[h];
  const int64_t t = selected ? int64_t(idx[int64_t(h) * CAPC + slot]) * C + j : int64_t(-1);
  const bool attended = selected && t < n_host && flags[int64_t(h) * F + t] == 0;
  float v = 0.0f;  // exact for the float16 / float32 host dtypes
  if (attended) {
    const int64_t pp = int64_t(pages[t / P]);
    const int b = int(pp / PPB);
    int s = 0;
    TQ_UNROLL for (int k = 1; k < 10; ++k) {
      s += b >= table[k] ? 1 : 0;
    }
    const int64_t at = (((int64_t(b - table[s]) * PPB + pp % PPB) * H + h) * P + t % P) * D + e;
    v = s == 0 ? float(s0[at]) : s == 1 ? float(s1[at]) : s == 2 ? float(s2[at])
      : s == 3 ? float(s3[at]) : s == 4 ? float(s4[at]) : s == 5 ? float(s5[at])
      : s == 6 ? float(s6[at]) : s == 7 ? float(s7[at]) : s == 8 ? float(s8[at])
      : float(s9[at]);
  }
  out[gid] = v;
  if (e == 0) {
    ok[row] = attended;
  }
}
