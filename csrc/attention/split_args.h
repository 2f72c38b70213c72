// What the blocks of every CUDA attention kernel read of a call, and where they leave each
// split's state: the scalar kernel (attention_cuda.cu), the tensor-core prefill
// (prefill_cuda.cu) and decode (decode_tc_cuda.cu). One struct, filled on the host in one place
// (split_args), so that the three kernels cannot disagree about the call. CUDA builds only.
#pragma once
#ifdef KVCACHE_EXT_WITH_CUDA

#include <ATen/ATen.h>

#include <cstdint>

#include "attention/attention_kernels.h"
#include "attention/attention_plan.h"
#include "store/paged_layout.h"

namespace kvcache_ext::attention {

struct SplitArgs {
  const void* q;                   // [B, Hq, n_total, D] of the store's dtype
  store::PagedView view;           // K, V and pos of every live token
  const int32_t* q_pos;            // [B, n_total] or null (every live token visible)
  const int32_t* len;              // [S] live tokens: a split ends there at the latest
  const Split* splits;             // [W] (the plan, attention_plan.h)
  const int32_t* seg_first_split;  // [S + 1]: splits of segment s are [first[s], first[s+1])
  const int32_t* plan_segments;    // the plan's S (its last word): != segments refuses it
  int32_t segments, heads, groups;
  // This pass attends queries [i0, i0 + n) of the n_total in q (the scalar kernel's passes over
  // query chunks; one pass otherwise), rows = G * n of them per segment, in row_tiles blocks a
  // split.
  int32_t n_total, i0, n, rows, row_tiles;
  float scale_log2;                // softmax scale * log2(e): logits in base 2
  int64_t capacity;                // slots of the slot layout
  float* logits;                   // [rows, capacity] raw logits for slot_stats, or null
  float* part_m;                   // [W, rows] each split's running max
  float* part_l;                   // [W, rows] its sum
  float* part_o;                   // [W, rows, D] its unnormalised output
  float* lse;                      // [S, rows] merged log-sum-exp for prefill_stats, or null
};

// The call's part of the arguments: one pass over every query (i0 = 0, n = n_total); the caller
// sets rows, row_tiles and the outputs.
inline SplitArgs split_args(const Problem& p, const at::Tensor& plan, int64_t splits) {
  constexpr float kLog2e = 1.4426950408889634f;
  SplitArgs a{};
  a.q = p.q.data_ptr();
  a.view = p.view;
  a.q_pos = p.q_pos.defined() ? p.q_pos.data_ptr<int32_t>() : nullptr;
  a.len = p.len.data_ptr<int32_t>();
  a.splits = reinterpret_cast<const Split*>(plan.data_ptr<int32_t>());
  a.seg_first_split = plan.data_ptr<int32_t>() + 3 * splits;
  a.plan_segments = plan.data_ptr<int32_t>() + plan.numel() - 1;
  a.segments = static_cast<int32_t>(p.segments);
  a.heads = static_cast<int32_t>(p.segments / p.q.size(0));
  a.groups = static_cast<int32_t>(p.groups);
  a.n_total = a.n = static_cast<int32_t>(p.q.size(2));
  a.i0 = 0;
  a.scale_log2 = p.scale * kLog2e;
  a.capacity = p.capacity;
  return a;
}

}  // namespace kvcache_ext::attention

#endif  // KVCACHE_EXT_WITH_CUDA
