// Attention of new queries over one layer's RaggedKVStore, with the per-slot softmax
// statistics that eviction policies read. See README "Attention".
#pragma once
#include <ATen/ATen.h>

#include <tuple>

#include "store/ragged_store.h"

namespace kvcache_ext {

// q [B, Hq, n, D] with Hq a multiple of store.heads(). Returns (out [B, Hq, n, D], mass,
// last, sum_sq, count); a statistic not asked for is an undefined tensor (None in Python).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> ragged_attention(
    const at::Tensor& q, const RaggedKVStore& store, double scale,
    const c10::optional<at::Tensor>& q_pos, bool want_mass, bool want_last, bool want_sum_sq,
    bool want_count);

}  // namespace kvcache_ext
