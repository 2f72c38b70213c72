// The CUDA attention's split merge (attention_cuda.cu: merge_runs, then merge_segments), run
// on the host through the same functions (attention/merge_states.h) in the same order as the
// kernels, against a float64 softmax over each segment's logits, all splits concatenated.
// Split counts from 1 to several thousand per segment, empty splits, masked (-inf) logits,
// rows that see nothing, and logits far apart (scales that underflow). The split lanes are
// those of the kernel's head_dims (MergeLayout: 128 threads / (D / 4)).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "attention/merge_states.h"
#include "tests/test_util.h"

namespace {

using kvcache_ext::attention::merge_piece_head;
using kvcache_ext::attention::merge_pieces;
using kvcache_ext::attention::merge_run_length;
using kvcache_ext::attention::merge_two_levels;

constexpr int kE = 8;  // output elements per row in the model
using State = kvcache_ext::attention::MergeState<kE>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// fp32 merges of up to thousands of states against float64: above the rounding seen (up to
// about 2e-7 on these cases), far below what a lost split or a missed rescale gives.
constexpr double kTol = 2e-6;

// One row of every segment: each split's logits (base 2, -inf = masked) and V rows.
struct Split {
  int segment;
  std::vector<float> x;
  std::vector<std::array<float, kE>> v;
};

struct Case {
  std::vector<Split> splits;   // in plan order: the splits of segment 0, then 1, ...
  std::vector<int> first;      // [S + 1]
};

// attend_split's output for one split: its own max, sum and unnormalised output, in float.
State split_state(const Split& sp) {
  State st = State::empty();
  for (float x : sp.x) st.m = std::max(st.m, x);
  if (st.m == kNegInf) return st;
  for (size_t j = 0; j < sp.x.size(); ++j) {
    const float p = sp.x[j] == kNegInf ? 0.f : exp2f(sp.x[j] - st.m);
    st.l += p;
    for (int e = 0; e < kE; ++e) st.o[e] += p * sp.v[j][e];
  }
  return st;
}

enum class Mutation { kNone, kNoRescale, kDropFirstPiece };

// A fold as MergeState::merge does it, with a mutation for the test that the checks can fail.
void fold(State& st, const State& b, Mutation mut) {
  if (mut != Mutation::kNoRescale) return st.merge(b);
  const float m_all = std::max(st.m, b.m);
  if (m_all == kNegInf) return;
  const float sb = kvcache_ext::attention::merge_scale(b.m, m_all);
  st.l = st.l + b.l * sb;  // the running state is not brought to the new maximum
  for (int e = 0; e < kE; ++e) st.o[e] = st.o[e] + b.o[e] * sb;
  st.m = m_all;
}

// The kernels' two levels for split lanes `lanes` (merge_runs, then merge_segments), in
// their order: returns each segment's final state. Level 1 folds in place, as it does.
std::vector<State> merge_model(const Case& c, int lanes, Mutation mut = Mutation::kNone) {
  const int W = static_cast<int>(c.splits.size()), S = static_cast<int>(c.first.size()) - 1;
  std::vector<State> part(W);
  for (int w = 0; w < W; ++w) part[w] = split_state(c.splits[w]);
  const int run = merge_run_length(W, S, lanes);
  if (run > 1) {  // merge_runs: in each run, each long segment's splits folded into its head
    for (int w0 = 0; w0 < W; w0 += run) {
      const int w1 = std::min(w0 + run, W);
      for (int side = 0; side < 2; ++side) {
        const int seg = c.splits[side == 0 ? w0 : w1 - 1].segment;
        if (side == 1 && seg == c.splits[w0].segment) break;
        if (!merge_two_levels(c.first[seg], c.first[seg + 1], run)) continue;
        const int head = std::max(c.first[seg], w0), end = std::min(c.first[seg + 1], w1);
        State st = State::empty();
        for (int w = head; w < end; ++w) fold(st, part[w], mut);
        part[head] = st;
      }
    }
  }
  std::vector<State> out(S);
  for (int s = 0; s < S; ++s) {  // merge_segments
    const int step = merge_two_levels(c.first[s], c.first[s + 1], run) ? run : 1;
    const int pieces = merge_pieces(c.first[s], c.first[s + 1], step);
    const int j0 = mut == Mutation::kDropFirstPiece ? 1 : 0;
    if (pieces == 1) {
      out[s] = State::empty();
      fold(out[s], part[c.first[s]], mut);
      continue;
    }
    std::vector<State> lane(lanes, State::empty());
    for (int y = 0; y < lanes; ++y)
      for (int j = y; j < pieces; j += lanes)
        if (j >= j0) fold(lane[y], part[merge_piece_head(c.first[s], step, j)], mut);
    out[s] = lane[0];
    for (int y = 1; y < lanes; ++y) fold(out[s], lane[y], mut);
  }
  return out;
}

// Largest error of a segment's merged output and 1/l against the float64 softmax of all its
// logits, relative to the size of the values (|v| <= 1, so absolute on o / l).
double max_error(const Case& c, const std::vector<State>& got) {
  const int S = static_cast<int>(c.first.size()) - 1;
  double worst = 0;
  for (int s = 0; s < S; ++s) {
    double m = -INFINITY;
    for (int w = c.first[s]; w < c.first[s + 1]; ++w)
      for (float x : c.splits[w].x) m = std::max(m, static_cast<double>(x));
    const State& st = got[s];
    if (m == -INFINITY) {  // the row saw nothing: exactly zeros and inv_l = 0
      if (st.m != kNegInf || st.inv_l() != 0.f) return INFINITY;
      for (int e = 0; e < kE; ++e)
        if (st.out(e) != 0.f) return INFINITY;
      continue;
    }
    if (st.m != static_cast<float>(m)) return INFINITY;  // the max is exact
    double l = 0;
    std::array<double, kE> o{};
    for (int w = c.first[s]; w < c.first[s + 1]; ++w) {
      const Split& sp = c.splits[w];
      for (size_t j = 0; j < sp.x.size(); ++j) {
        if (sp.x[j] == kNegInf) continue;
        const double p = std::exp2(static_cast<double>(sp.x[j]) - m);
        l += p;
        for (int e = 0; e < kE; ++e) o[e] += p * sp.v[j][e];
      }
    }
    worst = std::max(worst, std::abs(static_cast<double>(st.inv_l()) * l - 1.0));
    for (int e = 0; e < kE; ++e)
      worst = std::max(worst, std::abs(static_cast<double>(st.out(e)) - o[e] / l));
  }
  return worst;
}

// Segments with `counts[s]` splits each; a split holds 0 to 6 logits, some masked, some
// splits wholly masked or empty; `spread` is the logits' range in base 2 (far apart when
// large: most scales underflow to 0).
Case make_case(std::mt19937& rng, const std::vector<int>& counts, float spread,
               bool blind_rows = true) {
  Case c;
  for (size_t s = 0; s < counts.size(); ++s) {
    c.first.push_back(static_cast<int>(c.splits.size()));
    // kind 0: a row that sees nothing (every logit masked)
    const int kind = kvtest::uniform_int(rng, blind_rows ? 0 : 1, 5);
    for (int k = 0; k < counts[s]; ++k) {
      Split sp;
      sp.segment = static_cast<int>(s);
      const int n = kvtest::uniform_int(rng, 0, 6);
      const bool masked = kind == 0 || kvtest::uniform_int(rng, 0, 9) == 0;
      std::uniform_real_distribution<float> x(-spread, spread), v(-1.f, 1.f);
      for (int j = 0; j < n; ++j) {
        sp.x.push_back(masked || kvtest::uniform_int(rng, 0, 4) == 0 ? kNegInf : x(rng));
        std::array<float, kE> row;
        for (auto& e : row) e = v(rng);
        sp.v.push_back(row);
      }
      c.splits.push_back(std::move(sp));
    }
  }
  c.first.push_back(static_cast<int>(c.splits.size()));
  return c;
}

std::vector<int> random_counts(std::mt19937& rng, int S, int most) {
  std::vector<int> counts(S);
  for (auto& n : counts) {
    const int kind = kvtest::uniform_int(rng, 0, 3);
    n = kind == 0 ? 1 : kind == 1 ? kvtest::uniform_int(rng, 2, 16) : kvtest::uniform_int(rng, 1, most);
  }
  return counts;
}

constexpr int kLanes[] = {2, 4, 5, 6, 8};  // head_dim 256/192, 128/112, 96, 80, 64

TEST(MergeStates, MatchesFloat64SoftmaxOverAllSplits) {
  std::mt19937 rng(43);
  for (int trial = 0; trial < 60; ++trial) {
    const int S = kvtest::uniform_int(rng, 1, 6);
    const Case c = make_case(rng, random_counts(rng, S, trial % 4 == 0 ? 6000 : 300),
                             trial % 3 == 0 ? 200.f : 20.f);
    for (int lanes : kLanes) {
      const double err = max_error(c, merge_model(c, lanes));
      ASSERT_LT(err, kTol) << "trial " << trial << " lanes " << lanes;
    }
  }
}

TEST(MergeStates, OneLongSegmentTakesBothLevels) {
  // Batch 1 with one KV head: one segment of thousands of splits (both levels run), and a
  // single split (a copy-out, bit for bit the split's own state).
  std::mt19937 rng(44);
  for (int count : {1, 2, 3, 37, 528, 1056, 4224, 7000}) {
    const Case c = make_case(rng, {count}, 20.f);
    for (int lanes : kLanes) {
      const int run = merge_run_length(count, 1, lanes);
      if (count >= 64 * lanes) {
        EXPECT_GT(run, 1) << count << " splits, lanes " << lanes;
        EXPECT_TRUE(merge_two_levels(0, count, run)) << count << " splits, lanes " << lanes;
      }
      const std::vector<State> got = merge_model(c, lanes);
      ASSERT_LT(max_error(c, got), kTol) << count << " splits, lanes " << lanes;
      if (count == 1) {
        const State own = split_state(c.splits[0]);
        EXPECT_EQ(got[0].m, own.m);
        EXPECT_EQ(got[0].l, own.l);
        EXPECT_EQ(0, std::memcmp(got[0].o, own.o, sizeof own.o));
      }
    }
  }
}

TEST(MergeStates, RowsThatSeeNothingGiveZerosAndEmptySplitsChangeNothing) {
  std::mt19937 rng(45);
  Case c = make_case(rng, {1, 5, 300}, 20.f);
  for (Split& sp : c.splits)
    for (float& x : sp.x) x = kNegInf;  // every segment's row sees nothing
  for (int lanes : kLanes) {
    for (const State& st : merge_model(c, lanes)) {
      EXPECT_EQ(st.m, kNegInf);
      EXPECT_EQ(st.inv_l(), 0.f);
      for (int e = 0; e < kE; ++e) EXPECT_EQ(st.out(e), 0.f);
    }
  }
  // Empty states folded in anywhere leave a state as it was, bit for bit.
  const Case d = make_case(rng, {40}, 20.f);
  State a = State::empty(), b = State::empty();
  for (const Split& sp : d.splits) {
    a.merge(split_state(sp));
    b.merge(State::empty());
    b.merge(split_state(sp));
    b.merge(State::empty());
  }
  EXPECT_EQ(a.m, b.m);
  EXPECT_EQ(a.l, b.l);
  EXPECT_EQ(0, std::memcmp(a.o, b.o, sizeof a.o));
}

TEST(MergeStates, OrderChangesRoundingOnlyAndAFixedOrderIsExact) {
  std::mt19937 rng(46);
  const Case c = make_case(rng, {3000, 1, 17}, 20.f);
  const std::vector<State> model = merge_model(c, 4);
  // Deterministic: the kernels' fixed order gives the same bits on every run.
  const std::vector<State> again = merge_model(c, 4);
  for (size_t s = 0; s < model.size(); ++s) {
    EXPECT_EQ(model[s].m, again[s].m);
    EXPECT_EQ(model[s].l, again[s].l);
    EXPECT_EQ(0, std::memcmp(model[s].o, again[s].o, sizeof model[s].o));
  }
  // Any order of the same splits: the same softmax within rounding.
  for (int trial = 0; trial < 5; ++trial) {
    std::vector<State> shuffled(model.size(), State::empty());
    for (size_t s = 0; s + 1 < c.first.size(); ++s) {
      std::vector<int> order;
      for (int w = c.first[s]; w < c.first[s + 1]; ++w) order.push_back(w);
      std::shuffle(order.begin(), order.end(), rng);
      for (int w : order) shuffled[s].merge(split_state(c.splits[w]));
      EXPECT_EQ(shuffled[s].m, model[s].m);
      EXPECT_NEAR(shuffled[s].l * model[s].inv_l(), model[s].l > 0.f ? 1.0 : 0.0, kTol);
      for (int e = 0; e < kE; ++e) EXPECT_NEAR(shuffled[s].out(e), model[s].out(e), kTol);
    }
  }
}

TEST(MergeStates, PiecesCoverEverySplitOnce) {
  std::mt19937 rng(47);
  for (int trial = 0; trial < 2000; ++trial) {
    const int first = kvtest::uniform_int(rng, 0, 5000), last = first + kvtest::uniform_int(rng, 1, 3000);
    const int run = 1 << kvtest::uniform_int(rng, 0, 7);
    const int pieces = merge_pieces(first, last, run);
    int next = first;
    for (int j = 0; j < pieces; ++j) {
      ASSERT_EQ(merge_piece_head(first, run, j), next) << first << ".." << last << " run " << run;
      next = std::min(last, (next / run + 1) * run);  // a piece ends at a run boundary or at last
    }
    ASSERT_EQ(next, last) << first << ".." << last << " run " << run;
  }
}

TEST(MergeStates, TheChecksCatchAMutatedMerge) {
  std::mt19937 rng(48);
  const Case c = make_case(rng, {200, 9, 1}, 20.f, /*blind_rows=*/false);
  ASSERT_GT(merge_run_length(210, 3, 4), 1);  // both levels run
  ASSERT_LT(max_error(c, merge_model(c, 4)), kTol);
  EXPECT_GT(max_error(c, merge_model(c, 4, Mutation::kNoRescale)), 10 * kTol);
  EXPECT_GT(max_error(c, merge_model(c, 4, Mutation::kDropFirstPiece)), 10 * kTol);
}

}  // namespace
