// The segmented_topk / grouped_topk ops (ops.h) against plain sorting loops (kvtest::reference_*).
//
// Every case runs on the CPU; its *Cuda twin also runs the same inputs on the GPU and
// requires the CUDA result to equal the CPU result exactly.
#include <gtest/gtest.h>

#include <tuple>

#include "ops.h"
#include "tests/test_util.h"

namespace {

using kvtest::Throws;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// The layout the segmented_topk / grouped_topk ops take: segments in order, each a contiguous
// run of live slots, with slack after them and gaps between segments. (The paged store's own
// selection, store_topk, reads the tokens through the pages instead: test_store_topk.cpp.)
struct Layout {
  std::vector<float> scores;
  std::vector<int32_t> pos;
  std::vector<int64_t> start;
  std::vector<int32_t> len;

  int64_t capacity() const { return static_cast<int64_t>(scores.size()); }
  int64_t segments() const { return static_cast<int64_t>(start.size()); }
};

// Builds a layout by hand: live slots of each segment given, `slack` free slots after each.
Layout layout_of(const std::vector<std::vector<std::pair<float, int32_t>>>& segs, int slack = 0) {
  Layout L;
  for (const auto& seg : segs) {
    L.start.push_back(L.capacity());
    L.len.push_back(static_cast<int32_t>(seg.size()));
    for (const auto& [score, pos] : seg) {
      L.scores.push_back(score);
      L.pos.push_back(pos);
    }
    for (int i = 0; i < slack; ++i) {  // slack that would win if it were considered
      L.scores.push_back(kInf);
      L.pos.push_back(0);
    }
  }
  return L;
}

struct Inputs {
  at::Tensor scores, pos, start, len;
  Inputs to(const at::Device& d) const {
    return {scores.to(d), pos.to(d), start.to(d), len.to(d)};
  }
};

Inputs tensors(const Layout& L) {
  return {kvtest::from_vec(L.scores, at::kFloat), kvtest::from_vec(L.pos, at::kInt),
          kvtest::from_vec(L.start, at::kLong), kvtest::from_vec(L.len, at::kInt)};
}

const at::Device kCuda(at::kCUDA, 0);

// Runs segmented_topk on the CPU (and on CUDA), checks it against the reference and
// returns the CPU keep mask.
std::vector<bool> check_segmented(const Layout& L, const std::vector<int64_t>& k, bool cuda,
                                  at::ScalarType k_dtype = at::kLong) {
  const std::vector<bool> want = kvtest::reference_segmented_topk(L.scores, L.pos, L.start, L.len, k);
  const Inputs in = tensors(L);
  const at::Tensor scores_before = in.scores.clone();
  const at::Tensor k_t = kvtest::from_vec(k, at::kLong).to(k_dtype);
  const at::Tensor keep = kvcache_ext::ops::segmented_topk(in.scores, in.pos, in.start, in.len, k_t);
  EXPECT_EQ(keep.scalar_type(), at::kBool);
  EXPECT_EQ(keep.sizes(), at::IntArrayRef({L.capacity()}));
  EXPECT_TRUE(keep.device().is_cpu());
  EXPECT_TRUE(kvtest::SameKeep(kvtest::to_bools(keep), want)) << "CPU segmented_topk vs reference";
  EXPECT_TRUE(kvtest::BytesEqual(in.scores, scores_before)) << "the scores were modified";
  if (cuda) {
    const Inputs g = in.to(kCuda);
    const at::Tensor keep_g = kvcache_ext::ops::segmented_topk(g.scores, g.pos, g.start, g.len, k_t.to(kCuda));
    EXPECT_TRUE(keep_g.device().is_cuda());
    EXPECT_TRUE(kvtest::BytesEqual(keep_g, keep)) << "CUDA segmented_topk vs CPU";
    EXPECT_TRUE(kvtest::BytesEqual(g.scores, scores_before)) << "the CUDA scores were modified";
  }
  return kvtest::to_bools(keep);
}

std::vector<bool> check_grouped(const Layout& L, int64_t group_size, const std::vector<int64_t>& k,
                                bool cuda, std::vector<int32_t>* counts_out = nullptr) {
  std::vector<int32_t> want_counts;
  const std::vector<bool> want =
      kvtest::reference_grouped_topk(L.scores, L.pos, L.start, L.len, group_size, k, want_counts);
  const Inputs in = tensors(L);
  const at::Tensor k_t = kvtest::from_vec(k, at::kLong);
  const auto [keep, counts] =
      kvcache_ext::ops::grouped_topk(in.scores, in.pos, in.start, in.len, group_size, k_t);
  EXPECT_EQ(keep.scalar_type(), at::kBool);
  EXPECT_EQ(keep.sizes(), at::IntArrayRef({L.capacity()}));
  EXPECT_EQ(counts.scalar_type(), at::kInt);
  EXPECT_EQ(counts.sizes(), at::IntArrayRef({L.segments()}));
  EXPECT_TRUE(kvtest::SameKeep(kvtest::to_bools(keep), want)) << "CPU grouped_topk vs reference";
  EXPECT_EQ(kvtest::to_vec<int32_t>(counts), want_counts) << "CPU grouped_topk counts";
  if (cuda) {
    const Inputs g = in.to(kCuda);
    const auto [keep_g, counts_g] =
        kvcache_ext::ops::grouped_topk(g.scores, g.pos, g.start, g.len, group_size, k_t.to(kCuda));
    EXPECT_TRUE(keep_g.device().is_cuda());
    EXPECT_TRUE(counts_g.device().is_cuda());
    EXPECT_TRUE(kvtest::BytesEqual(keep_g, keep)) << "CUDA grouped_topk vs CPU";
    EXPECT_TRUE(kvtest::BytesEqual(counts_g, counts)) << "CUDA grouped_topk counts vs CPU";
  }
  if (counts_out) *counts_out = kvtest::to_vec<int32_t>(counts);
  return kvtest::to_bools(keep);
}

std::vector<bool> slots(int64_t capacity, std::initializer_list<int64_t> kept) {
  std::vector<bool> v(capacity, false);
  for (int64_t s : kept) v[s] = true;
  return v;
}

// ---- random layouts -------------------------------------------------------------------

enum class Scores { kNormal, kTies, kHalf, kBFloat16, kSpecial };
enum class Positions { kDistinct, kShared, kDuplicates };

struct TopkCase {
  int64_t S, group_size, max_len;
  Scores scores;
  Positions pos;
  uint32_t seed;
};

std::string topk_name(const ::testing::TestParamInfo<TopkCase>& info) {
  const TopkCase& c = info.param;
  static const char* score_names[] = {"normal", "ties", "half", "bf16", "special"};
  static const char* pos_names[] = {"distinctpos", "sharedpos", "duppos"};
  std::ostringstream s;
  s << "S" << c.S << "_G" << c.group_size << "_len" << c.max_len << "_"
    << score_names[static_cast<int>(c.scores)] << "_" << pos_names[static_cast<int>(c.pos)]
    << "_seed" << c.seed;
  return s.str();
}

float draw_score(Scores kind, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  switch (kind) {
    case Scores::kNormal: return normal(rng);
    case Scores::kTies: {  // a few values, zeros of both signs
      const int64_t v = kvtest::uniform_int(rng, 0, 4);
      return v == 0 ? -0.0f : static_cast<float>(v - 1);
    }
    case Scores::kHalf: return static_cast<float>(c10::Half(normal(rng) * 0.01f));
    case Scores::kBFloat16: return static_cast<float>(c10::BFloat16(normal(rng)));
    case Scores::kSpecial:
      switch (kvtest::uniform_int(rng, 0, 9)) {
        case 0: return kNaN;
        case 1: return -kNaN;
        case 2: return kInf;
        case 3: return -kInf;
        case 4: return 0.0f;
        case 5: return -0.0f;
        case 6: return std::numeric_limits<float>::lowest();
        case 7: return std::numeric_limits<float>::denorm_min();
        default: return normal(rng);
      }
  }
  return 0.f;
}

Layout random_layout(const TopkCase& c, std::mt19937& rng) {
  Layout L;
  int64_t cursor = 0;
  for (int64_t s = 0; s < c.S; ++s) {
    cursor += kvtest::uniform_int(rng, 0, 2);  // gap before the segment
    const int64_t roll = kvtest::uniform_int(rng, 0, 9);
    const int64_t len = roll == 0 ? 0 : roll == 1 ? std::min<int64_t>(1, c.max_len)
                                                  : kvtest::uniform_int(rng, 0, c.max_len);
    L.start.push_back(cursor);
    L.len.push_back(static_cast<int32_t>(len));
    cursor += len + kvtest::uniform_int(rng, 0, 3);  // slack after it
  }
  cursor += kvtest::uniform_int(rng, 0, 3);
  // Everything outside live slots gets values that would be kept if it were considered.
  L.scores.assign(cursor, kInf);
  L.pos.assign(cursor, 0);
  for (int64_t i = 0; i < cursor; ++i) {
    const int64_t r = kvtest::uniform_int(rng, 0, 2);
    L.scores[i] = r == 0 ? kInf : r == 1 ? 1e30f : kNaN;
  }
  for (int64_t s = 0; s < c.S; ++s) {
    std::vector<int32_t> p(L.len[s]);
    std::iota(p.begin(), p.end(), 0);
    if (c.pos == Positions::kDistinct) {
      const int32_t offset = static_cast<int32_t>(kvtest::uniform_int(rng, 0, 1000));
      std::shuffle(p.begin(), p.end(), rng);
      for (auto& x : p) x += offset;
    } else if (c.pos == Positions::kDuplicates) {
      for (auto& x : p) x = static_cast<int32_t>(kvtest::uniform_int(rng, 0, 3));
    }  // kShared: 0, 1, 2, ... in every segment, as the heads of one layer have them
    for (int32_t j = 0; j < L.len[s]; ++j) {
      L.scores[L.start[s] + j] = draw_score(c.scores, rng);
      L.pos[L.start[s] + j] = p[j];
    }
  }
  return L;
}

std::vector<int64_t> random_budgets(const std::vector<int64_t>& sizes, int mode, std::mt19937& rng) {
  std::vector<int64_t> k;
  for (const int64_t n : sizes) {
    switch (mode) {
      case 0: k.push_back(kvtest::uniform_int(rng, 0, n + 2)); break;
      case 1: k.push_back(0); break;
      case 2: k.push_back(n); break;
      case 3: k.push_back(n / 3); break;
      default: {
        const int64_t choices[] = {0, 1, n / 2, std::max<int64_t>(n - 1, 0), n + 5, INT32_MAX};
        k.push_back(choices[kvtest::uniform_int(rng, 0, 5)]);
      }
    }
  }
  return k;
}

class TopkRandom : public ::testing::TestWithParam<TopkCase> {};

void segmented_random(const TopkCase& c, bool cuda) {
  std::mt19937 rng(c.seed);
  for (int round = 0; round < 3; ++round) {
    const Layout L = random_layout(c, rng);
    std::vector<int64_t> sizes(L.len.begin(), L.len.end());
    for (int mode = 0; mode < 5; ++mode) {
      SCOPED_TRACE(::testing::Message() << "layout " << round << ", budget mode " << mode);
      check_segmented(L, random_budgets(sizes, mode, rng), cuda,
                      mode % 2 ? at::kInt : at::kLong);
      if (::testing::Test::HasFailure()) return;
    }
  }
}

void grouped_random(const TopkCase& c, bool cuda) {
  std::mt19937 rng(c.seed + 100);
  for (int round = 0; round < 3; ++round) {
    const Layout L = random_layout(c, rng);
    std::vector<int64_t> sizes;
    for (int64_t g = 0; g * c.group_size < c.S; ++g) {
      int64_t total = 0;
      for (int64_t s = g * c.group_size; s < (g + 1) * c.group_size; ++s) total += L.len[s];
      sizes.push_back(total);
    }
    for (int mode = 0; mode < 5; ++mode) {
      SCOPED_TRACE(::testing::Message() << "layout " << round << ", budget mode " << mode);
      std::vector<int32_t> counts;
      const std::vector<int64_t> k = random_budgets(sizes, mode, rng);
      check_grouped(L, c.group_size, k, cuda, &counts);
      // Per group, the counts add up to min(k, live slots).
      for (size_t g = 0; g < sizes.size(); ++g) {
        int64_t sum = 0;
        for (int64_t s = g * c.group_size; s < static_cast<int64_t>((g + 1) * c.group_size); ++s) sum += counts[s];
        EXPECT_EQ(sum, std::min(k[g], sizes[g])) << "group " << g;
      }
      if (::testing::Test::HasFailure()) return;
    }
  }
}

TEST_P(TopkRandom, SegmentedMatchesReference) { segmented_random(GetParam(), false); }
TEST_P(TopkRandom, GroupedMatchesReference) { grouped_random(GetParam(), false); }
#ifdef KVCACHE_EXT_WITH_CUDA
TEST_P(TopkRandom, SegmentedMatchesReferenceCuda) {
  KVTEST_REQUIRE_CUDA();
  segmented_random(GetParam(), true);
}
TEST_P(TopkRandom, GroupedMatchesReferenceCuda) {
  KVTEST_REQUIRE_CUDA();
  grouped_random(GetParam(), true);
}
#endif

std::vector<TopkCase> topk_cases() {
  using P = Positions;
  using Sc = Scores;
  return {
      {1, 1, 0, Sc::kNormal, P::kDistinct, 1},     // one empty segment
      {1, 1, 1, Sc::kNormal, P::kDistinct, 2},     // len 0 or 1
      {5, 5, 1, Sc::kTies, P::kShared, 3},
      {4, 2, 2, Sc::kTies, P::kDuplicates, 4},
      {8, 4, 7, Sc::kTies, P::kShared, 5},
      {8, 2, 64, Sc::kNormal, P::kDistinct, 6},
      {8, 8, 64, Sc::kHalf, P::kShared, 7},
      {6, 3, 64, Sc::kBFloat16, P::kDistinct, 8},
      {12, 4, 64, Sc::kSpecial, P::kDistinct, 9},
      {12, 6, 40, Sc::kSpecial, P::kDuplicates, 10},
      {33, 11, 300, Sc::kTies, P::kDistinct, 11},
      {33, 3, 300, Sc::kHalf, P::kDistinct, 12},
      {3, 3, 5000, Sc::kNormal, P::kDistinct, 13},  // long segments (several GPU blocks)
      {4, 2, 5000, Sc::kTies, P::kShared, 14},
      {2, 1, 20000, Sc::kBFloat16, P::kDistinct, 15},
  };
}

INSTANTIATE_TEST_SUITE_P(Cases, TopkRandom, ::testing::ValuesIn(topk_cases()), topk_name);

// ---- directed cases -------------------------------------------------------------------

#ifdef KVCACHE_EXT_WITH_CUDA
#define TOPK_TEST(name)                            \
  void name##_body(bool cuda);                     \
  TEST(Topk, name) { name##_body(false); }         \
  TEST(Topk, name##Cuda) {                         \
    KVTEST_REQUIRE_CUDA();                         \
    name##_body(true);                             \
  }                                                \
  void name##_body(bool cuda)
#else
#define TOPK_TEST(name)                            \
  void name##_body(bool cuda);                     \
  TEST(Topk, name) { name##_body(false); }         \
  void name##_body(bool cuda)
#endif

TOPK_TEST(TiesBreakToLowerPosition) {
  // Equal scores everywhere: the lowest positions are kept, wherever their slots are.
  const Layout one = layout_of({{{1.f, 50}, {1.f, 10}, {1.f, 40}, {1.f, 20}, {1.f, 30}, {1.f, 0}}}, 2);
  EXPECT_TRUE(kvtest::SameKeep(check_segmented(one, {3}, cuda), slots(8, {5, 1, 3})));
  EXPECT_TRUE(kvtest::SameKeep(check_segmented(one, {1}, cuda), slots(8, {5})));
  // Across the segments of a group: equal score and position -> the lower slot.
  const Layout two = layout_of({{{2.f, 2}, {2.f, 0}, {2.f, 1}}, {{2.f, 0}, {2.f, 1}, {2.f, 2}}});
  std::vector<int32_t> counts;
  EXPECT_TRUE(kvtest::SameKeep(check_grouped(two, 2, {3}, cuda, &counts), slots(6, {1, 3, 2})));
  EXPECT_EQ(counts, (std::vector<int32_t>{2, 1}));
  // A higher score still beats a lower position.
  const Layout mixed = layout_of({{{1.f, 0}, {1.5f, 9}, {1.f, 1}}});
  EXPECT_TRUE(kvtest::SameKeep(check_segmented(mixed, {2}, cuda), slots(3, {1, 0})));
}

TOPK_TEST(NaNEvictedFirst) {
  const float lowest = std::numeric_limits<float>::lowest();
  const Layout L = layout_of({{{kNaN, 0}, {-kInf, 1}, {1.f, 2}, {kNaN, 3}, {lowest, 4}, {-0.0f, 5}}}, 1);
  EXPECT_TRUE(kvtest::SameKeep(check_segmented(L, {4}, cuda), slots(7, {2, 5, 4, 1})));
  EXPECT_TRUE(kvtest::SameKeep(check_segmented(L, {5}, cuda), slots(7, {2, 5, 4, 1, 0})));
  EXPECT_TRUE(kvtest::SameKeep(check_segmented(L, {6}, cuda), slots(7, {0, 1, 2, 3, 4, 5})));
  // -NaN is NaN too.
  const Layout neg = layout_of({{{-kNaN, 0}, {-kInf, 1}}});
  EXPECT_TRUE(kvtest::SameKeep(check_segmented(neg, {1}, cuda), slots(2, {1})));
  // In a group, a NaN of one head goes before any number of another head.
  const Layout g = layout_of({{{kNaN, 0}, {3.f, 1}}, {{-kInf, 0}, {kNaN, 1}}});
  std::vector<int32_t> counts;
  EXPECT_TRUE(kvtest::SameKeep(check_grouped(g, 2, {2}, cuda, &counts), slots(4, {1, 2})));
  EXPECT_EQ(counts, (std::vector<int32_t>{1, 1}));
}

TOPK_TEST(NegativeZeroEqualsPositiveZero) {
  const Layout L = layout_of({{{-0.0f, 7}, {0.0f, 5}, {-0.0f, 3}}});
  EXPECT_TRUE(kvtest::SameKeep(check_segmented(L, {1}, cuda), slots(3, {2})));
  EXPECT_TRUE(kvtest::SameKeep(check_segmented(L, {2}, cuda), slots(3, {2, 1})));
}

TOPK_TEST(BudgetAtLeastLengthKeepsAllLiveSlots) {
  const Layout L = layout_of({{{0.5f, 0}, {kNaN, 1}, {-1.f, 2}}, {{2.f, 0}}, {}, {{-kInf, 4}, {kNaN, 2}}}, 3);
  const std::vector<bool> live = slots(L.capacity(), {0, 1, 2, 6, 13, 14});
  EXPECT_TRUE(kvtest::SameKeep(check_segmented(L, {3, 1, 0, 2}, cuda), live));
  EXPECT_TRUE(kvtest::SameKeep(check_segmented(L, {4, 2, 1, 3}, cuda), live));
  EXPECT_TRUE(kvtest::SameKeep(check_segmented(L, {INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX}, cuda, at::kInt), live));
  EXPECT_TRUE(kvtest::SameKeep(check_grouped(L, 2, {4, 2}, cuda), live));
  EXPECT_TRUE(kvtest::SameKeep(check_grouped(L, 4, {INT32_MAX}, cuda), live));
  EXPECT_TRUE(kvtest::SameKeep(check_segmented(L, {0, 0, 0, 0}, cuda), slots(L.capacity(), {})));
}

// A budget too large for int32 ("keep everything") must keep every live slot or be
// rejected; it must not wrap around to a small budget.
TOPK_TEST(HugeBudgetKeepsAllOrIsRejected) {
  const Layout L = layout_of({{{0.5f, 0}, {1.f, 1}}, {{2.f, 0}, {3.f, 1}, {4.f, 2}}}, 1);
  const std::vector<bool> live = slots(L.capacity(), {0, 1, 3, 4, 5});
  const Inputs in = tensors(L);
  for (const int64_t huge : {int64_t{1} << 32, (int64_t{1} << 32) + 1, int64_t{1} << 40,
                             std::numeric_limits<int64_t>::max()}) {
    SCOPED_TRACE(::testing::Message() << "k = " << huge);
    for (const bool on_cuda : {false, true}) {
      if (on_cuda && !cuda) continue;
      const Inputs d = on_cuda ? in.to(kCuda) : in;
      const at::Tensor k = at::full({2}, huge, d.start.options());
      try {
        const at::Tensor keep = kvcache_ext::ops::segmented_topk(d.scores, d.pos, d.start, d.len, k);
        EXPECT_TRUE(kvtest::SameKeep(kvtest::to_bools(keep), live))
            << "segmented_topk with k=" << huge << " on " << d.scores.device();
      } catch (const c10::ValueError&) {
        // rejected: fine
      }
      try {
        const auto [keep, counts] =
            kvcache_ext::ops::grouped_topk(d.scores, d.pos, d.start, d.len, 2, k.slice(0, 0, 1));
        EXPECT_TRUE(kvtest::SameKeep(kvtest::to_bools(keep), live))
            << "grouped_topk with k=" << huge << " on " << d.scores.device();
      } catch (const c10::ValueError&) {
      }
    }
  }
}

TOPK_TEST(EmptySegmentsAndZeroCapacity) {
  // Every segment empty, no slots at all.
  const Layout none = layout_of({{}, {}, {}, {}});
  EXPECT_EQ(check_segmented(none, {0, 1, 2, 3}, cuda).size(), 0u);
  std::vector<int32_t> counts;
  check_grouped(none, 2, {1, 5}, cuda, &counts);
  EXPECT_EQ(counts, (std::vector<int32_t>{0, 0, 0, 0}));
  // Every segment empty, slack slots only.
  const Layout slack = layout_of({{}, {}, {}}, 2);
  EXPECT_TRUE(kvtest::SameKeep(check_segmented(slack, {5, 5, 5}, cuda), slots(6, {})));
  check_grouped(slack, 3, {5}, cuda, &counts);
  EXPECT_EQ(counts, (std::vector<int32_t>{0, 0, 0}));
  // One live segment among empty ones.
  const Layout one = layout_of({{}, {{1.f, 0}, {2.f, 1}, {0.f, 2}}, {}, {}}, 1);
  EXPECT_TRUE(kvtest::SameKeep(check_segmented(one, {3, 2, 3, 0}, cuda), slots(one.capacity(), {1, 2})));
  check_grouped(one, 4, {2}, cuda, &counts);
  EXPECT_EQ(counts, (std::vector<int32_t>{0, 2, 0, 0}));
  // No segments at all: nothing is kept, whatever the capacity.
  Layout zero;
  zero.scores = {1.f, 2.f, 3.f};
  zero.pos = {0, 1, 2};
  EXPECT_TRUE(kvtest::SameKeep(check_segmented(zero, {}, cuda), slots(3, {})));
  check_grouped(zero, 2, {}, cuda, &counts);
  EXPECT_TRUE(counts.empty());
}

TOPK_TEST(GroupedCountsPerSegment) {
  // Three heads of one batch item, then three of another; distinct scores.
  const Layout L = layout_of({{{9.f, 0}, {1.f, 1}, {8.f, 2}},   // head 0
                              {{7.f, 0}, {6.f, 1}},             // head 1
                              {{0.5f, 0}, {0.4f, 1}, {0.3f, 2}, {10.f, 3}},  // head 2
                              {{1.f, 0}},
                              {},
                              {{3.f, 0}, {2.f, 1}}},
                             1);
  // Group 0 keeps 10, 9, 8, 7 (k=4); group 1 keeps 3, 2 (k=2).
  std::vector<int32_t> counts;
  const std::vector<bool> keep = check_grouped(L, 3, {4, 2}, cuda, &counts);
  EXPECT_EQ(counts, (std::vector<int32_t>{2, 1, 1, 0, 0, 2}));
  // Slots: head 0 at 0..2 (slack 3), head 1 at 4..5 (6), head 2 at 7..10 (11), then 12 (13),
  // an empty segment (slack 14), 15..16 (17).
  EXPECT_TRUE(kvtest::SameKeep(keep, slots(L.capacity(), {0, 2, 4, 10, 15, 16})));
  // group_size 1 is segmented_topk.
  const std::vector<int64_t> k = {1, 2, 0, 1, 3, 1};
  EXPECT_TRUE(kvtest::SameKeep(check_grouped(L, 1, k, cuda), check_segmented(L, k, cuda)));
}

TOPK_TEST(RejectsBadInputs) {
  const Layout L = layout_of({{{1.f, 0}, {2.f, 1}}, {{3.f, 0}}}, 1);
  const at::Device d = cuda ? kCuda : at::Device(at::kCPU);
  const Inputs in = tensors(L).to(d);
  const at::Tensor k = at::full({2}, 1, in.start.options());
  auto seg = [&](const at::Tensor& s, const at::Tensor& p, const at::Tensor& st, const at::Tensor& l,
                 const at::Tensor& kk) { return [=] { kvcache_ext::ops::segmented_topk(s, p, st, l, kk); }; };
  EXPECT_TRUE(Throws<c10::TypeError>(seg(in.scores.to(at::kDouble), in.pos, in.start, in.len, k), "scores"));
  EXPECT_TRUE(Throws<c10::TypeError>(seg(in.scores.to(at::kHalf), in.pos, in.start, in.len, k), "scores"));
  EXPECT_TRUE(Throws<c10::ValueError>(seg(in.scores.view({1, -1}), in.pos, in.start, in.len, k), "scores"));
  const at::Tensor strided = at::zeros({2 * L.capacity()}, in.scores.options()).slice(0, 0, 2 * L.capacity(), 2);
  EXPECT_TRUE(Throws<c10::ValueError>(seg(strided, in.pos, in.start, in.len, k), "contiguous"));
  EXPECT_TRUE(Throws<c10::TypeError>(seg(in.scores, in.pos.to(at::kLong), in.start, in.len, k), "pos"));
  EXPECT_TRUE(Throws<c10::ValueError>(seg(in.scores, in.pos.slice(0, 1), in.start, in.len, k), "pos"));
  EXPECT_TRUE(Throws<c10::TypeError>(seg(in.scores, in.pos, in.start.to(at::kInt), in.len, k), "start"));
  EXPECT_TRUE(Throws<c10::ValueError>(seg(in.scores, in.pos, in.start.view({1, 2}), in.len, k), "start"));
  EXPECT_TRUE(Throws<c10::TypeError>(seg(in.scores, in.pos, in.start, in.len.to(at::kLong), k), "len"));
  EXPECT_TRUE(Throws<c10::ValueError>(seg(in.scores, in.pos, in.start, in.len.slice(0, 1), k), "len"));
  EXPECT_TRUE(Throws<c10::TypeError>(seg(in.scores, in.pos, in.start, in.len, k.to(at::kFloat)), "k"));
  EXPECT_TRUE(Throws<c10::ValueError>(seg(in.scores, in.pos, in.start, in.len, k.slice(0, 1)), "k"));
  EXPECT_TRUE(Throws<c10::ValueError>(seg(in.scores, in.pos, in.start, in.len, k - 2), "k"));
  // Segments out of order, overlapping, or outside the buffers.
  auto longs = [&](std::vector<int64_t> v) { return kvtest::from_vec(v, at::kLong).to(d); };
  const at::Tensor start_overlap = longs({0, 1});
  EXPECT_TRUE(Throws<c10::ValueError>(seg(in.scores, in.pos, start_overlap, in.len, k), "segments"));
  const at::Tensor start_past = longs({0, L.capacity()});
  EXPECT_TRUE(Throws<c10::ValueError>(seg(in.scores, in.pos, start_past, in.len, k), "segments"));
  const at::Tensor start_neg = longs({-1, 3});
  EXPECT_TRUE(Throws<c10::ValueError>(seg(in.scores, in.pos, start_neg, in.len, k), "segments"));
  const at::Tensor len_neg = longs({-1, 1}).to(at::kInt);
  EXPECT_TRUE(Throws<c10::ValueError>(seg(in.scores, in.pos, in.start, len_neg, k), "segments"));
  // grouped
  auto grp = [&](int64_t gs, const at::Tensor& kk) {
    return [=] { kvcache_ext::ops::grouped_topk(in.scores, in.pos, in.start, in.len, gs, kk); };
  };
  EXPECT_TRUE(Throws<c10::ValueError>(grp(0, k), "group_size"));
  EXPECT_TRUE(Throws<c10::ValueError>(grp(-1, k), "group_size"));
  EXPECT_TRUE(Throws<c10::ValueError>(grp(3, k.slice(0, 1)), "group_size"));
  EXPECT_TRUE(Throws<c10::ValueError>(grp(2, k), "k"));  // k must be [groups] = [1]
  EXPECT_TRUE(Throws<c10::ValueError>(grp(2, k.slice(0, 1) - 5), "k"));
  if (cuda) {  // mixed devices
    const Inputs h = tensors(L);
    EXPECT_TRUE(Throws<c10::ValueError>(seg(in.scores, h.pos, in.start, in.len, k), "pos"));
    EXPECT_TRUE(Throws<c10::ValueError>(seg(in.scores, in.pos, h.start, in.len, k), "start"));
    EXPECT_TRUE(Throws<c10::ValueError>(seg(in.scores, in.pos, in.start, h.len, k), "len"));
  }
}

}  // namespace
