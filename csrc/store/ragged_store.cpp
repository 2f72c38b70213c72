#include "store/ragged_store.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/checks.h"
#include "common/device_dispatch.h"

namespace kvcache_ext {

namespace {
// Smallest headroom a regrown segment gets, so that decode does not regrow every few tokens.
constexpr int64_t kMinGrowthSlots = 16;
}  // namespace

RaggedKVStore::RaggedKVStore(int64_t batch, int64_t heads, int64_t head_dim,
                             int64_t score_channels, const at::Tensor& like, double growth)
    : batch_(batch), heads_(heads), head_dim_(head_dim), score_channels_(score_channels),
      growth_(growth) {
  TORCH_CHECK_VALUE(batch >= 1, "batch must be >= 1, got ", batch);
  TORCH_CHECK_VALUE(heads >= 1, "heads must be >= 1, got ", heads);
  TORCH_CHECK_VALUE(head_dim >= 1, "head_dim must be >= 1, got ", head_dim);
  TORCH_CHECK_VALUE(score_channels >= 0, "score_channels must be >= 0, got ", score_channels);
  TORCH_CHECK_VALUE(growth > 1.0 && std::isfinite(growth), "growth must be > 1, got ", growth);
  const auto dtype = like.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                   "the store holds float32, float16 or bfloat16 K/V, got ", dtype);
  check_device_supported(like.device());
  kv_options_ = like.options();
  const int64_t S = batch * heads;
  const auto meta = at::TensorOptions().device(like.device());
  buf_.k = at::empty({0, head_dim}, kv_options_);
  buf_.v = at::empty({0, head_dim}, kv_options_);
  buf_.pos = at::empty({0}, meta.dtype(at::kInt));
  buf_.scores = at::empty({0, score_channels}, meta.dtype(at::kFloat));
  start_ = at::zeros({S}, meta.dtype(at::kLong));
  len_ = at::zeros({S}, meta.dtype(at::kInt));
  cap_ = at::zeros({S}, meta.dtype(at::kInt));
  start_h_.assign(S, 0);
  len_h_.assign(S, 0);
  cap_h_.assign(S, 0);
}

int64_t RaggedKVStore::num_tokens() const {
  return std::accumulate(len_h_.begin(), len_h_.end(), int64_t{0});
}

int64_t RaggedKVStore::nbytes() const {
  int64_t total = 0;
  for (const auto* t : {&buf_.k, &buf_.v, &buf_.pos, &buf_.scores, &start_, &len_, &cap_}) {
    total += t->numel() * t->element_size();
  }
  return total;
}

void RaggedKVStore::check_tokens(const at::Tensor& t, int64_t n, const char* name) const {
  check_defined(t, name);
  TORCH_CHECK_TYPE(t.scalar_type() == kv_options_.dtype().toScalarType(), name,
                   " must have the store's dtype ", kv_options_.dtype(), ", got ", t.scalar_type());
  check_device(t, kv_options_.device(), name);
  check_shape(t, {batch_, heads_, n, head_dim_}, name);
  check_contiguous(t, name);
}

void RaggedKVStore::append(const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos,
                           const c10::optional<at::Tensor>& valid) {
  check_defined(k, "k");
  TORCH_CHECK_VALUE(k.dim() == 4, "k must have shape [batch, heads, n, head_dim], got ", k.sizes());
  const int64_t n = k.size(2);
  check_tokens(k, n, "k");
  check_tokens(v, n, "v");
  const auto device = kv_options_.device();
  at::Tensor pos32 = as_int32(pos, device, "pos");
  TORCH_CHECK_VALUE(pos32.sizes() == at::IntArrayRef({n}) ||
                        pos32.sizes() == at::IntArrayRef({batch_, n}),
                    "pos must have shape [batch, n] = [", batch_, ", ", n, "] or [n], got ",
                    pos32.sizes());
  if (pos32.dim() == 1) pos32 = pos32.unsqueeze(0).expand({batch_, n}).contiguous();
  const int64_t S = num_segments();

  std::vector<int64_t> incoming(S, n);
  at::Tensor rank;    // undefined: every token is stored
  at::Tensor counts;  // tokens stored per segment, on the device; undefined: n each
  if (valid.has_value() && valid->defined()) {
    const at::Tensor& mask = *valid;
    check_dtype(mask, at::kBool, "valid");
    check_device(mask, device, "valid");
    TORCH_CHECK_VALUE(
        mask.sizes() == at::IntArrayRef({batch_, n}) ||
            mask.sizes() == at::IntArrayRef({batch_, heads_, n}),
        "valid must have shape [batch, n] or [batch, heads, n], got ", mask.sizes());
    const at::Tensor per_segment =
        (mask.dim() == 2 ? mask.unsqueeze(1).expand({batch_, heads_, n}) : mask).reshape({S, n});
    const at::Tensor as_int = per_segment.to(at::kInt);
    rank = (at::cumsum(as_int, 1, at::kInt) - 1).masked_fill_(per_segment.logical_not(), -1);
    counts = as_int.sum(1, /*keepdim=*/false, at::kInt);
    const at::Tensor counts_h = counts.to(at::kCPU, at::kLong);  // host sync: prefill only
    std::copy_n(counts_h.data_ptr<int64_t>(), S, incoming.begin());
  }
  if (n == 0) return;
  ensure_room(incoming);
  KVCACHE_DEVICE_DISPATCH(device, store::append, buf_, start_, len_, k.view({S, n, head_dim_}),
                          v.view({S, n, head_dim_}), pos32, rank);
  // Both copies of the lengths advance without a host-device transfer.
  if (counts.defined()) len_.add_(counts); else len_.add_(n);
  for (int64_t s = 0; s < S; ++s) len_h_[s] += static_cast<int32_t>(incoming[s]);
}

void RaggedKVStore::replace(const at::Tensor& slot, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& pos, bool check_bounds) {
  const auto device = kv_options_.device();
  const int64_t S = num_segments();
  check_tokens(k, 1, "k");
  check_tokens(v, 1, "v");
  check_defined(slot, "slot");
  TORCH_CHECK_TYPE(is_integer_dtype(slot.scalar_type()), "slot must be an integer tensor, got ",
                   slot.scalar_type());
  check_shape(slot, {batch_, heads_}, "slot");
  const at::Tensor slot64 = slot.to(device, at::kLong).reshape({S}).contiguous();
  at::Tensor pos32 = as_int32(pos, device, "pos");
  TORCH_CHECK_VALUE(pos32.numel() == batch_ && (pos32.dim() == 1 || pos32.dim() == 2),
                    "pos must have shape [batch] or [batch, 1], got ", pos32.sizes());
  pos32 = pos32.reshape({batch_});
  if (check_bounds) {
    const bool out_of_range = slot64.lt(0).logical_or(slot64.ge(len_)).any().item<bool>();
    TORCH_CHECK_INDEX(!out_of_range, "slot must index a live slot of its segment: 0 <= slot[b, h] < ",
                      "len[b, h] (an empty segment has nothing to replace)");
  }
  KVCACHE_DEVICE_DISPATCH(device, store::replace, buf_, start_, slot64, k.view({S, head_dim_}),
                          v.view({S, head_dim_}), pos32);
}

void RaggedKVStore::compact(const at::Tensor& keep) {
  check_defined(keep, "keep");
  check_dtype(keep, at::kBool, "keep");
  check_device(keep, kv_options_.device(), "keep");
  TORCH_CHECK_VALUE(keep.dim() == 1 && keep.size(0) == capacity(),
                    "keep must be a [capacity] = [", capacity(),
                    "] bool mask in the store's slot layout, got shape ", keep.sizes());
  check_contiguous(keep, "keep");
  KVCACHE_DEVICE_DISPATCH(kv_options_.device(), store::compact, buf_, start_, len_, keep);
  const at::Tensor lens = len_.to(at::kCPU);  // host sync: the new lengths depend on keep
  std::copy_n(lens.data_ptr<int32_t>(), num_segments(), len_h_.begin());
}

void RaggedKVStore::reserve(int64_t extra) {
  TORCH_CHECK_VALUE(extra >= 0, "reserve takes a number of tokens >= 0, got ", extra);
  std::vector<int32_t> new_cap(cap_h_);
  bool grows = false;
  for (size_t s = 0; s < new_cap.size(); ++s) {
    const int64_t need = len_h_[s] + extra;
    TORCH_CHECK_VALUE(need <= INT32_MAX, "a segment cannot hold more than 2^31 - 1 tokens");
    if (need > new_cap[s]) {
      new_cap[s] = static_cast<int32_t>(need);
      grows = true;
    }
  }
  if (grows) relayout(new_cap);
}

void RaggedKVStore::shrink_to_fit() {
  if (cap_h_ != len_h_) relayout(len_h_);
}

void RaggedKVStore::ensure_room(const std::vector<int64_t>& incoming) {
  const int64_t S = num_segments();
  std::vector<int64_t> need(S);
  bool fits = true;
  for (int64_t s = 0; s < S; ++s) {
    need[s] = len_h_[s] + incoming[s];
    fits = fits && need[s] <= cap_h_[s];
  }
  if (fits) return;
  // Every segment gets headroom proportional to the larger of its own need and the mean
  // need. A regrowth copies the whole store once, and the headroom guarantees that at
  // least (growth - 1) * total tokens arrive before the next one: amortized O(1) per token
  // however skewed the segment lengths are, with slack bounded by 2 * (growth - 1) * total.
  const double mean = std::accumulate(need.begin(), need.end(), 0.0) / static_cast<double>(S);
  std::vector<int32_t> new_cap(S);
  for (int64_t s = 0; s < S; ++s) {
    const auto headroom = std::max<int64_t>(
        kMinGrowthSlots,
        static_cast<int64_t>(std::ceil((growth_ - 1.0) * std::max<double>(need[s], mean))));
    const int64_t target = std::max<int64_t>(cap_h_[s], need[s] + headroom);
    TORCH_CHECK_VALUE(target <= INT32_MAX, "a segment cannot hold more than 2^31 - 1 tokens");
    new_cap[s] = static_cast<int32_t>(target);
  }
  relayout(new_cap);
}

void RaggedKVStore::relayout(const std::vector<int32_t>& new_cap) {
  const int64_t S = num_segments();
  std::vector<int64_t> new_start(S);
  int64_t total = 0;
  for (int64_t s = 0; s < S; ++s) {
    new_start[s] = total;
    total += new_cap[s];
  }
  const auto device = kv_options_.device();
  const auto meta = at::TensorOptions().device(device);
  store::SlotBuffers fresh{
      at::empty({total, head_dim_}, kv_options_), at::empty({total, head_dim_}, kv_options_),
      at::empty({total}, meta.dtype(at::kInt)),
      at::empty({total, score_channels_}, meta.dtype(at::kFloat))};
  const at::Tensor fresh_start = at::tensor(new_start, at::kLong).to(device);
  const int64_t max_len = *std::max_element(len_h_.begin(), len_h_.end());
  if (max_len > 0) {
    KVCACHE_DEVICE_DISPATCH(device, store::relocate, buf_, fresh, start_, fresh_start, len_,
                            max_len);
  }
  buf_ = std::move(fresh);
  start_ = fresh_start;
  cap_ = at::tensor(new_cap, at::kInt).to(device);
  start_h_ = std::move(new_start);
  cap_h_ = new_cap;
}

}  // namespace kvcache_ext
