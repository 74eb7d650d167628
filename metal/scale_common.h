// Power-of-two scaling of lookup tables; goes into the kernel header (codebook_scores.h).

// The table's element type: float, or the backend's 16-bit float (tq_half, from the prelude).
template <bool HALF>
struct tq_lut_type {
  typedef float type;
};
template <>
struct tq_lut_type<true> {
  typedef tq_half type;
};

// The smallest e with b < 2^e, for finite b >= 0 (-126 for zero and subnormals; 129 for inf).
TQ_DEVICE_FN int tq_pow2_exponent_above(const float b) {
  const int biased = int(tq_as_uint(b) >> 23);
  return biased == 0 ? -126 : biased - 126;
}

// 2^k exactly, for -126 <= k <= 127.
TQ_DEVICE_FN float tq_pow2(const int k) {
  return tq_as_float(uint32_t(k + 127) << 23);
}

// The smallest e with sqrt(x) < 2^e, for finite x >= 2^-126 (from x's exponent alone: no
// square root); -63 for zero and subnormals.
TQ_DEVICE_FN int tq_pow2_exponent_above_sqrt(const float x) {
  const int e2 = tq_pow2_exponent_above(x);  // x < 2^e2, so sqrt(x) < 2^(e2 / 2)
  return e2 / 2 + ((e2 / 2) * 2 < e2 ? 1 : 0);  // ceil(e2 / 2)
}
