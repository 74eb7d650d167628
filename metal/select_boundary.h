// tq_boundary, the scan that finds where a running sum of histogram bins reaches a target:
// the threshold bin of a mass histogram (pass 1b, select_mass.h) and the cap's bin of a
// ranking histogram (pass 3, select_rank.h). Goes into the kernel header after
// reduce_common.h.
//
// tq_boundary: the first bin b of v[0 .. nv) (bin 0 is the top) at which the running sum
// v[0] + ... + v[b] reaches target = scale * (sum of v) + offset. Every thread of the
// threadgroup must call it (it has barriers); v and scratch (>= 32 floats) are shared memory.
// The bins split into 32 segments, each summed by one warp (a warp takes segments w, w + nw,
// ...), the segment is found from those sums, and each warp then scans that segment 32 bins
// at a time with a warp prefix sum: a few hundred cycles instead of a scan through all bins.
// The float sums follow the segments, not the warps, so every threadgroup size gets the same
// result (the persistent kernel's 512 threads and the passes' 1024 agree bit for bit).
// Returns the bin, the sum of the bins before it, the total, and whether the target was
// reached (if not, bin = nv - 1).
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
