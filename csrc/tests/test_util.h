// Shared helpers of the GoogleTest cases: random inputs from fixed seeds, exact (bitwise)
// comparisons, error-type checks, CUDA skipping, and the plain reference selection that
// the top-k kernels are checked against. Nothing here calls kvcache_ext code (the store the
// tests drive, OpStore, and the helpers that read its paged layout are in store_util.h).
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace kvtest {

// ---------------------------------------------------------------------------------------
// CUDA
// ---------------------------------------------------------------------------------------
inline bool cuda_available() { return at::hasCUDA(); }

// First statement of every CUDA variant: skips (with a reason) on machines without a GPU.
#define KVTEST_REQUIRE_CUDA()                                                          \
  do {                                                                                 \
    if (!::kvtest::cuda_available()) {                                                 \
      GTEST_SKIP() << "no CUDA device available (the CUDA kernels are compiled in, "   \
                      "but at::hasCUDA() is false)";                                   \
    }                                                                                  \
  } while (0)

// Runs a step of a scenario and stops the scenario at its first failure, naming the step.
#define KVTEST_STEP(what, ...)                                 \
  do {                                                         \
    SCOPED_TRACE(what);                                        \
    __VA_ARGS__;                                               \
    if (::testing::Test::HasFailure()) return;                 \
  } while (0)

// ---------------------------------------------------------------------------------------
// Tensors
// ---------------------------------------------------------------------------------------
inline const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "f32";
    case at::kHalf: return "f16";
    case at::kBFloat16: return "bf16";
    default: return "other";
  }
}

inline at::Tensor host(const at::Tensor& t) { return t.to(at::kCPU).contiguous(); }

template <typename T>
std::vector<T> to_vec(const at::Tensor& t) {
  const at::Tensor c = host(t);
  TORCH_CHECK(c.element_size() == sizeof(T), "to_vec: element size mismatch");
  std::vector<T> out(c.numel());
  if (!out.empty()) std::memcpy(out.data(), c.data_ptr(), c.nbytes());
  return out;
}

template <typename T>
at::Tensor from_vec(const std::vector<T>& v, at::ScalarType dtype) {
  at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::TensorOptions().dtype(dtype));
  TORCH_CHECK(t.element_size() == sizeof(T), "from_vec: element size mismatch");
  if (!v.empty()) std::memcpy(t.data_ptr(), v.data(), v.size() * sizeof(T));
  return t;
}

inline at::Tensor from_bools(const std::vector<bool>& v) {
  at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::TensorOptions().dtype(at::kBool));
  bool* p = t.data_ptr<bool>();
  for (size_t i = 0; i < v.size(); ++i) p[i] = v[i];
  return t;
}

inline std::vector<bool> to_bools(const at::Tensor& t) {
  const at::Tensor c = host(t);
  std::vector<bool> out(c.numel());
  const bool* p = c.data_ptr<bool>();
  for (size_t i = 0; i < out.size(); ++i) out[i] = p[i];
  return out;
}

// Normal(0, 1) values of the given shape, rounded to dtype, on the CPU.
inline at::Tensor random_normal(at::IntArrayRef shape, at::ScalarType dtype, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
  float* p = t.data_ptr<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = normal(rng);
  return t.to(dtype);
}

inline at::Tensor random_mask(at::IntArrayRef shape, double p_true, std::mt19937& rng) {
  std::bernoulli_distribution coin(p_true);
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(at::kBool));
  bool* p = t.data_ptr<bool>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = coin(rng);
  return t;
}

inline int64_t uniform_int(std::mt19937& rng, int64_t lo, int64_t hi) {  // [lo, hi]
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

// Bitwise equality of two tensors (same dtype and shape), wherever they live.
inline ::testing::AssertionResult BytesEqual(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type()) {
    return ::testing::AssertionFailure()
           << "dtypes differ: " << a.scalar_type() << " vs " << b.scalar_type();
  }
  if (a.sizes() != b.sizes()) {
    return ::testing::AssertionFailure() << "shapes differ: " << a.sizes() << " vs " << b.sizes();
  }
  const at::Tensor x = host(a), y = host(b);
  const int64_t n = x.numel();
  if (n == 0) return ::testing::AssertionSuccess();
  const int64_t row = x.dim() >= 2 ? x.numel() / x.size(0) : 1;
  const int64_t esz = x.element_size();
  const auto* px = static_cast<const uint8_t*>(x.data_ptr());
  const auto* py = static_cast<const uint8_t*>(y.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(px + i * esz, py + i * esz, esz) != 0) {
      return ::testing::AssertionFailure()
             << "first difference at flat index " << i << " (row " << i / row << "): "
             << x.reshape({-1})[i].item().toDouble() << " vs "
             << y.reshape({-1})[i].item().toDouble();
    }
  }
  return ::testing::AssertionSuccess();
}

// ---------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------
// Checks that fn throws exactly the c10 error type E (c10::ValueError, c10::TypeError,
// c10::IndexError, or c10::Error for any of them) and that its message mentions `needle`.
template <typename E>
::testing::AssertionResult Throws(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
  } catch (const E& e) {
    const std::string msg = e.what_without_backtrace();
    if (!needle.empty() && msg.find(needle) == std::string::npos) {
      return ::testing::AssertionFailure()
             << "threw " << c10::demangle(typeid(e).name()) << " as expected, but the message "
             << "does not mention '" << needle << "': " << msg;
    }
    return ::testing::AssertionSuccess();
  } catch (const c10::Error& e) {
    return ::testing::AssertionFailure()
           << "expected " << c10::demangle(typeid(E).name()) << ", got "
           << c10::demangle(typeid(e).name()) << ": " << e.what_without_backtrace();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "expected " << c10::demangle(typeid(E).name())
                                         << ", got " << c10::demangle(typeid(e).name()) << ": "
                                         << e.what();
  }
  return ::testing::AssertionFailure() << "expected " << c10::demangle(typeid(E).name())
                                       << " mentioning '" << needle << "', nothing was thrown";
}

// ---------------------------------------------------------------------------------------
// Reference selection (the contract of select/topk.h, written as plain loops)
// ---------------------------------------------------------------------------------------
struct Candidate {
  float score;
  int32_t pos;
  int64_t slot;
};

// True when a is kept before b: higher score first, NaN below every number, -0.0 == +0.0,
// then lower position, then (equal score and position) lower slot.
inline bool kept_before(const Candidate& a, const Candidate& b) {
  const bool a_nan = std::isnan(a.score), b_nan = std::isnan(b.score);
  if (a_nan != b_nan) return b_nan;
  if (!a_nan && a.score != b.score) return a.score > b.score;
  if (a.pos != b.pos) return a.pos < b.pos;
  return a.slot < b.slot;
}

inline void keep_best(std::vector<Candidate> cand, int64_t k, std::vector<bool>& keep) {
  std::sort(cand.begin(), cand.end(), kept_before);
  for (int64_t i = 0; i < std::min<int64_t>(k, cand.size()); ++i) keep[cand[i].slot] = true;
}

// The top-k kernels take contiguous segments: [start[s], start[s] + len[s]) of scores/pos.
inline std::vector<bool> reference_segmented_topk(const std::vector<float>& scores,
                                                  const std::vector<int32_t>& pos,
                                                  const std::vector<int64_t>& start,
                                                  const std::vector<int32_t>& len,
                                                  const std::vector<int64_t>& k) {
  std::vector<bool> keep(scores.size(), false);
  for (size_t s = 0; s < start.size(); ++s) {
    std::vector<Candidate> cand;
    for (int64_t j = start[s]; j < start[s] + len[s]; ++j) cand.push_back({scores[j], pos[j], j});
    keep_best(cand, k[s], keep);
  }
  return keep;
}

// Returns keep and fills counts (per segment).
inline std::vector<bool> reference_grouped_topk(const std::vector<float>& scores,
                                                const std::vector<int32_t>& pos,
                                                const std::vector<int64_t>& start,
                                                const std::vector<int32_t>& len,
                                                int64_t group_size, const std::vector<int64_t>& k,
                                                std::vector<int32_t>& counts) {
  std::vector<bool> keep(scores.size(), false);
  const int64_t S = static_cast<int64_t>(start.size());
  for (int64_t g = 0; g * group_size < S; ++g) {
    std::vector<Candidate> cand;
    for (int64_t s = g * group_size; s < (g + 1) * group_size; ++s) {
      for (int64_t j = start[s]; j < start[s] + len[s]; ++j) cand.push_back({scores[j], pos[j], j});
    }
    keep_best(cand, k[g], keep);
  }
  counts.assign(S, 0);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t j = start[s]; j < start[s] + len[s]; ++j) counts[s] += keep[j] ? 1 : 0;
  }
  return keep;
}

// First differing slot of two keep masks, for failure messages.
inline ::testing::AssertionResult SameKeep(const std::vector<bool>& got,
                                           const std::vector<bool>& want) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure()
           << "keep has " << got.size() << " slots, expected " << want.size();
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      int64_t n_got = std::count(got.begin(), got.end(), true);
      int64_t n_want = std::count(want.begin(), want.end(), true);
      return ::testing::AssertionFailure()
             << "slot " << i << " kept=" << got[i] << ", expected " << want[i] << " (kept "
             << n_got << " slots in all, expected " << n_want << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace kvtest
