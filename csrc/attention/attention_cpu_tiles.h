// The inner loops of the CPU attention, compiled once per x86 ISA (AVX-512, AVX2, the
// baseline) and picked at run time, as torch's own CPU kernels are: an extension is built
// for the baseline ISA, so the wide paths are functions with a target attribute.
//
// A tile is a run of a segment's tokens that lie in one page (their K or V rows follow one
// another) against the rows of a block of queries: rows j = 0 .. rows - 1, each a float
// query of D elements, already scaled.
#pragma once
#include <cstdint>
#include <string>

namespace kvcache_ext::attention {

template <typename T>
struct Tiles {
  // logits[j * ld + l] = q_j . k_l for l < run. `next`: the rows of the run that comes next
  // (prefetched meanwhile; run rows of it are read), or nullptr.
  void (*logits)(const T* k, int64_t run, int64_t D, const float* q, int64_t rows, float* logits,
                 int64_t ld, const T* next);
  // acc[j * D + d] += sum over l < run of p[j * ld + l] * v_l[d]; `next` as for logits.
  void (*values)(const T* v, int64_t run, int64_t D, const float* p, int64_t ld, int64_t rows,
                 float* acc, const T* next);
  // dst[i] = float(src[i]) for i < count.
  void (*widen)(const T* src, float* dst, int64_t count);
  // x[i] = e^(x[i] - m) for i < count; returns their sum.
  float (*exp_sum)(float* x, int64_t count, float m);
  // max of x[0 .. count), -inf for count = 0.
  float (*max)(const float* x, int64_t count);
};

// The loops for the ISA in use (see cpu_isa()); T is float, c10::BFloat16, c10::Half or
// int8_t (int8 pages: the loops see the steps; the caller applies the rows' scales).
template <typename T>
const Tiles<T>& tiles();

// The ISA the CPU attention uses: the widest this CPU supports ("avx512", "avx2" or
// "baseline"), unless KVCACHE_EXT_CPU_ISA or set_cpu_isa() asked for a narrower one.
std::string cpu_isa();
// Tests run every ISA the CPU has; asking for one it lacks is an error.
void set_cpu_isa(const std::string& isa);

}  // namespace kvcache_ext::attention
