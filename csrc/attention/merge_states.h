// The merge of partial softmax states (FlashInfer's "merge states"), host and device code
// alike (no CUDA headers): the CUDA attention's split merge (attention_cuda.cu) runs it, the
// gtest MergeStates.* runs the same functions on the host against a float64 softmax.
//
// A state summarises attention over a set of logits x (base 2: q was pre-scaled by log2(e)):
// m = max x, l = sum 2^(x - m), o = sum 2^(x - m) v (unnormalised, E elements of the output
// row). The empty set is m = -inf, l = 0, o = 0; merging it changes nothing, and a row whose
// merged state is empty (it saw no slot) gets a zero output and inv_l = 0, never NaN.
// Merging is a left fold in a fixed order (the caller's), so a fixed order gives the same
// bits every time; another order differs by rounding only.
//
// The split merge runs in two levels for a long segment (more than `run` splits): the plan's
// splits are cut into runs of `run` consecutive ones, the segment's splits in each run are
// merged first, each piece into the slot of its first split (its head), then the segment
// merges its pieces' heads. A short segment merges its splits at once. merge_run_length
// picks `run`, merge_two_levels tells a long segment, merge_pieces and merge_piece_head
// enumerate a segment's heads (with run 1: its splits).
#pragma once

#include <math.h>

#include <cstdint>

#if defined(__CUDACC__)
#define KVCACHE_MERGE_HD __host__ __device__
#else
#define KVCACHE_MERGE_HD
#endif

namespace kvcache_ext::attention {

// 2^(m_part - m_all): the factor that brings a part with maximum m_part to the common
// maximum m_all >= m_part. An empty part (m_part = -inf) weighs 0, also when m_all is -inf
// (where the subtraction would give NaN).
KVCACHE_MERGE_HD inline float merge_scale(float m_part, float m_all) {
  return m_part == -INFINITY ? 0.f : exp2f(m_part - m_all);
}

template <int E>
struct MergeState {
  float m, l, o[E];

  KVCACHE_MERGE_HD static MergeState empty() {
    MergeState st;
    st.m = -INFINITY;
    st.l = 0.f;
    for (int e = 0; e < E; ++e) st.o[e] = 0.f;
    return st;
  }

  // Folds the state (m_b, l_b, o_b) into this one.
  KVCACHE_MERGE_HD void merge(float m_b, float l_b, const float* o_b) {
    const float m_all = m > m_b ? m : m_b;
    if (m_all == -INFINITY) return;  // both empty
    const float sa = merge_scale(m, m_all), sb = merge_scale(m_b, m_all);
    l = l * sa + l_b * sb;
    for (int e = 0; e < E; ++e) o[e] = o[e] * sa + o_b[e] * sb;
    m = m_all;
  }
  KVCACHE_MERGE_HD void merge(const MergeState& b) { merge(b.m, b.l, b.o); }

  // 1 / l, or 0 for a row that saw no slot (its output is then zeros).
  KVCACHE_MERGE_HD float inv_l() const { return l > 0.f ? 1.f / l : 0.f; }
  KVCACHE_MERGE_HD float out(int e) const { return o[e] * inv_l(); }
};

// The first level's run length for a plan of `splits` splits over `segments` segments, merged
// by `lanes` split lanes per row in the second level: about sqrt(longest / lanes), a power of
// two, so that both levels take a similar number of steps for the longest segment possible
// (all but one segment with one split); 1 (no first level) when that is 2 or less.
KVCACHE_MERGE_HD inline int merge_run_length(int64_t splits, int64_t segments, int lanes) {
  const int64_t longest = splits - segments + 1;  // the most splits one segment can have
  int run = 1;
  while (int64_t{4} * run * run * lanes <= longest) run *= 2;  // (2 run)^2 <= longest / lanes
  return run > 2 ? run : 1;
}

// Whether the segment of splits [first, last) is merged in two levels.
KVCACHE_MERGE_HD inline bool merge_two_levels(int first, int last, int run) {
  return run > 1 && last - first > run;
}

// A segment's splits [first, last) (last > first) cut at the multiples of run: the pieces the
// second level merges. Piece 0 starts at first, piece j > 0 at (first / run + j) * run.
KVCACHE_MERGE_HD inline int merge_pieces(int first, int last, int run) {
  return (last - 1) / run - first / run + 1;
}
KVCACHE_MERGE_HD inline int merge_piece_head(int first, int run, int j) {
  return j == 0 ? first : (first / run + j) * run;
}

}  // namespace kvcache_ext::attention
