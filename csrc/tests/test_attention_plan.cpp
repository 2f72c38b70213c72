// The CUDA attention's plan rules (attention/attention_plan.h), on the host: the splits a plan
// makes, read against the lengths of a later call as the kernel reads them, must cover every
// live token of every segment exactly once, in order, whether the plan is fresh or stale
// (made for other lengths: segments grown, shrunk, emptied, filled). The CUDA twin in
// tests/test_attention.py (test_stale_plan_on_cuda_*) runs the kernel itself on a stale plan.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "attention/attention_plan.h"
#include "tests/test_util.h"

namespace {

using kvcache_ext::attention::effective_split;
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
