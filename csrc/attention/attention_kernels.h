// Kernels of the attention over the ragged store, one CPU and one CUDA implementation.
// They trust their inputs: the attention_run op (ops.cpp) checks everything first.
//
// Rows of a segment: segment s = (b, h) serves the R = G * n query rows (g, i) of the
// query heads h * G + g (HF's repeat_kv grouping) and the n new tokens i. Row r = g * n + i,
// so the rows of a segment are contiguous in q and out ([B, Hq, n, D]).
#pragma once
#include <ATen/ATen.h>

#include <vector>

#include "store/paged_layout.h"

namespace kvcache_ext::attention {

struct Problem {
  at::Tensor q;       // [B, Hq, n, D] contiguous, the store's dtype (int8 pages: a float dtype)
  store::PagedView view;  // the store's pages: K, V and pos of every live token
  int64_t capacity;   // slots of the store's slot layout (the statistics' length)
  int64_t segments;   // S = B * H
  at::Tensor len;     // [S] int32 on the store's device
  const std::vector<int32_t>* len_host;  // host mirror of len (no device sync needed)
  at::Tensor q_pos;   // [B, n] int32: token l is visible to query i iff its pos <= q_pos[b, i].
                      // Undefined: every live slot is visible to every query.
  int64_t groups;     // G = Hq / H
  float scale;        // softmax scale applied to q . k
  at::Tensor plan;    // CUDA: the plan of attention_plan (ops.h); undefined: made from len_host
};

// Outputs. `out` is always defined; each statistic is undefined when not requested. The
// CUDA kernel writes the live slots of zero-filled statistics (adding up over its passes of
// query chunks when the call takes several); the CPU kernel gets them
// uninitialised and writes every slot (zeros where no live token is), which saves a pass of
// writes over them.
struct Result {
  at::Tensor out;     // [B, Hq, n, D] q's dtype
  // Statistics are in slot layout (store/paged_layout.h).
  at::Tensor mass;    // [capacity] f32: sum over the n queries and G heads of p
  at::Tensor last;    // [capacity, G] f32: p of the last query (i = n - 1) per head g
  at::Tensor sum_sq;  // [capacity] f32: sum over queries of (mean over g of p)^2
  at::Tensor count;   // [capacity] int32: number of queries that saw the slot
};

void ragged_attention_cpu(const Problem& p, Result& r);
#ifdef KVCACHE_EXT_WITH_CUDA
void ragged_attention_cuda(const Problem& p, Result& r);
// The CUDA work partition of ops::attention_plan for segments of lengths len and `rows`
// query rows per segment: [3 W] splits then [S + 1] first split per segment, on the device.
// Sized for the tensor-core decode (decode_tc.h: one block per split) when KVCACHE_EXT_TC_DECODE
// is 1 and rows <= 16, else for the scalar kernel's row tiles.
at::Tensor plan_cuda(const std::vector<int32_t>& len, int64_t rows, const c10::Device& device);

// The tensor-core prefill kernel (prefill_cuda.cu), on by default: attention_run sends it the
// CUDA calls it takes (prefill_tc_applies): fp16 or bf16 pages (not int8), head_dim 64 or 128, at least
// kPrefillTcMinRows query rows per KV head (G * n), statistics only for G <= 64 (it stores
// each live slot's statistics once into the zero-filled ones). Every other call, and every
// call under KVCACHE_EXT_TC_PREFILL=0, runs the scalar ragged_attention_cuda. It is on by
// default because it is faster than the scalar kernel on causal prefill blocks (docs/kernels.md
// and docs/gpu.md give the figures).
constexpr int64_t kPrefillTcMinRows = 16;
constexpr const char* kPrefillTcSwitch = "KVCACHE_EXT_TC_PREFILL";
// The switch, read from the environment on every call that could take the tensor-core path
// (never on decode): unset or "1" on, "0" off; any other value raises a ValueError naming it.
bool prefill_tc_enabled();
// The plan of attention_plan (same layout, same stale-plan rules) with splits sized for the
// tensor-core prefill's 64-row tiles rather than the scalar kernel's 4-row ones (which would
// give it a fraction of the blocks it needs on long segments); attention_plan makes it for
// calls of kPrefillTcMinRows rows or more while the switch is on. The scalar kernel reads it as
// well (the calls prefill_tc_applies rejects), with splits sized for the other kernel.
at::Tensor plan_prefill_cuda(const std::vector<int32_t>& len, int64_t rows, const c10::Device& device);
bool prefill_tc_applies(const Problem& p, const Result& r);
void prefill_attention_cuda(const Problem& p, Result& r);
#endif

}  // namespace kvcache_ext::attention
