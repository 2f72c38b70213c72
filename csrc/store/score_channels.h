// The score channels of a store's pages as tensors: the parts of a slab as typed views, and
// the channel update of a policy (H2O's accumulated mass) done in place in the pages. Plain
// ATen ops on views of the slabs, so one implementation serves CPU and CUDA; no kernel of
// its own. Shared by the store_add_scores op (ops.cpp) and the page allocator.
#pragma once
#include <ATen/ATen.h>

#include "store/paged_layout.h"

namespace kvcache_ext::store {

// Part `part` (kK, kV, kPos, kScores, kScale) of every page of a slab (uint8 [pages, record
// bytes]) as a [pages, P, width] view ([pages, P] for kPos), typed: kv_dtype (the pages'
// element type) for K and V, int32 for the positions, float32 for the scores, float16 for
// the scales (width 2, or 0 on pages that are not int8).
at::Tensor slab_part(const at::Tensor& slab, const PageRecord& record, int part, int64_t page_size,
                     at::ScalarType kv_dtype);

// Score channel `channel` of every slot += values ([capacity] float32 on the slabs' device,
// slot layout: the slabs' pages numbered in order). Inputs already checked.
void add_to_scores(at::TensorList slabs, const PageRecord& record, int64_t page_size, int64_t channel,
                   const at::Tensor& values);

}  // namespace kvcache_ext::store
