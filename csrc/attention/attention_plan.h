// The CUDA attention's work plan: which split of which segment each block attends, and the
// rule by which a block reads its split against the lengths of the call. Host and device
// code alike (no CUDA headers): the CUDA kernel (attention_cuda.cu) and the CPU gtest
// (tests/test_attention.cpp) use the same functions.
//
// Layout of a plan tensor (int32 on the device): [3 W] splits {segment, begin, end}, then
// [S + 1] first split of each segment, then S itself (the last element). numel = 3 W + S + 2.
//
// A stale plan (made for other lengths than the store's now, e.g. reused across an append or
// a compaction) must not drop or invent tokens, and must cost no host sync to catch. So:
// - every segment has at least one split, an empty one [0, 0) when it had no token;
// - a split ends at min(its end, len[s]), except the last split of a segment, which ends at
//   len[s] whatever the plan said: a segment that grew since is attended whole by its last
//   split (correct, only less balanced), one that shrank loses the tokens it no longer has;
// - a plan made for another number of segments (its last element is not S) is refused on
//   the device: no block reads its splits and every output row is NaN.
// A fresh plan gives the balanced partition; a stale one of the same store gives the same
// result, exactly.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__CUDACC__)
#define KVCACHE_PLAN_HD __host__ __device__
#else
#define KVCACHE_PLAN_HD
#endif

namespace kvcache_ext::attention {

struct Split {  // a piece of one segment's live tokens: token indices [begin, end)
  int32_t segment, begin, end;
};
static_assert(sizeof(Split) == 3 * sizeof(int32_t), "Split is three int32");

constexpr int kPlanTile = 128;  // tokens per tile of attend_split (kTile in the kernel)

// The tokens [begin, end) that split w (of segment s = split.segment) reads when the store's
// length of s is `len`: see the rules above.
KVCACHE_PLAN_HD inline Split effective_split(Split split, int32_t w, const int32_t* seg_first_split,
                                             int32_t len) {
  const bool last_of_segment = w + 1 == seg_first_split[split.segment + 1];
  split.end = last_of_segment ? len : (split.end < len ? split.end : len);
  if (split.begin > split.end) split.begin = split.end;  // shrank past it: nothing to read
  return split;
}

// Splits of every segment's live slots, sized so that the grid has a few blocks per SM (sms)
// even when one segment holds every token; one empty split for an empty segment.
inline void plan_splits(const std::vector<int32_t>& len, int64_t row_tiles, int64_t sms,
                        std::vector<Split>& splits, std::vector<int32_t>& first) {
  int64_t tiles = 0;
  for (int32_t l : len) tiles += (static_cast<int64_t>(l) + kPlanTile - 1) / kPlanTile;
  const int64_t target_blocks = int64_t{8} * std::max<int64_t>(sms, 1);
  const int64_t tiles_per_split =
      std::max<int64_t>(1, (tiles * row_tiles + target_blocks - 1) / target_blocks);
  const int64_t split_len = tiles_per_split * kPlanTile;
  splits.clear();
  first.assign(len.size() + 1, 0);
  for (size_t s = 0; s < len.size(); ++s) {
    first[s] = static_cast<int32_t>(splits.size());
    const auto seg = static_cast<int32_t>(s);
    if (len[s] <= 0) splits.push_back({seg, 0, 0});
    for (int64_t b0 = 0; b0 < len[s]; b0 += split_len) {
      splits.push_back({seg, static_cast<int32_t>(b0),
                        static_cast<int32_t>(std::min<int64_t>(len[s], b0 + split_len))});
    }
  }
  first[len.size()] = static_cast<int32_t>(splits.size());
}

// The plan's int32 words (layout above).
inline std::vector<int32_t> plan_words(const std::vector<Split>& splits,
                                       const std::vector<int32_t>& first) {
  std::vector<int32_t> words;
  words.reserve(3 * splits.size() + first.size() + 1);
  for (const Split& sp : splits) words.insert(words.end(), {sp.segment, sp.begin, sp.end});
  words.insert(words.end(), first.begin(), first.end());
  words.push_back(static_cast<int32_t>(first.size()) - 1);  // S
  return words;
}

// W of a plan of `numel` words for S segments, or -1 when it cannot be one (checked on the
// host from the tensor's size alone; whether its last word is S is checked on the device).
inline int64_t plan_splits_count(int64_t numel, int64_t segments) {
  const int64_t rest = numel - segments - 2;
  return rest >= 3 * segments && rest % 3 == 0 ? rest / 3 : -1;
}

}  // namespace kvcache_ext::attention
