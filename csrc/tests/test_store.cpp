// RaggedKVStore against a plain host model: one std::vector of tokens per segment.
//
// Every scenario runs on the CPU store; its *Cuda twin runs the same operations with the
// same inputs on a CPU store and a CUDA store side by side, checks both against the model
// and the CUDA store's live slots against the CPU store's, byte for byte.
#include <gtest/gtest.h>

#include <memory>

#include "select/topk.h"
#include "store/ragged_store.h"
#include "tests/test_util.h"

namespace {

using kvcache_ext::RaggedKVStore;
using kvtest::Throws;

struct StoreCase {
  at::ScalarType dtype;
  int64_t B, H, D, C;
  double growth;
  uint32_t seed;
};

std::string case_name(const ::testing::TestParamInfo<StoreCase>& info) {
  const StoreCase& c = info.param;
  std::ostringstream s;
  s << kvtest::dtype_name(c.dtype) << "_B" << c.B << "H" << c.H << "D" << c.D << "C" << c.C
    << "_g" << static_cast<int>(c.growth * 100) << "_seed" << c.seed;
  return s.str();
}

// One stored token, as the model sees it: raw K/V bytes, position, raw score bits.
struct Token {
  std::vector<uint8_t> k, v;
  int32_t pos;
  std::vector<uint32_t> scores;
};

struct Ptrs {
  const void *k, *v, *pos, *scores;
  bool operator==(const Ptrs& o) const {
    return k == o.k && v == o.v && pos == o.pos && scores == o.scores;
  }
};

// Drives one CPU store (and optionally one CUDA store) and the model through the same steps.
class StoreHarness {
 public:
  StoreHarness(const StoreCase& c, bool with_cuda) : c_(c), segs_(c.B * c.H) {
    devices_.emplace_back(at::kCPU);
    if (with_cuda) devices_.emplace_back(at::kCUDA, 0);
    for (const auto& d : devices_) {
      const at::Tensor like = at::empty({0}, at::TensorOptions().dtype(c.dtype).device(d));
      stores_.push_back(std::make_unique<RaggedKVStore>(c.B, c.H, c.D, c.C, like, c.growth));
    }
  }

  int64_t S() const { return c_.B * c_.H; }
  RaggedKVStore& cpu() { return *stores_[0]; }
  size_t num_stores() const { return stores_.size(); }
  RaggedKVStore& store(size_t i) { return *stores_[i]; }
  const at::Device& device(size_t i) const { return devices_[i]; }
  const std::vector<Token>& segment(int64_t s) const { return segs_[s]; }
  int64_t model_tokens() const {
    int64_t n = 0;
    for (const auto& s : segs_) n += s.size();
    return n;
  }
  std::vector<int64_t> start_host() { return kvtest::to_vec<int64_t>(cpu().start()); }

  // k, v [B, H, n, D] in the store's dtype; pos [n] or [B, n]; valid [B, n] or [B, H, n].
  void append(const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos,
              const c10::optional<at::Tensor>& valid = c10::nullopt) {
    for (size_t i = 0; i < stores_.size(); ++i) {
      const auto& d = devices_[i];
      c10::optional<at::Tensor> valid_d;
      if (valid) valid_d = valid->to(d);
      stores_[i]->append(k.to(d), v.to(d), pos.to(d), valid_d);
    }
    const int64_t n = k.size(2);
    const std::vector<int64_t> p = kvtest::to_vec<int64_t>(pos.to(at::kLong));
    std::vector<bool> mask;
    if (valid) mask = kvtest::to_bools(*valid);
    for (int64_t b = 0; b < c_.B; ++b) {
      for (int64_t h = 0; h < c_.H; ++h) {
        const int64_t s = b * c_.H + h;
        for (int64_t t = 0; t < n; ++t) {
          if (valid) {
            const int64_t m = valid->dim() == 2 ? b * n + t : s * n + t;
            if (!mask[m]) continue;
          }
          const int64_t pt = pos.dim() == 1 ? p[t] : p[b * n + t];
          segs_[s].push_back(token(k, v, s * n + t, static_cast<int32_t>(pt)));
        }
      }
    }
  }

  // slot [B, H] integer; k, v [B, H, 1, D]; pos [B] or [B, 1].
  void replace(const at::Tensor& slot, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& pos, bool check_bounds) {
    for (size_t i = 0; i < stores_.size(); ++i) {
      const auto& d = devices_[i];
      stores_[i]->replace(slot.to(d), k.to(d), v.to(d), pos.to(d), check_bounds);
    }
    const std::vector<int64_t> sl = kvtest::to_vec<int64_t>(slot.to(at::kLong));
    const std::vector<int64_t> p = kvtest::to_vec<int64_t>(pos.to(at::kLong));
    for (int64_t s = 0; s < S(); ++s) {
      segs_[s].at(sl[s]) = token(k, v, s, static_cast<int32_t>(p[s / c_.H]));
    }
  }

  // keep [capacity] bool in the slot layout (identical on every store).
  void compact(const at::Tensor& keep) {
    const std::vector<int64_t> start = start_host();
    for (size_t i = 0; i < stores_.size(); ++i) stores_[i]->compact(keep.to(devices_[i]));
    const std::vector<bool> flags = kvtest::to_bools(keep);
    for (int64_t s = 0; s < S(); ++s) {
      std::vector<Token> kept;
      for (size_t j = 0; j < segs_[s].size(); ++j) {
        if (flags[start[s] + j]) kept.push_back(segs_[s][j]);
      }
      segs_[s] = std::move(kept);
    }
  }

  void reserve(int64_t extra) {
    for (auto& st : stores_) st->reserve(extra);
  }
  void shrink_to_fit() {
    for (auto& st : stores_) st->shrink_to_fit();
  }

  // Writes values [capacity, C] float32 into every store's score channels (a policy's job).
  void set_scores(const at::Tensor& values) {
    for (size_t i = 0; i < stores_.size(); ++i) stores_[i]->scores().copy_(values.to(devices_[i]));
    const std::vector<int64_t> start = start_host();
    const std::vector<uint32_t> bits = kvtest::to_vec<uint32_t>(values.view(at::kInt));
    for (int64_t s = 0; s < S(); ++s) {
      for (size_t j = 0; j < segs_[s].size(); ++j) {
        const int64_t row = start[s] + j;
        segs_[s][j].scores.assign(bits.begin() + row * c_.C, bits.begin() + (row + 1) * c_.C);
      }
    }
  }

  // Random scores for every slot: normal values with a few NaNs, infinities and -0.0.
  at::Tensor random_scores(std::mt19937& rng) {
    at::Tensor t = kvtest::random_normal({cpu().capacity(), c_.C}, at::kFloat, rng);
    float* p = t.data_ptr<float>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      switch (kvtest::uniform_int(rng, 0, 19)) {
        case 0: p[i] = std::numeric_limits<float>::quiet_NaN(); break;
        case 1: p[i] = -std::numeric_limits<float>::infinity(); break;
        case 2: p[i] = -0.0f; break;
        default: break;
      }
    }
    return t;
  }

  std::vector<Ptrs> ptrs() const {
    std::vector<Ptrs> out;
    for (const auto& st : stores_) {
      out.push_back({st->k().data_ptr(), st->v().data_ptr(), st->pos().data_ptr(),
                     st->scores().data_ptr()});
    }
    return out;
  }

  // Checks every store against the model, and the CUDA store against the CPU store.
  void verify() {
    for (size_t i = 0; i < stores_.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "store on " << devices_[i]);
      verify_store(*stores_[i], devices_[i]);
      if (::testing::Test::HasFailure()) return;
    }
    if (stores_.size() > 1) {
      SCOPED_TRACE("CUDA store vs CPU store");
      RaggedKVStore &a = *stores_[0], &b = *stores_[1];
      EXPECT_TRUE(kvtest::BytesEqual(b.start(), a.start()));
      EXPECT_TRUE(kvtest::BytesEqual(b.len(), a.len()));
      EXPECT_TRUE(kvtest::BytesEqual(b.cap(), a.cap()));
      EXPECT_EQ(b.capacity(), a.capacity());
      EXPECT_EQ(b.nbytes(), a.nbytes());
      const at::Tensor idx = live_index(a);
      EXPECT_TRUE(kvtest::BytesEqual(host(b.k()).index_select(0, idx), host(a.k()).index_select(0, idx)));
      EXPECT_TRUE(kvtest::BytesEqual(host(b.v()).index_select(0, idx), host(a.v()).index_select(0, idx)));
      EXPECT_TRUE(kvtest::BytesEqual(host(b.pos()).index_select(0, idx), host(a.pos()).index_select(0, idx)));
      EXPECT_TRUE(kvtest::BytesEqual(host(b.scores()).index_select(0, idx),
                                     host(a.scores()).index_select(0, idx)));
    }
  }

 private:
  static at::Tensor host(const at::Tensor& t) { return kvtest::host(t); }

  Token token(const at::Tensor& k, const at::Tensor& v, int64_t row, int32_t pos) const {
    const at::Tensor kc = k.contiguous(), vc = v.contiguous();
    const int64_t bytes = c_.D * kc.element_size();
    const auto* kp = static_cast<const uint8_t*>(kc.data_ptr()) + row * bytes;
    const auto* vp = static_cast<const uint8_t*>(vc.data_ptr()) + row * bytes;
    return Token{{kp, kp + bytes}, {vp, vp + bytes}, pos, std::vector<uint32_t>(c_.C, 0u)};
  }

  static at::Tensor live_index(RaggedKVStore& st) {
    const auto start = kvtest::to_vec<int64_t>(st.start());
    const auto len = kvtest::to_vec<int32_t>(st.len());
    std::vector<int64_t> idx;
    for (size_t s = 0; s < start.size(); ++s) {
      for (int64_t j = 0; j < len[s]; ++j) idx.push_back(start[s] + j);
    }
    return kvtest::from_vec(idx, at::kLong);
  }

  void verify_store(RaggedKVStore& st, const at::Device& d) {
    const int64_t S = this->S();
    // Metadata tensors.
    EXPECT_EQ(st.start().scalar_type(), at::kLong);
    EXPECT_EQ(st.len().scalar_type(), at::kInt);
    EXPECT_EQ(st.cap().scalar_type(), at::kInt);
    for (const at::Tensor* t : {&st.start(), &st.len(), &st.cap()}) {
      EXPECT_EQ(t->sizes(), at::IntArrayRef({S}));
      EXPECT_EQ(t->device(), d);
    }
    const auto start = kvtest::to_vec<int64_t>(st.start());
    const auto len = kvtest::to_vec<int32_t>(st.len());
    const auto cap = kvtest::to_vec<int32_t>(st.cap());
    EXPECT_EQ(st.len_host(), len) << "len_host() disagrees with len()";
    EXPECT_EQ(st.cap_host(), cap) << "cap_host() disagrees with cap()";
    if (::testing::Test::HasFailure()) return;
    // Segment layout.
    const int64_t capacity = st.capacity();
    int64_t prev_end = 0, total = 0;
    for (int64_t s = 0; s < S; ++s) {
      EXPECT_EQ(len[s], static_cast<int64_t>(segs_[s].size())) << "len of segment " << s;
      EXPECT_GE(cap[s], len[s]) << "segment " << s;
      EXPECT_GE(start[s], prev_end) << "segment " << s << " overlaps the previous one";
      prev_end = start[s] + cap[s];
      total += len[s];
    }
    EXPECT_LE(prev_end, capacity) << "segments run past the buffers";
    EXPECT_EQ(st.num_tokens(), total);
    // Buffers.
    const at::ScalarType dt = c_.dtype;
    EXPECT_EQ(st.k().scalar_type(), dt);
    EXPECT_EQ(st.v().scalar_type(), dt);
    EXPECT_EQ(st.pos().scalar_type(), at::kInt);
    EXPECT_EQ(st.scores().scalar_type(), at::kFloat);
    EXPECT_EQ(st.k().sizes(), at::IntArrayRef({capacity, c_.D}));
    EXPECT_EQ(st.v().sizes(), at::IntArrayRef({capacity, c_.D}));
    EXPECT_EQ(st.pos().sizes(), at::IntArrayRef({capacity}));
    EXPECT_EQ(st.scores().sizes(), at::IntArrayRef({capacity, c_.C}));
    for (const at::Tensor* t : {&st.k(), &st.v(), &st.pos(), &st.scores()}) {
      EXPECT_EQ(t->device(), d);
      EXPECT_TRUE(t->is_contiguous());
    }
    const int64_t esz = at::elementSize(dt);
    const int64_t expect_nbytes =
        capacity * (2 * c_.D * esz + 4 + 4 * c_.C) + S * (8 + 4 + 4);
    EXPECT_EQ(st.nbytes(), expect_nbytes);
    EXPECT_EQ(st.batch(), c_.B);
    EXPECT_EQ(st.heads(), c_.H);
    EXPECT_EQ(st.head_dim(), c_.D);
    EXPECT_EQ(st.score_channels(), c_.C);
    EXPECT_EQ(st.num_segments(), S);
    if (::testing::Test::HasFailure()) return;
    // Live slots, byte for byte.
    const at::Tensor k = host(st.k()), v = host(st.v()), pos = host(st.pos()),
                     sc = host(st.scores());
    const auto* kp = static_cast<const uint8_t*>(k.data_ptr());
    const auto* vp = static_cast<const uint8_t*>(v.data_ptr());
    const auto* pp = pos.data_ptr<int32_t>();
    const auto* sp = static_cast<const uint32_t*>(sc.data_ptr());
    const int64_t row = c_.D * esz;
    int failures = 0;
    for (int64_t s = 0; s < S && failures < 5; ++s) {
      for (size_t j = 0; j < segs_[s].size() && failures < 5; ++j) {
        const int64_t r = start[s] + j;
        const Token& t = segs_[s][j];
        const bool k_ok = std::memcmp(kp + r * row, t.k.data(), row) == 0;
        const bool v_ok = std::memcmp(vp + r * row, t.v.data(), row) == 0;
        const bool p_ok = pp[r] == t.pos;
        const bool s_ok = c_.C == 0 || std::memcmp(sp + r * c_.C, t.scores.data(), 4 * c_.C) == 0;
        if (!(k_ok && v_ok && p_ok && s_ok)) {
          ++failures;
          ADD_FAILURE() << "segment " << s << ", slot " << j << " (row " << r << "):"
                        << (k_ok ? "" : " K differs") << (v_ok ? "" : " V differs")
                        << (p_ok ? "" : " pos differs") << (s_ok ? "" : " scores differ")
                        << " (pos " << pp[r] << ", expected " << t.pos << ")";
        }
      }
    }
  }

  StoreCase c_;
  std::vector<at::Device> devices_;
  std::vector<std::unique_ptr<RaggedKVStore>> stores_;
  std::vector<std::vector<Token>> segs_;
};

// ---- inputs ---------------------------------------------------------------------------

at::Tensor rand_tokens(const StoreCase& c, int64_t n, std::mt19937& rng) {
  return kvtest::random_normal({c.B, c.H, n, c.D}, c.dtype, rng);
}

// Positions [n] (shared by the batch) or [B, n], in various integer dtypes.
at::Tensor make_pos(const StoreCase& c, int64_t n, int64_t first, int variant) {
  switch (variant % 3) {
    case 0: return at::arange(first, first + n, at::kLong);
    case 1:  // per batch item, as with left padding
      return (at::arange(first, first + n, at::kInt).unsqueeze(0) +
              at::arange(c.B, at::kInt).unsqueeze(1) * 1000)
          .contiguous();
    default: return at::arange(first, first + n, at::kShort).unsqueeze(0).expand({c.B, n}).contiguous();
  }
}

int count_relayouts(std::vector<Ptrs>& last, const std::vector<Ptrs>& now) {
  const int changed = last[0] == now[0] ? 0 : 1;
  last = now;
  return changed;
}

class Store : public ::testing::TestWithParam<StoreCase> {};

// Declares scenario `name` as a CPU test and (with CUDA compiled in) its Cuda twin.
#ifdef KVCACHE_EXT_WITH_CUDA
#define STORE_SCENARIO(name)                                     \
  void name##_body(const StoreCase& c, bool cuda);               \
  TEST_P(Store, name) { name##_body(GetParam(), false); }        \
  TEST_P(Store, name##Cuda) {                                    \
    KVTEST_REQUIRE_CUDA();                                       \
    name##_body(GetParam(), true);                               \
  }                                                              \
  void name##_body(const StoreCase& c, bool cuda)
#else
#define STORE_SCENARIO(name)                                     \
  void name##_body(const StoreCase& c, bool cuda);               \
  TEST_P(Store, name) { name##_body(GetParam(), false); }        \
  void name##_body(const StoreCase& c, bool cuda)
#endif

// ---- scenarios ------------------------------------------------------------------------

STORE_SCENARIO(EmptyStore) {
  (void)c.seed;
  StoreHarness h(c, cuda);
  KVTEST_STEP("fresh store", h.verify());
  EXPECT_EQ(h.cpu().capacity(), 0);
  KVTEST_STEP("append n=0", h.append(at::empty({c.B, c.H, 0, c.D}, c.dtype),
                                     at::empty({c.B, c.H, 0, c.D}, c.dtype),
                                     at::empty({0}, at::kLong)));
  KVTEST_STEP("after append n=0", h.verify());
  EXPECT_EQ(h.cpu().capacity(), 0) << "appending nothing must not allocate";
  KVTEST_STEP("compact empty", h.compact(at::empty({0}, at::kBool)));
  KVTEST_STEP("shrink empty", h.shrink_to_fit());
  KVTEST_STEP("reserve(0)", h.reserve(0));
  KVTEST_STEP("after no-ops", h.verify());
  EXPECT_EQ(h.cpu().capacity(), 0);
}

STORE_SCENARIO(AppendUniform) {
  StoreHarness h(c, cuda);
  std::mt19937 rng(c.seed);
  const std::vector<int64_t> ns = {5, 0, 1, 3, 17, 1, 1, 40, 2};
  int64_t next = 0;
  for (size_t i = 0; i < ns.size(); ++i) {
    const int64_t n = ns[i];
    const at::Tensor k = rand_tokens(c, n, rng), v = rand_tokens(c, n, rng);
    KVTEST_STEP(::testing::Message() << "append #" << i << " n=" << n,
                h.append(k, v, make_pos(c, n, next, i)));
    KVTEST_STEP(::testing::Message() << "after append #" << i, h.verify());
    next += n;
  }
  EXPECT_EQ(h.cpu().num_tokens(), next * c.B * c.H);
}

STORE_SCENARIO(AppendValidMask) {
  StoreHarness h(c, cuda);
  std::mt19937 rng(c.seed + 1);
  struct Step { int64_t n; double p; bool per_head; };
  const std::vector<Step> steps = {{6, 0.5, false}, {0, 0.5, true},  {1, 0.5, true},
                                   {9, 0.0, false}, {9, 1.0, true},  {13, 0.3, true},
                                   {1, 0.0, true},  {30, 0.7, false}, {4, 0.5, true}};
  int64_t next = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto& st = steps[i];
    const at::Tensor k = rand_tokens(c, st.n, rng), v = rand_tokens(c, st.n, rng);
    const at::Tensor valid = st.per_head ? kvtest::random_mask({c.B, c.H, st.n}, st.p, rng)
                                         : kvtest::random_mask({c.B, st.n}, st.p, rng);
    KVTEST_STEP(::testing::Message() << "masked append #" << i << " n=" << st.n,
                h.append(k, v, make_pos(c, st.n, next, i), valid));
    KVTEST_STEP(::testing::Message() << "after masked append #" << i, h.verify());
    next += st.n;
  }
}

// Token-by-token decode: data survives every regrowth, and regrowths are geometric
// (amortized O(1) per token, never a copy per step), also when one segment gets all tokens.
STORE_SCENARIO(GrowthKeepsData) {
  for (const bool skewed : {false, true}) {
    SCOPED_TRACE(skewed ? "only segment 0 receives tokens" : "every segment receives tokens");
    StoreHarness h(c, cuda);
    std::mt19937 rng(c.seed + 2);
    const int64_t prompt = kvtest::uniform_int(rng, 0, 20);
    const int64_t steps = 160, n = skewed ? 3 : 1;
    at::Tensor only_first = at::zeros({c.B, c.H, n}, at::kBool);
    only_first[0][0].fill_(true);
    int64_t next = 0;
    auto last = h.ptrs();
    int relayouts = 0;
    for (int64_t i = 0; i < steps + 1; ++i) {
      const int64_t m = i == 0 ? prompt : n;
      const at::Tensor k = rand_tokens(c, m, rng), v = rand_tokens(c, m, rng);
      c10::optional<at::Tensor> valid;
      if (skewed && i > 0) valid = only_first;
      KVTEST_STEP(::testing::Message() << "step " << i, h.append(k, v, make_pos(c, m, next, 0), valid));
      next += m;
      relayouts += count_relayouts(last, h.ptrs());
      KVTEST_STEP(::testing::Message() << "after step " << i, h.verify());
    }
    // The store never holds fewer slots than tokens, and at least one regrowth happened.
    const int64_t total = h.cpu().num_tokens();
    EXPECT_GE(h.cpu().capacity(), total);
    EXPECT_GE(relayouts, 1);
    // Geometric growth: about log_growth(total) regrowths, far fewer than the steps.
    const int bound =
        3 + static_cast<int>(std::ceil(std::log(std::max<double>(total, 2.0)) / std::log(c.growth)));
    EXPECT_LE(relayouts, bound) << "the store regrew " << relayouts << " times for " << total
                                << " tokens (growth " << c.growth << ")";
  }
}

STORE_SCENARIO(Replace) {
  StoreHarness h(c, cuda);
  std::mt19937 rng(c.seed + 3);
  int64_t next = 0;
  // Every segment needs >= 1 live slot; lengths differ per segment after the masked append.
  const int64_t n0 = kvtest::uniform_int(rng, 1, 6);
  KVTEST_STEP("prompt", h.append(rand_tokens(c, n0, rng), rand_tokens(c, n0, rng), make_pos(c, n0, 0, 0)));
  next += n0;
  KVTEST_STEP("masked", h.append(rand_tokens(c, 7, rng), rand_tokens(c, 7, rng), make_pos(c, 7, next, 1),
                                 kvtest::random_mask({c.B, c.H, 7}, 0.5, rng)));
  next += 7;
  if (c.C > 0) KVTEST_STEP("scores", h.set_scores(h.random_scores(rng)));
  KVTEST_STEP("before replace", h.verify());
  const auto ptrs = h.ptrs();
  for (int round = 0; round < 12; ++round) {
    const auto len = kvtest::to_vec<int32_t>(h.cpu().len());
    std::vector<int64_t> slot(c.B * c.H);
    for (size_t s = 0; s < slot.size(); ++s) slot[s] = kvtest::uniform_int(rng, 0, len[s] - 1);
    at::Tensor slot_t = kvtest::from_vec(slot, at::kLong).view({c.B, c.H});
    if (round % 2) slot_t = slot_t.to(at::kInt);
    at::Tensor pos = at::arange(next, next + c.B, at::kLong);
    if (round % 3 == 1) pos = pos.to(at::kInt).view({c.B, 1});
    next += c.B;
    KVTEST_STEP(::testing::Message() << "replace round " << round,
                h.replace(slot_t, rand_tokens(c, 1, rng), rand_tokens(c, 1, rng), pos,
                          /*check_bounds=*/round % 4 != 3));
    KVTEST_STEP(::testing::Message() << "after replace round " << round, h.verify());
  }
  EXPECT_EQ(h.ptrs(), ptrs) << "replace must write in place";
}

STORE_SCENARIO(CompactStableInPlace) {
  StoreHarness h(c, cuda);
  std::mt19937 rng(c.seed + 4);
  int64_t next = 0;
  for (int i = 0; i < 3; ++i) {
    const int64_t n = kvtest::uniform_int(rng, 1, 25);
    KVTEST_STEP("fill", h.append(rand_tokens(c, n, rng), rand_tokens(c, n, rng), make_pos(c, n, next, i),
                                 kvtest::random_mask({c.B, c.H, n}, 0.8, rng)));
    next += n;
  }
  const std::vector<double> p_keep = {0.5, 1.0, 0.9, 0.3, 0.0, 0.6};
  for (size_t round = 0; round < p_keep.size(); ++round) {
    if (c.C > 0) KVTEST_STEP("scores", h.set_scores(h.random_scores(rng)));
    const auto ptrs = h.ptrs();
    const at::Tensor start = kvtest::host(h.cpu().start()).clone();
    const at::Tensor cap = kvtest::host(h.cpu().cap()).clone();
    const int64_t capacity = h.cpu().capacity();
    // Flags in slack slots are random too: compact must ignore them.
    const at::Tensor keep = kvtest::random_mask({capacity}, p_keep[round], rng);
    KVTEST_STEP(::testing::Message() << "compact round " << round << " p_keep=" << p_keep[round],
                h.compact(keep));
    KVTEST_STEP(::testing::Message() << "after compact round " << round, h.verify());
    EXPECT_EQ(h.ptrs(), ptrs) << "compact must work in place";
    EXPECT_EQ(h.cpu().capacity(), capacity);
    EXPECT_TRUE(kvtest::BytesEqual(h.cpu().start(), start));
    EXPECT_TRUE(kvtest::BytesEqual(h.cpu().cap(), cap));
    // Appending after a compaction reuses the freed slots.
    const int64_t n = kvtest::uniform_int(rng, 0, 3);
    KVTEST_STEP("append after compact",
                h.append(rand_tokens(c, n, rng), rand_tokens(c, n, rng), make_pos(c, n, next, round)));
    next += n;
    KVTEST_STEP("after append", h.verify());
  }
}

// Segments of hundreds of slots: compaction in several tiles (the CUDA kernel stages at
// most 256 slots at a time), with a fully kept prefix that does not move.
STORE_SCENARIO(CompactLongSegments) {
  StoreHarness h(c, cuda);
  std::mt19937 rng(c.seed + 10);
  const int64_t n = 700;
  KVTEST_STEP("fill", h.append(rand_tokens(c, n, rng), rand_tokens(c, n, rng), make_pos(c, n, 0, 0),
                               kvtest::random_mask({c.B, c.H, n}, 0.9, rng)));
  if (c.C > 0) KVTEST_STEP("scores", h.set_scores(h.random_scores(rng)));
  const std::vector<int64_t> prefixes = {300, 0, 0, 520};
  const std::vector<double> p_keep = {0.5, 0.5, 0.97, 0.1};
  for (size_t round = 0; round < p_keep.size(); ++round) {
    at::Tensor keep = kvtest::random_mask({h.cpu().capacity()}, p_keep[round], rng);
    const auto start = h.start_host();
    for (int64_t s = 0; s < c.B * c.H; ++s) {
      keep.slice(0, start[s], start[s] + std::min<int64_t>(prefixes[round], h.segment(s).size()))
          .fill_(true);
    }
    KVTEST_STEP(::testing::Message() << "compact round " << round, h.compact(keep));
    KVTEST_STEP(::testing::Message() << "after compact round " << round, h.verify());
  }
}

STORE_SCENARIO(ReserveAndShrink) {
  StoreHarness h(c, cuda);
  std::mt19937 rng(c.seed + 5);
  int64_t next = 0;
  KVTEST_STEP("reserve on empty", h.reserve(3));
  KVTEST_STEP("after reserve on empty", h.verify());
  for (int32_t cp : h.cpu().cap_host()) EXPECT_GE(cp, 3);
  KVTEST_STEP("fill", h.append(rand_tokens(c, 9, rng), rand_tokens(c, 9, rng), make_pos(c, 9, 0, 0),
                               kvtest::random_mask({c.B, c.H, 9}, 0.6, rng)));
  next += 9;
  if (c.C > 0) KVTEST_STEP("scores", h.set_scores(h.random_scores(rng)));
  auto ptrs = h.ptrs();
  KVTEST_STEP("reserve(0)", h.reserve(0));
  EXPECT_EQ(h.ptrs(), ptrs) << "reserve(0) must not reallocate";
  // reserve(e): e more tokens per segment fit without a regrowth.
  const int64_t extra = 25;
  KVTEST_STEP("reserve", h.reserve(extra));
  KVTEST_STEP("after reserve", h.verify());
  {
    const auto len = h.cpu().len_host();
    const auto cap = h.cpu().cap_host();
    for (size_t s = 0; s < len.size(); ++s) EXPECT_GE(cap[s], len[s] + extra) << "segment " << s;
  }
  ptrs = h.ptrs();
  KVTEST_STEP("append into reserve", h.append(rand_tokens(c, 10, rng), rand_tokens(c, 10, rng),
                                              make_pos(c, 10, next, 1)));
  next += 10;
  for (int i = 0; i < 15; ++i) {
    KVTEST_STEP("decode into reserve", h.append(rand_tokens(c, 1, rng), rand_tokens(c, 1, rng),
                                                make_pos(c, 1, next, 2)));
    next += 1;
  }
  KVTEST_STEP("after filling the reserve", h.verify());
  EXPECT_EQ(h.ptrs(), ptrs) << "appending what reserve() made room for must not regrow";
  // Compact, then give memory back.
  KVTEST_STEP("compact", h.compact(kvtest::random_mask({h.cpu().capacity()}, 0.5, rng)));
  const int64_t bytes_before = h.cpu().nbytes();
  KVTEST_STEP("shrink_to_fit", h.shrink_to_fit());
  KVTEST_STEP("after shrink_to_fit", h.verify());
  EXPECT_EQ(h.cpu().cap_host(), h.cpu().len_host());
  EXPECT_EQ(h.cpu().capacity(), h.cpu().num_tokens());
  EXPECT_LE(h.cpu().nbytes(), bytes_before);
  ptrs = h.ptrs();
  KVTEST_STEP("shrink_to_fit again", h.shrink_to_fit());
  EXPECT_EQ(h.ptrs(), ptrs) << "shrink_to_fit of a tight store must not reallocate";
  KVTEST_STEP("append after shrink", h.append(rand_tokens(c, 3, rng), rand_tokens(c, 3, rng),
                                              make_pos(c, 3, next, 0)));
  next += 3;
  KVTEST_STEP("after append after shrink", h.verify());
  // Keep nothing, shrink to nothing, start over.
  KVTEST_STEP("compact to empty", h.compact(at::zeros({h.cpu().capacity()}, at::kBool)));
  KVTEST_STEP("shrink to empty", h.shrink_to_fit());
  KVTEST_STEP("after shrink to empty", h.verify());
  EXPECT_EQ(h.cpu().capacity(), 0);
  KVTEST_STEP("append after emptying", h.append(rand_tokens(c, 2, rng), rand_tokens(c, 2, rng),
                                                make_pos(c, 2, next, 1)));
  KVTEST_STEP("after append after emptying", h.verify());
}

// A random mix of every operation, checked after each.
STORE_SCENARIO(RandomOperations) {
  StoreHarness h(c, cuda);
  std::mt19937 rng(c.seed + 6);
  int64_t next = 0;
  for (int step = 0; step < 60; ++step) {
    const int op = static_cast<int>(kvtest::uniform_int(rng, 0, 9));
    ::testing::Message what;
    what << "step " << step << " op " << op;
    if (op <= 3) {
      const int64_t n = kvtest::uniform_int(rng, 0, op == 0 ? 20 : 2);
      c10::optional<at::Tensor> valid;
      if (op == 2) valid = kvtest::random_mask({c.B, c.H, n}, 0.5, rng);
      if (op == 3) valid = kvtest::random_mask({c.B, n}, 0.5, rng);
      KVTEST_STEP(what << " append", h.append(rand_tokens(c, n, rng), rand_tokens(c, n, rng),
                                              make_pos(c, n, next, step), valid));
      next += n;
    } else if (op == 4) {
      const auto len = h.cpu().len_host();
      if (*std::min_element(len.begin(), len.end()) == 0) continue;
      std::vector<int64_t> slot(len.size());
      for (size_t s = 0; s < slot.size(); ++s) slot[s] = kvtest::uniform_int(rng, 0, len[s] - 1);
      KVTEST_STEP(what << " replace",
                  h.replace(kvtest::from_vec(slot, at::kLong).view({c.B, c.H}), rand_tokens(c, 1, rng),
                            rand_tokens(c, 1, rng), at::arange(next, next + c.B, at::kLong), true));
      next += c.B;
    } else if (op <= 6) {
      KVTEST_STEP(what << " compact",
                  h.compact(kvtest::random_mask({h.cpu().capacity()}, op == 5 ? 0.8 : 0.4, rng)));
    } else if (op == 7) {
      KVTEST_STEP(what << " reserve", h.reserve(kvtest::uniform_int(rng, 0, 12)));
    } else if (op == 8) {
      KVTEST_STEP(what << " shrink_to_fit", h.shrink_to_fit());
    } else if (c.C > 0) {
      KVTEST_STEP(what << " set_scores", h.set_scores(h.random_scores(rng)));
    }
    KVTEST_STEP(what << " verify", h.verify());
  }
}

// The eviction loop of a policy: score, select with segmented / grouped top-k, compact.
STORE_SCENARIO(EvictWithTopk) {
  StoreHarness h(c, cuda);
  std::mt19937 rng(c.seed + 7);
  int64_t next = 0;
  for (int round = 0; round < 6; ++round) {
    const int64_t n = kvtest::uniform_int(rng, 1, 30);
    KVTEST_STEP("append block", h.append(rand_tokens(c, n, rng), rand_tokens(c, n, rng),
                                         make_pos(c, n, next, round),
                                         kvtest::random_mask({c.B, c.H, n}, 0.9, rng)));
    next += n;
    const int64_t capacity = h.cpu().capacity();
    // Scores on a coarse grid (many ties) so that the position tie-break matters.
    at::Tensor scores = (kvtest::random_normal({capacity}, at::kFloat, rng) * 2).round_();
    if (c.C > 0) {
      at::Tensor all = h.random_scores(rng);
      all.select(1, 0).copy_(scores);
      KVTEST_STEP("scores", h.set_scores(all));
    }
    const auto start = kvtest::to_vec<int64_t>(h.cpu().start());
    const auto len = kvtest::to_vec<int32_t>(h.cpu().len());
    const auto pos = kvtest::to_vec<int32_t>(h.cpu().pos());
    const auto sc = kvtest::to_vec<float>(scores);
    const int64_t S = c.B * c.H;
    std::vector<bool> want;
    std::vector<int64_t> budget;
    const bool grouped = round % 2 == 1;
    std::vector<int32_t> want_counts;
    if (!grouped) {
      for (int64_t s = 0; s < S; ++s) budget.push_back(kvtest::uniform_int(rng, 0, len[s] + 2));
      want = kvtest::reference_segmented_topk(sc, pos, start, len, budget);
    } else {  // Ada-KV: all heads of a batch item share one budget
      for (int64_t b = 0; b < c.B; ++b) budget.push_back(kvtest::uniform_int(rng, 0, 12 * c.H));
      want = kvtest::reference_grouped_topk(sc, pos, start, len, c.H, budget, want_counts);
    }
    for (size_t i = 0; i < h.num_stores(); ++i) {
      SCOPED_TRACE(::testing::Message() << "selection on " << h.device(i));
      RaggedKVStore& st = h.store(i);
      const at::Tensor sc_d = scores.to(h.device(i));
      const at::Tensor k_d = kvtest::from_vec(budget, at::kLong).to(h.device(i));
      at::Tensor keep;
      if (!grouped) {
        keep = kvcache_ext::segmented_topk(sc_d, st.pos(), st.start(), st.len(), k_d);
      } else {
        at::Tensor counts;
        std::tie(keep, counts) = kvcache_ext::grouped_topk(sc_d, st.pos(), st.start(), st.len(), c.H, k_d);
        EXPECT_EQ(kvtest::to_vec<int32_t>(counts), want_counts);
      }
      EXPECT_EQ(keep.device(), h.device(i));
      EXPECT_TRUE(kvtest::SameKeep(kvtest::to_bools(keep), want));
    }
    if (::testing::Test::HasFailure()) return;
    KVTEST_STEP("compact", h.compact(kvtest::from_bools(want)));
    KVTEST_STEP("after compact", h.verify());
    if (grouped) {
      EXPECT_EQ(h.cpu().len_host(), want_counts);
    }
  }
}

STORE_SCENARIO(BadInputsThrow) {
  StoreHarness h(c, cuda);
  std::mt19937 rng(c.seed + 8);
  const int64_t B = c.B, H = c.H, D = c.D, n = 2;
  KVTEST_STEP("fill", h.append(rand_tokens(c, 4, rng), rand_tokens(c, 4, rng), make_pos(c, 4, 0, 0)));
  KVTEST_STEP("fill", h.append(rand_tokens(c, 3, rng), rand_tokens(c, 3, rng), make_pos(c, 3, 4, 0),
                               kvtest::random_mask({B, H, 3}, 0.5, rng)));
  const auto ptrs = h.ptrs();
  const at::ScalarType other = c.dtype == at::kFloat ? at::kHalf : at::kFloat;
  for (size_t i = 0; i < h.num_stores(); ++i) {
    SCOPED_TRACE(::testing::Message() << "store on " << h.device(i));
    RaggedKVStore& st = h.store(i);
    const at::Device d = h.device(i);
    const auto o = at::TensorOptions().device(d);
    auto tok = [&](int64_t b, int64_t hh, int64_t m, int64_t dd) {
      return at::randn({b, hh, m, dd}, o.dtype(at::kFloat)).to(c.dtype);
    };
    const at::Tensor k = tok(B, H, n, D), v = tok(B, H, n, D);
    const at::Tensor pos = at::arange(n, o.dtype(at::kLong));
    // append
    EXPECT_TRUE(Throws<c10::TypeError>([&] { st.append(k.to(other), v, pos, c10::nullopt); }, "k"));
    EXPECT_TRUE(Throws<c10::TypeError>([&] { st.append(k, v.to(other), pos, c10::nullopt); }, "v"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.append(k[0], v[0], pos, c10::nullopt); }, "k"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.append(tok(B, H + 1, n, D), tok(B, H + 1, n, D), pos, c10::nullopt); }, "k"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.append(tok(B, H, n, D + 1), tok(B, H, n, D + 1), pos, c10::nullopt); }, "k"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.append(k, tok(B, H, n + 1, D), pos, c10::nullopt); }, "v"));
    const at::Tensor strided = tok(B, H, n, 2 * D).slice(3, 0, 2 * D, 2);
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.append(strided, v, pos, c10::nullopt); }, "contiguous"));
    EXPECT_TRUE(Throws<c10::TypeError>([&] { st.append(k, v, pos.to(at::kFloat), c10::nullopt); }, "pos"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.append(k, v, at::zeros({B + 1, n}, o.dtype(at::kLong)), c10::nullopt); }, "pos"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.append(k, v, at::zeros({B, n, 1}, o.dtype(at::kLong)), c10::nullopt); }, "pos"));
    EXPECT_TRUE(Throws<c10::TypeError>([&] { st.append(k, v, pos, at::ones({B, n}, o.dtype(at::kInt))); }, "valid"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.append(k, v, pos, at::ones({B, n + 1}, o.dtype(at::kBool))); }, "valid"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.append(k, v, pos, at::ones({B, H + 1, n}, o.dtype(at::kBool))); }, "valid"));
    // replace
    const at::Tensor k1 = tok(B, H, 1, D), v1 = tok(B, H, 1, D);
    const at::Tensor pos1 = at::full({B}, 100, o.dtype(at::kLong));
    const at::Tensor slot0 = at::zeros({B, H}, o.dtype(at::kLong));
    EXPECT_TRUE(Throws<c10::TypeError>([&] { st.replace(slot0.to(at::kFloat), k1, v1, pos1, true); }, "slot"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.replace(at::zeros({B * H + 1}, o.dtype(at::kLong)), k1, v1, pos1, true); }, "slot"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.replace(slot0, k, v, pos1, true); }, "k"));
    EXPECT_TRUE(Throws<c10::TypeError>([&] { st.replace(slot0, k1.to(other), v1, pos1, true); }, "k"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.replace(slot0, k1, v1, at::zeros({B + 1}, o.dtype(at::kLong)), true); }, "pos"));
    EXPECT_TRUE(Throws<c10::TypeError>([&] { st.replace(slot0, k1, v1, pos1.to(at::kFloat), true); }, "pos"));
    const at::Tensor len = st.len().view({B, H}).to(at::kLong);
    EXPECT_TRUE(Throws<c10::IndexError>([&] { st.replace(len, k1, v1, pos1, true); }, "slot"));
    EXPECT_TRUE(Throws<c10::IndexError>([&] { st.replace(slot0 - 1, k1, v1, pos1, true); }, "slot"));
    // compact
    const int64_t capacity = st.capacity();
    EXPECT_TRUE(Throws<c10::TypeError>([&] { st.compact(at::ones({capacity}, o.dtype(at::kByte))); }, "keep"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.compact(at::ones({capacity + 1}, o.dtype(at::kBool))); }, "keep"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.compact(at::ones({1, capacity}, o.dtype(at::kBool))); }, "keep"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.compact(at::ones({2 * capacity}, o.dtype(at::kBool)).slice(0, 0, 2 * capacity, 2)); }, "contiguous"));
    // reserve
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.reserve(-1); }, "reserve"));
    if (d.is_cuda()) {  // tensors on the wrong device
      const at::Tensor kc = k.cpu(), vc = v.cpu();
      EXPECT_TRUE(Throws<c10::ValueError>([&] { st.append(kc, vc, pos, c10::nullopt); }, "k"));
      EXPECT_TRUE(Throws<c10::ValueError>([&] { st.append(k, vc, pos, c10::nullopt); }, "v"));
      EXPECT_TRUE(Throws<c10::ValueError>([&] { st.append(k, v, pos, at::ones({B, n}, at::kBool)); }, "valid"));
      EXPECT_TRUE(Throws<c10::ValueError>([&] { st.replace(slot0, k1.cpu(), v1, pos1, true); }, "k"));
      EXPECT_TRUE(Throws<c10::ValueError>([&] { st.compact(at::ones({capacity}, at::kBool)); }, "keep"));
    }
  }
  // No failed call may have changed anything.
  KVTEST_STEP("after the failed calls", h.verify());
  EXPECT_EQ(h.ptrs(), ptrs);
  // An empty segment has nothing to replace.
  StoreHarness e(c, cuda);
  at::Tensor only_first = at::zeros({B, H, 1}, at::kBool);
  only_first[0][0].fill_(true);
  KVTEST_STEP("fill one segment", e.append(rand_tokens(c, 1, rng), rand_tokens(c, 1, rng),
                                           make_pos(c, 1, 0, 0), only_first));
  for (size_t i = 0; i < e.num_stores(); ++i) {
    const auto o = at::TensorOptions().device(e.device(i));
    if (B * H > 1) {
      EXPECT_TRUE(Throws<c10::IndexError>(
          [&] {
            e.store(i).replace(at::zeros({B, H}, o.dtype(at::kLong)),
                               at::zeros({B, H, 1, D}, o.dtype(c.dtype)),
                               at::zeros({B, H, 1, D}, o.dtype(c.dtype)),
                               at::zeros({B}, o.dtype(at::kLong)), true);
          },
          "slot"))
          << "replace in an empty segment";
    }
  }
  KVTEST_STEP("after the failed replace", e.verify());
}

// pos of the wrong length: a clear ValueError naming pos (DESIGN: "every entry point checks
// ... shapes and raises a clear error").
STORE_SCENARIO(AppendRejectsWrongPosLength) {
  StoreHarness h(c, cuda);
  std::mt19937 rng(c.seed + 9);
  for (size_t i = 0; i < h.num_stores(); ++i) {
    SCOPED_TRACE(::testing::Message() << "store on " << h.device(i));
    const auto o = at::TensorOptions().device(h.device(i));
    const at::Tensor k = rand_tokens(c, 2, rng).to(h.device(i)), v = rand_tokens(c, 2, rng).to(h.device(i));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { h.store(i).append(k, v, at::arange(3, o.dtype(at::kLong)), c10::nullopt); }, "pos"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { h.store(i).append(k, v, at::arange(1, o.dtype(at::kLong)), c10::nullopt); }, "pos"));
  }
  KVTEST_STEP("after the failed calls", h.verify());
}

// ---- cases ----------------------------------------------------------------------------

std::vector<StoreCase> store_cases() {
  std::vector<StoreCase> cases;
  uint32_t seed = 1;
  for (const at::ScalarType dt : {at::kFloat, at::kHalf, at::kBFloat16}) {
    cases.push_back({dt, 1, 1, 1, 0, 1.5, seed++});   // smallest: one segment, D = 1, no scores
    cases.push_back({dt, 1, 1, 8, 1, 2.0, seed++});
    cases.push_back({dt, 2, 3, 16, 3, 1.25, seed++});
    cases.push_back({dt, 3, 2, 64, 2, 1.5, seed++});
  }
  cases.push_back({at::kHalf, 4, 8, 128, 1, 1.5, seed++});  // a model-like head_dim
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, Store, ::testing::ValuesIn(store_cases()), case_name);

// ---- construction ---------------------------------------------------------------------

void constructor_errors(const at::Device& d) {
  const auto o = at::TensorOptions().device(d);
  const at::Tensor f = at::empty({0}, o.dtype(at::kFloat));
  EXPECT_TRUE(Throws<c10::ValueError>([&] { RaggedKVStore(0, 1, 8, 1, f, 1.5); }, "batch"));
  EXPECT_TRUE(Throws<c10::ValueError>([&] { RaggedKVStore(1, 0, 8, 1, f, 1.5); }, "heads"));
  EXPECT_TRUE(Throws<c10::ValueError>([&] { RaggedKVStore(1, 1, 0, 1, f, 1.5); }, "head_dim"));
  EXPECT_TRUE(Throws<c10::ValueError>([&] { RaggedKVStore(1, 1, 8, -1, f, 1.5); }, "score_channels"));
  EXPECT_TRUE(Throws<c10::ValueError>([&] { RaggedKVStore(1, 1, 8, 1, f, 1.0); }, "growth"));
  EXPECT_TRUE(Throws<c10::ValueError>([&] { RaggedKVStore(1, 1, 8, 1, f, 0.5); }, "growth"));
  EXPECT_TRUE(Throws<c10::ValueError>(
      [&] { RaggedKVStore(1, 1, 8, 1, f, std::numeric_limits<double>::infinity()); }, "growth"));
  EXPECT_TRUE(Throws<c10::ValueError>(
      [&] { RaggedKVStore(1, 1, 8, 1, f, std::numeric_limits<double>::quiet_NaN()); }, "growth"));
  EXPECT_TRUE(Throws<c10::TypeError>([&] { RaggedKVStore(1, 1, 8, 1, f.to(at::kDouble), 1.5); }, "float"));
  EXPECT_TRUE(Throws<c10::TypeError>([&] { RaggedKVStore(1, 1, 8, 1, f.to(at::kInt), 1.5); }, "float"));
  const RaggedKVStore ok(2, 3, 8, 2, f.to(at::kBFloat16), 1.5);
  EXPECT_EQ(ok.k().scalar_type(), at::kBFloat16);
  EXPECT_EQ(ok.k().device(), d);
  EXPECT_EQ(ok.num_segments(), 6);
  EXPECT_EQ(ok.capacity(), 0);
  EXPECT_DOUBLE_EQ(ok.growth(), 1.5);
}

TEST(StoreConstruction, RejectsBadArguments) { constructor_errors(at::kCPU); }

#ifdef KVCACHE_EXT_WITH_CUDA
TEST(StoreConstruction, RejectsBadArgumentsCuda) {
  KVTEST_REQUIRE_CUDA();
  constructor_errors(at::Device(at::kCUDA, 0));
}
#endif

}  // namespace
