// Entry points of the selection: input checks, then the CPU or CUDA kernel.
#include "select/topk.h"

#include "common/checks.h"
#include "common/device_dispatch.h"

namespace kvcache_ext {

namespace {

// Checks the slot-layout inputs shared by both selections; returns k as int32 on the device.
at::Tensor check_selection_inputs(const at::Tensor& scores, const at::Tensor& pos,
                                  const at::Tensor& start, const at::Tensor& len,
                                  const at::Tensor& k, int64_t num_k, bool check_values) {
  check_defined(scores, "scores");
  const auto device = scores.device();
  check_device_supported(device);
  check_dtype(scores, at::kFloat, "scores");
  TORCH_CHECK_VALUE(scores.dim() == 1, "scores must be 1-D [capacity], got shape ", scores.sizes());
  const int64_t capacity = scores.size(0);
  TORCH_CHECK_VALUE(capacity < INT32_MAX, "selection supports fewer than 2^31 slots");
  check_contiguous(scores, "scores");
  check_defined(pos, "pos");
  check_dtype(pos, at::kInt, "pos");
  check_device(pos, device, "pos");
  check_shape(pos, {capacity}, "pos");
  check_contiguous(pos, "pos");
  check_defined(start, "start");
  check_dtype(start, at::kLong, "start");
  check_device(start, device, "start");
  TORCH_CHECK_VALUE(start.dim() == 1, "start must be 1-D [segments], got shape ", start.sizes());
  check_contiguous(start, "start");
  const int64_t S = start.size(0);
  check_lengths(len, device, S);
  check_defined(k, "k");
  TORCH_CHECK_TYPE(is_integer_dtype(k.scalar_type()), "k must be an integer tensor, got ",
                   k.scalar_type());
  // A budget beyond any segment keeps everything: clamp before narrowing to int32, in int64
  // (INT32_MAX is out of range of a narrower k's own dtype: int8, uint8, int16 budgets).
  const at::Tensor k32 = as_int32(k.to(at::kLong).clamp_max(INT32_MAX), device, "k");
  check_shape(k32, {num_k}, "k");
  if (S == 0 || !check_values) return k32;
  // One host sync for every value check (the layout's and the budget's, read back together):
  // selection runs at eviction time, not per token.
  const at::Tensor end = start + len;
  at::Tensor bad = len.lt(0).any().logical_or(start.lt(0).any()).logical_or(end.gt(capacity).any());
  if (S > 1) bad = bad.logical_or(start.slice(0, 1).lt(end.slice(0, 0, S - 1)).any());
  const at::Tensor flags = at::stack({bad, k32.lt(0).any()}).to(at::kCPU);
  const bool* f = flags.data_ptr<bool>();
  TORCH_CHECK_VALUE(!f[0],
                    "segments must lie in order inside the slot buffers: 0 <= start[s], "
                    "start[s] + len[s] <= start[s + 1], start[S-1] + len[S-1] <= capacity, len >= 0");
  TORCH_CHECK_VALUE(!f[1], "k (the budget) must be >= 0 everywhere");
  return k32;
}

}  // namespace

at::Tensor segmented_topk(const at::Tensor& scores, const at::Tensor& pos, const at::Tensor& start,
                          const at::Tensor& len, const at::Tensor& k, bool check_values) {
  const at::Tensor k32 = check_selection_inputs(scores, pos, start, len, k, start.size(0), check_values);
  at::Tensor keep = at::zeros_like(scores, scores.options().dtype(at::kBool));
  if (start.size(0) > 0 && scores.size(0) > 0) {
    KVCACHE_DEVICE_DISPATCH(scores.device(), select::segmented_topk, scores, pos, start, len, k32,
                            keep);
  }
  return keep;
}

std::tuple<at::Tensor, at::Tensor> grouped_topk(const at::Tensor& scores, const at::Tensor& pos,
                                                const at::Tensor& start, const at::Tensor& len,
                                                int64_t group_size, const at::Tensor& k,
                                                bool check_values) {
  check_defined(start, "start");
  TORCH_CHECK_VALUE(group_size >= 1, "group_size must be >= 1, got ", group_size);
  TORCH_CHECK_VALUE(start.dim() == 1 && start.size(0) % group_size == 0,
                    "the number of segments (", start.sizes(), ") must be a multiple of group_size (",
                    group_size, ")");
  const int64_t groups = start.size(0) / group_size;
  const at::Tensor k32 = check_selection_inputs(scores, pos, start, len, k, groups, check_values);
  at::Tensor keep = at::zeros_like(scores, scores.options().dtype(at::kBool));
  at::Tensor counts = at::zeros_like(len);
  if (groups > 0 && scores.size(0) > 0) {
    KVCACHE_DEVICE_DISPATCH(scores.device(), select::grouped_topk, scores, pos, start, len,
                            group_size, k32, keep, counts);
  }
  return {keep, counts};
}

}  // namespace kvcache_ext
