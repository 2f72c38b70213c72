// The store_topk op (RaggedKVStore.select): the selection through the store's pages, on a
// store filled by ragged appends (pages of different segments interleave, so candidate
// order is not slot order), with scores in slot layout, padded [B, H, L] or (C > 0) read
// from score channel 0 of the pages, per segment and grouped (Ada-KV), against the plain
// sorting reference over the live tokens packed in candidate order.
//
// Every case runs on a CPU store; its *Cuda twin builds the same store on the GPU and
// requires the CUDA op's keep mask and counts to equal the reference exactly.
#include <gtest/gtest.h>

#include <random>

#include "ops.h"
#include "tests/store_util.h"
#include "tests/test_util.h"

namespace {

using kvtest::OpStore;

struct StoreTopkCase {
  int64_t B, H, D, C, P, max_append;
  at::ScalarType dtype;
  uint32_t seed;
};

std::string case_name(const ::testing::TestParamInfo<StoreTopkCase>& info) {
  const StoreTopkCase& c = info.param;
  std::ostringstream s;
  s << "B" << c.B << "_H" << c.H << "_C" << c.C << "_P" << c.P << "_n" << c.max_append << "_"
    << kvtest::dtype_name(c.dtype) << "_seed" << c.seed;
  return s.str();
}

// Scores with many ties (so that the position and candidate-order tie rules matter), NaN
// and infinities.
float draw_score(std::mt19937& rng) {
  switch (kvtest::uniform_int(rng, 0, 11)) {
    case 0: return std::numeric_limits<float>::quiet_NaN();
    case 1: return -std::numeric_limits<float>::infinity();
    case 2: return std::numeric_limits<float>::infinity();
    case 3: return -0.0f;
    case 4:
    case 5:
    case 6: return static_cast<float>(kvtest::uniform_int(rng, -2, 2));
    default: return static_cast<float>(c10::BFloat16(std::normal_distribution<float>(0.f, 1.f)(rng)));
  }
}

void select_through_pages(const StoreTopkCase& c, bool cuda) {
  std::mt19937 rng(c.seed);
  const at::Device device = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  const at::Tensor like = at::empty({0}, at::TensorOptions().dtype(c.dtype).device(device));
  OpStore st(c.B, c.H, c.D, c.C, like, c.P);
  const int64_t S = c.B * c.H;
  int64_t next = 0;
  for (int round = 0; round < 5; ++round) {
    // Ragged appends: each segment stores a random subset of the new tokens; positions
    // repeat across the heads of a batch row (and, every other round, within a segment).
    const int64_t n = kvtest::uniform_int(rng, 0, c.max_append);
    const at::Tensor kv = kvtest::random_normal({c.B, c.H, n, c.D}, c.dtype, rng);
    at::Tensor pos = at::arange(next, next + n, at::kLong).expand({c.B, n}).contiguous();
    if (round % 2 == 1 && n > 0) pos = (pos % 3).contiguous();
    next += n;
    const at::Tensor valid = kvtest::random_mask({c.B, c.H, n}, round == 0 ? 0.3 : 0.8, rng);
    st.append(kv.to(device), kv.to(device), pos.to(device), valid.to(device));
    const int64_t capacity = st.capacity();
    std::vector<float> slot_scores(capacity);
    for (float& x : slot_scores) x = draw_score(rng);
    const at::Tensor scores = kvtest::from_vec(slot_scores, at::kFloat);
    if (c.C > 0) {
      at::Tensor all = kvtest::random_normal({capacity, c.C}, at::kFloat, rng);
      all.select(1, 0).copy_(scores);
      st.set_scores(all.to(device));
    }
    // The live tokens in candidate order (segment by segment, token by token).
    const auto slots = kvtest::live_slots(st);
    const std::vector<int32_t> pos_all = kvtest::to_vec<int32_t>(kvtest::host(st.pos()));
    std::vector<float> sc;
    std::vector<int32_t> ps;
    std::vector<int64_t> start, packed_slot;
    std::vector<int32_t> len;
    int64_t longest = 0;
    for (const auto& seg : slots) {
      start.push_back(static_cast<int64_t>(sc.size()));
      len.push_back(static_cast<int32_t>(seg.size()));
      longest = std::max<int64_t>(longest, seg.size());
      for (const int64_t slot : seg) {
        sc.push_back(slot_scores[slot]);
        ps.push_back(pos_all[slot]);
        packed_slot.push_back(slot);
      }
    }
    at::Tensor padded = at::full({S, longest + 1}, 5.0f, at::kFloat);  // slack that would win
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t i = 0; i < len[s]; ++i) padded[s][i] = sc[start[s] + i];
    }
    std::vector<c10::optional<at::Tensor>> sources = {scores.to(device),
                                                      padded.view({c.B, c.H, longest + 1}).to(device)};
    if (c.C > 0) sources.push_back(c10::nullopt);
    for (const bool grouped : {false, true}) {
      std::vector<int64_t> budget;
      std::vector<bool> want_packed;
      std::vector<int32_t> want_counts(S, 0);
      if (!grouped) {
        for (int64_t s = 0; s < S; ++s) budget.push_back(kvtest::uniform_int(rng, 0, len[s] + 2));
        want_packed = kvtest::reference_segmented_topk(sc, ps, start, len, budget);
      } else {
        for (int64_t b = 0; b < c.B; ++b) {
          int64_t total = 0;
          for (int64_t h = 0; h < c.H; ++h) total += len[b * c.H + h];
          budget.push_back(kvtest::uniform_int(rng, 0, total + 2));
        }
        want_packed = kvtest::reference_grouped_topk(sc, ps, start, len, c.H, budget, want_counts);
      }
      std::vector<bool> want(capacity, false);
      std::vector<int32_t> want_seg_counts(S, 0);
      for (int64_t s = 0; s < S; ++s) {
        for (int64_t i = 0; i < len[s]; ++i) {
          if (want_packed[start[s] + i]) {
            want[packed_slot[start[s] + i]] = true;
            ++want_seg_counts[s];
          }
        }
      }
      for (size_t i = 0; i < sources.size(); ++i) {
        SCOPED_TRACE(::testing::Message() << "round " << round << (grouped ? " grouped" : " per segment")
                                          << ", scores source " << i);
        const auto [keep, counts] = st.select(sources[i], kvtest::from_vec(budget, at::kLong).to(device), grouped);
        EXPECT_EQ(keep.device(), device);
        EXPECT_EQ(counts.device(), device);
        EXPECT_TRUE(kvtest::SameKeep(kvtest::to_bools(kvtest::host(keep)), want));
        EXPECT_EQ(kvtest::to_vec<int32_t>(kvtest::host(counts)), want_seg_counts);
      }
    }
    if (::testing::Test::HasFailure()) return;
  }
}

class StoreTopk : public ::testing::TestWithParam<StoreTopkCase> {};

TEST_P(StoreTopk, MatchesReferenceThroughPages) { select_through_pages(GetParam(), false); }
#ifdef KVCACHE_EXT_WITH_CUDA
TEST_P(StoreTopk, MatchesReferenceThroughPagesCuda) {
  KVTEST_REQUIRE_CUDA();
  select_through_pages(GetParam(), true);
}
#endif

INSTANTIATE_TEST_SUITE_P(
    Cases, StoreTopk,
    ::testing::Values(StoreTopkCase{1, 1, 8, 0, 1, 3, at::kFloat, 1},      // single-slot pages
                      StoreTopkCase{2, 3, 8, 1, 4, 9, at::kHalf, 2},       // GQA-like heads, batch 2
                      StoreTopkCase{3, 2, 16, 2, 8, 40, at::kBFloat16, 3},
                      StoreTopkCase{1, 2, 8, 1, 16, 900, at::kFloat, 4},   // batch 1, few heads, long
                      StoreTopkCase{4, 4, 8, 0, 16, 30, at::kHalf, 5}),
    case_name);

// On CUDA the op reads nothing back: a negative budget keeps nothing (on CPU it is refused,
// test_store.cpp), a budget past the live tokens keeps them all, and a padded width shorter
// than a segment scores the tokens past it as NaN (evicted first) instead of reading out of
// bounds.
#ifdef KVCACHE_EXT_WITH_CUDA
TEST(StoreTopk, CudaBudgetsClampAndShortPaddingIsNaN) {
  KVTEST_REQUIRE_CUDA();
  const at::Device cuda(at::kCUDA, 0);
  OpStore st(1, 2, 8, 0, at::empty({0}, at::TensorOptions().dtype(at::kFloat).device(cuda)), 4);
  const at::Tensor kv = at::randn({1, 2, 6, 8}).to(cuda);
  st.append(kv, kv, at::arange(6, at::kLong).to(cuda));
  const auto slots = kvtest::live_slots(st);
  std::vector<float> slot_scores(st.capacity(), 0.f);
  for (int64_t s = 0; s < 2; ++s) {
    for (int64_t i = 0; i < 6; ++i) slot_scores[slots[s][i]] = static_cast<float>(i);
  }
  const at::Tensor scores = kvtest::from_vec(slot_scores, at::kFloat).to(cuda);
  const at::Tensor k = kvtest::from_vec(std::vector<int64_t>{-4, 100}, at::kLong).to(cuda);
  const auto [keep, counts] = st.select(scores, k, false);
  EXPECT_EQ(kvtest::to_vec<int32_t>(kvtest::host(counts)), (std::vector<int32_t>{0, 6}));
  std::vector<bool> want(st.capacity(), false);
  for (const int64_t slot : slots[1]) want[slot] = true;
  EXPECT_TRUE(kvtest::SameKeep(kvtest::to_bools(kvtest::host(keep)), want));
  // Padded width 4 < 6 tokens: tokens 4 and 5 score NaN and go first, whatever their score.
  const at::Tensor padded = at::arange(8, at::kFloat).view({1, 2, 4}).add(10).to(cuda);
  const at::Tensor k4 = kvtest::from_vec(std::vector<int64_t>{4, 5}, at::kLong).to(cuda);
  const auto [keep_p, counts_p] = st.select(padded, k4, false);
  std::vector<bool> want_p(st.capacity(), false);
  for (int64_t s = 0; s < 2; ++s) {
    for (int64_t i = 0; i < (s == 0 ? 4 : 5); ++i) want_p[slots[s][i]] = true;
  }
  EXPECT_TRUE(kvtest::SameKeep(kvtest::to_bools(kvtest::host(keep_p)), want_p));
  EXPECT_EQ(kvtest::to_vec<int32_t>(kvtest::host(counts_p)), (std::vector<int32_t>{4, 5}));
}
#endif

}  // namespace
