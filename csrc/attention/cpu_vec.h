// Portable SIMD for the CPU attention: W-lane float vectors (GCC/Clang vector extensions),
// loads that widen fp32 / bf16 / fp16 / int8 rows to float in registers, and an exp.
//
// The extension is compiled for the baseline x86-64 ISA; the code that uses these helpers is
// instantiated once per ISA inside functions carrying a target attribute (attention_cpu_tiles.h),
// and the compiler lowers the same vector code to SSE2 (W = 4), AVX2 (W = 8) or AVX-512
// (W = 16). Everything here is always_inline so that it takes the ISA of its caller.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

// A vector returned by an always_inline helper never crosses a real call: the ABI note is moot.
#pragma GCC diagnostic ignored "-Wpsabi"

#define KVCACHE_ALWAYS_INLINE inline __attribute__((always_inline))

namespace kvcache_ext::attention::vec {

template <int W>
struct Lanes {
  typedef float f __attribute__((vector_size(W * 4)));
  typedef int32_t i __attribute__((vector_size(W * 4)));
  typedef uint32_t u __attribute__((vector_size(W * 4)));
  typedef uint16_t u16 __attribute__((vector_size(W * 2)));
  typedef _Float16 f16 __attribute__((vector_size(W * 2)));
  typedef int8_t i8 __attribute__((vector_size(W)));
  typedef int16_t i16 __attribute__((vector_size(W * 2)));
};

template <int W>
using vf = typename Lanes<W>::f;

template <int W>
KVCACHE_ALWAYS_INLINE vf<W> splat(float x) {
  return vf<W>{} + x;
}

// W elements of a row, as floats. memcpy is how vector extensions load unaligned data.
template <int W>
KVCACHE_ALWAYS_INLINE vf<W> load(const float* p) {
  vf<W> x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
template <int W>
KVCACHE_ALWAYS_INLINE vf<W> load(const c10::BFloat16* p) {
  // bf16 is the upper half of an fp32: widen by a 16-bit shift.
  typename Lanes<W>::u16 x;
  std::memcpy(&x, p, sizeof(x));
  return reinterpret_cast<vf<W>>(__builtin_convertvector(x, typename Lanes<W>::u) << 16);
}
template <int W>
KVCACHE_ALWAYS_INLINE vf<W> load(const c10::Half* p) {
  typename Lanes<W>::f16 x;
  std::memcpy(&x, p, sizeof(x));
  return __builtin_convertvector(x, vf<W>);
}

template <int W>
KVCACHE_ALWAYS_INLINE vf<W> load(const int8_t* p) {  // int8 pages: the steps, not yet scaled
  typename Lanes<W>::i8 x;
  std::memcpy(&x, p, sizeof(x));
  // Widened 8 -> 16 -> 32 bits, then to float: GCC turns each step into vector sign
  // extensions, where a direct int8 -> float conversion becomes one scalar conversion per lane.
  const auto wide = __builtin_convertvector(__builtin_convertvector(x, typename Lanes<W>::i16), typename Lanes<W>::i);
  return __builtin_convertvector(wide, vf<W>);
}

#if defined(__GNUC__) && defined(__x86_64__)
// The wide ISAs sign-extend 8 or 16 int8 values to 32 bits in one instruction. These carry
// their ISA's target, so they cannot be always_inline into the ISA-neutral helpers between:
// the tile entry points (attention_cpu_tiles.cpp) are flattened, which inlines them there.
template <>
__attribute__((target("avx2"))) inline vf<8> load<8>(const int8_t* p) {
  return (vf<8>)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
template <>
__attribute__((target("avx512f"))) inline vf<16> load<16>(const int8_t* p) {
  // The zero-masked forms: the plain ones start from an undefined vector, which GCC 12 warns of.
  const __m512i wide = _mm512_maskz_cvtepi8_epi32(0xFFFF, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (vf<16>)_mm512_maskz_cvtepi32_ps(0xFFFF, wide);
}
#endif

template <int W>
KVCACHE_ALWAYS_INLINE void store(float* p, vf<W> x) {
  std::memcpy(p, &x, sizeof(x));
}

// Horizontal sum as a tree of halves (log2 W dependent adds, not W).
KVCACHE_ALWAYS_INLINE float sum(vf<4> x) {
  const vf<4> y = x + __builtin_shufflevector(x, x, 2, 3, 0, 1);
  return y[0] + y[1];
}
KVCACHE_ALWAYS_INLINE float sum(vf<8> x) {
  return sum(__builtin_shufflevector(x, x, 0, 1, 2, 3) + __builtin_shufflevector(x, x, 4, 5, 6, 7));
}
KVCACHE_ALWAYS_INLINE float sum(vf<16> x) {
  return sum(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
             __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
}

template <int W>
KVCACHE_ALWAYS_INLINE float max(vf<W> x) {
  float m = x[0];
  for (int e = 1; e < W; ++e) m = x[e] > m ? x[e] : m;
  return m;
}

template <int W>
KVCACHE_ALWAYS_INLINE vf<W> vmax(vf<W> a, vf<W> b) {
  return a > b ? a : b;
}

// e^x, within 2 ulp over the float range; exactly 0 below e^-87.3 (so e^-inf = 0: masked
// slots weigh nothing). Range reduction x = n ln2 + r, |r| <= ln2 / 2, then a degree-6
// polynomial for e^r (Cephes' expf coefficients) scaled by 2^n through the exponent bits.
template <int W>
KVCACHE_ALWAYS_INLINE vf<W> exp(vf<W> x) {
  using vi = typename Lanes<W>::i;
  // Inputs above 88 (n = 127, the largest exponent) never occur in a softmax (x <= 0).
  const vf<W> lo = splat<W>(-87.3365448f), hi = splat<W>(88.f);
  const vi underflow = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // Round x / ln2 to the nearest integer with the 1.5 * 2^23 trick (no float->int rounding
  // mode involved): its low mantissa bits then hold n.
  const vf<W> shifter = splat<W>(12582912.f);
  const vf<W> t = x * splat<W>(1.44269504f) + shifter;
  const vf<W> n = t - shifter;
  vf<W> r = x - n * splat<W>(0.693359375f);
  r = r - n * splat<W>(-2.12194440e-4f);
  vf<W> y = splat<W>(1.9875691500e-4f);
  y = y * r + splat<W>(1.3981999507e-3f);
  y = y * r + splat<W>(8.3334519073e-3f);
  y = y * r + splat<W>(4.1665795894e-2f);
  y = y * r + splat<W>(1.6666665459e-1f);
  y = y * r + splat<W>(5.0000001201e-1f);
  y = y * (r * r) + r + splat<W>(1.f);
  // 2^n: n + 127 in the exponent field. n is in [-126, 127] after the clamps.
  const vi bits = (reinterpret_cast<vi>(t) - reinterpret_cast<vi>(shifter) + 127) << 23;
  const vf<W> result = y * reinterpret_cast<vf<W>>(bits);
  return underflow ? splat<W>(0.f) : result;
}

}  // namespace kvcache_ext::attention::vec
