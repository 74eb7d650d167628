// Threadgroup reductions shared by the kernel bodies (goes into the kernel header). Every
// thread of the threadgroup must call them: they have barriers, and return only after the
// scratch array `red` (shared memory) may be reused.

// Row r < R of a per-thread array x[R], reduced over the threadgroup: the maximum (MAX) or
// the sum. Thread r gets row r's result (threads r >= R get the identity). red holds at
// least 32 * R floats.
template <int R, bool MAX>
TQ_DEVICE_FN float tq_block_rows(
    const TQ_THREAD float* x, TQ_TG float* red, const int tid, const int ntid) {
  const int lane = tid % TQ_SIMD;
  const int warp = tid / TQ_SIMD;
  const int nw = ntid / TQ_SIMD;
  TQ_UNROLL for (int r = 0; r < R; ++r) {
    const float v = MAX ? tq_warp_max(x[r]) : tq_warp_sum(x[r]);
    if (lane == 0) {
      red[warp * R + r] = v;
    }
  }
  TQ_BARRIER();
  float out = MAX ? -TQ_INF : 0.0f;
  if (tid < R) {
    for (int w = 0; w < nw; ++w) {
      const float v = red[w * R + tid];
      out = MAX ? (v > out ? v : out) : out + v;
    }
  }
  TQ_BARRIER();
  return out;
}

// x reduced over the threadgroup (maximum if MAX, else sum), returned to every thread. red
// holds at least 32 floats. The warps' partial results are combined in the same order by
// every thread, so all of them get the same value.
template <bool MAX>
TQ_DEVICE_FN float tq_block_all(const float x, TQ_TG float* red, const int tid, const int ntid) {
  const int nw = ntid / TQ_SIMD;
  const float v = MAX ? tq_warp_max(x) : tq_warp_sum(x);
  if (tid % TQ_SIMD == 0) {
    red[tid / TQ_SIMD] = v;
  }
  TQ_BARRIER();
  float out = MAX ? -TQ_INF : 0.0f;
  for (int w = 0; w < nw; ++w) {
    out = MAX ? (red[w] > out ? red[w] : out) : out + red[w];
  }
  TQ_BARRIER();
  return out;
}

// Exclusive prefix sums in thread order over the threadgroup, of R values per thread: x[r]
// becomes the sum of x[r] over the threads before this one, total[r] the sum over all of them
// (the same in every thread). red holds at least 32 * R floats.
template <int R>
TQ_DEVICE_FN void tq_block_scan(
    TQ_THREAD float* x, TQ_THREAD float* total, TQ_TG float* red, const int tid,
    const int ntid) {
  const int lane = tid % TQ_SIMD;
  const int warp = tid / TQ_SIMD;
  const int nw = ntid / TQ_SIMD;
  TQ_UNROLL for (int r = 0; r < R; ++r) {
    const float inc = tq_warp_prefix_sum(x[r]);
    if (lane == TQ_SIMD - 1) {
      red[warp * R + r] = inc;
    }
    x[r] = inc - x[r];
    total[r] = 0.0f;
  }
  TQ_BARRIER();
  for (int w = 0; w < nw; ++w) {
    TQ_UNROLL for (int r = 0; r < R; ++r) {
      const float v = red[w * R + r];
      x[r] += w < warp ? v : 0.0f;
      total[r] += v;
    }
  }
  TQ_BARRIER();
}
