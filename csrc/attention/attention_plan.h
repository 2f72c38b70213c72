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
#include <utility>
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

// Split sizing in whole waves. A wave is what the GPU runs at once: sms x resident blocks
// (resident: blocks of the attention kernel per SM). With every split cut to
// tiles_per_split tiles of kPlanTile tokens, a segment of t tiles has ceil(t / tiles_per_split)
// splits (one, empty, when t = 0) and the grid has row_tiles blocks per split. The model of
// the run's time: ceil(blocks / wave) waves, each as long as the longest block, tiles_per_split
// tiles plus a fixed cost per block (loading q, writing the split's partial output, merging
// it) of about a quarter tile: kPlanBlockCostQuarters = 1 against 4 per tile. So a last wave
// that is mostly empty costs as much as a full one, and more, shorter splits pay only when they
// remove a wave. The plan takes, among the shortest split lengths that fit the grid in
// 1, 2, ... kPlanMaxWaves waves, the one of least modelled time (the fewest waves on a tie);
// when even one split per segment needs more waves, one split per segment. At most 4 waves:
// the sizing before aimed at 2; more waves multiply the splits (merge work, host time of the
// plan: one term per distinct length and try), and the model overstates what a part-empty
// last wave costs a memory-bound kernel, whose fewer blocks then share the bandwidth.
constexpr int64_t kPlanMaxWaves = 4;
constexpr int64_t kPlanBlockCostQuarters = 1;
// Blocks per SM of attend_split<bf16, 128, 4> on sm_90 (128 registers of 128 threads), the
// default when the caller does not say (the CUDA plan asks the runtime).
constexpr int64_t kPlanResidentPerSm = 4;

inline int64_t plan_tiles(int32_t len) { return (std::max<int64_t>(len, 0) + kPlanTile - 1) / kPlanTile; }

// The segments' tile counts, as (tiles, segments with that many) in increasing order: the
// block counts below cost one term per distinct length (one for uniform lengths), since
// the plan is made on the host for every layer and step.
struct PlanLengths {
  std::vector<std::pair<int64_t, int64_t>> runs;
  int64_t tiles = 0;  // all segments' tiles

  explicit PlanLengths(const std::vector<int32_t>& len) {
    std::vector<int64_t> t;
    t.reserve(len.size());
    for (int32_t l : len) t.push_back(plan_tiles(l));
    if (!std::all_of(t.begin(), t.end(), [&](int64_t x) { return x == t.front(); }))
      std::sort(t.begin(), t.end());  // uniform lengths (the common case) skip the sort
    for (int64_t x : t) {
      if (runs.empty() || runs.back().first != x) runs.emplace_back(x, 0);
      ++runs.back().second;
      tiles += x;
    }
  }
  int64_t longest() const { return runs.empty() ? 1 : std::max<int64_t>(runs.back().first, 1); }
  // Blocks of the grid with splits of tiles_per_split tiles.
  int64_t blocks(int64_t row_tiles, int64_t tiles_per_split) const {
    int64_t splits = 0;
    for (const auto& [t, n] : runs) splits += n * std::max<int64_t>(1, (t + tiles_per_split - 1) / tiles_per_split);
    return splits * row_tiles;
  }
  // The modelled time of the run (above), in quarter tiles.
  int64_t cost(int64_t row_tiles, int64_t tiles_per_split, int64_t wave) const {
    const int64_t waves = (blocks(row_tiles, tiles_per_split) + wave - 1) / wave;
    return waves * (4 * tiles_per_split + kPlanBlockCostQuarters);
  }
};

// The split length in tiles (above).
inline int64_t plan_tiles_per_split(const std::vector<int32_t>& len, int64_t row_tiles, int64_t sms,
                                    int64_t resident) {
  const PlanLengths lengths(len);
  const int64_t wave = std::max<int64_t>(sms, 1) * std::max<int64_t>(resident, 1);
  const int64_t longest = lengths.longest();
  int64_t best = longest, best_cost = lengths.cost(row_tiles, longest, wave);
  // fits: the shortest length found so far whose grid fits in the waves tried (more waves
  // fit it too). A grid in `waves` waves needs tiles_per_split >= tiles x row_tiles / (waves
  // x wave), since a segment of t tiles has at least t / tiles_per_split splits.
  int64_t fits = longest;
  for (int64_t waves = 1; waves <= kPlanMaxWaves; ++waves) {
    if (lengths.blocks(row_tiles, longest) > waves * wave) continue;
    int64_t lo = std::max<int64_t>(1, lengths.tiles * row_tiles / (waves * wave)), hi = fits;
    lo = std::min(lo, hi);
    while (lo < hi) {  // the shortest split length that fits in `waves` waves
      const int64_t mid = lo + (hi - lo) / 2;
      if (lengths.blocks(row_tiles, mid) <= waves * wave) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    fits = lo;
    const int64_t cost = lengths.cost(row_tiles, lo, wave);
    if (cost < best_cost) {
      best = lo;
      best_cost = cost;
    }
  }
  return best;
}

// Splits of every segment's live slots, sized in whole waves (above) so that the grid fills
// the GPU even when one segment holds every token; one empty split for an empty segment.
inline void plan_splits(const std::vector<int32_t>& len, int64_t row_tiles, int64_t sms,
                        std::vector<Split>& splits, std::vector<int32_t>& first,
                        int64_t resident = kPlanResidentPerSm) {
  const int64_t split_len = plan_tiles_per_split(len, row_tiles, sms, resident) * kPlanTile;
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
