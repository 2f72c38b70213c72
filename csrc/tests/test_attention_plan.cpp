// The CUDA attention's plan rules (attention/attention_plan.h), on the host: the splits a plan
// makes, read against the lengths of a later call as the kernel reads them, must cover every
// live token of every segment exactly once, in order, whether the plan is fresh or stale
// (made for other lengths: segments grown, shrunk, emptied, filled). The CUDA twin in
// tests/test_attention.py (test_stale_plan_on_cuda_*) runs the kernel itself on a stale plan.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "attention/attention_plan.h"
#include "tests/test_util.h"

namespace {

using kvcache_ext::attention::effective_split;
using kvcache_ext::attention::kPlanTile;
using kvcache_ext::attention::PlanLengths;
using kvcache_ext::attention::plan_tiles;
using kvcache_ext::attention::plan_tiles_per_split;
using kvcache_ext::attention::plan_splits;
using kvcache_ext::attention::plan_splits_count;
using kvcache_ext::attention::plan_words;
using kvcache_ext::attention::Split;

std::vector<int32_t> random_lengths(std::mt19937& rng, int64_t S, int32_t longest) {
  std::vector<int32_t> len(S);
  for (auto& l : len) {
    const int kind = kvtest::uniform_int(rng, 0, 4);  // empty, one token, short, long
    l = kind == 0 ? 0 : kind == 1 ? 1 : kind == 2 ? kvtest::uniform_int(rng, 2, 300)
                                                  : kvtest::uniform_int(rng, 2, longest);
  }
  return len;
}

// The tokens the kernel reads for each segment under lengths `now`, from a plan made for
// `then`: must be [0, now[s]) exactly once, in order.
void expect_covers(const std::vector<int32_t>& then, const std::vector<int32_t>& now,
                   int64_t row_tiles, int64_t sms) {
  std::vector<Split> splits;
  std::vector<int32_t> first;
  plan_splits(then, row_tiles, sms, splits, first);
  const auto S = static_cast<int64_t>(then.size());
  const std::vector<int32_t> words = plan_words(splits, first);
  ASSERT_EQ(plan_splits_count(static_cast<int64_t>(words.size()), S),
            static_cast<int64_t>(splits.size()));
  ASSERT_EQ(words.back(), S);  // the device check of a foreign plan reads this word
  for (int64_t s = 0; s < S; ++s) {
    ASSERT_LT(first[s], first[s + 1]) << "segment " << s << " has no split";
    int32_t next = 0;  // the first token not read yet
    for (int32_t w = first[s]; w < first[s + 1]; ++w) {
      ASSERT_EQ(splits[w].segment, s);
      const Split e = effective_split(splits[w], w, first.data(), now[s]);
      ASSERT_LE(e.begin, e.end);
      if (e.begin == e.end) continue;
      ASSERT_EQ(e.begin, next) << "segment " << s << " split " << w << " (then " << then[s]
                               << " tokens, now " << now[s] << ")";
      next = e.end;
    }
    ASSERT_EQ(next, now[s]) << "segment " << s << " (then " << then[s] << ", now " << now[s] << ")";
  }
}

TEST(AttentionPlan, FreshPlanCoversEveryToken) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t S = kvtest::uniform_int(rng, 1, 40);
    const auto len = random_lengths(rng, S, 70000);
    expect_covers(len, len, kvtest::uniform_int(rng, 1, 8), kvtest::uniform_int(rng, 1, 132));
    if (HasFailure()) return;
  }
}

TEST(AttentionPlan, StalePlanCoversEveryTokenOfTheNewLengths) {
  std::mt19937 rng(8);
  for (int trial = 0; trial < 400; ++trial) {
    const int64_t S = kvtest::uniform_int(rng, 1, 40);
    const auto then = random_lengths(rng, S, 70000);
    std::vector<int32_t> now = then;
    for (auto& l : now) {  // grown by a decode step, emptied, compacted, refilled
      const int kind = kvtest::uniform_int(rng, 0, 4);
      if (kind == 0) l += 1;
      if (kind == 1) l = 0;
      if (kind == 2) l /= kvtest::uniform_int(rng, 1, 8);
      if (kind == 3) l += kvtest::uniform_int(rng, 0, 5000);
    }
    expect_covers(then, now, kvtest::uniform_int(rng, 1, 8), kvtest::uniform_int(rng, 1, 132));
    if (HasFailure()) return;
  }
}

// ---------------------------------------------------------------------------------------
// Whole waves (attention_plan.h, plan_tiles_per_split): on an H100's 132 SMs with 4 resident
// blocks (attend_split<bf16, 128, 4>), and on other shapes.

struct Waves {
  int64_t tiles_per_split, blocks, waves;
  double efficiency;  // blocks / (waves x wave): the share of the last wave's slots in use
};

Waves waves_of(const std::vector<int32_t>& len, int64_t row_tiles, int64_t sms, int64_t resident) {
  const int64_t wave = sms * resident;
  Waves w;
  w.tiles_per_split = plan_tiles_per_split(len, row_tiles, sms, resident);
  // The plan itself must have the blocks the model counts.
  std::vector<Split> splits;
  std::vector<int32_t> first;
  plan_splits(len, row_tiles, sms, splits, first, resident);
  w.blocks = static_cast<int64_t>(splits.size()) * row_tiles;
  EXPECT_EQ(w.blocks, PlanLengths(len).blocks(row_tiles, w.tiles_per_split));
  w.waves = (w.blocks + wave - 1) / wave;
  w.efficiency = static_cast<double>(w.blocks) / static_cast<double>(w.waves * wave);
  return w;
}

// The sizing before whole waves: 8 blocks per SM, the split length rounded up to tiles.
int64_t old_tiles_per_split(const std::vector<int32_t>& len, int64_t row_tiles, int64_t sms) {
  int64_t tiles = 0;
  for (int32_t l : len) tiles += plan_tiles(l);
  const int64_t target = 8 * sms;
  return std::max<int64_t>(1, (tiles * row_tiles + target - 1) / target);
}

TEST(AttentionPlan, UniformDecodeFillsWholeWaves) {
  // Batch 16 x 8 KV heads x 32K tokens (1 GiB of bf16 K+V at D = 128), G = 4: one row tile.
  const std::vector<int32_t> len(128, 32768);
  const Waves w = waves_of(len, 1, 132, 4);
  EXPECT_GE(w.efficiency, 0.96) << w.blocks << " blocks in " << w.waves << " waves";
  EXPECT_GT(PlanLengths(len).blocks(1, w.tiles_per_split - 1), w.waves * 528);
  EXPECT_LE(PlanLengths(len).cost(1, w.tiles_per_split, 528),
            PlanLengths(len).cost(1, old_tiles_per_split(len, 1, 132), 528));
  // Every token once, splits within their segment.
  expect_covers(len, len, 1, 132);
}

TEST(AttentionPlan, OneLongSegmentFillsWholeWaves) {
  // Batch 1, one KV head, 2M tokens: the splits are the only parallelism.
  for (int64_t sms : {132, 114, 108, 78}) {
    const std::vector<int32_t> len{int32_t{1} << 21};
    const Waves w = waves_of(len, 1, sms, 4);
    EXPECT_GE(w.efficiency, 0.95) << sms << " SMs: " << w.blocks << " blocks in " << w.waves << " waves";
    EXPECT_LE(PlanLengths(len).cost(1, w.tiles_per_split, sms * 4),
              PlanLengths(len).cost(1, old_tiles_per_split(len, 1, sms), sms * 4));
    expect_covers(len, len, 1, sms);
    // Not cut finer than the waves need: at least 8 tiles (1024 tokens) a split here.
    EXPECT_GE(w.tiles_per_split, 8);
  }
}

TEST(AttentionPlan, SkewedLengthsModelNoSlowerThanBefore) {
  // Ada-KV-like budgets: per (row, head) lengths spread over two orders of magnitude.
  std::mt19937 rng(9);
  for (int trial = 0; trial < 50; ++trial) {
    const int64_t S = kvtest::uniform_int(rng, 8, 256);
    std::vector<int32_t> len(S);
    std::lognormal_distribution<double> budget(std::log(4096.0), 1.2);
    for (auto& l : len) l = static_cast<int32_t>(std::min(budget(rng), 500000.0));
    const int64_t row_tiles = kvtest::uniform_int(rng, 1, 4), sms = 132;
    const Waves w = waves_of(len, row_tiles, sms, 4);
    const int64_t old_tps = old_tiles_per_split(len, row_tiles, sms);
    const int64_t old_waves = (PlanLengths(len).blocks(row_tiles, old_tps) + 527) / 528;
    if (old_waves <= kvcache_ext::attention::kPlanMaxWaves) {
      EXPECT_LE(PlanLengths(len).cost(row_tiles, w.tiles_per_split, 528),
                PlanLengths(len).cost(row_tiles, old_tps, 528))
          << "trial " << trial;
    }
    // Whole waves as far as the lengths allow: the next shorter split length would need
    // another wave (with skewed lengths the block count jumps, so the last wave may still be
    // part empty; its blocks are then as long as the waves allow).
    if (w.tiles_per_split > 1)
      EXPECT_GT(PlanLengths(len).blocks(row_tiles, w.tiles_per_split - 1), w.waves * 528)
          << "trial " << trial << ": " << w.blocks << " blocks";
    expect_covers(len, len, row_tiles, sms);
    if (HasFailure()) return;
  }
}

TEST(AttentionPlan, ManySegmentsKeepOneSplitEach) {
  // Prefill-like: 256 segments x 64 row tiles is beyond kPlanMaxWaves waves already.
  const std::vector<int32_t> len(256, 4096);
  const Waves w = waves_of(len, 64, 132, 4);
  EXPECT_EQ(w.tiles_per_split, 4096 / kPlanTile);
  EXPECT_EQ(w.blocks, 256 * 64);
}

TEST(AttentionPlan, SizeOfAnotherSegmentCountIsRefused) {
  std::vector<Split> splits;
  std::vector<int32_t> first;
  plan_splits({5, 0, 300}, 1, 132, splits, first);
  const auto words = plan_words(splits, first);
  const auto n = static_cast<int64_t>(words.size());
  EXPECT_EQ(plan_splits_count(n, 3), 5);  // 1 + 1 (empty) + 3 splits of 128: 15 + 4 + 1 words
  EXPECT_EQ(plan_splits_count(n, 4), -1);
  EXPECT_EQ(plan_splits_count(n, 2), -1);
  EXPECT_EQ(plan_splits_count(0, 0), -1);
  EXPECT_EQ(plan_splits_count(2, 0), 0);  // no segment: S + 1 = 1 first word, then S
}

}  // namespace
