// int8 pages (store/quantize.h): what append stores, computed here from the format's definition
// with plain ATen (not the store's quantize_row), the scales moved with their tokens by both
// compactions, and the attention against a dense softmax over the dequantized rows, on the CPU
// kernels and (the *Cuda twins) the CUDA ones. The Python tests run the same against
// kvcache_ext.reference on random ragged stores.
#include "tests/store_util.h"

namespace {

using kvtest::OpStore;

// The format: scale = float16(min(max |x| / 127, 65504)); q = clamp(round(x / scale)) (0 where
// the scale is 0); the row given back is q * scale in float32. x: [..., D] float32.
at::Tensor as_stored(const at::Tensor& x) {
  const at::Tensor amax = x.abs().nan_to_num(0).amax(-1, /*keepdim=*/true);
  const at::Tensor scale = (amax / 127.f).clamp_max(65504.f).to(at::kHalf).to(at::kFloat);
  const at::Tensor safe = at::where(scale > 0, scale, at::ones_like(scale));
  const at::Tensor q = at::round(x / safe).clamp(-127, 127).nan_to_num(0);
  return at::where(scale > 0, q * scale, at::zeros_like(x));
}

// The live K (or V) rows of every segment as a dense [S, L, D] tensor (zero past a length).
at::Tensor dense_rows(const OpStore& st, bool k) {
  const at::Tensor all = (k ? st.k() : st.v()).to(at::kFloat).cpu();
  const auto slots = kvtest::live_slots(st);
  int64_t L = 0;
  for (const auto& s : slots) L = std::max<int64_t>(L, s.size());
  at::Tensor out = at::zeros({static_cast<int64_t>(slots.size()), L, st.head_dim()});
  for (size_t s = 0; s < slots.size(); ++s)
    for (size_t i = 0; i < slots[s].size(); ++i) out[s][i] = all[slots[s][i]];
  return out;
}

void append_stores_the_format_and_compaction_moves_the_scales(const at::Device& device) {
  for (const at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    std::mt19937 rng(7);
    const int64_t B = 2, H = 3, D = 24, n = 13, P = 4;
    OpStore st(B, H, D, /*score_channels=*/1, at::empty({0}, at::TensorOptions().dtype(dtype).device(device)), P,
               at::kChar);
    ASSERT_EQ(st.kv_dtype(), at::kChar);
    // Rows of many magnitudes, one of zeros.
    at::Tensor k = (kvtest::random_normal({B, H, n, D}, at::kFloat, rng) *
                    at::logspace(-3, 3, n).view({1, 1, n, 1})).to(dtype);
    k[0][0][2].zero_();
    const at::Tensor v = kvtest::random_normal({B, H, n, D}, dtype, rng);
    st.append(k.to(device), v.to(device), at::arange(n));
    EXPECT_TRUE(kvtest::PagingConsistent(st));
    EXPECT_TRUE(at::equal(dense_rows(st, true), as_stored(k.to(at::kFloat)).to(dtype).to(at::kFloat).view({B * H, n, D})))
        << kvtest::dtype_name(dtype);
    EXPECT_TRUE(at::equal(dense_rows(st, false), as_stored(v.to(at::kFloat)).to(dtype).to(at::kFloat).view({B * H, n, D})));
    // Each token's rows stay its own through both compactions: compare by position.
    const at::Tensor before_k = dense_rows(st, true);
    for (const bool stable : {false, true}) {
      st.compact(kvtest::random_mask({st.capacity()}, 0.6, rng).to(device), stable);
      EXPECT_TRUE(kvtest::PagingConsistent(st));
      const at::Tensor pos = st.pos().cpu();
      const at::Tensor rows = st.k().to(at::kFloat).cpu();
      const auto slots = kvtest::live_slots(st);
      for (size_t s = 0; s < slots.size(); ++s)
        for (const int64_t slot : slots[s]) {
          const int64_t p = pos[slot].item<int32_t>();
          EXPECT_TRUE(at::equal(rows[slot], before_k[s][p])) << "segment " << s << " position " << p;
        }
    }
  }
}

// The CUDA kernels take head_dim 64: both devices run it.
void attention_is_over_the_dequantized_rows(const at::Device& device) {
  std::mt19937 rng(11);
  const int64_t B = 2, H = 2, G = 3, D = 64, n = 40;
  OpStore st(B, H, D, 1, at::empty({0}, at::TensorOptions().device(device)), 16, at::kChar);
  const at::Tensor k = kvtest::random_normal({B, H, n, D}, at::kFloat, rng);
  const at::Tensor v = kvtest::random_normal({B, H, n, D}, at::kFloat, rng);
  st.append(k.to(device), v.to(device), at::arange(n));
  const at::Tensor q = kvtest::random_normal({B, H * G, 1, D}, at::kFloat, rng);
  const double scale = 0.2;
  const auto result = st.attend(q.to(device), scale, c10::nullopt, true, false, false, false);
  const at::Tensor out = std::get<0>(result).cpu(), mass = std::get<1>(result).cpu();
  // Dense: every query head g of KV head h over the dequantized rows, in float64.
  const at::Tensor kd = as_stored(k).to(at::kDouble).repeat_interleave(G, 1);
  const at::Tensor vd = as_stored(v).to(at::kDouble).repeat_interleave(G, 1);
  const at::Tensor p = at::softmax(at::matmul(q.to(at::kDouble), kd.transpose(-1, -2)) * scale, -1);
  const at::Tensor want = at::matmul(p, vd).to(at::kFloat);
  EXPECT_TRUE(at::allclose(out, want, 1e-5, 1e-5)) << (out - want).abs().max().item<float>();
  // mass: per token, the sum over its G query heads.
  const at::Tensor want_mass = p.view({B, H, G, n}).sum(2).to(at::kFloat);
  const auto slots = kvtest::live_slots(st);
  for (int64_t s = 0; s < B * H; ++s)
    for (int64_t i = 0; i < n; ++i)
      EXPECT_NEAR(mass[slots[s][i]].item<float>(), want_mass[s / H][s % H][i].item<float>(), 1e-5);
}

TEST(Int8Pages, AppendStoresTheFormatAndCompactionMovesTheScales) {
  append_stores_the_format_and_compaction_moves_the_scales(at::kCPU);
}

TEST(Int8Pages, AttentionIsOverTheDequantizedRows) { attention_is_over_the_dequantized_rows(at::kCPU); }

#ifdef KVCACHE_EXT_WITH_CUDA
TEST(Int8Pages, AppendStoresTheFormatAndCompactionMovesTheScalesCuda) {
  KVTEST_REQUIRE_CUDA();
  append_stores_the_format_and_compaction_moves_the_scales(at::Device(at::kCUDA, 0));
}

TEST(Int8Pages, AttentionIsOverTheDequantizedRowsCuda) {
  KVTEST_REQUIRE_CUDA();
  attention_is_over_the_dequantized_rows(at::Device(at::kCUDA, 0));
}
#endif

TEST(Int8Pages, AKvDtypeOtherThanTheDtypeOrInt8IsRefused) {
  const auto cpu = at::empty({0}, at::kFloat);
  EXPECT_THROW(OpStore(1, 1, 8, 1, cpu, 16, at::kHalf), c10::TypeError);
}

}  // namespace
