// The device-independent logic of the tensor-core decode kernel (decode_tc_cuda.cu), host and
// device code alike (no CUDA headers), so that the CPU gtest (tests/test_prefill_tiles.cpp,
// DecodeTiles.*) runs the kernel's tile loop through exactly these functions.
//
// Tiling (FlashInfer's decode on tensor cores: one warp of query rows, the warps along the KV
// tile). A decode call has few query rows per KV head (R = G * n <= kRows: the G heads of a
// group times the n new tokens), so a block takes them all as one mma M tile of 16 rows (rows
// past R zero) and its 4 warps split each KV tile of prefill::kTileN tokens instead: warp w
// takes tokens [16 w, 16 w + 16), which is one k-step of O += P V. Each warp keeps its own
// online softmax state {m, l, o} over its tokens of every tile of the split; at the end the
// block folds the 4 warp states in warp order (merge_states.h) into the split's state. The KV
// tiles are copied by cp.async in 2 stages into swizzled shared memory (tc_common.cuh, the
// prefill's copy), so one tile is in flight while the warps compute the other. The fragment
// maps, ldmatrix addresses and swizzle are prefill_tiles.h's.
//
// Rows are in the scalar kernel's order, r = g * n + i (attention_kernels.h): the split states
// land in the same part_m / part_l / part_o as attend_split's and the same merge
// (merge_segments, merge_runs) combines the splits. With statistics the kernel also writes each
// row's raw logit (base 2, -inf where masked) of every token of its split to the scalar
// kernel's logits buffer ([rows, capacity], slot layout), where the same slot_stats pass reads
// them; the causal skip of whole KV tiles is then off, so that every token gets its logits.
#pragma once

#include <cstdint>

#include "attention/merge_states.h"
#include "attention/prefill_tiles.h"

namespace kvcache_ext::attention::decode_tc {

constexpr int kWarps = prefill::kWarps;
constexpr int kThreads = prefill::kThreads;
constexpr int kRows = prefill::kWarpRows;              // the M tile: every row of a segment
constexpr int kWarpTokens = prefill::kTileN / kWarps;  // a warp's tokens of a KV tile
static_assert(kWarpTokens == 16, "a warp's tokens are one k-step of O += P V");

// Row of q and out ([B, Hq, n_total, D] as rows of D) of row r of segment s, in a pass over the
// queries [i0, i0 + n) (ragged_attention_cuda's passes over query chunks when the statistics'
// logits buffer would be too large; one pass, i0 = 0 and n = n_total, otherwise).
KVCACHE_PREFILL_HD inline int64_t q_row(int64_t s, int r, int groups, int n, int n_total, int i0) {
  return (s * groups + r / n) * n_total + i0 + r % n;
}
// The query (index in the n_total new tokens) of row r.
KVCACHE_PREFILL_HD inline int query_of(int r, int n, int i0) { return i0 + r % n; }
// The first token of warp w's share of a KV tile.
KVCACHE_PREFILL_HD inline int warp_first_token(int warp) { return warp * kWarpTokens; }

// The split's state of row r, element d: the warps' states folded in warp order. m and l are
// [kWarps, kRows], o is [kWarps, kRows, D] (each warp's rows over its own tokens).
KVCACHE_PREFILL_HD inline MergeState<1> merge_warps(const float* m, const float* l, const float* o, int r, int D,
                                                    int d) {
  MergeState<1> st = MergeState<1>::empty();
  for (int w = 0; w < kWarps; ++w) {
    const int wr = w * kRows + r;
    st.merge(m[wr], l[wr], o + static_cast<int64_t>(wr) * D + d);
  }
  return st;
}

}  // namespace kvcache_ext::attention::decode_tc
