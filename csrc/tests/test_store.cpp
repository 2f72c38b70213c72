// The store as the Python RaggedKVStore runs it (kvtest::OpStore: the page allocator and the
// store ops' C++ functions on its state) against a plain host model: one std::vector of tokens
// per segment, and the page bookkeeping the allocator promises (pages per segment, free pages,
// slabs, repacks).
//
// Every scenario runs on the CPU store; its *Cuda twin runs the same operations with the
// same inputs on a CPU store and a CUDA store side by side, checks both against the model
// and the CUDA store's pages and live slots against the CPU store's, byte for byte.
// Every case has a page size (1 to 1024), so that appends, compactions and the kernels
// cross page boundaries, and most scenarios leave the pages fragmented (pages freed by
// compaction and reused by other segments, several slabs).
#include <gtest/gtest.h>

#include <functional>
#include <memory>

#include "ops.h"
#include "tests/store_util.h"
#include "tests/test_util.h"

namespace {

using kvcache_ext::PageAllocator;
using kvtest::OpStore;
using kvtest::ceil_div;
using kvtest::Placement;
using kvtest::Throws;

struct StoreCase {
  at::ScalarType dtype;
  int64_t B, H, D, C;
  int64_t P;  // page size
  uint32_t seed;
};

std::string case_name(const ::testing::TestParamInfo<StoreCase>& info) {
  const StoreCase& c = info.param;
  std::ostringstream s;
  s << kvtest::dtype_name(c.dtype) << "_B" << c.B << "H" << c.H << "D" << c.D << "C" << c.C
    << "_P" << c.P << "_seed" << c.seed;
  return s.str();
}

// One stored token, as the model sees it: raw K/V bytes, position, raw score bits.
struct Token {
  std::vector<uint8_t> k, v;
  int32_t pos;
  std::vector<uint32_t> scores;
};

// The page bookkeeping of the allocator's contract (page_allocator.h): a segment owns the pages
// for its tokens, or for the tokens reserve/repack asked room for; growth takes free pages
// first and allocates the missing ones as one slab, and an append that allocates a slab
// gives every segment pages for page_size / 2 tokens more than it needs (the lookahead);
// compaction gives the pages past a segment's last token back to the free pages; repack
// moves the live tokens into one new slab of exactly the pages asked for, gives back every
// other page, and counts as a repack when it moved a token.
struct PageModel {
  int64_t P = 1;
  std::vector<int64_t> pages;  // per segment
  int64_t num_pages = 0, free = 0, slabs = 0, allocations = 0, repacks = 0;

  void grow(const std::vector<int64_t>& need_tokens, int64_t lookahead) {
    std::vector<int64_t> want = wanted(need_tokens, 0);
    int64_t missing = missing_pages(want);
    if (lookahead > 0 && missing > free) {
      want = wanted(need_tokens, lookahead);
      missing = missing_pages(want);
    }
    pages = want;
    const int64_t reused = std::min(missing, free);
    free -= reused;
    if (missing > reused) {
      num_pages += missing - reused;
      ++slabs;
      ++allocations;
    }
  }
  std::vector<int64_t> wanted(const std::vector<int64_t>& need_tokens, int64_t ahead) const {
    std::vector<int64_t> want(pages.size());
    for (size_t s = 0; s < pages.size(); ++s) want[s] = std::max(pages[s], ceil_div(need_tokens[s] + ahead, P));
    return want;
  }
  int64_t missing_pages(const std::vector<int64_t>& want) const {
    int64_t missing = 0;
    for (size_t s = 0; s < pages.size(); ++s) missing += want[s] - pages[s];
    return missing;
  }
  void compacted(const std::vector<int64_t>& len) {
    for (size_t s = 0; s < pages.size(); ++s) {
      const int64_t keep = ceil_div(len[s], P);
      free += pages[s] - keep;
      pages[s] = keep;
    }
  }
  void repacked(const std::vector<int64_t>& len, int64_t extra) {
    int64_t total = 0, tokens = 0;
    for (size_t s = 0; s < pages.size(); ++s) {
      pages[s] = ceil_div(len[s] + extra, P);
      total += pages[s];
      tokens += len[s];
    }
    num_pages = total;
    free = 0;
    slabs = total > 0 ? 1 : 0;
    allocations += total > 0 ? 1 : 0;
    repacks += tokens > 0 ? 1 : 0;
  }
};

// Drives one CPU store (and optionally one CUDA store) and the model through the same steps.
class StoreHarness {
 public:
  StoreHarness(const StoreCase& c, bool with_cuda) : c_(c), segs_(c.B * c.H) {
    model_.P = c.P;
    model_.pages.assign(S(), 0);
    devices_.emplace_back(at::kCPU);
    if (with_cuda) devices_.emplace_back(at::kCUDA, 0);
    for (const auto& d : devices_) {
      const at::Tensor like = at::empty({0}, at::TensorOptions().dtype(c.dtype).device(d));
      stores_.push_back(std::make_unique<OpStore>(c.B, c.H, c.D, c.C, like, c.P));
    }
  }

  int64_t S() const { return c_.B * c_.H; }
  OpStore& cpu() { return *stores_[0]; }
  size_t num_stores() const { return stores_.size(); }
  OpStore& store(size_t i) { return *stores_[i]; }
  const at::Device& device(size_t i) const { return devices_[i]; }
  const std::vector<Token>& segment(int64_t s) const { return segs_[s]; }
  const PageModel& model() const { return model_; }
  std::vector<int64_t> lens() const {
    std::vector<int64_t> out;
    for (const auto& s : segs_) out.push_back(static_cast<int64_t>(s.size()));
    return out;
  }
  int64_t model_tokens() const {
    int64_t n = 0;
    for (const auto& s : segs_) n += s.size();
    return n;
  }
  std::vector<Placement> placements() const {
    std::vector<Placement> out;
    for (const auto& st : stores_) out.push_back(kvtest::placement(*st));
    return out;
  }

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
    if (n > 0) model_.grow(lens(), c_.P / 2);  // appending nothing allocates nothing
  }

  // slot [B, H] integer (token indices); k, v [B, H, 1, D]; pos [B] or [B, 1].
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

  // keep [capacity] bool in the slot layout (identical on every store: verify checks it).
  // Unordered (stable false): a segment keeping m tokens keeps those among its first m where
  // they are, and the r-th kept token past them takes the r-th evicted place among them.
  void compact(const at::Tensor& keep, bool stable = true) {
    const auto slots = kvtest::live_slots(cpu());
    for (size_t i = 0; i < stores_.size(); ++i) stores_[i]->compact(keep.to(devices_[i]), stable);
    const std::vector<bool> flags = kvtest::to_bools(keep);
    for (int64_t s = 0; s < S(); ++s) {
      const auto kept_at = [&](size_t j) { return flags[slots[s][j]]; };
      std::vector<Token> kept;
      for (size_t j = 0; j < segs_[s].size(); ++j) {
        if (kept_at(j)) kept.push_back(segs_[s][j]);
      }
      if (!stable) {
        const size_t m = kept.size();
        kept.assign(segs_[s].begin(), segs_[s].begin() + static_cast<std::ptrdiff_t>(m));
        size_t hole = 0;
        for (size_t j = m; j < segs_[s].size(); ++j) {
          if (!kept_at(j)) continue;
          while (kept_at(hole)) ++hole;
          kept[hole++] = segs_[s][j];
        }
      }
      segs_[s] = std::move(kept);
    }
    model_.compacted(lens());
  }

  // A keep mask: random flags in every slot (slack rows and free pages too, which compact
  // must ignore), then keep_token(s, j) for token j of segment s.
  at::Tensor keep_mask(std::mt19937& rng, const std::function<bool(int64_t, int64_t)>& keep_token) {
    at::Tensor keep = kvtest::random_mask({cpu().capacity()}, 0.5, rng);
    bool* kp = keep.data_ptr<bool>();
    const auto slots = kvtest::live_slots(cpu());
    for (int64_t s = 0; s < S(); ++s) {
      for (size_t j = 0; j < slots[s].size(); ++j) kp[slots[s][j]] = keep_token(s, j);
    }
    return keep;
  }

  void reserve(int64_t extra) {
    for (auto& st : stores_) st->reserve(extra);
    std::vector<int64_t> need = lens();
    for (auto& n : need) n += extra;
    model_.grow(need, 0);
  }
  void repack(int64_t extra) {
    for (auto& st : stores_) st->repack(extra);
    model_.repacked(lens(), extra);
  }
  void shrink_to_fit() {
    for (auto& st : stores_) st->shrink_to_fit();
    model_.repacked(lens(), 0);
  }

  // Writes values [capacity, C] float32 into every store's score channels (a policy's job).
  void set_scores(const at::Tensor& values) {
    for (size_t i = 0; i < stores_.size(); ++i) stores_[i]->set_scores(values.to(devices_[i]));
    const auto slots = kvtest::live_slots(cpu());
    const std::vector<uint32_t> bits = kvtest::to_vec<uint32_t>(values.contiguous().view(at::kInt));
    for (int64_t s = 0; s < S(); ++s) {
      for (size_t j = 0; j < segs_[s].size(); ++j) {
        const int64_t row = slots[s][j];
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

  // Every segment holds exactly the pages its tokens need, and the bytes held are those
  // pages plus the free ones (and the tables): what append and compact leave when nothing
  // was reserved, and what repack(0) leaves (with no free page).
  // Every segment holds the pages its tokens need and at most the lookahead's one more (a
  // slab an append allocates holds page_size / 2 tokens more per segment); the bytes held
  // are those pages, the free pages and the tables.
  void expect_tight() {
    for (size_t i = 0; i < stores_.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "store on " << devices_[i]);
      const OpStore& st = *stores_[i];
      const std::vector<int32_t> pages = st.pages_host();
      int64_t held = st.free_pages();
      for (int64_t s = 0; s < S(); ++s) {
        const int64_t len = st.len_host()[s];
        EXPECT_GE(pages[s], ceil_div(len, c_.P)) << "segment " << s << " with " << len << " tokens";
        EXPECT_LE(pages[s], ceil_div(len + c_.P / 2, c_.P)) << "segment " << s << " with " << len << " tokens";
        held += pages[s];
      }
      const int64_t page_bytes = kvtest::expected_page_bytes(c_.P, c_.D, at::elementSize(c_.dtype), c_.C);
      EXPECT_EQ(st.nbytes(), held * (page_bytes + 8) + S() * st.page_table().size(1) * 4 + S() * 4)
          << held << " pages (free ones included) of " << page_bytes << " bytes";
    }
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
      OpStore &a = *stores_[0], &b = *stores_[1];
      EXPECT_TRUE(kvtest::BytesEqual(b.page_table(), a.page_table()));
      EXPECT_TRUE(kvtest::BytesEqual(b.len(), a.len()));
      EXPECT_EQ(b.pages_host(), a.pages_host());
      EXPECT_EQ(b.capacity(), a.capacity());
      EXPECT_EQ(b.nbytes(), a.nbytes());
      EXPECT_EQ(b.free_pages(), a.free_pages());
      EXPECT_EQ(b.num_slabs(), a.num_slabs());
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

  static at::Tensor live_index(const OpStore& st) {
    std::vector<int64_t> idx;
    for (const auto& seg : kvtest::live_slots(st)) idx.insert(idx.end(), seg.begin(), seg.end());
    return kvtest::from_vec(idx, at::kLong);
  }

  void verify_store(OpStore& st, const at::Device& d) {
    const int64_t S = this->S();
    ASSERT_TRUE(kvtest::PagingConsistent(st));
    EXPECT_EQ(st.device(), d);
    EXPECT_EQ(st.dtype(), c_.dtype);
    EXPECT_EQ(st.page_size(), c_.P);
    EXPECT_EQ(st.batch(), c_.B);
    EXPECT_EQ(st.heads(), c_.H);
    EXPECT_EQ(st.head_dim(), c_.D);
    EXPECT_EQ(st.score_channels(), c_.C);
    EXPECT_EQ(st.num_segments(), S);
    // The model's bookkeeping.
    std::vector<int32_t> want_len;
    for (const auto& seg : segs_) want_len.push_back(static_cast<int32_t>(seg.size()));
    EXPECT_EQ(st.len_host(), want_len) << "tokens per segment";
    const std::vector<int32_t> pages = st.pages_host();
    EXPECT_EQ(std::vector<int64_t>(pages.begin(), pages.end()), model_.pages) << "pages per segment";
    EXPECT_EQ(st.num_pages(), model_.num_pages) << "pages held";
    EXPECT_EQ(st.free_pages(), model_.free) << "free pages";
    EXPECT_EQ(st.num_slabs(), model_.slabs) << "slabs held";
    EXPECT_EQ(st.slab_allocations(), model_.allocations) << "slab allocations";
    EXPECT_EQ(st.repacks(), model_.repacks) << "repacks";
    if (::testing::Test::HasFailure()) return;
    // The copies in slot layout.
    const int64_t capacity = st.capacity();
    const at::Tensor k = st.k(), v = st.v(), pos = st.pos(), sc = st.scores();
    EXPECT_EQ(k.scalar_type(), c_.dtype);
    EXPECT_EQ(v.scalar_type(), c_.dtype);
    EXPECT_EQ(pos.scalar_type(), at::kInt);
    EXPECT_EQ(sc.scalar_type(), at::kFloat);
    EXPECT_EQ(k.sizes(), at::IntArrayRef({capacity, c_.D}));
    EXPECT_EQ(v.sizes(), at::IntArrayRef({capacity, c_.D}));
    EXPECT_EQ(pos.sizes(), at::IntArrayRef({capacity}));
    EXPECT_EQ(sc.sizes(), at::IntArrayRef({capacity, c_.C}));
    for (const at::Tensor* t : {&k, &v, &pos, &sc}) {
      EXPECT_EQ(t->device(), d);
      EXPECT_TRUE(t->is_contiguous());
    }
    if (::testing::Test::HasFailure()) return;
    // Live tokens, byte for byte, found through the page table.
    const at::Tensor kh = host(k), vh = host(v), ph = host(pos), sh = host(sc);
    const auto* kp = static_cast<const uint8_t*>(kh.data_ptr());
    const auto* vp = static_cast<const uint8_t*>(vh.data_ptr());
    const auto* pp = ph.data_ptr<int32_t>();
    const auto* sp = static_cast<const uint32_t*>(sh.data_ptr());
    const int64_t row = c_.D * at::elementSize(c_.dtype);
    const auto slots = kvtest::live_slots(st);
    int failures = 0;
    for (int64_t s = 0; s < S && failures < 5; ++s) {
      for (size_t j = 0; j < segs_[s].size() && failures < 5; ++j) {
        const int64_t r = slots[s][j];
        const Token& t = segs_[s][j];
        const bool k_ok = std::memcmp(kp + r * row, t.k.data(), row) == 0;
        const bool v_ok = std::memcmp(vp + r * row, t.v.data(), row) == 0;
        const bool p_ok = pp[r] == t.pos;
        const bool s_ok = c_.C == 0 || std::memcmp(sp + r * c_.C, t.scores.data(), 4 * c_.C) == 0;
        if (!(k_ok && v_ok && p_ok && s_ok)) {
          ++failures;
          ADD_FAILURE() << "segment " << s << ", token " << j << " (slot " << r << ", page "
                        << r / c_.P << " row " << r % c_.P << "):" << (k_ok ? "" : " K differs")
                        << (v_ok ? "" : " V differs") << (p_ok ? "" : " pos differs")
                        << (s_ok ? "" : " scores differ") << " (pos " << pp[r] << ", expected "
                        << t.pos << ")";
        }
      }
    }
  }

  StoreCase c_;
  std::vector<at::Device> devices_;
  std::vector<std::unique_ptr<OpStore>> stores_;
  std::vector<std::vector<Token>> segs_;
  PageModel model_;
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

// [B, H, n] mask that stores tokens in segment `only` alone.
at::Tensor only_segment(const StoreCase& c, int64_t n, int64_t only) {
  at::Tensor m = at::zeros({c.B * c.H, n}, at::kBool);
  m[only].fill_(true);
  return m.view({c.B, c.H, n});
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
  StoreHarness h(c, cuda);
  const int64_t S = c.B * c.H;
  KVTEST_STEP("fresh store", h.verify());
  for (size_t i = 0; i < h.num_stores(); ++i) {
    const OpStore& st = h.store(i);
    EXPECT_EQ(st.capacity(), 0);
    EXPECT_EQ(st.num_pages(), 0);
    EXPECT_EQ(st.num_slabs(), 0);
    EXPECT_EQ(st.page_table().sizes(), at::IntArrayRef({S, 0}));
    EXPECT_EQ(st.pages_host(), std::vector<int32_t>(S, 0));
    EXPECT_EQ(st.k().sizes(), at::IntArrayRef({0, c.D}));
  }
  KVTEST_STEP("append n=0", h.append(at::empty({c.B, c.H, 0, c.D}, c.dtype),
                                     at::empty({c.B, c.H, 0, c.D}, c.dtype),
                                     at::empty({0}, at::kLong)));
  KVTEST_STEP("after append n=0", h.verify());
  EXPECT_EQ(h.cpu().capacity(), 0) << "appending nothing must not allocate";
  EXPECT_EQ(h.cpu().slab_allocations(), 0) << "appending nothing must not allocate";
  KVTEST_STEP("compact empty", h.compact(at::empty({0}, at::kBool)));
  KVTEST_STEP("repack(0) empty", h.repack(0));
  KVTEST_STEP("shrink empty", h.shrink_to_fit());
  KVTEST_STEP("reserve(0)", h.reserve(0));
  KVTEST_STEP("after no-ops", h.verify());
  EXPECT_EQ(h.cpu().capacity(), 0);
  EXPECT_EQ(h.cpu().slab_allocations(), 0) << "nothing to hold, nothing allocated";
  EXPECT_EQ(h.cpu().repacks(), 0) << "nothing to move, no repack";
  // Pages without tokens: reserved, then given back by repack.
  KVTEST_STEP("reserve(3) on empty", h.reserve(3));
  KVTEST_STEP("after reserve(3)", h.verify());
  for (const int32_t p : h.cpu().pages_host()) EXPECT_EQ(p, ceil_div(3, c.P));
  EXPECT_EQ(h.cpu().num_tokens(), 0);
  KVTEST_STEP("shrink pages without tokens", h.shrink_to_fit());
  KVTEST_STEP("after shrink", h.verify());
  EXPECT_EQ(h.cpu().capacity(), 0);
  EXPECT_EQ(h.cpu().num_slabs(), 0);
  KVTEST_STEP("tight", h.expect_tight());
}

STORE_SCENARIO(AppendUniform) {
  StoreHarness h(c, cuda);
  std::mt19937 rng(c.seed);
  // Lengths that start, end and cross page boundaries for every page size.
  const std::vector<int64_t> ns = {5, 0, 1, 3, 17, 1, 1, 40, 2, c.P, 2 * c.P + 1};
  int64_t next = 0;
  for (size_t i = 0; i < ns.size(); ++i) {
    const int64_t n = ns[i];
    const at::Tensor k = rand_tokens(c, n, rng), v = rand_tokens(c, n, rng);
    const auto before = h.placements();
    KVTEST_STEP(::testing::Message() << "append #" << i << " n=" << n,
                h.append(k, v, make_pos(c, n, next, i)));
    KVTEST_STEP(::testing::Message() << "after append #" << i, h.verify());
    KVTEST_STEP("tight", h.expect_tight());
    const auto now = h.placements();
    for (size_t s = 0; s < before.size(); ++s) EXPECT_TRUE(kvtest::PagesStayed(before[s], now[s]));
    next += n;
  }
  EXPECT_EQ(h.cpu().num_tokens(), next * c.B * c.H);
  EXPECT_EQ(h.cpu().repacks(), 0);
}

STORE_SCENARIO(AppendValidMask) {
  StoreHarness h(c, cuda);
  std::mt19937 rng(c.seed + 1);
  struct Step { int64_t n; double p; bool per_head; };
  const std::vector<Step> steps = {{6, 0.5, false}, {0, 0.5, true},  {1, 0.5, true},
                                   {9, 0.0, false}, {9, 1.0, true},  {13, 0.3, true},
                                   {1, 0.0, true},  {30, 0.7, false}, {4, 0.5, true},
                                   {3 * c.P + 2, 0.6, true}};
  int64_t next = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto& st = steps[i];
    const at::Tensor k = rand_tokens(c, st.n, rng), v = rand_tokens(c, st.n, rng);
    const at::Tensor valid = st.per_head ? kvtest::random_mask({c.B, c.H, st.n}, st.p, rng)
                                         : kvtest::random_mask({c.B, st.n}, st.p, rng);
    const auto before = h.placements();
    KVTEST_STEP(::testing::Message() << "masked append #" << i << " n=" << st.n,
                h.append(k, v, make_pos(c, st.n, next, i), valid));
    KVTEST_STEP(::testing::Message() << "after masked append #" << i, h.verify());
    KVTEST_STEP("tight", h.expect_tight());
    const auto now = h.placements();
    for (size_t s = 0; s < before.size(); ++s) EXPECT_TRUE(kvtest::PagesStayed(before[s], now[s]));
    next += st.n;
  }
}

// Token-by-token decode: a segment grows by one page when its last page is full, taking a
// free page if there is one, else allocating (with the lookahead); no token ever moves
// (repacks() stays 0), and the contents stay exactly the model's. Variants: every segment decodes; only segment 0
// does; every segment decodes with an eviction every 16 steps (free pages to reuse).
STORE_SCENARIO(DecodeGrowsByWholePages) {
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE(variant == 0 ? "every segment decodes"
                 : variant == 1 ? "only segment 0 decodes"
                                : "every segment decodes, evicting every 16 steps");
    StoreHarness h(c, cuda);
    std::mt19937 rng(c.seed + 2 + variant);
    // Large pages: a prompt that nearly fills the first page, so that decoding crosses it.
    const int64_t prompt = c.P <= 16 ? kvtest::uniform_int(rng, 0, 20) : c.P - kvtest::uniform_int(rng, 1, 20);
    const int64_t steps = std::min<int64_t>(std::max<int64_t>(120, 3 * c.P + 5), 300);
    // Pages for the prompt first (exactly those: reserve has no lookahead), so that the
    // prompt's append allocates nothing and the first page is the prompt's only one.
    KVTEST_STEP("reserve", h.reserve(prompt));
    KVTEST_STEP("prompt", h.append(rand_tokens(c, prompt, rng), rand_tokens(c, prompt, rng),
                                   make_pos(c, prompt, 0, 0)));
    int64_t next = prompt, new_pages = 0, reused_pages = 0;
    for (int64_t i = 0; i < steps; ++i) {
      ::testing::Message what;
      what << "step " << i;
      c10::optional<at::Tensor> valid;
      if (variant == 1) valid = only_segment(c, 1, 0);
      const auto before = h.placements();
      KVTEST_STEP(what << " decode", h.append(rand_tokens(c, 1, rng), rand_tokens(c, 1, rng),
                                              make_pos(c, 1, next, i), valid));
      next += 1;
      KVTEST_STEP(what << " after decode", h.verify());
      KVTEST_STEP(what << " tight", h.expect_tight());
      const auto now = h.placements();
      for (size_t d = 0; d < before.size(); ++d) {
        const Placement &b = before[d], &a = now[d];
        EXPECT_EQ(a.repacks, 0) << "decoding must never repack";
        EXPECT_TRUE(kvtest::PagesStayed(b, a));
        // One more page for the segments whose pages were full, from the free pages, else
        // from a slab that also holds the next page of every segment with fewer than
        // page_size / 2 free slots left.
        int64_t needed = 0, grew = 0;
        for (size_t s = 0; s < b.pages.size(); ++s) needed += a.len[s] > b.pages[s] * c.P ? 1 : 0;
        const bool allocates = needed > b.free_pages;
        for (size_t s = 0; s < b.pages.size(); ++s) {
          const bool full = a.len[s] > b.pages[s] * c.P;
          const bool ahead = allocates && b.pages[s] * c.P - a.len[s] < c.P / 2;
          EXPECT_EQ(a.pages[s] - b.pages[s], full || ahead ? 1 : 0) << "segment " << s;
          grew += a.pages[s] - b.pages[s];
        }
        const int64_t reused = std::min(grew, b.free_pages);
        EXPECT_EQ(a.num_pages - b.num_pages, grew - reused) << "free pages are taken first";
        EXPECT_EQ(a.slab_allocations - b.slab_allocations, grew > reused ? 1 : 0);
        if (d == 0) {
          new_pages += grew;
          reused_pages += reused;
        }
      }
      if (::testing::Test::HasFailure()) return;
      if (variant == 2 && i % 16 == 15) {
        KVTEST_STEP(what << " evict", h.compact(h.keep_mask(rng, [&](int64_t, int64_t) {
          return kvtest::uniform_int(rng, 0, 9) < 6;
        })));
        KVTEST_STEP(what << " after evict", h.verify());
      }
    }
    EXPECT_GT(new_pages, 0) << "the scenario must cross page boundaries";
    if (variant == 2 && c.P <= 16) {
      EXPECT_GT(reused_pages, 0) << "the scenario must reuse freed pages";
    }
    EXPECT_EQ(h.cpu().repacks(), 0);
  }
}

STORE_SCENARIO(Replace) {
  StoreHarness h(c, cuda);
  std::mt19937 rng(c.seed + 3);
  int64_t next = 0;
  // Every segment needs >= 1 live token; lengths differ per segment after the masked append.
  const int64_t n0 = kvtest::uniform_int(rng, 1, 6);
  KVTEST_STEP("prompt", h.append(rand_tokens(c, n0, rng), rand_tokens(c, n0, rng), make_pos(c, n0, 0, 0)));
  next += n0;
  const int64_t n1 = 7 + 2 * c.P;
  KVTEST_STEP("masked", h.append(rand_tokens(c, n1, rng), rand_tokens(c, n1, rng), make_pos(c, n1, next, 1),
                                 kvtest::random_mask({c.B, c.H, n1}, 0.5, rng)));
  next += n1;
  // Fragment: evict most tokens, then grow again into the freed pages.
  KVTEST_STEP("evict", h.compact(h.keep_mask(rng, [&](int64_t, int64_t j) {
    return j == 0 || kvtest::uniform_int(rng, 0, 3) == 0;
  })));
  KVTEST_STEP("regrow", h.append(rand_tokens(c, 5, rng), rand_tokens(c, 5, rng), make_pos(c, 5, next, 2),
                                 kvtest::random_mask({c.B, c.H, 5}, 0.7, rng)));
  next += 5;
  if (c.C > 0) KVTEST_STEP("scores", h.set_scores(h.random_scores(rng)));
  KVTEST_STEP("before replace", h.verify());
  const auto before = h.placements();
  for (int round = 0; round < 12; ++round) {
    const auto len = kvtest::to_vec<int32_t>(h.cpu().len());
    std::vector<int64_t> slot(c.B * c.H);
    for (size_t s = 0; s < slot.size(); ++s) {
      // The first and last token of a segment half the time: page boundaries.
      const int64_t pick = kvtest::uniform_int(rng, 0, 3);
      slot[s] = pick == 0 ? 0 : pick == 1 ? len[s] - 1 : kvtest::uniform_int(rng, 0, len[s] - 1);
    }
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
  const auto after = h.placements();
  for (size_t d = 0; d < before.size(); ++d) {
    EXPECT_TRUE(kvtest::SamePlacement(before[d], after[d])) << "replace must write in place";
  }
}

// Compaction keeps the kept tokens in order, in the pages they were in (no page moves),
// and gives back whole pages: free_pages() grows by the pages past each segment's new last
// token, num_pages() does not change. The next append takes those free pages before it
// allocates anything.
STORE_SCENARIO(CompactStableInPlace) {
  StoreHarness h(c, cuda);
  std::mt19937 rng(c.seed + 4);
  int64_t next = 0;
  for (int i = 0; i < 3; ++i) {
    const int64_t n = kvtest::uniform_int(rng, 1, 25) + c.P;
    KVTEST_STEP("fill", h.append(rand_tokens(c, n, rng), rand_tokens(c, n, rng), make_pos(c, n, next, i),
                                 kvtest::random_mask({c.B, c.H, n}, 0.8, rng)));
    next += n;
  }
  const std::vector<double> p_keep = {0.5, 1.0, 0.9, 0.3, 0.0, 0.6};
  int64_t freed_total = 0;
  for (size_t round = 0; round < p_keep.size(); ++round) {
    if (c.C > 0) KVTEST_STEP("scores", h.set_scores(h.random_scores(rng)));
    const auto before = h.placements();
    // Flags in slack rows and free pages are random too: compact must ignore them.
    const at::Tensor keep = kvtest::random_mask({h.cpu().capacity()}, p_keep[round], rng);
    KVTEST_STEP(::testing::Message() << "compact round " << round << " p_keep=" << p_keep[round],
                h.compact(keep));
    KVTEST_STEP(::testing::Message() << "after compact round " << round, h.verify());
    KVTEST_STEP("tight", h.expect_tight());
    const auto now = h.placements();
    for (size_t d = 0; d < before.size(); ++d) {
      const Placement &b = before[d], &a = now[d];
      EXPECT_TRUE(kvtest::PagesStayed(b, a)) << "compact must work in place";
      EXPECT_EQ(a.num_pages, b.num_pages) << "compact gives pages back to the store, not to the allocator";
      EXPECT_EQ(a.slab_allocations, b.slab_allocations);
      EXPECT_EQ(a.num_slabs, b.num_slabs);
      int64_t freed = 0;
      for (size_t s = 0; s < b.pages.size(); ++s) freed += b.pages[s] - a.pages[s];
      EXPECT_EQ(a.free_pages - b.free_pages, freed) << "every page left empty is free again";
      if (d == 0) freed_total += freed;
    }
    if (round == 1) {  // p_keep = 1: nothing changes at all
      for (size_t d = 0; d < before.size(); ++d) EXPECT_TRUE(kvtest::SamePlacement(before[d], now[d]));
    }
    // Appending after a compaction takes the freed pages first.
    const int64_t n = kvtest::uniform_int(rng, 0, 3) + (round % 2) * c.P;
    KVTEST_STEP("append after compact",
                h.append(rand_tokens(c, n, rng), rand_tokens(c, n, rng), make_pos(c, n, next, round)));
    next += n;
    KVTEST_STEP("after append", h.verify());
    const auto grown = h.placements();
    for (size_t d = 0; d < grown.size(); ++d) {
      int64_t missing = 0;
      for (size_t s = 0; s < grown[d].pages.size(); ++s) missing += grown[d].pages[s] - now[d].pages[s];
      if (missing <= now[d].free_pages) {
        EXPECT_EQ(grown[d].slab_allocations, now[d].slab_allocations)
            << missing << " new pages, " << now[d].free_pages << " free: nothing to allocate";
        EXPECT_EQ(grown[d].num_pages, now[d].num_pages);
      }
    }
  }
  EXPECT_GT(freed_total, 0) << "the scenario must free pages";
}

// Segments of hundreds of tokens: compaction in several tiles (the CUDA kernel stages at
// most 256 tokens at a time), with a fully kept prefix that does not move.
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
    const at::Tensor keep = h.keep_mask(rng, [&](int64_t, int64_t j) {
      return j < prefixes[round] || std::bernoulli_distribution(p_keep[round])(rng);
    });
    KVTEST_STEP(::testing::Message() << "compact round " << round, h.compact(keep));
    KVTEST_STEP(::testing::Message() << "after compact round " << round, h.verify());
    // Regrow into the freed pages, so that the next round compacts fragmented segments.
    const int64_t m = kvtest::uniform_int(rng, 1, 60);
    KVTEST_STEP("regrow", h.append(rand_tokens(c, m, rng), rand_tokens(c, m, rng),
                                   make_pos(c, m, n + 100 * round, 0),
                                   kvtest::random_mask({c.B, c.H, m}, 0.8, rng)));
    KVTEST_STEP("after regrow", h.verify());
  }
}

// Unordered compaction (store_compact with stable false, per-step eviction's): random flags,
// nothing evicted, almost everything evicted, and one token evicted per segment (a decode
// step's eviction: one token moves, the segment's last kept one, into the evicted place).
STORE_SCENARIO(CompactUnordered) {
  StoreHarness h(c, cuda);
  std::mt19937 rng(c.seed + 20);
  const int64_t n = 300;
  KVTEST_STEP("fill", h.append(rand_tokens(c, n, rng), rand_tokens(c, n, rng), make_pos(c, n, 0, 0),
                               kvtest::random_mask({c.B, c.H, n}, 0.9, rng)));
  if (c.C > 0) KVTEST_STEP("scores", h.set_scores(h.random_scores(rng)));
  const std::vector<double> p_keep = {0.5, 1.0, 0.05, -1.0, 0.9};  // -1: one evicted per segment
  for (size_t round = 0; round < p_keep.size(); ++round) {
    const std::vector<int64_t> lens = h.lens();
    std::vector<int64_t> evicted(lens.size());
    for (size_t s = 0; s < lens.size(); ++s) evicted[s] = lens[s] ? kvtest::uniform_int(rng, 0, lens[s] - 1) : -1;
    const at::Tensor keep = h.keep_mask(rng, [&](int64_t s, int64_t j) {
      return p_keep[round] < 0 ? j != evicted[s] : std::bernoulli_distribution(p_keep[round])(rng);
    });
    KVTEST_STEP(::testing::Message() << "unordered compact round " << round, h.compact(keep, false));
    KVTEST_STEP(::testing::Message() << "after unordered compact round " << round, h.verify());
    const int64_t m = kvtest::uniform_int(rng, 1, 40);
    KVTEST_STEP("regrow", h.append(rand_tokens(c, m, rng), rand_tokens(c, m, rng),
                                   make_pos(c, m, n + 100 * round, 0),
                                   kvtest::random_mask({c.B, c.H, m}, 0.8, rng)));
    KVTEST_STEP("after regrow", h.verify());
  }
}

// reserve(e): pages for e more tokens per segment, so that appending them allocates nothing
// and moves nothing. repack(e): the live tokens move into one slab with pages for e more
// tokens per segment, every other page is given back (free_pages() == 0), repacks() counts it.
STORE_SCENARIO(ReserveAndRepack) {
  StoreHarness h(c, cuda);
  std::mt19937 rng(c.seed + 5);
  int64_t next = 0;
  KVTEST_STEP("reserve on empty", h.reserve(3));
  KVTEST_STEP("after reserve on empty", h.verify());
  for (int32_t p : h.cpu().pages_host()) EXPECT_EQ(p, ceil_div(3, c.P));
  KVTEST_STEP("fill", h.append(rand_tokens(c, 9, rng), rand_tokens(c, 9, rng), make_pos(c, 9, 0, 0),
                               kvtest::random_mask({c.B, c.H, 9}, 0.6, rng)));
  next += 9;
  if (c.C > 0) KVTEST_STEP("scores", h.set_scores(h.random_scores(rng)));
  auto before = h.placements();
  KVTEST_STEP("reserve(0)", h.reserve(0));
  for (size_t d = 0; d < before.size(); ++d) {
    EXPECT_TRUE(kvtest::SamePlacement(before[d], h.placements()[d])) << "reserve(0) must change nothing";
  }
  // reserve(e): e more tokens per segment fit without any allocation.
  const int64_t extra = 25;
  KVTEST_STEP("reserve", h.reserve(extra));
  KVTEST_STEP("after reserve", h.verify());
  {
    const auto len = h.cpu().len_host();
    const auto pages = h.cpu().pages_host();
    for (size_t s = 0; s < len.size(); ++s) {
      EXPECT_EQ(pages[s], ceil_div(len[s] + extra, c.P)) << "segment " << s << ": new pages only where needed";
    }
  }
  before = h.placements();
  KVTEST_STEP("append into reserve", h.append(rand_tokens(c, 10, rng), rand_tokens(c, 10, rng),
                                              make_pos(c, 10, next, 1)));
  next += 10;
  for (int i = 0; i < 15; ++i) {
    KVTEST_STEP("decode into reserve", h.append(rand_tokens(c, 1, rng), rand_tokens(c, 1, rng),
                                                make_pos(c, 1, next, 2)));
    next += 1;
  }
  KVTEST_STEP("after filling the reserve", h.verify());
  for (size_t d = 0; d < before.size(); ++d) {
    const Placement now = h.placements()[d];
    EXPECT_EQ(now.table.ids, before[d].table.ids) << "appending what reserve() made room for takes no page";
    EXPECT_EQ(now.addresses, before[d].addresses);
    EXPECT_EQ(now.slab_allocations, before[d].slab_allocations);
  }
  // Compact, then repack: contents kept, only the pages needed held, nothing free.
  KVTEST_STEP("compact", h.compact(kvtest::random_mask({h.cpu().capacity()}, 0.5, rng)));
  KVTEST_STEP("append after compact", h.append(rand_tokens(c, 2, rng), rand_tokens(c, 2, rng),
                                               make_pos(c, 2, next, 0),
                                               kvtest::random_mask({c.B, c.H, 2}, 0.5, rng)));
  next += 2;
  const int64_t bytes_before = h.cpu().nbytes();
  const int64_t repacks_before = h.cpu().repacks();
  KVTEST_STEP("shrink_to_fit", h.shrink_to_fit());
  KVTEST_STEP("after shrink_to_fit", h.verify());
  KVTEST_STEP("tight after shrink_to_fit", h.expect_tight());
  for (size_t d = 0; d < h.num_stores(); ++d) {
    const OpStore& st = h.store(d);
    EXPECT_EQ(st.free_pages(), 0);
    EXPECT_EQ(st.repacks(), repacks_before + (st.num_tokens() > 0 ? 1 : 0));
    EXPECT_LE(st.nbytes(), bytes_before);
    EXPECT_LE(st.num_slabs(), 1);
  }
  // repack(e) gives room for e more tokens.
  const int64_t room = 2 * c.P + 1;
  KVTEST_STEP("repack with room", h.repack(room));
  KVTEST_STEP("after repack with room", h.verify());
  for (size_t s = 0; s < h.cpu().pages_host().size(); ++s) {
    EXPECT_EQ(h.cpu().pages_host()[s], ceil_div(h.cpu().len_host()[s] + room, c.P));
  }
  EXPECT_EQ(h.cpu().free_pages(), 0);
  before = h.placements();
  KVTEST_STEP("append into the room", h.append(rand_tokens(c, room, rng), rand_tokens(c, room, rng),
                                               make_pos(c, room, next, 1)));
  next += room;
  KVTEST_STEP("after append into the room", h.verify());
  for (size_t d = 0; d < before.size(); ++d) {
    EXPECT_TRUE(kvtest::PagesStayed(before[d], h.placements()[d]));
    EXPECT_EQ(h.placements()[d].slab_allocations, before[d].slab_allocations);
  }
  // Keep nothing, repack to nothing, start over.
  KVTEST_STEP("compact to empty", h.compact(at::zeros({h.cpu().capacity()}, at::kBool)));
  KVTEST_STEP("shrink to empty", h.shrink_to_fit());
  KVTEST_STEP("after shrink to empty", h.verify());
  EXPECT_EQ(h.cpu().capacity(), 0);
  EXPECT_EQ(h.cpu().nbytes(), c.B * c.H * 4) << "only the lengths are left";
  KVTEST_STEP("append after emptying", h.append(rand_tokens(c, 2, rng), rand_tokens(c, 2, rng),
                                                make_pos(c, 2, next, 1)));
  KVTEST_STEP("after append after emptying", h.verify());
}

// Fragmented pages: pages freed by one segment are taken by another (out of id order), a
// second and a third slab are allocated when the free pages run out, and every kernel keeps
// working on tokens spread over all of them; repack then gathers everything in one slab.
STORE_SCENARIO(FragmentedPages) {
  StoreHarness h(c, cuda);
  std::mt19937 rng(c.seed + 11);
  const int64_t S = c.B * c.H, last = S - 1;
  int64_t next = 0;
  const int64_t n0 = 6 * c.P + 3;
  KVTEST_STEP("fill", h.append(rand_tokens(c, n0, rng), rand_tokens(c, n0, rng), make_pos(c, n0, 0, 0)));
  next += n0;
  KVTEST_STEP("after fill", h.verify());
  EXPECT_EQ(h.cpu().num_slabs(), 1);
  // Evict most tokens; the last segment keeps its first token, so it keeps its first page.
  auto before = h.placements();
  KVTEST_STEP("evict", h.compact(h.keep_mask(rng, [&](int64_t s, int64_t j) {
    return (s == last && j == 0) || kvtest::uniform_int(rng, 0, 5) == 0;
  })));
  KVTEST_STEP("after evict", h.verify());
  KVTEST_STEP("tight after evict", h.expect_tight());
  const int64_t free_after_evict = h.cpu().free_pages();
  ASSERT_GT(free_after_evict, 0) << "the eviction must free pages";
  for (size_t d = 0; d < before.size(); ++d) {
    EXPECT_EQ(h.placements()[d].num_pages, before[d].num_pages);
    EXPECT_TRUE(kvtest::PagesStayed(before[d], h.placements()[d]));
  }
  // Only the last segment grows, by exactly the free pages: every free page is reused,
  // nothing is allocated.
  before = h.placements();
  const int64_t slack = h.cpu().pages_host()[last] * c.P - h.cpu().len_host()[last];
  const int64_t m = slack + free_after_evict * c.P;
  KVTEST_STEP("grow into the free pages",
              h.append(rand_tokens(c, m, rng), rand_tokens(c, m, rng), make_pos(c, m, next, 1),
                       only_segment(c, m, last)));
  next += m;
  KVTEST_STEP("after growing into the free pages", h.verify());
  for (size_t d = 0; d < before.size(); ++d) {
    const Placement now = h.placements()[d];
    EXPECT_EQ(now.free_pages, 0);
    EXPECT_EQ(now.num_pages, before[d].num_pages) << "free pages suffice: nothing to allocate";
    EXPECT_EQ(now.slab_allocations, before[d].slab_allocations);
    EXPECT_TRUE(kvtest::PagesStayed(before[d], now));
  }
  if (S > 1) {
    EXPECT_TRUE(kvtest::pages_out_of_order(h.cpu()))
        << "the last segment must have taken pages freed by the others";
  }
  // Every segment grows: the free pages are gone, so a second slab is allocated.
  before = h.placements();
  const int64_t m2 = 2 * c.P + 1;
  KVTEST_STEP("grow past the free pages",
              h.append(rand_tokens(c, m2, rng), rand_tokens(c, m2, rng), make_pos(c, m2, next, 2),
                       kvtest::random_mask({c.B, c.H, m2}, 0.9, rng)));
  next += m2;
  KVTEST_STEP("after growing past the free pages", h.verify());
  EXPECT_EQ(h.cpu().num_slabs(), 2);
  for (size_t d = 0; d < before.size(); ++d) {
    EXPECT_TRUE(kvtest::PagesStayed(before[d], h.placements()[d])) << "growth moves no page";
  }
  // Scores in every slot, then evict again and grow by more than is free: the free pages
  // are taken and the rest is a third slab.
  if (c.C > 0) KVTEST_STEP("scores", h.set_scores(h.random_scores(rng)));
  KVTEST_STEP("evict again", h.compact(h.keep_mask(rng, [&](int64_t, int64_t) {
    return kvtest::uniform_int(rng, 0, 2) == 0;
  })));
  KVTEST_STEP("after evicting again", h.verify());
  before = h.placements();
  const int64_t m3 = (h.cpu().free_pages() / std::max<int64_t>(S, 1) + 2) * c.P;
  KVTEST_STEP("grow past the free pages again",
              h.append(rand_tokens(c, m3, rng), rand_tokens(c, m3, rng), make_pos(c, m3, next, 0)));
  next += m3;
  KVTEST_STEP("after growing past the free pages again", h.verify());
  EXPECT_EQ(h.cpu().free_pages(), 0);
  EXPECT_EQ(h.cpu().num_slabs(), 3);
  EXPECT_EQ(h.cpu().slab_allocations(), before[0].slab_allocations + 1) << "one slab per growth";
  // Replace and compact across the slabs.
  std::vector<int64_t> slot(S);
  for (int64_t s = 0; s < S; ++s) slot[s] = kvtest::uniform_int(rng, 0, h.cpu().len_host()[s] - 1);
  KVTEST_STEP("replace", h.replace(kvtest::from_vec(slot, at::kLong).view({c.B, c.H}),
                                   rand_tokens(c, 1, rng), rand_tokens(c, 1, rng),
                                   at::arange(next, next + c.B, at::kLong), true));
  KVTEST_STEP("compact across slabs", h.compact(kvtest::random_mask({h.cpu().capacity()}, 0.7, rng)));
  KVTEST_STEP("after replace and compact", h.verify());
  // Repack: same tokens, one slab, no free page.
  KVTEST_STEP("repack", h.repack(0));
  KVTEST_STEP("after repack", h.verify());
  KVTEST_STEP("tight after repack", h.expect_tight());
  EXPECT_EQ(h.cpu().num_slabs(), 1);
  EXPECT_EQ(h.cpu().free_pages(), 0);
  EXPECT_EQ(h.cpu().repacks(), 1);
}

// A random mix of every operation, checked after each.
STORE_SCENARIO(RandomOperations) {
  StoreHarness h(c, cuda);
  std::mt19937 rng(c.seed + 6);
  int64_t next = 0;
  for (int step = 0; step < 60; ++step) {
    const int op = static_cast<int>(kvtest::uniform_int(rng, 0, 10));
    ::testing::Message what;
    what << "step " << step << " op " << op;
    if (op <= 3) {
      const int64_t n = kvtest::uniform_int(rng, 0, op == 0 ? 20 + c.P : 2);
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
      KVTEST_STEP(what << " repack", h.repack(kvtest::uniform_int(rng, 0, 1) * kvtest::uniform_int(rng, 0, 9)));
    } else if (op == 9) {
      KVTEST_STEP(what << " shrink_to_fit", h.shrink_to_fit());
    } else if (c.C > 0) {
      KVTEST_STEP(what << " set_scores", h.set_scores(h.random_scores(rng)));
    }
    KVTEST_STEP(what << " verify", h.verify());
  }
}

// An eviction loop through the slot-layout top-k ops: score, gather the live tokens segment by
// segment (segmented_topk / grouped_topk take contiguous segments), select, scatter the flags
// back to the slot layout, compact. (RaggedKVStore.select reads through the pages instead, with
// store_topk: test_store_topk.cpp.)
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
    // The live tokens packed segment by segment.
    const auto slots = kvtest::live_slots(h.cpu());
    std::vector<int64_t> packed_slots, start;
    std::vector<int32_t> len;
    for (const auto& seg : slots) {
      start.push_back(static_cast<int64_t>(packed_slots.size()));
      len.push_back(static_cast<int32_t>(seg.size()));
      packed_slots.insert(packed_slots.end(), seg.begin(), seg.end());
    }
    const at::Tensor index = kvtest::from_vec(packed_slots, at::kLong);
    const auto pos = kvtest::to_vec<int32_t>(h.cpu().pos().index_select(0, index));
    const auto sc = kvtest::to_vec<float>(scores.index_select(0, index));
    const int64_t S = c.B * c.H;
    std::vector<bool> want_packed;
    std::vector<int64_t> budget;
    const bool grouped = round % 2 == 1;
    std::vector<int32_t> want_counts;
    if (!grouped) {
      for (int64_t s = 0; s < S; ++s) budget.push_back(kvtest::uniform_int(rng, 0, len[s] + 2));
      want_packed = kvtest::reference_segmented_topk(sc, pos, start, len, budget);
    } else {  // Ada-KV: all heads of a batch item share one budget
      for (int64_t b = 0; b < c.B; ++b) budget.push_back(kvtest::uniform_int(rng, 0, 12 * c.H));
      want_packed = kvtest::reference_grouped_topk(sc, pos, start, len, c.H, budget, want_counts);
    }
    std::vector<bool> want(capacity, false);
    for (size_t j = 0; j < packed_slots.size(); ++j) want[packed_slots[j]] = want_packed[j];
    for (size_t i = 0; i < h.num_stores(); ++i) {
      SCOPED_TRACE(::testing::Message() << "selection on " << h.device(i));
      OpStore& st = h.store(i);
      const at::Device d = h.device(i);
      const at::Tensor index_d = index.to(d);
      const at::Tensor sc_d = scores.to(d).index_select(0, index_d);
      const at::Tensor pos_d = st.pos().index_select(0, index_d);
      const at::Tensor start_d = kvtest::from_vec(start, at::kLong).to(d);
      const at::Tensor len_d = kvtest::from_vec(len, at::kInt).to(d);
      const at::Tensor k_d = kvtest::from_vec(budget, at::kLong).to(d);
      at::Tensor kept;
      if (!grouped) {
        kept = kvcache_ext::ops::segmented_topk(sc_d, pos_d, start_d, len_d, k_d);
      } else {
        at::Tensor counts;
        std::tie(kept, counts) = kvcache_ext::ops::grouped_topk(sc_d, pos_d, start_d, len_d, c.H, k_d);
        EXPECT_EQ(kvtest::to_vec<int32_t>(counts), want_counts);
      }
      EXPECT_EQ(kept.device(), d);
      at::Tensor keep = at::zeros({capacity}, at::TensorOptions().dtype(at::kBool).device(d));
      keep.index_copy_(0, index_d, kept);
      EXPECT_TRUE(kvtest::SameKeep(kvtest::to_bools(keep), want));
    }
    // The store's own selection (CPU): through its pages, with the scores in slot layout,
    // padded with a spare column, or (C > 0) read from channel 0 of the store.
    {
      const OpStore& st = h.cpu();
      int64_t longest = 0;
      for (const int32_t l : len) longest = std::max<int64_t>(longest, l);
      at::Tensor padded = at::full({S, longest + 1}, std::numeric_limits<float>::quiet_NaN(), at::kFloat);
      for (int64_t s = 0; s < S; ++s) {
        for (int64_t i = 0; i < len[s]; ++i) padded[s][i] = sc[start[s] + i];
      }
      std::vector<c10::optional<at::Tensor>> sources = {scores, padded.view({c.B, c.H, longest + 1})};
      if (c.C > 0) sources.push_back(c10::nullopt);
      for (size_t i = 0; i < sources.size(); ++i) {
        SCOPED_TRACE(::testing::Message() << "the store_topk op, scores source " << i);
        const auto [keep, counts] = st.select(sources[i], kvtest::from_vec(budget, at::kLong), grouped);
        EXPECT_TRUE(kvtest::SameKeep(kvtest::to_bools(keep), want));
        if (grouped) {
          EXPECT_EQ(kvtest::to_vec<int32_t>(counts), want_counts);
        }
      }
    }
    if (::testing::Test::HasFailure()) return;
    KVTEST_STEP("compact", h.compact(kvtest::from_bools(want)));
    KVTEST_STEP("after compact", h.verify());
    if (grouped) {
      EXPECT_EQ(h.cpu().len_host(), want_counts);
    }
  }
}

// k(), v(), pos(), scores(), len() and page_table() are copies: writing to them changes
// nothing in the store, and each call gives a new tensor.
STORE_SCENARIO(AccessorsReturnCopies) {
  StoreHarness h(c, cuda);
  std::mt19937 rng(c.seed + 12);
  // Writes to every copy the store hands out, then checks that the store is as it was.
  auto write_to_copies = [&] {
    const auto before = h.placements();
    for (size_t i = 0; i < h.num_stores(); ++i) {
      SCOPED_TRACE(::testing::Message() << "store on " << h.device(i));
      OpStore& st = h.store(i);
      if (st.capacity() > 0) {
        EXPECT_NE(st.k().data_ptr(), st.k().data_ptr()) << "k() must return a new copy";
        EXPECT_NE(st.pos().data_ptr(), st.pos().data_ptr()) << "pos() must return a new copy";
      }
      st.k().fill_(7);
      st.v().fill_(-7);
      st.pos().fill_(-1);
      st.scores().fill_(42);
      st.len().fill_(0);
      st.page_table().fill_(0);
      at::Tensor k = st.k();
      k.mul_(2);
    }
    KVTEST_STEP("after writing to the copies", h.verify());
    const auto after = h.placements();
    for (size_t d = 0; d < before.size(); ++d) EXPECT_TRUE(kvtest::SamePlacement(before[d], after[d]));
  };
  KVTEST_STEP("empty store", write_to_copies());
  const int64_t n = 2 * c.P + 3;
  KVTEST_STEP("fill", h.append(rand_tokens(c, n, rng), rand_tokens(c, n, rng), make_pos(c, n, 0, 1),
                               kvtest::random_mask({c.B, c.H, n}, 0.7, rng)));
  if (c.C > 0) KVTEST_STEP("scores", h.set_scores(h.random_scores(rng)));
  KVTEST_STEP("one slab", write_to_copies());
  KVTEST_STEP("evict", h.compact(kvtest::random_mask({h.cpu().capacity()}, 0.5, rng)));
  KVTEST_STEP("regrow", h.append(rand_tokens(c, n, rng), rand_tokens(c, n, rng), make_pos(c, n, n, 1)));
  if (c.C > 0) KVTEST_STEP("scores", h.set_scores(h.random_scores(rng)));
  KVTEST_STEP("several slabs", write_to_copies());
  KVTEST_STEP("repack", h.repack(0));
  KVTEST_STEP("repacked", write_to_copies());
  KVTEST_STEP("single token", h.compact(h.keep_mask(rng, [](int64_t, int64_t j) { return j == 0; })));
  KVTEST_STEP("repack to one page per segment", h.repack(0));
  KVTEST_STEP("one page per segment", write_to_copies());
}

// set_scores writes every slot's channels; scores() reads them back, bit for bit, whatever
// page and slab the slot is in and whatever the strides of the input. New tokens start
// with zero scores; kept tokens take theirs along through compaction and repack.
STORE_SCENARIO(SetScoresRoundTrip) {
  StoreHarness h(c, cuda);
  std::mt19937 rng(c.seed + 13);
  const int64_t n = 3 * c.P + 1;
  KVTEST_STEP("fill", h.append(rand_tokens(c, n, rng), rand_tokens(c, n, rng), make_pos(c, n, 0, 0)));
  KVTEST_STEP("evict", h.compact(kvtest::random_mask({h.cpu().capacity()}, 0.3, rng)));
  // More pages than the eviction freed: a second slab.
  KVTEST_STEP("grow into two slabs", h.append(rand_tokens(c, 2 * n, rng), rand_tokens(c, 2 * n, rng),
                                              make_pos(c, 2 * n, n, 0)));
  ASSERT_GE(h.cpu().num_slabs(), 2);
  for (int round = 0; round < 2; ++round) {
    const at::Tensor x = h.random_scores(rng);
    // Round 1 passes a column-major tensor.
    const at::Tensor input = round == 0 ? x : x.t().contiguous().t();
    KVTEST_STEP(::testing::Message() << "set_scores round " << round, h.set_scores(input));
    for (size_t i = 0; i < h.num_stores(); ++i) {
      SCOPED_TRACE(::testing::Message() << "store on " << h.device(i));
      EXPECT_TRUE(kvtest::BytesEqual(h.store(i).scores(), x)) << "every slot reads back what was written";
    }
    KVTEST_STEP("after set_scores", h.verify());
  }
  KVTEST_STEP("append", h.append(rand_tokens(c, 3, rng), rand_tokens(c, 3, rng), make_pos(c, 3, 3 * n, 0)));
  KVTEST_STEP("compact", h.compact(kvtest::random_mask({h.cpu().capacity()}, 0.6, rng)));
  KVTEST_STEP("after append and compact", h.verify());
  KVTEST_STEP("repack", h.repack(1));
  KVTEST_STEP("after repack", h.verify());
}

STORE_SCENARIO(BadInputsThrow) {
  StoreHarness h(c, cuda);
  std::mt19937 rng(c.seed + 8);
  const int64_t B = c.B, H = c.H, D = c.D, C = c.C, n = 2;
  KVTEST_STEP("fill", h.append(rand_tokens(c, 4, rng), rand_tokens(c, 4, rng), make_pos(c, 4, 0, 0)));
  KVTEST_STEP("fill", h.append(rand_tokens(c, 3, rng), rand_tokens(c, 3, rng), make_pos(c, 3, 4, 0),
                               kvtest::random_mask({B, H, 3}, 0.5, rng)));
  const auto before = h.placements();
  const at::ScalarType other = c.dtype == at::kFloat ? at::kHalf : at::kFloat;
  for (size_t i = 0; i < h.num_stores(); ++i) {
    SCOPED_TRACE(::testing::Message() << "store on " << h.device(i));
    OpStore& st = h.store(i);
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
    // A token index at len (inside the segment's last page, or just past it) is not live.
    const at::Tensor len = st.len().view({B, H}).to(at::kLong);
    EXPECT_TRUE(Throws<c10::IndexError>([&] { st.replace(len, k1, v1, pos1, true); }, "slot"));
    EXPECT_TRUE(Throws<c10::IndexError>([&] { st.replace(slot0 - 1, k1, v1, pos1, true); }, "slot"));
    // compact
    const int64_t capacity = st.capacity();
    EXPECT_TRUE(Throws<c10::TypeError>([&] { st.compact(at::ones({capacity}, o.dtype(at::kByte))); }, "keep"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.compact(at::ones({capacity + 1}, o.dtype(at::kBool))); }, "keep"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.compact(at::ones({capacity - 1}, o.dtype(at::kBool))); }, "keep"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.compact(at::ones({1, capacity}, o.dtype(at::kBool))); }, "keep"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.compact(at::ones({2 * capacity}, o.dtype(at::kBool)).slice(0, 0, 2 * capacity, 2)); }, "contiguous"));
    // reserve, repack
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.reserve(-1); }, "reserve"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.repack(-1); }, "repack"));
    // set_scores: a [capacity, C] float32 tensor on the store's device
    const auto f32 = o.dtype(at::kFloat);
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.set_scores(at::Tensor()); }, "scores"));
    EXPECT_TRUE(Throws<c10::TypeError>([&] { st.set_scores(at::zeros({capacity, C}, o.dtype(at::kDouble))); }, "scores"));
    EXPECT_TRUE(Throws<c10::TypeError>([&] { st.set_scores(at::zeros({capacity, C}, o.dtype(at::kHalf))); }, "scores"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.set_scores(at::zeros({capacity + 1, C}, f32)); }, "scores"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.set_scores(at::zeros({capacity - 1, C}, f32)); }, "scores"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.set_scores(at::zeros({capacity, C + 1}, f32)); }, "scores"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st.set_scores(at::zeros({capacity * std::max<int64_t>(C, 1)}, f32)); }, "scores"));
    if (d.is_cuda()) {  // tensors on the wrong device
      const at::Tensor kc = k.cpu(), vc = v.cpu();
      EXPECT_TRUE(Throws<c10::ValueError>([&] { st.append(kc, vc, pos, c10::nullopt); }, "k"));
      EXPECT_TRUE(Throws<c10::ValueError>([&] { st.append(k, vc, pos, c10::nullopt); }, "v"));
      EXPECT_TRUE(Throws<c10::ValueError>([&] { st.append(k, v, pos, at::ones({B, n}, at::kBool)); }, "valid"));
      EXPECT_TRUE(Throws<c10::ValueError>([&] { st.replace(slot0, k1.cpu(), v1, pos1, true); }, "k"));
      EXPECT_TRUE(Throws<c10::ValueError>([&] { st.compact(at::ones({capacity}, at::kBool)); }, "keep"));
      EXPECT_TRUE(Throws<c10::ValueError>([&] { st.set_scores(at::zeros({capacity, C}, at::kFloat)); }, "scores"));
    }
  }
  // No failed call may have changed anything.
  KVTEST_STEP("after the failed calls", h.verify());
  const auto after = h.placements();
  for (size_t d = 0; d < before.size(); ++d) EXPECT_TRUE(kvtest::SamePlacement(before[d], after[d]));
  // An empty segment has nothing to replace.
  StoreHarness e(c, cuda);
  KVTEST_STEP("fill one segment", e.append(rand_tokens(c, 1, rng), rand_tokens(c, 1, rng),
                                           make_pos(c, 1, 0, 0), only_segment(c, 1, 0)));
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
    cases.push_back({dt, 1, 1, 1, 0, 1, seed++});   // smallest: one segment, D = 1, no scores
    cases.push_back({dt, 1, 1, 8, 1, 2, seed++});
    cases.push_back({dt, 2, 3, 16, 3, 4, seed++});
    cases.push_back({dt, 3, 2, 64, 2, 16, seed++});
  }
  // Other page sizes over the same shapes.
  cases.push_back({at::kFloat, 2, 3, 16, 3, 1, seed++});
  cases.push_back({at::kFloat, 3, 2, 64, 2, 2, seed++});
  cases.push_back({at::kHalf, 1, 1, 8, 1, 16, seed++});
  cases.push_back({at::kBFloat16, 2, 2, 8, 1, 8, seed++});
  cases.push_back({at::kFloat, 1, 2, 4, 1, 64, seed++});
  cases.push_back({at::kHalf, 2, 1, 8, 0, 1024, seed++});  // the largest page
  cases.push_back({at::kHalf, 4, 8, 128, 1, 16, seed++});  // a model-like head_dim
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, Store, ::testing::ValuesIn(store_cases()), case_name);

// ---- construction ---------------------------------------------------------------------

void constructor_errors(const at::Device& d) {
  const auto o = at::TensorOptions().device(d);
  const at::Tensor f = at::empty({0}, o.dtype(at::kFloat));
  EXPECT_TRUE(Throws<c10::ValueError>([&] { PageAllocator(0, 1, 8, 1, f, 16); }, "batch"));
  EXPECT_TRUE(Throws<c10::ValueError>([&] { PageAllocator(1, 0, 8, 1, f, 16); }, "heads"));
  EXPECT_TRUE(Throws<c10::ValueError>([&] { PageAllocator(1, 1, 0, 1, f, 16); }, "head_dim"));
  EXPECT_TRUE(Throws<c10::ValueError>([&] { PageAllocator(1, 1, 8, -1, f, 16); }, "score_channels"));
  // page_size: a power of two in [1, 1024].
  for (const int64_t bad : {int64_t{0}, int64_t{-1}, int64_t{-16}, int64_t{3}, int64_t{6},
                            int64_t{12}, int64_t{24}, int64_t{1000}, int64_t{1023},
                            int64_t{1025}, int64_t{2048}, int64_t{4096}, int64_t{1} << 40,
                            std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()}) {
    EXPECT_TRUE(Throws<c10::ValueError>([&] { PageAllocator(1, 1, 8, 1, f, bad); }, "page_size"))
        << "page_size " << bad;
  }
  EXPECT_TRUE(Throws<c10::TypeError>([&] { PageAllocator(1, 1, 8, 1, f.to(at::kDouble), 16); }, "float"));
  EXPECT_TRUE(Throws<c10::TypeError>([&] { PageAllocator(1, 1, 8, 1, f.to(at::kInt), 16); }, "float"));
  const PageAllocator ok(2, 3, 8, 2, f.to(at::kBFloat16), 4);
  EXPECT_EQ(ok.k().scalar_type(), at::kBFloat16);
  EXPECT_EQ(ok.k().device(), d);
  EXPECT_EQ(ok.dtype(), at::kBFloat16);
  EXPECT_EQ(ok.device(), d);
  EXPECT_EQ(ok.like().scalar_type(), at::kBFloat16);
  EXPECT_EQ(ok.like().device(), d);
  EXPECT_EQ(ok.num_segments(), 6);
  EXPECT_EQ(ok.capacity(), 0);
  EXPECT_EQ(ok.page_size(), 4);
  EXPECT_EQ(ok.num_pages(), 0);
  EXPECT_EQ(ok.free_pages(), 0);
  EXPECT_EQ(ok.slab_allocations(), 0);
  EXPECT_EQ(ok.repacks(), 0);
  EXPECT_TRUE(kvtest::PagingConsistent(ok));
}

// Every power of two in [1, 1024] is a page size: P + 1 tokens take two pages per segment.
void every_page_size(const at::Device& d) {
  std::mt19937 rng(77);
  for (int64_t P = 1; P <= 1024; P *= 2) {
    SCOPED_TRACE(::testing::Message() << "page_size " << P);
    const int64_t B = 2, H = 2, D = 8;
    OpStore st(B, H, D, 1, at::empty({0}, at::TensorOptions().dtype(at::kHalf).device(d)), P);
    EXPECT_EQ(st.page_size(), P);
    const at::Tensor k = kvtest::random_normal({B, H, P + 1, D}, at::kHalf, rng);
    const at::Tensor v = kvtest::random_normal({B, H, P + 1, D}, at::kHalf, rng);
    st.append(k.to(d), v.to(d), at::arange(P + 1, at::kLong).to(d), c10::nullopt);
    EXPECT_TRUE(kvtest::PagingConsistent(st));
    EXPECT_EQ(st.pages_host(), std::vector<int32_t>(B * H, 2));
    EXPECT_EQ(st.num_pages(), 2 * B * H);
    EXPECT_EQ(st.capacity(), 2 * B * H * P);
    // Token i of segment s is at slot page * P + i mod P.
    const auto slots = kvtest::live_slots(st);
    const at::Tensor keys = kvtest::host(st.k());
    const at::Tensor want = k.reshape({B * H, P + 1, D});
    for (int64_t s = 0; s < B * H; ++s) {
      for (const int64_t i : {int64_t{0}, P - 1, P}) {
        EXPECT_TRUE(kvtest::BytesEqual(keys[slots[s][i]], want[s][i])) << "segment " << s << " token " << i;
      }
    }
  }
}

// PageAllocator::fork: the fork's tokens are the store's (their pages shared: only a segment's
// partly filled last page is copied), tokens appended to either go to pages of its own, and
// the shared tokens are read-only in both until a repack.
void fork_shares_pages(const at::Device& d) {
  std::mt19937 rng(11);
  const int64_t B = 2, H = 2, D = 8, P = 4;
  const auto like = at::empty({0}, at::TensorOptions().dtype(at::kFloat).device(d));
  OpStore parent(B, H, D, 1, like, P);
  const std::vector<int64_t> lens = {0, 1, 2 * P, 2 * P + 3};  // empty, one token, whole pages, a partial page
  const int64_t L = 2 * P + 3;
  std::vector<bool> valid;
  for (const int64_t n : lens)
    for (int64_t i = 0; i < L; ++i) valid.push_back(i < n);
  const at::Tensor k = kvtest::random_normal({B, H, L, D}, at::kFloat, rng);
  parent.append(k.to(d), k.to(d), at::arange(L, at::kLong).to(d),
                kvtest::from_bools(valid).view({B, H, L}).to(d));
  const at::Tensor parent_keys = kvtest::host(parent.k()).clone();
  const auto parent_slots = kvtest::live_slots(parent);

  OpStore child(parent.fork());
  EXPECT_TRUE(parent.shares_pages() && child.shares_pages());
  EXPECT_EQ(child.len_host(), parent.len_host());
  EXPECT_EQ(child.pool()[0].data_ptr(), parent.pool()[0].data_ptr());  // the same slab, not a copy
  EXPECT_EQ(child.num_slabs(), parent.num_slabs() + 1);                // plus the copied partial pages
  EXPECT_EQ(child.pool().back().size(0), 2);                           // segments 1 and 3
  const auto pages = kvtest::segment_pages(child);
  const auto parent_pages = kvtest::segment_pages(parent);
  // Whole pages of live tokens: read in place (a page the parent holds ahead stays the parent's).
  EXPECT_EQ(pages[2], std::vector<int32_t>(parent_pages[2].begin(), parent_pages[2].begin() + 2));
  EXPECT_EQ(pages[3][0], parent_pages[3][0]);
  EXPECT_NE(pages[3][2], parent_pages[3][2]);                          // the partial page: copied

  const at::Tensor more = kvtest::random_normal({B, H, 5, D}, at::kFloat, rng);
  child.append(more.to(d), more.to(d), at::arange(L, L + 5, at::kLong).to(d));
  const at::Tensor keys = kvtest::host(child.k());
  const auto slots = kvtest::live_slots(child);
  const at::Tensor flat = k.reshape({B * H, L, D}), added = more.reshape({B * H, 5, D});
  for (int64_t s = 0; s < B * H; ++s) {
    ASSERT_EQ(static_cast<int64_t>(slots[s].size()), lens[s] + 5) << "segment " << s;
    for (int64_t i = 0; i < lens[s] + 5; ++i) {
      const at::Tensor want = i < lens[s] ? flat[s][i] : added[s][i - lens[s]];
      EXPECT_TRUE(kvtest::BytesEqual(keys[slots[s][i]], want)) << "segment " << s << " token " << i;
    }
  }
  // The parent's tokens did not move or change.
  EXPECT_EQ(kvtest::live_slots(parent), parent_slots);
  EXPECT_TRUE(kvtest::BytesEqual(kvtest::host(parent.k()), parent_keys));

  for (OpStore* st : {&parent, &child}) {
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st->set_scores(at::zeros({st->capacity(), 1}, like.options())); },
                                        "set_scores would write tokens that this store shares"));
    EXPECT_TRUE(Throws<c10::ValueError>([&] { st->finish_compact(); }, "a compaction would write"));
  }
  child.repack(0);
  EXPECT_FALSE(child.shares_pages());
  EXPECT_TRUE(kvtest::PagingConsistent(child));
  child.set_scores(at::zeros({child.capacity(), 1}, like.options()));
}

TEST(StoreFork, SharesPagesAndAppendsApart) { fork_shares_pages(at::kCPU); }
#ifdef KVCACHE_EXT_WITH_CUDA
TEST(StoreFork, SharesPagesAndAppendsApartCuda) {
  KVTEST_REQUIRE_CUDA();
  fork_shares_pages(at::Device(at::kCUDA, 0));
}
#endif

// A decode step as a CUDA graph replays it (kvcache_ext/hf/decode_graph.py): pages held ahead
// (has_room), the store_append op alone (no prepare_append), the host lengths advanced apart
// (note_appended), and attention with the plan of the lengths the pages hold. Equal to the
// store that appends through prepare_append and plans afresh.
void append_in_held_pages(const at::Device& d) {
  std::mt19937 rng(5);
  const int64_t B = 2, H = 2, Hq = 4, D = 8, P = 4, L = 5;
  const auto like = at::empty({0}, at::TensorOptions().dtype(at::kFloat).device(d));
  OpStore held(B, H, D, 0, like, P), twin(B, H, D, 0, like, P);
  const at::Tensor k = kvtest::random_normal({B, H, L, D}, at::kFloat, rng).to(d);
  for (OpStore* st : {&held, &twin}) st->append(k, k, at::arange(L, at::kLong).to(d));
  held.reserve(2);                                    // pages for 7 tokens: 8 per segment
  const at::Tensor plan = held.attention_plan_of_pages(Hq / H);
  const at::Tensor q = kvtest::random_normal({B, Hq, 1, D}, at::kFloat, rng).to(d);
  for (int64_t step = 0; step < 3; ++step) {
    ASSERT_TRUE(held.has_room(1));
    const at::Tensor t = kvtest::random_normal({B, H, 1, D}, at::kFloat, rng).to(d);
    const at::Tensor pos = at::full({B, 1}, L + step, at::kLong).to(d);
    kvcache_ext::ops::store_append(held.pool(), held.page_table_device(), held.len_device(), t, t, pos,
                                   c10::nullopt, c10::nullopt, P, 0);
    held.note_appended(1);
    twin.append(t, t, pos);
    EXPECT_EQ(held.len_host(), twin.len_host());
    const auto got = kvcache_ext::ops::attention_run(q, held.pool(), held.page_table_device(), held.len_device(),
                                                     plan, c10::nullopt, 0.5, H, P, D, 0, at::kFloat, true,
                                                     false, false, false);
    const auto want = twin.attend(q, 0.5, c10::nullopt, true, false, false, false);
    EXPECT_TRUE(at::allclose(kvtest::host(std::get<0>(got)), kvtest::host(std::get<0>(want)), 1e-6, 1e-6));
    EXPECT_TRUE(at::allclose(kvtest::host(std::get<1>(got)).sum(), kvtest::host(std::get<1>(want)).sum(), 1e-5,
                             1e-5));
  }
  EXPECT_FALSE(held.has_room(1));
  EXPECT_TRUE(Throws<c10::ValueError>([&] { held.note_appended(1); }, "no room for 1 more"));
  EXPECT_EQ(held.len_host(), std::vector<int32_t>(B * H, L + 3));     // unchanged by the refusal
  EXPECT_TRUE(kvtest::BytesEqual(kvtest::host(held.k()).index_select(0, at::tensor(kvtest::live_slots(held)[3])),
                                 kvtest::host(twin.k()).index_select(0, at::tensor(kvtest::live_slots(twin)[3]))));
}

TEST(StoreGraphStep, AppendsInHeldPages) { append_in_held_pages(at::kCPU); }
#ifdef KVCACHE_EXT_WITH_CUDA
TEST(StoreGraphStep, AppendsInHeldPagesCuda) {
  KVTEST_REQUIRE_CUDA();
  append_in_held_pages(at::Device(at::kCUDA, 0));
}
#endif

// H2O's decode step with eviction as a CUDA graph replays it: the ops alone (store_append into
// held pages, attention_run with the plan of those pages and the mass, store_add_scores,
// store_topk by the slot rule, store_compact unordered) and the host halves after (note_appended,
// note_kept_in_pages), against the eager step on a twin (the allocator's prepare_append and plan
// around the same ops, finish_compact with the lengths min(len, budget)): the same kept tokens
// and lengths at every step, every page still held.
void evict_in_held_pages(const at::Device& d) {
  std::mt19937 rng(7);
  const int64_t B = 2, H = 2, Hq = 4, D = 8, P = 4, L = 9, sinks = 1, recent = 2;
  const auto like = at::empty({0}, at::TensorOptions().dtype(at::kFloat).device(d));
  OpStore held(B, H, D, 1, like, P), twin(B, H, D, 1, like, P);
  const at::Tensor k = kvtest::random_normal({B, H, L, D}, at::kFloat, rng).to(d);
  for (OpStore* st : {&held, &twin}) st->append(k, k, at::arange(L, at::kLong).to(d));
  held.reserve(1);
  const int64_t pages = held.num_pages();
  const at::Tensor plan = held.attention_plan_of_pages(Hq / H);
  const at::Tensor budget_host = at::tensor({5, 7, 9, 6}, at::kLong).view({B, H});
  const at::Tensor budget = budget_host.to(at::kInt).to(d);
  for (int64_t step = 0; step < 4; ++step) {
    ASSERT_TRUE(held.has_room(1));
    const at::Tensor t = kvtest::random_normal({B, H, 1, D}, at::kFloat, rng).to(d);
    const at::Tensor q = kvtest::random_normal({B, Hq, 1, D}, at::kFloat, rng).to(d);
    const at::Tensor pos = at::full({B, 1}, L + step, at::kLong).to(d);
    const at::Tensor last_pos = at::full({B}, L + step, at::kLong).to(d);
    kvcache_ext::ops::store_append(held.pool(), held.page_table_device(), held.len_device(), t, t, pos,
                                   c10::nullopt, c10::nullopt, P, 1);
    const auto got = kvcache_ext::ops::attention_run(q, held.pool(), held.page_table_device(), held.len_device(),
                                                     plan, c10::nullopt, 0.5, H, P, D, 1, at::kFloat, true,
                                                     false, false, false);
    kvcache_ext::ops::store_add_scores(held.pool(), held.page_table_device(), held.len_device(), std::get<1>(got),
                                       0, P, D, 1, at::kFloat);
    const auto [keep, counts] = kvcache_ext::ops::store_topk(held.pool(), held.page_table_device(),
                                                             held.len_device(), c10::nullopt, budget.view({-1}),
                                                             1, P, D, 1, at::kFloat, std::string("mass"), sinks,
                                                             recent, last_pos);
    kvcache_ext::ops::store_compact(held.pool(), held.page_table_device(), held.len_device(), keep, P, D, 1,
                                    at::kFloat, /*stable=*/false);
    held.note_appended(1);
    held.note_kept_in_pages(budget_host.view({-1}));
    twin.append(t, t, pos);
    const auto eager = twin.attend(q, 0.5, c10::nullopt, true, false, false, false);
    kvcache_ext::ops::store_add_scores(twin.pool(), twin.page_table_device(), twin.len_device(), std::get<1>(eager),
                                       0, P, D, 1, at::kFloat);
    const auto twin_keep = std::get<0>(kvcache_ext::ops::store_topk(
        twin.pool(), twin.page_table_device(), twin.len_device(), c10::nullopt, budget.view({-1}), 1, P, D, 1,
        at::kFloat, std::string("mass"), sinks, recent, last_pos));
    kvcache_ext::ops::store_compact(twin.pool(), twin.page_table_device(), twin.len_device(), twin_keep, P, D, 1,
                                    at::kFloat, /*stable=*/false);
    std::vector<int64_t> kept;
    for (int64_t s = 0; s < B * H; ++s)
      kept.push_back(std::min<int64_t>(twin.len_host()[s], budget_host.view({-1})[s].item<int64_t>()));
    twin.finish_compact(at::tensor(kept, at::kLong));
    EXPECT_TRUE(at::allclose(kvtest::host(std::get<0>(got)), kvtest::host(std::get<0>(eager)), 1e-5, 1e-5));
    EXPECT_EQ(held.len_host(), twin.len_host());
    EXPECT_TRUE(at::equal(kvtest::host(held.len()), kvtest::host(twin.len())));
    const auto held_slots = kvtest::live_slots(held), twin_slots = kvtest::live_slots(twin);
    for (int64_t s = 0; s < B * H; ++s) {
      const at::Tensor a = at::tensor(held_slots[s]), b = at::tensor(twin_slots[s]);
      EXPECT_TRUE(at::equal(kvtest::host(held.pos()).index_select(0, a), kvtest::host(twin.pos()).index_select(0, b)))
          << "step " << step << " segment " << s;
      EXPECT_TRUE(kvtest::BytesEqual(kvtest::host(held.k()).index_select(0, a),
                                     kvtest::host(twin.k()).index_select(0, b)));
    }
    EXPECT_EQ(held.num_pages(), pages);
  }
  EXPECT_EQ(held.len_host(), std::vector<int32_t>({5, 7, 9, 6}));
}

// store_decode_step (a decode step in one op) against the ops it stands for on a twin: the
// append, the attention with the mass, channel 0 += mass and channel 1 += count, then the
// top-k by the slot rule and the unordered compaction; ragged segments (an empty one), GQA,
// batch 2, a budget below and one above the lengths: the same output, tokens and channels.
void decode_step_equals_the_ops(const at::Device& d) {
  std::mt19937 rng(11);
  const int64_t B = 2, H = 2, Hq = 4, D = 8, P = 4, L = 9, sinks = 1, recent = 2;
  const auto like = at::empty({0}, at::TensorOptions().dtype(at::kFloat).device(d));
  OpStore one(B, H, D, 2, like, P), twin(B, H, D, 2, like, P);
  const at::Tensor k = kvtest::random_normal({B, H, L, D}, at::kFloat, rng).to(d);
  at::Tensor valid = at::ones({B, H, L}, at::kBool);
  valid[0][0].fill_(false);   // an empty segment
  for (OpStore* st : {&one, &twin}) st->append(k, k, at::arange(L, at::kLong).to(d), valid.to(d));
  const at::Tensor budget = at::tensor({5, 7, 20, 3}, at::kInt).to(d);
  for (int64_t step = 0; step < 4; ++step) {
    const at::Tensor t = kvtest::random_normal({B, H, 1, D}, at::kFloat, rng).to(d);
    const at::Tensor q = kvtest::random_normal({B, Hq, 1, D}, at::kFloat, rng).to(d);
    const at::Tensor pos = at::full({B, 1}, L + step, at::kLong).to(d);
    const at::Tensor last_pos = at::full({B}, L + step, at::kLong).to(d);
    const bool evict = step % 2 == 1;
    // one op
    const auto [pos32, rank, counts] = one.prepare_append(t, t, pos, c10::nullopt);
    const auto got = kvcache_ext::ops::store_decode_step(
        one.pool(), one.page_table_device(), one.len_device(), q, t, t, pos32, rank, counts,
        one.attention_plan(Hq / H), c10::nullopt, 0.5, P, 2, true, false, false, false, {0, 3},
        evict ? c10::optional<std::string>("mass") : c10::nullopt, evict ? sinks : 0, evict ? recent : 0,
        evict ? c10::optional<at::Tensor>(last_pos) : c10::nullopt,
        evict ? c10::optional<at::Tensor>(budget) : c10::nullopt);
    if (evict) one.finish_compact();
    // the ops
    twin.append(t, t, pos);
    const auto want = twin.attend(q, 0.5, c10::nullopt, true, false, false, true);
    kvcache_ext::ops::store_add_scores(twin.pool(), twin.page_table_device(), twin.len_device(), std::get<1>(want),
                                       0, P, D, 2, at::kFloat);
    kvcache_ext::ops::store_add_scores(twin.pool(), twin.page_table_device(), twin.len_device(),
                                       std::get<4>(want).to(at::kFloat), 1, P, D, 2, at::kFloat);
    if (evict) {
      const auto keep = std::get<0>(kvcache_ext::ops::store_topk(
          twin.pool(), twin.page_table_device(), twin.len_device(), c10::nullopt, budget, 1, P, D, 2, at::kFloat,
          std::string("mass"), sinks, recent, last_pos));
      twin.compact(keep, /*stable=*/false);
    }
    EXPECT_TRUE(at::allclose(kvtest::host(std::get<0>(got)), kvtest::host(std::get<0>(want)), 1e-6, 1e-6));
    EXPECT_TRUE(at::allclose(kvtest::host(std::get<1>(got)), kvtest::host(std::get<1>(want)), 1e-6, 1e-6));
    EXPECT_EQ(std::get<4>(got).numel(), 0);   // count was accumulated, not asked for
    EXPECT_EQ(one.len_host(), twin.len_host());
    const auto one_slots = kvtest::live_slots(one), twin_slots = kvtest::live_slots(twin);
    for (int64_t s = 0; s < B * H; ++s) {
      const at::Tensor a = at::tensor(one_slots[s]), b = at::tensor(twin_slots[s]);
      EXPECT_TRUE(at::equal(kvtest::host(one.pos()).index_select(0, a), kvtest::host(twin.pos()).index_select(0, b)))
          << "step " << step << " segment " << s;
      EXPECT_TRUE(at::allclose(kvtest::host(one.scores()).index_select(0, a),
                               kvtest::host(twin.scores()).index_select(0, b), 1e-6, 1e-6));
    }
  }
  EXPECT_EQ(one.len_host(), std::vector<int32_t>({4, 7, 13, 3}));
}

TEST(StoreDecodeStep, EqualsTheOps) { decode_step_equals_the_ops(at::kCPU); }
#ifdef KVCACHE_EXT_WITH_CUDA
TEST(StoreDecodeStep, EqualsTheOpsCuda) {
  KVTEST_REQUIRE_CUDA();
  decode_step_equals_the_ops(at::Device(at::kCUDA, 0));
}
#endif

TEST(StoreGraphStep, EvictsInHeldPages) { evict_in_held_pages(at::kCPU); }
#ifdef KVCACHE_EXT_WITH_CUDA
TEST(StoreGraphStep, EvictsInHeldPagesCuda) {
  KVTEST_REQUIRE_CUDA();
  evict_in_held_pages(at::Device(at::kCUDA, 0));
}
#endif

TEST(StoreConstruction, RejectsBadArguments) { constructor_errors(at::kCPU); }
TEST(StoreConstruction, TakesEveryPageSize) { every_page_size(at::kCPU); }
TEST(StoreConstruction, HugeExtraIsRejected) {
  OpStore st(1, 2, 8, 1, at::empty({0}, at::kHalf), 16);
  st.append(at::zeros({1, 2, 3, 8}, at::kHalf), at::zeros({1, 2, 3, 8}, at::kHalf), at::arange(3),
            c10::nullopt);
  const auto before = kvtest::placement(st);
  EXPECT_TRUE(kvtest::Throws<c10::ValueError>([&] { st.reserve(INT64_MAX); }, "2^31"));
  EXPECT_TRUE(kvtest::Throws<c10::ValueError>([&] { st.repack(INT64_MAX); }, "2^31"));
  EXPECT_TRUE(kvtest::SamePlacement(before, kvtest::placement(st)));
  EXPECT_EQ(st.repacks(), 0);
}

#ifdef KVCACHE_EXT_WITH_CUDA
TEST(StoreConstruction, RejectsBadArgumentsCuda) {
  KVTEST_REQUIRE_CUDA();
  constructor_errors(at::Device(at::kCUDA, 0));
}
TEST(StoreConstruction, TakesEveryPageSizeCuda) {
  KVTEST_REQUIRE_CUDA();
  every_page_size(at::Device(at::kCUDA, 0));
}
#endif

}  // namespace

// The store_topk op (RaggedKVStore.select) names the argument, the value and
// what it accepts.
TEST(StoreSelect, RejectsBadInputs) {
  const at::Tensor like = at::empty({0}, at::kHalf);
  OpStore st(2, 3, 8, 1, like, 4);
  const at::Tensor tok = at::randn({2, 3, 5, 8}).to(at::kHalf);
  st.append(tok, tok, at::arange(5), c10::nullopt);
  const at::Tensor k6 = at::ones({6}, at::kLong);
  EXPECT_TRUE(Throws<c10::ValueError>([&] { st.select(c10::nullopt, at::tensor({1, 1, 1, 1, -2, 1}), false); },
                                      "k (the budget) must be >= 0, got k[4] = -2"));
  EXPECT_TRUE(Throws<c10::ValueError>([&] { st.select(c10::nullopt, at::ones({2}, at::kLong), false); },
                                      "k (the budget) must have shape [6] (one per segment), got [2]"));
  EXPECT_TRUE(Throws<c10::ValueError>([&] { st.select(c10::nullopt, k6, true); },
                                      "k (the budget) must have shape [2] (one per group of 3 segments), got [6]"));
  EXPECT_TRUE(Throws<c10::TypeError>([&] { st.select(c10::nullopt, at::ones({6}), false); }, "integer"));
  EXPECT_TRUE(Throws<c10::ValueError>([&] { st.select(at::zeros({st.capacity() + 1}), k6, false); },
                                      "[batch, heads, L >= 5] padded, got shape"));
  EXPECT_TRUE(Throws<c10::ValueError>([&] { st.select(at::zeros({2, 3, 4}), k6, false); }, "L >= 5"));
  EXPECT_TRUE(Throws<c10::TypeError>([&] { st.select(at::zeros({st.capacity()}, at::kDouble), k6, false); },
                                     "scores"));
  OpStore no_scores(1, 1, 8, 0, like, 4);
  EXPECT_TRUE(Throws<c10::ValueError>([&] { no_scores.select(c10::nullopt, at::ones({1}, at::kLong), false); },
                                      "no score channels"));
}
