// Segmented top-k selection over the store's slot layout (see selection_key.h for the order).
#pragma once
#include <ATen/ATen.h>

#include <tuple>

namespace kvcache_ext {

namespace store {
struct PagedView;  // store/paged_layout.h
}  // namespace store

// Keeps the k[s] best live slots of every segment s (all of them when k[s] >= len[s]).
// scores [capacity] float32, pos [capacity] int32, start [S] int64, len [S] int32,
// k [S] integer. Returns keep [capacity] bool (false outside live slots).
// check_values: the checks that read values (segments in order inside the buffers, k >= 0),
// one host sync on CUDA together; false for callers that made the layout themselves (the
// store's select), which then costs no sync (a negative k keeps nothing).
at::Tensor segmented_topk(const at::Tensor& scores, const at::Tensor& pos, const at::Tensor& start,
                          const at::Tensor& len, const at::Tensor& k, bool check_values = true);

// Ada-KV's allocation step: segments [g * group_size, (g + 1) * group_size) form group g,
// and the k[g] best live slots of the whole group are kept, wherever they fall.
// Returns keep [capacity] bool and the number kept per segment, counts [S] int32.
std::tuple<at::Tensor, at::Tensor> grouped_topk(const at::Tensor& scores, const at::Tensor& pos,
                                                const at::Tensor& start, const at::Tensor& len,
                                                int64_t group_size, const at::Tensor& k,
                                                bool check_values = true);

namespace select {
// Kernels; inputs already checked. k is int32 [S] (segmented) or [G] (grouped).
void segmented_topk_cpu(const at::Tensor& scores, const at::Tensor& pos, const at::Tensor& start,
                        const at::Tensor& len, const at::Tensor& k, const at::Tensor& keep);
void grouped_topk_cpu(const at::Tensor& scores, const at::Tensor& pos, const at::Tensor& start,
                      const at::Tensor& len, int64_t group_size, const at::Tensor& k,
                      const at::Tensor& keep, const at::Tensor& counts);
// The selection of RaggedKVStore::select, reading each segment's tokens through the
// store's pages: group g is segments [g * group_size, (g + 1) * group_size) (group_size 1:
// per segment) and keeps its k[g] best tokens. scores: undefined (channel 0 of the pages),
// [capacity] (slot layout) or [B, H, L] (padded) float32. keep [capacity] bool, zeroed;
// counts [S] int32 receives the number kept per segment. CPU only: on CUDA the store's
// Python select packs the segments and calls the CUDA kernels above.
void paged_topk_cpu(const store::PagedView& view, const at::Tensor& len, const at::Tensor& scores,
                    int64_t group_size, const at::Tensor& k, const at::Tensor& keep,
                    const at::Tensor& counts);

#ifdef KVCACHE_EXT_WITH_CUDA
void segmented_topk_cuda(const at::Tensor& scores, const at::Tensor& pos, const at::Tensor& start,
                         const at::Tensor& len, const at::Tensor& k, const at::Tensor& keep);
void grouped_topk_cuda(const at::Tensor& scores, const at::Tensor& pos, const at::Tensor& start,
                       const at::Tensor& len, int64_t group_size, const at::Tensor& k,
                       const at::Tensor& keep, const at::Tensor& counts);
#endif
}  // namespace select

}  // namespace kvcache_ext
