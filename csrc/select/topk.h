// Kernels of the segmented top-k selection (see radix_select.h for the order and the shared
// radix selection). Their entry points, with the input checks, are the ops segmented_topk,
// grouped_topk and store_topk (ops.h).
#pragma once
#include <ATen/ATen.h>

namespace kvcache_ext {

namespace store {
struct PagedView;  // store/paged_layout.h
}  // namespace store

namespace select {
struct SlotRule;  // select/slot_rule.h

// Inputs already checked. k is int32 [S] (segmented) or [G] (grouped).
// Keeps the k[s] best live slots of every segment s (all of them when k[s] >= len[s]):
// scores [capacity] float32, pos [capacity] int32, start [S] int64, len [S] int32; keep
// [capacity] bool, zeroed.
void segmented_topk_cpu(const at::Tensor& scores, const at::Tensor& pos, const at::Tensor& start,
                        const at::Tensor& len, const at::Tensor& k, const at::Tensor& keep);
// Ada-KV's allocation step: segments [g * group_size, (g + 1) * group_size) form group g,
// and the k[g] best live slots of the whole group are kept, wherever they fall; counts [S]
// int32, zeroed, receives the number kept per segment.
void grouped_topk_cpu(const at::Tensor& scores, const at::Tensor& pos, const at::Tensor& start,
                      const at::Tensor& len, int64_t group_size, const at::Tensor& k,
                      const at::Tensor& keep, const at::Tensor& counts);
// The selection of the store_topk op, reading each segment's tokens through the
// store's pages: group g is segments [g * group_size, (g + 1) * group_size) (group_size 1:
// per segment) and keeps its k[g] best tokens. scores: undefined (channel 0 of the pages),
// [capacity] (slot layout) or [B, H, L] (padded) float32. keep [capacity] bool, zeroed;
// counts [S] int32, zeroed, receives the number kept per segment. The CPU op checks every
// k >= 0; the CUDA kernel clamps k[g] to [0, live tokens of g] on the device (no host sync).
// rule (a slot rule's eviction, RaggedKVStore.evict_by_rule; scores then undefined): each token's score is
// rule->score of its record (slot_rule.h) instead.
void paged_topk_cpu(const store::PagedView& view, const at::Tensor& len, const at::Tensor& scores,
                    int64_t group_size, const at::Tensor& k, const at::Tensor& keep,
                    const at::Tensor& counts, const SlotRule* rule = nullptr);

#ifdef KVCACHE_EXT_WITH_CUDA
void segmented_topk_cuda(const at::Tensor& scores, const at::Tensor& pos, const at::Tensor& start,
                         const at::Tensor& len, const at::Tensor& k, const at::Tensor& keep);
void grouped_topk_cuda(const at::Tensor& scores, const at::Tensor& pos, const at::Tensor& start,
                       const at::Tensor& len, int64_t group_size, const at::Tensor& k,
                       const at::Tensor& keep, const at::Tensor& counts);
void paged_topk_cuda(const store::PagedView& view, const at::Tensor& len, const at::Tensor& scores,
                     int64_t group_size, const at::Tensor& k, const at::Tensor& keep,
                     const at::Tensor& counts, const SlotRule* rule = nullptr);
#endif
}  // namespace select

}  // namespace kvcache_ext
