// The int8 pages' number format, one definition for every kernel and for the plain-PyTorch
// reference (kvcache_ext/reference/quantize.py is its twin, bit for bit):
//
//   scale = float16(min(max_d |x_d| / 127, 65504))      one per row (a token's K, or its V)
//   q_d   = clamp(round_half_even(x_d / float(scale)), -127, 127)   (0 where scale is 0)
//   x_d  ~= q_d * float(scale)
//
// x in float32 (a row of float16 or bfloat16 is widened first, exactly). The scale is float16:
// two bytes, not four, per row (docs/store.md weighs the two), with 11 bits of precision, and
// the division uses the rounded scale, so the error bound (half a step of the scale actually
// stored) holds. Rows
// whose largest value exceeds 127 * 65504 saturate at +-127 steps of the largest scale; a
// NaN counts as 0 in the maximum and is stored as 0.
#pragma once
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>

#include "store/paged_layout.h"  // KVCACHE_HOST_DEVICE: the CUDA store kernels quantize with these

namespace kvcache_ext::store {

constexpr float kQuantMax = 127.f;
constexpr float kMaxScale = 65504.f;  // the largest finite float16

// The scale of a row whose largest magnitude is amax, as stored.
KVCACHE_HOST_DEVICE inline c10::Half quant_scale(float amax) {
  return c10::Half(fminf(amax / kQuantMax, kMaxScale));
}

// One value quantized with the stored scale `scale` (as a float; > 0).
KVCACHE_HOST_DEVICE inline int8_t quantize_value(float x, float scale) {
  float q = nearbyintf(x / scale);  // the default rounding mode: half to even
  q = q > kQuantMax ? kQuantMax : q;
  q = q < -kQuantMax ? -kQuantMax : q;
  return static_cast<int8_t>(q == q ? q : 0.f);
}

// The running maximum of magnitudes with a: a NaN compares false, so it does not count (and
// the maximum does not depend on the order magnitudes come in).
KVCACHE_HOST_DEVICE inline float quant_max(float amax, float a) { return a > amax ? a : amax; }

// Quantizes a row of D values of type T (float, c10::Half or c10::BFloat16) into q; returns
// its scale.
template <typename T>
c10::Half quantize_row(const T* x, int64_t D, int8_t* q) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) {
    amax = quant_max(amax, fabsf(static_cast<float>(x[d])));
  }
  const c10::Half scale = quant_scale(amax);
  const float s = static_cast<float>(scale);
  for (int64_t d = 0; d < D; ++d) q[d] = s > 0.f ? quantize_value(static_cast<float>(x[d]), s) : 0;
  return scale;
}

}  // namespace kvcache_ext::store
