// Input checks shared by every entry point. Each raises a Python exception of
// the matching type (ValueError / TypeError / IndexError) through TORCH_CHECK_*.
#pragma once
#include <ATen/ATen.h>

#include <string>

namespace kvcache_ext {

inline void check_defined(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), name, " must be a tensor, got None");
}

inline void check_dtype(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must have dtype ", dtype, ", got ",
                   t.scalar_type());
}

inline void check_device(const at::Tensor& t, const at::Device& device, const char* name) {
  TORCH_CHECK_VALUE(t.device() == device, name, " must be on ", device, ", got ", t.device());
}

// Inputs the entry point copies to the state's device itself (positions, slots, budgets):
// on that device or on the CPU. A meta tensor (no data) or another device's is refused here,
// by name, rather than failing in the copy.
inline void check_device_or_cpu(const at::Tensor& t, const at::Device& device, const char* name) {
  TORCH_CHECK_VALUE(t.device() == device || t.device().is_cpu(), name, " must be on ", device,
                    (device.is_cpu() ? "" : " or on the CPU"), ", got ", t.device());
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
}

inline void check_shape(const at::Tensor& t, at::IntArrayRef shape, const char* name) {
  TORCH_CHECK_VALUE(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
}

inline bool is_integer_dtype(at::ScalarType s) {
  return at::isIntegralType(s, /*includeBool=*/false);
}

// Positions and counts may arrive as any integer tensor (HF uses int64); the kernels read int32.
inline at::Tensor as_int32(const at::Tensor& t, const at::Device& device, const char* name) {
  check_defined(t, name);
  TORCH_CHECK_TYPE(is_integer_dtype(t.scalar_type()), name, " must be an integer tensor, got ",
                   t.scalar_type());
  return t.to(device, at::kInt).contiguous();
}

// Segment lengths ``len``: a contiguous int32 [S] tensor on ``device``.
inline void check_lengths(const at::Tensor& len, const at::Device& device, int64_t S) {
  check_defined(len, "len");
  check_dtype(len, at::kInt, "len");
  check_device(len, device, "len");
  check_shape(len, {S}, "len");
  check_contiguous(len, "len");
}

// Positions as as_int32 gives them, refused (not wrapped) when a value is outside [lo, 2^31 - 1].
// The values are read on the host: free for a tensor on the CPU (whatever the store's device);
// a tensor already on a CUDA device is not read, since that would cost a host sync per call
// (the eviction engine keeps its positions below 2^31 on the host).
inline at::Tensor as_position32(const at::Tensor& t, const at::Device& device, const char* name,
                                int64_t lo) {
  check_defined(t, name);
  TORCH_CHECK_TYPE(is_integer_dtype(t.scalar_type()), name, " must be an integer tensor, got ",
                   t.scalar_type());
  check_device_or_cpu(t, device, name);
  if (t.device().is_cpu() && t.numel() > 0) {
    const at::Tensor wide = t.scalar_type() == at::kLong ? t : t.to(at::kLong);
    const auto [low, high] = at::aminmax(wide);
    const int64_t min = low.item<int64_t>(), max = high.item<int64_t>();
    TORCH_CHECK_VALUE(min >= lo && max <= INT32_MAX, name, " must hold positions in [",
                      lo == INT32_MIN ? std::string("-2^31") : std::to_string(lo),
                      ", 2^31 - 1] (the kernels keep them as int32), got values from ", min,
                      " to ", max);
  }
  return t.to(device, at::kInt).contiguous();
}

// The positions of n appended tokens ([n] or [batch, n] integers in [0, 2^31 - 1]) as a
// contiguous int32 [batch, n] on ``device``: store_append's rule, which the page allocator
// applies too before it gives the segments pages.
inline at::Tensor append_positions(const at::Tensor& pos, const at::Device& device, int64_t B, int64_t n) {
  at::Tensor pos32 = as_position32(pos, device, "pos", 0);
  TORCH_CHECK_VALUE(pos32.sizes() == at::IntArrayRef({n}) || pos32.sizes() == at::IntArrayRef({B, n}),
                    "pos must have shape [batch, n] = [", B, ", ", n, "] or [n], got ", pos32.sizes());
  return pos32.expand({B, n}).contiguous();
}

// The attention's q_pos ([n] or [batch, n] integers; negative: a query that sees no slot, as
// padding does) as a contiguous int32 [batch, n] on ``device``.
inline at::Tensor query_positions(const at::Tensor& q_pos_in, const at::Device& device, int64_t B, int64_t n) {
  at::Tensor q_pos = as_position32(q_pos_in, device, "q_pos", INT32_MIN);
  TORCH_CHECK_VALUE((q_pos.dim() == 1 && q_pos.size(0) == n) ||
                        (q_pos.dim() == 2 && q_pos.size(0) == B && q_pos.size(1) == n),
                    "q_pos must be [n] or [batch, n] = [", B, ", ", n, "], got shape ", q_pos.sizes());
  return q_pos.expand({B, n}).contiguous();
}

}  // namespace kvcache_ext
