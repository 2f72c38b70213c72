// Entry point of the attention over the ragged store: input checks, output allocation,
// then the CPU or CUDA kernel.
#include "attention/ragged_attention.h"

#include <cmath>
#include <limits>

#include "attention/attention_kernels.h"
#include "common/checks.h"
#include "common/device_dispatch.h"

namespace kvcache_ext {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> ragged_attention(
    const at::Tensor& q_in, const RaggedKVStore& store, double scale,
    const c10::optional<at::Tensor>& q_pos_in, bool want_mass, bool want_last, bool want_sum_sq,
    bool want_count) {
  check_defined(q_in, "q");
  const auto device = store.device();
  check_device_supported(device);
  check_device(q_in, device, "q");
  check_dtype(q_in, store.dtype(), "q (the store's dtype)");
  TORCH_CHECK_VALUE(q_in.dim() == 4, "q must be [batch, query heads, n, head_dim], got shape ",
                    q_in.sizes());
  const int64_t B = q_in.size(0), Hq = q_in.size(1), n = q_in.size(2), D = q_in.size(3);
  const int64_t H = store.heads();
  TORCH_CHECK_VALUE(B == store.batch(), "q has batch ", B, " but the store has batch ",
                    store.batch());
  TORCH_CHECK_VALUE(D == store.head_dim(), "q has head_dim ", D, " but the store has head_dim ",
                    store.head_dim());
  TORCH_CHECK_VALUE(Hq >= H && Hq % H == 0, "q has ", Hq, " query heads, which is not a multiple",
                    " of the store's ", H, " KV heads");
  // The kernels compute in float32: a double beyond its range would become inf there.
  TORCH_CHECK_VALUE(std::isfinite(scale) && std::abs(scale) <= std::numeric_limits<float>::max(),
                    "scale must be finite as a float32 (|scale| <= 3.4e38), got ", scale);
  TORCH_CHECK_VALUE(Hq / H * n < INT32_MAX, "too many query rows per KV head");

  attention::Problem p;
  p.q = q_in.contiguous();  // HF hands q over as a transposed view
  p.view = store.view();
  p.capacity = store.capacity();
  p.segments = store.num_segments();
  p.len = store.len_device();
  p.len_host = &store.len_host();
  p.groups = Hq / H;
  p.scale = static_cast<float>(scale);
  if (q_pos_in.has_value() && q_pos_in->defined()) p.q_pos = query_positions(*q_pos_in, device, B, n);

  const int64_t capacity = store.capacity();
  const auto f32 = p.q.options().dtype(at::kFloat);
  attention::Result r;
  r.out = at::empty_like(p.q);
  // Zero-filled for the CUDA kernel, which adds into them; the CPU kernel writes every slot.
  auto statistic = [&](at::IntArrayRef shape, at::ScalarType dtype) {
    return device.is_cuda() ? at::zeros(shape, f32.dtype(dtype)) : at::empty(shape, f32.dtype(dtype));
  };
  if (want_mass) r.mass = statistic({capacity}, at::kFloat);
  if (want_last) r.last = statistic({capacity, p.groups}, at::kFloat);
  if (want_sum_sq) r.sum_sq = statistic({capacity}, at::kFloat);
  if (want_count) r.count = statistic({capacity}, at::kInt);
  if (r.out.numel() == 0) {  // no kernel runs: the statistics are all zeros
    for (at::Tensor* t : {&r.mass, &r.last, &r.sum_sq, &r.count}) {
      if (t->defined()) t->zero_();
    }
    return {r.out, r.mass, r.last, r.sum_sq, r.count};
  }
  KVCACHE_DEVICE_DISPATCH(device, attention::ragged_attention, p, r);
  return {r.out, r.mass, r.last, r.sum_sq, r.count};
}

}  // namespace kvcache_ext
