// Kernels of the ragged KV store, one CPU and one CUDA implementation of each.
// They trust their inputs: the ops (ops.cpp) check everything first.
// Tokens are found through a PagedView (store/paged_layout.h); K and V rows are moved as
// raw bytes, so compaction needs no dtype dispatch; append and replace read the rows they
// are given by their dtype (float32, float16 or bfloat16), which int8 pages quantize
// (store/quantize.h).
#pragma once
#include <ATen/ATen.h>

#include "store/paged_layout.h"

namespace kvcache_ext::store {

// Writes token t of segment s (new_k/new_v [S, n, D], new_pos [B, n] with S = B * heads)
// as token len[s] + rank[s, t] of the segment and zeroes its scores (int8 pages: quantized,
// with its scales). rank [S, n] int32
// with -1 for tokens not stored; an undefined rank means rank = t. The segment's pages
// already cover the new tokens; len is not updated here.
void append_cpu(const PagedView& view, const at::Tensor& len, const at::Tensor& new_k,
                const at::Tensor& new_v, const at::Tensor& new_pos, const at::Tensor& rank);

// Overwrites token slot[s] ([S] int64, < len[s]) of segment s with token s of new_k/new_v
// [S, D] and new_pos [B] (S = B * heads), and zeroes its scores.
void replace_cpu(const PagedView& view, const at::Tensor& slot, const at::Tensor& new_k,
                 const at::Tensor& new_v, const at::Tensor& new_pos);

// Stable in-place removal of every live token whose keep flag ([capacity] bool, slot
// layout) is false. Writes the new lengths into len; frees no page (the page allocator does).
void compact_cpu(const PagedView& view, const at::Tensor& len, const at::Tensor& keep);

// The same removal without keeping the order: a segment keeping `kept` of its tokens keeps
// those among its first `kept` where they lie, and the r-th kept token past them fills the
// r-th evicted place among them (token order, both). Moves one token per evicted place that
// a later token fills, not every token after the first evicted one: what per-step eviction
// (one token out, one in) needs. Writes the new lengths into len; frees no page.
void compact_unordered_cpu(const PagedView& view, const at::Tensor& len, const at::Tensor& keep);

#ifdef KVCACHE_EXT_WITH_CUDA
void append_cuda(const PagedView& view, const at::Tensor& len, const at::Tensor& new_k,
                 const at::Tensor& new_v, const at::Tensor& new_pos, const at::Tensor& rank);
void replace_cuda(const PagedView& view, const at::Tensor& slot, const at::Tensor& new_k,
                  const at::Tensor& new_v, const at::Tensor& new_pos);
void compact_cuda(const PagedView& view, const at::Tensor& len, const at::Tensor& keep);
void compact_unordered_cuda(const PagedView& view, const at::Tensor& len, const at::Tensor& keep);
#endif

}  // namespace kvcache_ext::store
