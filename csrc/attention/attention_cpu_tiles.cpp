// The tile loops of attention_cpu_tiles.h, written once over W-lane vectors (cpu_vec.h) and
// instantiated per ISA.
#include "attention/attention_cpu_tiles.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <limits>

#include "attention/cpu_vec.h"

namespace kvcache_ext::attention {

namespace {

using vec::vf;

// Hints the rows of the next page run into cache while this one is computed: a page's rows
// are contiguous but pages are not, so the hardware prefetcher restarts at every page.
template <typename T>
KVCACHE_ALWAYS_INLINE void prefetch_row(const T* next, int64_t l, int64_t D) {
  if (next == nullptr) return;
  const char* row = reinterpret_cast<const char*>(next + l * D);
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(row + b);
}

// Rows of a logits block computed together: each K vector loaded is used RB times.
constexpr int kRowBlock = 4;

// Two keys per step: 2 * RB independent accumulators keep the FMA units busy while the
// next K rows load.
template <int W, int RB, typename T>
KVCACHE_ALWAYS_INLINE void logits_rows(const T* k, int64_t run, int64_t D, const float* q,
                                       float* out, int64_t ld, const T* next) {
  const int64_t Dv = D / W * W;
  int64_t l = 0;
  for (; l + 2 <= run; l += 2) {
    prefetch_row(next, l, D);
    prefetch_row(next, l + 1, D);
    const T* k0 = k + l * D;
    const T* k1 = k0 + D;
    vf<W> a0[RB] = {}, a1[RB] = {};
    for (int64_t d = 0; d < Dv; d += W) {
      const vf<W> x0 = vec::load<W>(k0 + d), x1 = vec::load<W>(k1 + d);
      for (int j = 0; j < RB; ++j) {
        const vf<W> qj = vec::load<W>(q + j * D + d);
        a0[j] += qj * x0;
        a1[j] += qj * x1;
      }
    }
    for (int j = 0; j < RB; ++j) {
      float s0 = vec::sum(a0[j]), s1 = vec::sum(a1[j]);
      for (int64_t d = Dv; d < D; ++d) {
        s0 += q[j * D + d] * static_cast<float>(k0[d]);
        s1 += q[j * D + d] * static_cast<float>(k1[d]);
      }
      out[j * ld + l] = s0;
      out[j * ld + l + 1] = s1;
    }
  }
  for (; l < run; ++l) {
    prefetch_row(next, l, D);
    const T* kl = k + l * D;
    vf<W> acc[RB] = {};
    for (int64_t d = 0; d < Dv; d += W) {
      const vf<W> kv = vec::load<W>(kl + d);
      for (int j = 0; j < RB; ++j) acc[j] += vec::load<W>(q + j * D + d) * kv;
    }
    for (int j = 0; j < RB; ++j) {
      float s = vec::sum(acc[j]);
      for (int64_t d = Dv; d < D; ++d) s += q[j * D + d] * static_cast<float>(kl[d]);
      out[j * ld + l] = s;
    }
  }
}

// Two vectors of each V row per pass (2 * RB accumulators), so a pass reads 2 * W contiguous
// elements of every row of the run.
template <int W, int RB, typename T>
KVCACHE_ALWAYS_INLINE void values_rows(const T* v, int64_t run, int64_t D, const float* p,
                                       int64_t ld, float* acc, const T* next) {
  const int64_t Dv2 = D / (2 * W) * (2 * W), Dv = D / W * W;
  int64_t d = 0;
  for (; d < Dv2; d += 2 * W) {
    vf<W> a0[RB], a1[RB];
    for (int j = 0; j < RB; ++j) {
      a0[j] = vec::load<W>(acc + j * D + d);
      a1[j] = vec::load<W>(acc + j * D + d + W);
    }
    for (int64_t l = 0; l < run; ++l) {
      if (d == 0) prefetch_row(next, l, D);
      const vf<W> v0 = vec::load<W>(v + l * D + d), v1 = vec::load<W>(v + l * D + d + W);
      for (int j = 0; j < RB; ++j) {
        const vf<W> w = vec::splat<W>(p[j * ld + l]);
        a0[j] += w * v0;
        a1[j] += w * v1;
      }
    }
    for (int j = 0; j < RB; ++j) {
      vec::store<W>(acc + j * D + d, a0[j]);
      vec::store<W>(acc + j * D + d + W, a1[j]);
    }
  }
  for (; d < Dv; d += W) {
    vf<W> a[RB];
    for (int j = 0; j < RB; ++j) a[j] = vec::load<W>(acc + j * D + d);
    for (int64_t l = 0; l < run; ++l) {
      if (d == 0) prefetch_row(next, l, D);
      const vf<W> vv = vec::load<W>(v + l * D + d);
      for (int j = 0; j < RB; ++j) a[j] += vec::splat<W>(p[j * ld + l]) * vv;
    }
    for (int j = 0; j < RB; ++j) vec::store<W>(acc + j * D + d, a[j]);
  }
  for (; d < D; ++d)
    for (int64_t l = 0; l < run; ++l)
      for (int j = 0; j < RB; ++j) acc[j * D + d] += p[j * ld + l] * static_cast<float>(v[l * D + d]);
}

// Blocks of kRowBlock rows, then the remainder with a block as tall as it.
template <int W, typename T>
KVCACHE_ALWAYS_INLINE void logits_tile(const T* k, int64_t run, int64_t D, const float* q,
                                       int64_t rows, float* out, int64_t ld, const T* next) {
  int64_t j = 0;
  for (; j + kRowBlock <= rows; j += kRowBlock, next = nullptr)  // the first block prefetches
    logits_rows<W, kRowBlock>(k, run, D, q + j * D, out + j * ld, ld, next);
  switch (rows - j) {
    case 3: return logits_rows<W, 3>(k, run, D, q + j * D, out + j * ld, ld, next);
    case 2: return logits_rows<W, 2>(k, run, D, q + j * D, out + j * ld, ld, next);
    case 1: return logits_rows<W, 1>(k, run, D, q + j * D, out + j * ld, ld, next);
    default: return;
  }
}

template <int W, typename T>
KVCACHE_ALWAYS_INLINE void values_tile(const T* v, int64_t run, int64_t D, const float* p,
                                       int64_t ld, int64_t rows, float* acc, const T* next) {
  int64_t j = 0;
  for (; j + kRowBlock <= rows; j += kRowBlock, next = nullptr)
    values_rows<W, kRowBlock>(v, run, D, p + j * ld, ld, acc + j * D, next);
  switch (rows - j) {
    case 3: return values_rows<W, 3>(v, run, D, p + j * ld, ld, acc + j * D, next);
    case 2: return values_rows<W, 2>(v, run, D, p + j * ld, ld, acc + j * D, next);
    case 1: return values_rows<W, 1>(v, run, D, p + j * ld, ld, acc + j * D, next);
    default: return;
  }
}

template <int W, typename T>
KVCACHE_ALWAYS_INLINE void widen_impl(const T* src, float* dst, int64_t count) {
  int64_t i = 0;
  for (; i + W <= count; i += W) vec::store<W>(dst + i, vec::load<W>(src + i));
  for (; i < count; ++i) dst[i] = static_cast<float>(src[i]);
}

template <int W>
KVCACHE_ALWAYS_INLINE float exp_sum_impl(float* x, int64_t count, float m) {
  const vf<W> mv = vec::splat<W>(m);
  vf<W> total = {};
  int64_t i = 0;
  for (; i + W <= count; i += W) {
    const vf<W> e = vec::exp<W>(vec::load<W>(x + i) - mv);
    vec::store<W>(x + i, e);
    total += e;
  }
  if (i < count) {  // the tail through one padded vector, so every value gets the same exp
    float tail[W];
    std::fill(tail, tail + W, -std::numeric_limits<float>::infinity());
    std::copy(x + i, x + count, tail);
    const vf<W> e = vec::exp<W>(vec::load<W>(tail) - mv);
    vec::store<W>(tail, e);
    std::copy(tail, tail + (count - i), x + i);
    total += e;
  }
  return vec::sum(total);
}

template <int W>
KVCACHE_ALWAYS_INLINE float max_impl(const float* x, int64_t count) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (count >= W) {
    vf<W> mv = vec::load<W>(x);
    for (i = W; i + W <= count; i += W) mv = vec::vmax<W>(mv, vec::load<W>(x + i));
    m = vec::max<W>(mv);
  }
  for (; i < count; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// One set of entry points per ISA: ATTR is the target attribute (with flatten: everything they
// call is inlined into them, the ISA's own int8 loads of cpu_vec.h included), W the lanes of a
// float vector.
#define KVCACHE_DEFINE_TILES(ISA, ATTR, W)                                                      \
  template <typename T>                                                                         \
  ATTR void logits_##ISA(const T* k, int64_t run, int64_t D, const float* q, int64_t rows,      \
                         float* out, int64_t ld, const T* next) {                               \
    logits_tile<W>(k, run, D, q, rows, out, ld, next);                                          \
  }                                                                                             \
  template <typename T>                                                                         \
  ATTR void values_##ISA(const T* v, int64_t run, int64_t D, const float* p, int64_t ld,        \
                         int64_t rows, float* acc, const T* next) {                             \
    values_tile<W>(v, run, D, p, ld, rows, acc, next);                                          \
  }                                                                                             \
  template <typename T>                                                                         \
  ATTR void widen_##ISA(const T* src, float* dst, int64_t count) {                              \
    widen_impl<W>(src, dst, count);                                                             \
  }                                                                                             \
  ATTR float exp_sum_##ISA(float* x, int64_t count, float m) { return exp_sum_impl<W>(x, count, m); } \
  ATTR float max_##ISA(const float* x, int64_t count) { return max_impl<W>(x, count); }        \
  template <typename T>                                                                         \
  Tiles<T> tiles_##ISA() {                                                                      \
    return {logits_##ISA<T>, values_##ISA<T>, widen_##ISA<T>, exp_sum_##ISA, max_##ISA};        \
  }

KVCACHE_DEFINE_TILES(baseline, __attribute__((flatten)), 4)
#if defined(__GNUC__) && defined(__x86_64__)
#define KVCACHE_X86_ISAS 1
KVCACHE_DEFINE_TILES(avx2, __attribute__((target("avx2,fma,f16c"), flatten)), 8)
KVCACHE_DEFINE_TILES(avx512,
                     __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"), flatten)), 16)
#endif

// ISAs from narrowest to widest; supported(i) says whether this CPU runs ISA i.
constexpr const char* kIsaNames[] = {"baseline", "avx2", "avx512"};

bool supported(int isa) {
#ifdef KVCACHE_X86_ISAS
  if (isa == 1) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                       __builtin_cpu_supports("f16c");
  if (isa == 2) return supported(1) && __builtin_cpu_supports("avx512f") &&
                       __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                       __builtin_cpu_supports("avx512dq");
#endif
  return isa == 0;
}

int isa_index(const std::string& name) {
  for (int i = 0; i < 3; ++i)
    if (name == kIsaNames[i]) return i;
  TORCH_CHECK_VALUE(false, "unknown CPU ISA '", name, "'; choose baseline, avx2 or avx512");
  return 0;
}

int widest_supported() {
  int best = 0;
  for (int i = 0; i < 3; ++i)
    if (supported(i)) best = i;
  return best;
}

int checked(const std::string& name, const char* source) {
  const int i = isa_index(name);
  TORCH_CHECK_VALUE(supported(i), source, " asks for the CPU ISA '", name,
                    "', which this CPU does not support (widest: ", kIsaNames[widest_supported()],
                    ")");
  return i;
}

std::atomic<int>& current_isa() {
  static std::atomic<int> isa{[] {
    const char* env = std::getenv("KVCACHE_EXT_CPU_ISA");
    return env && *env ? checked(env, "KVCACHE_EXT_CPU_ISA") : widest_supported();
  }()};
  return isa;
}

}  // namespace

template <typename T>
const Tiles<T>& tiles() {
  static const Tiles<T> table[] = {
      tiles_baseline<T>(),
#ifdef KVCACHE_X86_ISAS
      tiles_avx2<T>(), tiles_avx512<T>(),
#endif
  };
  return table[current_isa().load()];
}

template const Tiles<float>& tiles<float>();
template const Tiles<c10::BFloat16>& tiles<c10::BFloat16>();
template const Tiles<c10::Half>& tiles<c10::Half>();
template const Tiles<int8_t>& tiles<int8_t>();

std::string cpu_isa() { return kIsaNames[current_isa().load()]; }

void set_cpu_isa(const std::string& isa) { current_isa().store(checked(isa, "set_cpu_isa")); }

}  // namespace kvcache_ext::attention
