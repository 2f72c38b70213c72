// CPU attention over the ragged store.
//
// Work unit: one segment and a block of queries i (all G heads of each), so a K or V row
// is converted to float once and used by every row of the block (decode: row loops,
// vectorized for AVX2 when the CPU has it; block prefill: matrix products). A block keeps its logits
// for the whole segment ([rows, len] floats, thread-local), so the softmax is the exact
// two-pass one (max first) and the statistics come from the final probabilities without
// recomputing anything. Without statistics the units run in parallel; with them, units of
// one segment run on one thread, as they add into the same slots.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention/attention_kernels.h"

namespace kvcache_ext::attention {

namespace {

constexpr int64_t kMaxRowsPerBlock = 64;
// From this many rows on (block prefill) a block's logits and output are two matrix
// products (torch's BLAS), which reuse each K and V row across rows far better than the
// row loops below; decode (rows = G) keeps the loops, which read K and V in one pass.
constexpr int64_t kGemmRows = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#define KVCACHE_ALWAYS_INLINE inline __attribute__((always_inline))

template <typename T>
KVCACHE_ALWAYS_INLINE void to_float(const T* src, float* dst, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

// logits[j * ld + l] = q_j . k_l for the rows j < rows of qf [rows, D] and the rows
// l < len of k [len, D] (one page's run of a segment's keys). Each K row is converted once for all rows; the dot product runs in
// 8 independent lanes, so it vectorizes without -ffast-math.
template <typename T>
KVCACHE_ALWAYS_INLINE void logits_impl(const T* k, int64_t len, int64_t D, const float* qf,
                                       int64_t rows, float* logits, int64_t ld, float* row_buf) {
  for (int64_t l = 0; l < len; ++l) {
    to_float(k + l * D, row_buf, D);
    for (int64_t j = 0; j < rows; ++j) {
      const float* a = qf + j * D;
      float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t d = 0;
      for (; d + 8 <= D; d += 8) {
        for (int e = 0; e < 8; ++e) part[e] += a[d + e] * row_buf[d + e];
      }
      for (; d < D; ++d) part[0] += a[d] * row_buf[d];
      logits[j * ld + l] =
          ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    }
  }
}

// acc_j += sum_l probs[j * ld + l] * v_l for the rows j < rows of acc [rows, D].
template <typename T>
KVCACHE_ALWAYS_INLINE void values_impl(const T* v, int64_t len, int64_t D, const float* probs,
                                       int64_t ld, int64_t rows, float* acc, float* row_buf) {
  for (int64_t l = 0; l < len; ++l) {
    to_float(v + l * D, row_buf, D);
    for (int64_t j = 0; j < rows; ++j) {
      const float w = probs[j * ld + l];
      if (w == 0.f) continue;  // masked slots, and rows that see nothing
      float* a = acc + j * D;
      for (int64_t d = 0; d < D; ++d) a[d] += w * row_buf[d];
    }
  }
}

// The two hot loops are also compiled for AVX2+FMA and picked at run time: an extension is
// built for the baseline x86-64 ISA (SSE2), while torch's own CPU kernels dispatch on the CPU.
#if defined(__GNUC__) && defined(__x86_64__)
#define KVCACHE_AVX2_PATH 1
template <typename T>
__attribute__((target("avx2,fma"))) void logits_avx2(const T* k, int64_t len, int64_t D,
                                                     const float* qf, int64_t rows, float* logits,
                                                     int64_t ld, float* row_buf) {
  logits_impl(k, len, D, qf, rows, logits, ld, row_buf);
}
template <typename T>
__attribute__((target("avx2,fma"))) void values_avx2(const T* v, int64_t len, int64_t D,
                                                     const float* probs, int64_t ld, int64_t rows,
                                                     float* acc, float* row_buf) {
  values_impl(v, len, D, probs, ld, rows, acc, row_buf);
}
bool cpu_has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#endif

template <typename T>
void compute_logits(const T* k, int64_t len, int64_t D, const float* qf, int64_t rows,
                    float* logits, int64_t ld, float* row_buf) {
#ifdef KVCACHE_AVX2_PATH
  if (cpu_has_avx2()) return logits_avx2(k, len, D, qf, rows, logits, ld, row_buf);
#endif
  logits_impl(k, len, D, qf, rows, logits, ld, row_buf);
}

template <typename T>
void accumulate_values(const T* v, int64_t len, int64_t D, const float* probs, int64_t ld,
                       int64_t rows, float* acc, float* row_buf) {
#ifdef KVCACHE_AVX2_PATH
  if (cpu_has_avx2()) return values_avx2(v, len, D, probs, ld, rows, acc, row_buf);
#endif
  values_impl(v, len, D, probs, ld, rows, acc, row_buf);
}

// Calls f(l0, run, rows) for the runs of a segment's tokens that share a page: tokens
// [l0, l0 + run) of part b, whose rows are contiguous from `rows`.
template <typename T, typename F>
void for_each_page_run(const store::PagedView& view, int part, int64_t s, int64_t len, const F& f) {
  const int64_t P = view.page_size();
  for (int64_t l0 = 0; l0 < len; l0 += P) {
    f(l0, std::min(P, len - l0), reinterpret_cast<const T*>(view.token(part, s, l0)));
  }
}

// The segment's rows of part b (K or V) as floats, contiguous [len, D].
template <typename T>
void gather_rows_as_float(const store::PagedView& view, int part, int64_t s, int64_t len,
                          int64_t D, float* out) {
  for_each_page_run<T>(view, part, s, len, [&](int64_t l0, int64_t run, const T* rows) {
    to_float(rows, out + l0 * D, run * D);
  });
}

struct Shape {
  int64_t heads, groups, n, D;
  bool causal, mass, last, sum_sq, count;
};

// Attends queries [i0, i1) of every head of segment s over its live slots.
template <typename T>
void attend_block(const Problem& p, Result& r, const Shape& sh, int64_t s, int64_t i0, int64_t i1) {
  const int64_t G = sh.groups, n = sh.n, D = sh.D, ib = i1 - i0, rows = G * ib;
  const int64_t b = s / sh.heads;
  const int64_t len = (*p.len_host)[s];
  const store::PagedView& view = p.view;
  // Row (g, i) of this segment is q/out row (s * G + g) * n + i.
  const T* q = p.q.data_ptr<T>() + s * G * n * D;
  T* out = r.out.data_ptr<T>() + s * G * n * D;
  auto row_offset = [&](int64_t g, int64_t i) { return (g * n + i) * D; };

  if (len == 0) {  // nothing to attend: zero output, no statistics
    for (int64_t g = 0; g < G; ++g)
      std::fill(out + row_offset(g, i0), out + row_offset(g, i0) + ib * D, T(0));
    return;
  }

  thread_local std::vector<float> qf, logits, acc, row_buf, kv_f;
  thread_local std::vector<int64_t> slot;
  thread_local std::vector<int32_t> slot_pos;
  qf.resize(rows * D);
  logits.resize(rows * len);
  acc.assign(rows * D, 0.f);
  row_buf.resize(D);
  // Local row index j = g * ib + (i - i0).
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t j = g * ib + (i - i0);
      to_float(q + row_offset(g, i), qf.data() + j * D, D);
      for (int64_t d = 0; d < D; ++d) qf[j * D + d] *= p.scale;
    }
  // The segment's slots and positions, token by token (they lie in pages).
  slot.resize(len);
  slot_pos.resize(len);
  for (int64_t l = 0; l < len; ++l) {
    slot[l] = view.slot(s, l);
    slot_pos[l] = *reinterpret_cast<const int32_t*>(view.row(store::kPos, slot[l]));
  }
  const int32_t* q_pos = sh.causal ? p.q_pos.data_ptr<int32_t>() + b * n : nullptr;

  // Logits: each K row once, against every row of the block.
  const bool gemm = rows >= kGemmRows;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  if (gemm) {  // logits [rows, len] = qf [rows, D] @ K^T
    kv_f.resize(len * D);
    gather_rows_as_float<T>(view, store::kK, s, len, D, kv_f.data());
    at::Tensor logits_t = at::from_blob(logits.data(), {rows, len}, f32);
    at::mm_out(logits_t, at::from_blob(qf.data(), {rows, D}, f32),
               at::from_blob(kv_f.data(), {len, D}, f32).t());
  } else {
    for_each_page_run<T>(view, store::kK, s, len, [&](int64_t l0, int64_t run, const T* k) {
      compute_logits(k, run, D, qf.data(), rows, logits.data() + l0, len, row_buf.data());
    });
  }
  if (q_pos) {  // causal by position: slots in a query's future are masked
    for (int64_t l = 0; l < len; ++l)
      for (int64_t i = i0; i < i1; ++i) {
        if (slot_pos[l] <= q_pos[i]) continue;
        for (int64_t g = 0; g < G; ++g) logits[(g * ib + (i - i0)) * len + l] = kNegInf;
      }
  }
  // Exact softmax per row: probabilities replace the logits; inv_sum = 0 for a row that sees
  // no slot (all its slots are in its future), whose output is then zero.
  std::vector<float> inv_sum(rows);
  for (int64_t j = 0; j < rows; ++j) {
    float* x = logits.data() + j * len;
    const float m = *std::max_element(x, x + len);
    if (m == kNegInf) {
      std::fill(x, x + len, 0.f);
      inv_sum[j] = 0.f;
      continue;
    }
    float sum = 0.f;
    for (int64_t l = 0; l < len; ++l) {
      x[l] = std::exp(x[l] - m);
      sum += x[l];
    }
    inv_sum[j] = 1.f / sum;
  }
  // Output: each V row once, accumulated into every row of the block.
  if (gemm) {  // acc [rows, D] = probs [rows, len] @ V
    gather_rows_as_float<T>(view, store::kV, s, len, D, kv_f.data());
    at::Tensor acc_t = at::from_blob(acc.data(), {rows, D}, f32);
    at::mm_out(acc_t, at::from_blob(logits.data(), {rows, len}, f32),
               at::from_blob(kv_f.data(), {len, D}, f32));
  } else {
    for_each_page_run<T>(view, store::kV, s, len, [&](int64_t l0, int64_t run, const T* v) {
      accumulate_values(v, run, D, logits.data() + l0, len, rows, acc.data(), row_buf.data());
    });
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t j = g * ib + (i - i0);
      T* o = out + row_offset(g, i);
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[j * D + d] * inv_sum[j]);
    }

  // Statistics of the normalized probabilities, added into this segment's slots.
  if (!(sh.mass || sh.last || sh.sum_sq || sh.count)) return;
  float* mass = sh.mass ? r.mass.data_ptr<float>() : nullptr;
  float* last = sh.last ? r.last.data_ptr<float>() : nullptr;
  float* sum_sq = sh.sum_sq ? r.sum_sq.data_ptr<float>() : nullptr;
  int32_t* count = sh.count ? r.count.data_ptr<int32_t>() : nullptr;
  for (int64_t l = 0; l < len; ++l) {
    float slot_mass = 0.f, slot_sq = 0.f;
    int32_t seen = 0;
    for (int64_t i = i0; i < i1; ++i) {
      float group_mass = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t j = g * ib + (i - i0);
        const float prob = logits[j * len + l] * inv_sum[j];
        group_mass += prob;
        if (last && i == n - 1) last[slot[l] * G + g] = prob;
      }
      slot_mass += group_mass;
      const float mean = group_mass / static_cast<float>(G);
      slot_sq += mean * mean;
      seen += (!q_pos || slot_pos[l] <= q_pos[i]) ? 1 : 0;
    }
    if (mass) mass[slot[l]] += slot_mass;
    if (sum_sq) sum_sq[slot[l]] += slot_sq;
    if (count) count[slot[l]] += seen;
  }
}

}  // namespace

void ragged_attention_cpu(const Problem& p, Result& r) {
  const int64_t B = p.q.size(0), n = p.q.size(2), D = p.q.size(3);
  const int64_t S = p.segments;
  Shape sh{S / B, p.groups, n, D, p.q_pos.defined(), r.mass.defined(), r.last.defined(),
           r.sum_sq.defined(), r.count.defined()};
  const int64_t per_block = std::max<int64_t>(1, kMaxRowsPerBlock / sh.groups);
  const int64_t blocks_per_segment = (n + per_block - 1) / per_block;
  const bool stats = sh.mass || sh.last || sh.sum_sq || sh.count;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.q.scalar_type(), "ragged_attention_cpu",
                                  [&] {
    auto run_segment_blocks = [&](int64_t s, int64_t first, int64_t end) {
      for (int64_t blk = first; blk < end; ++blk) {
        const int64_t i0 = blk * per_block;
        attend_block<scalar_t>(p, r, sh, s, i0, std::min(n, i0 + per_block));
      }
    };
    if (stats) {  // a segment's blocks add into the same slots: one thread per segment
      at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
        for (int64_t s = s0; s < s1; ++s) run_segment_blocks(s, 0, blocks_per_segment);
      });
    } else {
      at::parallel_for(0, S * blocks_per_segment, 1, [&](int64_t w0, int64_t w1) {
        for (int64_t w = w0; w < w1; ++w) {
          const int64_t s = w / blocks_per_segment, blk = w % blocks_per_segment;
          run_segment_blocks(s, blk, blk + 1);
        }
      });
    }
  });
}

}  // namespace kvcache_ext::attention
