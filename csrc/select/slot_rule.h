// The score a token gets under a slot rule: the eviction of a decode step by a scorer's rule
// (RaggedKVStore.evict_by_rule, the store_topk op with a rule), where the paged top-k reads
// each token's score from its record instead of a tensor the host made. Shared by the CPU and
// CUDA paged top-k (topk_cpu.cpp, topk_cuda.cu), so that the CPU tests exercise what the GPU
// runs. It is what the scorer's cache_scores gives on a padded view (H2O: channel 0;
// StreamingLLM: the position as a float), then +inf for a protected token (Protection.mask:
// position < sinks, or position > the row's newest position - recent when recent > 0).
#pragma once
#include <cstdint>
#include <limits>

#if defined(__CUDACC__)
#define KVCACHE_SLOT_RULE_FN __host__ __device__ __forceinline__
#else
#define KVCACHE_SLOT_RULE_FN inline
#endif

namespace kvcache_ext::select {

struct SlotRule {
  bool by_position = false;         // the score is the position (else channel 0 of the record)
  int32_t sinks = 0;                // positions below are protected
  int64_t recent = 0;               // positions above newest[row] - recent are protected (0: none)
  const int64_t* newest = nullptr;  // [B] each row's newest position, on the kernel's device
  int64_t heads = 1;                // segments per row: segment s belongs to row s / heads

  // The score of the token of segment `segment` at position `pos` whose record holds
  // `channel0` (not read when by_position).
  KVCACHE_SLOT_RULE_FN float score(const float* channel0, int32_t pos, int64_t segment) const {
    if (pos < sinks || (recent > 0 && static_cast<int64_t>(pos) > newest[segment / heads] - recent))
      return std::numeric_limits<float>::infinity();
    return by_position ? static_cast<float>(pos) : *channel0;
  }
};

}  // namespace kvcache_ext::select

#undef KVCACHE_SLOT_RULE_FN
