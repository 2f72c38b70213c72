// The shared selection logic of select/radix_select.h on the host: the ordered keys, and the
// radix selection both as the CPU kernel runs it (descend_serial, wide digits) and as the
// CUDA kernel runs it (topk_cuda.cu: 8-bit digits, a team of CTAs each histogramming a
// contiguous chunk, the bucket found by an exclusive scan from the top bucket, keys equal to
// the threshold kept in candidate order after the earlier chunks' counts), against a full
// sort of the candidates.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "select/radix_select.h"
#include "tests/test_util.h"

namespace {

using kvcache_ext::select::descend_serial;
using kvcache_ext::select::pos_key;
using kvcache_ext::select::score_key;
using kvcache_ext::select::selection_key;
using kvcache_ext::select::Threshold;
using kvcache_ext::select::Verdict;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(RadixSelect, ScoreKeysFollowTheFloatOrder) {
  const float ascending[] = {-kInf, std::numeric_limits<float>::lowest(), -1e10f, -1.f,
                             -std::numeric_limits<float>::denorm_min(), 0.f,
                             std::numeric_limits<float>::denorm_min(), 1e-30f, 1.f, 3.5f,
                             std::numeric_limits<float>::max(), kInf};
  for (size_t i = 1; i < std::size(ascending); ++i) {
    EXPECT_LT(score_key(ascending[i - 1]), score_key(ascending[i])) << ascending[i - 1] << " < " << ascending[i];
  }
  EXPECT_EQ(score_key(-0.f), score_key(0.f));
  // NaN of either sign is below -inf: the first evicted.
  EXPECT_EQ(score_key(kNaN), 0u);
  EXPECT_EQ(score_key(-kNaN), 0u);
  EXPECT_LT(score_key(kNaN), score_key(-kInf));
  // Lower position = larger key; the score decides first.
  EXPECT_GT(pos_key(3), pos_key(4));
  EXPECT_GT(selection_key(1.f, 100), selection_key(0.5f, 0));
  EXPECT_GT(selection_key(1.f, 0), selection_key(1.f, 1));
}

// The candidates of one group, in candidate order.
struct Group {
  std::vector<float> score;
  std::vector<int32_t> pos;
  int64_t size() const { return static_cast<int64_t>(score.size()); }
  uint64_t key(int64_t c) const { return selection_key(score[c], pos[c]); }
};

// The reference: a full sort (larger key first, then the earlier candidate), first k kept.
std::vector<bool> sorted_keep(const Group& g, int64_t k) {
  std::vector<int64_t> order(g.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return g.key(a) > g.key(b); });
  std::vector<bool> keep(g.size(), false);
  for (int64_t i = 0; i < std::min(std::max<int64_t>(k, 0), g.size()); ++i) keep[order[i]] = true;
  return keep;
}

// Keeps by the verdicts in candidate order (ties: the first t.rank of them), as topk_cpu.cpp's
// keep_best and the CUDA kernel's last loop do; equal_before: ties already taken before.
void keep_by_verdict(const Group& g, const Threshold& t, int64_t c0, int64_t c1,
                     int64_t equal_before, std::vector<bool>& keep) {
  for (int64_t c = c0; c < c1; ++c) {
    const Verdict v = t.verdict(g.key(c));
    if (v == Verdict::kKeep || (v == Verdict::kTie && equal_before++ < t.rank)) keep[c] = true;
  }
}

// The CPU kernel's use: descend_serial over histograms of every key in play, `bits` wide.
std::vector<bool> serial_keep(const Group& g, int64_t k, int bits) {
  const int64_t n = g.size();
  Threshold t(std::min(std::max<int64_t>(k, 0), n), n);
  std::vector<int64_t> hist(size_t{1} << bits);
  while (t.open()) {
    std::fill(hist.begin(), hist.end(), 0);
    for (int64_t c = 0; c < n; ++c) {
      if (t.in_play(g.key(c))) ++hist[t.digit(g.key(c), bits)];
    }
    descend_serial(t, hist.data(), bits);
  }
  std::vector<bool> keep(n, false);
  keep_by_verdict(g, t, 0, n, 0, keep);
  return keep;
}

// The CUDA kernel's use, step by step: `splits` CTAs with chunks of ceil(n / splits); per
// pass each chunk's histogram (8-bit digits), their sum, the bucket from an exclusive scan in
// descending bucket order; the last pass's per-chunk counts of the chosen bucket order the ties.
std::vector<bool> team_keep(const Group& g, int64_t k, int64_t splits) {
  constexpr int kBits = 8, kBuckets = 1 << kBits;
  const int64_t n = g.size();
  const int64_t kept = std::min(std::max<int64_t>(k, 0), n);
  const int64_t chunk = (n + splits - 1) / splits;
  Threshold t(kept, n);
  std::vector<std::vector<uint32_t>> local(splits, std::vector<uint32_t>(kBuckets));
  std::vector<uint32_t> chosen_local(splits, 0);
  for (int pass = 0; pass < 64 / kBits && t.open(); ++pass) {
    std::vector<uint32_t> team(kBuckets, 0);
    for (int64_t j = 0; j < splits; ++j) {
      std::fill(local[j].begin(), local[j].end(), 0u);
      const int64_t c0 = std::min(n, j * chunk), c1 = std::min(n, c0 + chunk);
      for (int64_t c = c0; c < c1; ++c) {
        if (t.in_play(g.key(c))) ++local[j][t.digit(g.key(c), kBits)];
      }
      for (int b = 0; b < kBuckets; ++b) team[b] += local[j][b];
    }
    // Thread x of the scan holds bucket kBuckets - 1 - x; `above` is its exclusive prefix.
    uint32_t above = 0;
    int holders = 0;
    uint32_t bucket = 0, bucket_above = 0;
    for (int x = 0; x < kBuckets; ++x) {
      const uint32_t b = kBuckets - 1 - x;
      if (t.holds_rank(above, team[b])) {
        ++holders;
        bucket = b;
        bucket_above = above;
      }
      above += team[b];
    }
    EXPECT_EQ(holders, 1) << "pass " << pass << ": exactly one bucket holds the rank";
    if (holders != 1) return {};
    t.descend(bucket, bucket_above, team[bucket], kBits);
    for (int64_t j = 0; j < splits; ++j) chosen_local[j] = local[j][bucket];
  }
  std::vector<bool> keep(n, false);
  const bool ordered_ties = t.rank > 0 && !t.settled;
  int64_t equal_before = 0;
  for (int64_t j = 0; j < splits; ++j) {
    const int64_t c0 = std::min(n, j * chunk), c1 = std::min(n, c0 + chunk);
    // The CTA's own count of ties, from its histogram, must be what the verdicts find.
    int64_t ties_here = 0;
    for (int64_t c = c0; c < c1; ++c) ties_here += t.verdict(g.key(c)) == Verdict::kTie;
    if (ordered_ties) {
      EXPECT_EQ(ties_here, chosen_local[j]) << "chunk " << j;
    }
    keep_by_verdict(g, t, c0, c1, equal_before, keep);
    if (ordered_ties) equal_before += chosen_local[j];
  }
  return keep;
}

enum class Kind { kNormal, kFewValues, kBFloat16, kSpecial, kAllEqual };

Group random_group(int64_t n, Kind kind, bool duplicate_pos, std::mt19937& rng) {
  Group g;
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int64_t c = 0; c < n; ++c) {
    float s = 0.f;
    switch (kind) {
      case Kind::kNormal: s = normal(rng); break;
      case Kind::kFewValues: s = static_cast<float>(kvtest::uniform_int(rng, -2, 2)); break;
      case Kind::kBFloat16: s = static_cast<float>(c10::BFloat16(normal(rng))); break;
      case Kind::kAllEqual: s = 0.25f; break;
      case Kind::kSpecial: {
        const float special[] = {kNaN, -kNaN, kInf, -kInf, 0.f, -0.f, std::numeric_limits<float>::lowest()};
        const int64_t r = kvtest::uniform_int(rng, 0, 9);
        s = r < 7 ? special[r] : normal(rng);
      }
    }
    g.score.push_back(s);
    // Positions as the heads of one group have them: 0, 1, ... per segment (repeats across
    // segments), or a few values (equal score and position: candidate order decides).
    g.pos.push_back(duplicate_pos ? static_cast<int32_t>(kvtest::uniform_int(rng, 0, 3))
                                  : static_cast<int32_t>(c % 97));
  }
  return g;
}

TEST(RadixSelect, SerialAndTeamSelectionsMatchAFullSort) {
  std::mt19937 rng(42);
  const int64_t sizes[] = {0, 1, 2, 7, 64, 65, 300, 3000};
  for (const int64_t n : sizes) {
    for (const Kind kind : {Kind::kNormal, Kind::kFewValues, Kind::kBFloat16, Kind::kSpecial, Kind::kAllEqual}) {
      for (const bool dup : {false, true}) {
        const Group g = random_group(n, kind, dup, rng);
        for (const int64_t k : {int64_t{-3}, int64_t{0}, int64_t{1}, n / 3, n / 2, n - 1, n, n + 5}) {
          SCOPED_TRACE(::testing::Message() << "n " << n << " kind " << static_cast<int>(kind)
                                            << " dup " << dup << " k " << k);
          const std::vector<bool> want = sorted_keep(g, k);
          for (const int bits : {8, 11}) {
            EXPECT_TRUE(kvtest::SameKeep(serial_keep(g, k, bits), want)) << "serial, " << bits << "-bit digits";
          }
          for (const int64_t splits : {1, 2, 3, 7}) {
            EXPECT_TRUE(kvtest::SameKeep(team_keep(g, k, splits), want)) << "team of " << splits;
          }
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  }
}

// A threshold settles as soon as the rank is the whole bucket: no further pass is needed,
// and every key in play is kept.
TEST(RadixSelect, SettlesWhenTheBucketIsTakenWhole) {
  Group g;
  for (int i = 0; i < 10; ++i) {
    g.score.push_back(i < 4 ? 1e6f : -1e6f);  // four keys in a high bucket, six in a low one
    g.pos.push_back(i);
  }
  Threshold t(4, 10);
  std::vector<int64_t> hist(256, 0);
  for (int64_t c = 0; c < g.size(); ++c) ++hist[t.digit(g.key(c), 8)];
  descend_serial(t, hist.data(), 8);
  EXPECT_TRUE(t.settled);
  EXPECT_FALSE(t.open());
  EXPECT_EQ(t.decided, 8);
  for (int64_t c = 0; c < g.size(); ++c) {
    EXPECT_EQ(t.verdict(g.key(c)), c < 4 ? Verdict::kKeep : Verdict::kDrop) << c;
  }
  // Keep-all and keep-nothing need no pass.
  EXPECT_FALSE(Threshold(10, 10).open());
  EXPECT_EQ(Threshold(10, 10).verdict(g.key(9)), Verdict::kKeep);
  EXPECT_FALSE(Threshold(0, 10).open());
  EXPECT_EQ(Threshold(0, 10).verdict(g.key(0)), Verdict::kDrop);
}

}  // namespace
