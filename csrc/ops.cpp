// The kernels as torch custom ops: TORCH_LIBRARY(kvcache_ext) and the functions the ops run,
// with every input check (see ops.h). The fake implementations, for torch.compile, are in
// kvcache_ext/kernels/ops.py.
#include "ops.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "attention/attention_kernels.h"
#include "common/checks.h"
#include "common/device_dispatch.h"
#include "select/slot_rule.h"
#include "select/topk.h"
#include "store/page_allocator.h"
#include "store/score_channels.h"
#include "store/store_kernels.h"

namespace kvcache_ext::ops {

int32_t page_shift(int64_t page_size) {
  TORCH_CHECK_VALUE(page_size >= 1 && page_size <= kMaxPageSize && (page_size & (page_size - 1)) == 0,
                    "page_size must be a power of two in [1, ", kMaxPageSize, "], got ", page_size);
  int32_t shift = 0;
  while ((int64_t{1} << shift) < page_size) ++shift;
  return shift;
}

namespace {

// The PagedView of a state, as the kernels take it; `page_base` keeps the view's page
// addresses alive (a [pages] int64 tensor on the state's device). Each op makes it from the
// state it is handed (checked, page addresses cached by pool: below).
struct StateView {
  store::PagedView view;
  at::ScalarType dtype;  // the pages' element type (is_page_dtype)
  at::Tensor page_base;
  int64_t segments = 0;
  int64_t capacity = 0;  // pages * page_size: the length of slot-layout tensors
};

// ---------------------------------------------------------------------------------------
// Page addresses. The kernels find page p at page_base[p]; page_base is a function of the
// pool alone (each slab's address and page count, and the record size), so it is cached
// under exactly that key: an op called again on the same pool (every decode step) finds it
// without a host-to-device copy, and an op handed other tensors than the store's own (the
// copies that functionalization makes under torch.compile, say) gets their addresses, never
// stale ones. A key whose addresses were freed and reused by an equal pool maps to equal
// addresses, so no entry is ever wrong.
//
// On CUDA the addresses are copied up without a sync (non-blocking, on the current stream),
// so an entry is also keyed by that stream: a kernel on the same stream runs after the copy
// (stream order), and when the entry is dropped its memory returns to the caching allocator
// as a block of that stream, which it hands out again only in that stream's order, after the
// kernels that read it. An op called on another stream gets (and uploads) its own entry:
// one small copy per stream and pool, no sync, no record_stream, never a read of an
// address list whose copy has not run yet, nor of one freed under a running kernel.

struct PoolKey {
  c10::Device device;
  c10::StreamId stream;  // the stream the addresses were copied up on (CPU: its default)
  int64_t record_bytes;
  std::vector<std::pair<uintptr_t, int64_t>> slabs;  // address, pages
  bool operator==(const PoolKey& o) const {
    return device == o.device && stream == o.stream && record_bytes == o.record_bytes &&
           slabs == o.slabs;
  }
};

struct PoolKeyHash {
  size_t operator()(const PoolKey& k) const {
    size_t h = std::hash<c10::Device>()(k.device) ^ std::hash<int64_t>()(k.record_bytes) ^
               (std::hash<int64_t>()(k.stream) << 1);
    for (const auto& [address, pages] : k.slabs) {
      h = h * 1000003u ^ std::hash<uintptr_t>()(address) ^ (std::hash<int64_t>()(pages) << 1);
    }
    return h;
  }
};

at::Tensor page_base_of(at::TensorList pool, int64_t record_bytes, const c10::Device& device) {
  // The current stream of `device`, read without CUDA headers (this file builds for CPU too).
  const c10::StreamId stream = c10::impl::VirtualGuardImpl(device.type()).getStream(device).id();
  PoolKey key{device, stream, record_bytes, {}};
  key.slabs.reserve(pool.size());
  int64_t pages = 0;
  for (const at::Tensor& slab : pool) {
    key.slabs.emplace_back(reinterpret_cast<uintptr_t>(slab.data_ptr()), slab.size(0));
    pages += slab.size(0);
  }
  static std::mutex mutex;
  // Never destroyed: CUDA tensors must not be freed after the CUDA runtime is torn down.
  static auto* cache = new std::unordered_map<PoolKey, at::Tensor, PoolKeyHash>();
  static int64_t cached_pages = 0;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    const auto it = cache->find(key);
    if (it != cache->end()) return it->second;
  }
  const auto host = at::TensorOptions().dtype(at::kLong).pinned_memory(device.is_cuda());
  at::Tensor bases = at::empty({pages}, host);
  int64_t* out = bases.data_ptr<int64_t>();
  for (const auto& [address, slab_pages] : key.slabs) {
    for (int64_t p = 0; p < slab_pages; ++p) *out++ = static_cast<int64_t>(address) + p * record_bytes;
  }
  // From pinned memory: no sync (the caching host allocator keeps the buffer until the copy ran).
  if (device.is_cuda()) bases = bases.to(device, at::kLong, /*non_blocking=*/true);
  const std::lock_guard<std::mutex> lock(mutex);
  // A growing cache makes a new pool (one more slab) every page of tokens: old keys are
  // dropped wholesale once the cache holds many pages' addresses.
  if (cache->size() >= 1024 || cached_pages + pages > (int64_t{1} << 23)) {
    cache->clear();
    cached_pages = 0;
  }
  if (cache->emplace(std::move(key), bases).second) cached_pages += pages;
  return bases;
}

// CPU stores only (on CUDA reading them would cost a sync): every live token, and the
// `extra[s]` (or extra_all) tokens about to be written after them, lie in pages the segment
// owns, and those pages exist.
void check_contents_cpu(const at::Tensor& page_table, const at::Tensor& len, int64_t pages,
                        int32_t shift, const int32_t* extra, int64_t extra_all) {
  const int64_t S = page_table.size(0), width = page_table.size(1);
  const int32_t* table = page_table.data_ptr<int32_t>();
  const int32_t* lens = len.data_ptr<int32_t>();
  for (int64_t s = 0; s < S; ++s) {
    const int64_t more = extra ? extra[s] : extra_all;
    TORCH_CHECK_VALUE(lens[s] >= 0 && more >= 0, "len[", s, "] = ", lens[s],
                      " is not a length (the store's state is corrupt)");
    const int64_t need = (lens[s] + more + (int64_t{1} << shift) - 1) >> shift;
    TORCH_CHECK_VALUE(need <= width, "segment ", s, " needs ", need, " pages for ", lens[s] + more,
                      " tokens but the page table has ", width,
                      " columns: give the store pages first (RaggedKVStore.reserve)");
    for (int64_t j = 0; j < need; ++j) {
      const int32_t page = table[s * width + j];
      TORCH_CHECK_VALUE(page >= 0 && page < pages, "page_table[", s, ", ", j, "] = ", page,
                        " is not a page of the pool (", pages, " pages): segment ", s,
                        " needs pages for ", lens[s] + more, " tokens");
    }
  }
}

void check_tokens(const at::Tensor& t, const at::Tensor& like, const char* name) {
  check_defined(t, name);
  check_dtype(t, like.scalar_type(), name);
  check_device(t, like.device(), name);
  check_shape(t, like.sizes(), name);
  check_contiguous(t, name);
}

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
  check_device_or_cpu(k, device, "k");
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

// The pages' element types: a float store's K/V dtype, or int8 (quantized pages).
bool is_page_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kChar;
}

// Rows handed to a store whose pages hold page_dtype (q, k, v): that dtype, or for int8 pages
// any float dtype the kernels compute with (int8 pages quantize K and V as they store them).
void check_rows_dtype(const at::Tensor& t, at::ScalarType page_dtype, const char* name) {
  if (page_dtype != at::kChar) {
    TORCH_CHECK_TYPE(t.scalar_type() == page_dtype, name, " must have the store's dtype ", page_dtype,
                     ", got ", t.scalar_type());
    return;
  }
  const at::ScalarType d = t.scalar_type();
  TORCH_CHECK_TYPE(d == at::kFloat || d == at::kHalf || d == at::kBFloat16, name,
                   " must be float32, float16 or bfloat16 (a store of int8 pages quantizes K and V as it "
                   "stores them), got ", d);
}

void check_query(const at::Tensor& q, const c10::Device& device, at::ScalarType dtype,
                 int64_t batch, int64_t kv_heads, int64_t head_dim, double scale) {
  check_defined(q, "q");
  check_device(q, device, "q");
  check_rows_dtype(q, dtype, "q");
  TORCH_CHECK_VALUE(q.dim() == 4, "q must be [batch, query heads, n, head_dim], got shape ", q.sizes());
  const int64_t Hq = q.size(1);
  TORCH_CHECK_VALUE(q.size(0) == batch, "q has batch ", q.size(0), " but the store has batch ", batch);
  TORCH_CHECK_VALUE(q.size(3) == head_dim, "q has head_dim ", q.size(3),
                    " but the store has head_dim ", head_dim);
  TORCH_CHECK_VALUE(Hq >= kv_heads && Hq % kv_heads == 0, "q has ", Hq,
                    " query heads, which is not a multiple of the store's ", kv_heads, " KV heads");
  // The kernels compute in float32: a double beyond its range would become inf there.
  TORCH_CHECK_VALUE(std::isfinite(scale) && std::abs(scale) <= std::numeric_limits<float>::max(),
                    "scale must be finite as a float32 (|scale| <= 3.4e38), got ", scale);
  TORCH_CHECK_VALUE(Hq / kv_heads * q.size(2) < INT32_MAX, "too many query rows per KV head");
}

StateView state_view(at::TensorList pool, const at::Tensor& page_table, const at::Tensor& len,
                     int64_t page_size, int64_t head_dim, int64_t score_channels,
                     at::ScalarType dtype, bool check_contents = true) {
  const int32_t shift = page_shift(page_size);
  TORCH_CHECK_VALUE(head_dim >= 1 && head_dim <= 65536, "head_dim must be in [1, 65536], got ", head_dim);
  TORCH_CHECK_VALUE(score_channels >= 0 && score_channels <= 65536,
                    "score_channels must be in [0, 65536], got ", score_channels);
  TORCH_CHECK_TYPE(is_page_dtype(dtype),
                   "the store holds float32, float16 or bfloat16 K/V, or int8 pages, got ", dtype);
  check_defined(page_table, "page_table");
  const c10::Device device = page_table.device();
  check_device_supported(device);
  check_dtype(page_table, at::kInt, "page_table");
  TORCH_CHECK_VALUE(page_table.dim() == 2, "page_table must be [segments, width], got shape ",
                    page_table.sizes());
  check_contiguous(page_table, "page_table");
  const int64_t S = page_table.size(0);
  check_lengths(len, device, S);
  const store::PageRecord record = store::page_record(page_size, head_dim, c10::elementSize(dtype),
                                                      score_channels, /*quantized=*/dtype == at::kChar);
  int64_t pages = 0;
  for (size_t i = 0; i < pool.size(); ++i) {
    const at::Tensor& slab = pool[i];
    TORCH_CHECK_VALUE(slab.defined() && slab.scalar_type() == at::kByte && slab.dim() == 2 &&
                          slab.size(1) == record.bytes && slab.is_contiguous(),
                      "pool[", i, "] must be a contiguous uint8 [pages, ", record.bytes,
                      "] slab (pages of ", page_size, " tokens of head_dim ", head_dim, ", ", dtype,
                      ", ", score_channels, " score channels)");
    check_device(slab, device, "pool");
    pages += slab.size(0);
  }
  TORCH_CHECK_VALUE(pages <= (INT32_MAX >> shift), "the store cannot hold more than 2^31 - 1 slots");
  StateView st;
  st.dtype = dtype;
  st.page_base = page_base_of(pool, record.bytes, device);
  st.view = store::PagedView{st.page_base.data_ptr<int64_t>(), page_table.data_ptr<int32_t>(),
                             page_table.size(1), shift, record};
  st.segments = S;
  st.capacity = pages << shift;
  if (check_contents && device.is_cpu()) check_contents_cpu(page_table, len, pages, shift, nullptr, 0);
  return st;
}

// What store_append (and store_decode_step) write, checked: positions as int32, and the
// rank and counts of an append of some tokens only (both undefined: every token).
struct AppendInputs {
  at::Tensor pos32, rank, counts;
};

AppendInputs check_append(const StateView& st, const at::Tensor& page_table, const at::Tensor& len,
                          const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos,
                          const c10::optional<at::Tensor>& rank_in,
                          const c10::optional<at::Tensor>& counts_in, int64_t page_size) {
  const c10::Device device = page_table.device();
  const int64_t B = k.size(0), H = k.size(1), n = k.size(2), S = st.segments;
  check_device(k, device, "k");
  check_contiguous(k, "k");
  check_rows_dtype(k, st.dtype, "k");
  TORCH_CHECK_VALUE(B * H == S, "k has batch x heads = ", B, " x ", H,
                    " segments but the page table has ", S);
  check_tokens(v, k, "v");
  AppendInputs in;
  in.pos32 = append_positions(pos, device, B, n);
  const bool has_rank = rank_in.has_value() && rank_in->defined();
  const bool has_counts = counts_in.has_value() && counts_in->defined();
  TORCH_CHECK_VALUE(has_rank == has_counts, "rank and counts are given together or not at all");
  if (has_rank) {
    in.rank = *rank_in;
    in.counts = *counts_in;
    check_dtype(in.rank, at::kInt, "rank");
    check_device(in.rank, device, "rank");
    check_shape(in.rank, {S, n}, "rank");
    check_contiguous(in.rank, "rank");
    check_dtype(in.counts, at::kInt, "counts");
    check_device(in.counts, device, "counts");
    check_shape(in.counts, {S}, "counts");
    check_contiguous(in.counts, "counts");
  }
  if (device.is_cpu()) {
    if (has_rank) {  // ranks lie in [-1, counts): the tokens stored land on the counted slots
      const int32_t* r = in.rank.data_ptr<int32_t>();
      const int32_t* c = in.counts.data_ptr<int32_t>();
      for (int64_t s = 0; s < S; ++s) {
        TORCH_CHECK_VALUE(c[s] >= 0 && c[s] <= n, "counts[", s, "] = ", c[s], " is not in [0, ", n, "]");
        for (int64_t t = 0; t < n; ++t) {
          TORCH_CHECK_VALUE(r[s * n + t] >= -1 && r[s * n + t] < c[s], "rank[", s, ", ", t, "] = ",
                            r[s * n + t], " is not in [-1, counts[", s, "] = ", c[s], ")");
        }
      }
    }
    check_contents_cpu(page_table, len, st.capacity / page_size, st.view.shift,
                       has_counts ? in.counts.data_ptr<int32_t>() : nullptr, n);
  }
  return in;
}

// The work of store_append and attention_run on a StateView, past the checks of the state:
// one the ops made with state_view.
// append_tokens: k, v [B, H, n, D] contiguous, pos32 [B, n] int32 contiguous, rank and counts
// both undefined or as store_append takes them; the pages must hold len + counts tokens.
void append_tokens(const StateView& st, const at::Tensor& len, const at::Tensor& k,
                   const at::Tensor& v, const at::Tensor& pos32, const at::Tensor& rank,
                   const at::Tensor& counts) {
  const int64_t S = st.segments, n = k.size(2), D = k.size(3);
  if (n == 0 || S == 0) return;
  KVCACHE_DEVICE_DISPATCH(len.device(), store::append, st.view, len, k.view({S, n, D}),
                          v.view({S, n, D}), pos32, rank);
  if (counts.defined()) len.add_(counts); else len.add_(n);
}

// attend: attention_run's checks of q, scale and plan, then its work.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attend(
    const StateView& st, const at::Tensor& q_in, const at::Tensor& len, const at::Tensor& plan,
    const c10::optional<at::Tensor>& q_pos_in, double scale, int64_t kv_heads, int64_t head_dim,
    at::ScalarType dtype, bool want_mass, bool want_last, bool want_sum_sq, bool want_count) {
  const c10::Device device = len.device();
  const int64_t S = st.segments, H = kv_heads;
  TORCH_CHECK_VALUE(H >= 1 && S % H == 0, "kv_heads = ", H, " does not divide the ", S,
                    " segments of the page table");
  check_query(q_in, device, dtype, S / H, H, head_dim, scale);
  const int64_t B = q_in.size(0), Hq = q_in.size(1), n = q_in.size(2);
  check_defined(plan, "plan");
  check_dtype(plan, at::kInt, "plan");
  check_device(plan, device, "plan");
  check_contiguous(plan, "plan");

  attention::Problem p;
  p.q = q_in.contiguous();
  p.view = st.view;
  p.capacity = st.capacity;
  p.segments = S;
  p.len = len;
  p.groups = Hq / H;
  p.scale = static_cast<float>(scale);
  std::vector<int32_t> len_host;
  if (device.is_cpu()) {
    // A CPU plan is the lengths it was made for; the kernel cuts its units from the lengths
    // the store has now (free to read here), so a stale plan of the store gives the same
    // result, as on CUDA: what a decode step replayed with the plan it was captured with needs.
    TORCH_CHECK_VALUE(plan.dim() == 1 && plan.size(0) == S,
                      "plan must be a CPU plan of this store's ", S, " segments (attention_plan), got "
                      "shape ", plan.sizes());
    len_host.assign(len.data_ptr<int32_t>(), len.data_ptr<int32_t>() + S);
    p.len_host = &len_host;
  } else {
    p.len_host = nullptr;
    p.plan = plan;
  }
  if (q_pos_in.has_value() && q_pos_in->defined()) p.q_pos = query_positions(*q_pos_in, device, B, n);
  const auto f32 = p.q.options().dtype(at::kFloat);
  attention::Result r;
  r.out = at::empty_like(p.q);
  auto statistic = [&](bool wanted, at::IntArrayRef shape, at::ScalarType dtype) {
    if (!wanted) return at::Tensor();
    // Zero-filled for the CUDA kernels, which write only the live slots (adding up over passes
    // of query chunks); the CPU kernel writes every slot.
    return device.is_cuda() ? at::zeros(shape, f32.dtype(dtype)) : at::empty(shape, f32.dtype(dtype));
  };
  r.mass = statistic(want_mass, {st.capacity}, at::kFloat);
  r.last = statistic(want_last, {st.capacity, p.groups}, at::kFloat);
  r.sum_sq = statistic(want_sum_sq, {st.capacity}, at::kFloat);
  r.count = statistic(want_count, {st.capacity}, at::kInt);
  if (r.out.numel() == 0) {
    for (at::Tensor* t : {&r.mass, &r.last, &r.sum_sq, &r.count}) {
      if (t->defined()) t->zero_();
    }
  } else {
#ifdef KVCACHE_EXT_WITH_CUDA
    // The tensor-core prefill where it applies, unless KVCACHE_EXT_TC_PREFILL=0 (attention_kernels.h).
    if (device.is_cuda() && attention::prefill_tc_applies(p, r)) {
      attention::prefill_attention_cuda(p, r);
    } else {
      KVCACHE_DEVICE_DISPATCH(device, attention::ragged_attention, p, r);
    }
#else
    KVCACHE_DEVICE_DISPATCH(device, attention::ragged_attention, p, r);
#endif
  }
  // A statistic not asked for is an empty tensor (an op returns no None).
  auto or_empty = [&](const at::Tensor& t, at::ScalarType dtype) {
    return t.defined() ? t : at::empty({0}, f32.dtype(dtype));
  };
  return {r.out, or_empty(r.mass, at::kFloat), or_empty(r.last, at::kFloat),
          or_empty(r.sum_sq, at::kFloat), or_empty(r.count, at::kInt)};
}

}  // namespace

void store_append(at::TensorList pool, const at::Tensor& page_table, const at::Tensor& len,
                  const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos,
                  const c10::optional<at::Tensor>& rank_in, const c10::optional<at::Tensor>& counts_in,
                  int64_t page_size, int64_t score_channels, c10::optional<at::ScalarType> kv_dtype) {
  check_defined(k, "k");
  TORCH_CHECK_VALUE(k.dim() == 4, "k must have shape [batch, heads, n, head_dim], got ", k.sizes());
  const StateView st = state_view(pool, page_table, len, page_size, k.size(3), score_channels,
                                  kv_dtype.value_or(k.scalar_type()));
  const AppendInputs in = check_append(st, page_table, len, k, v, pos, rank_in, counts_in, page_size);
  append_tokens(st, len, k, v, in.pos32, in.rank, in.counts);
}

void store_replace(at::TensorList pool, const at::Tensor& page_table, const at::Tensor& len,
                   const at::Tensor& slot, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& pos, int64_t page_size, int64_t head_dim,
                   int64_t score_channels, at::ScalarType dtype, bool check_bounds) {
  const StateView st = state_view(pool, page_table, len, page_size, head_dim, score_channels, dtype);
  check_defined(k, "k");
  check_rows_dtype(k, dtype, "k");
  TORCH_CHECK_VALUE(k.dim() == 4 && k.size(2) == 1 && k.size(3) == head_dim,
                    "k must have shape [batch, heads, 1, head_dim = ", head_dim, "], got ", k.sizes());
  const c10::Device device = page_table.device();
  const int64_t B = k.size(0), H = k.size(1), D = k.size(3), S = st.segments;
  check_device(k, device, "k");
  check_contiguous(k, "k");
  TORCH_CHECK_VALUE(B * H == S, "k has batch x heads = ", B, " x ", H,
                    " segments but the page table has ", S);
  check_tokens(v, k, "v");
  check_defined(slot, "slot");
  TORCH_CHECK_TYPE(is_integer_dtype(slot.scalar_type()), "slot must be an integer tensor, got ",
                   slot.scalar_type());
  check_shape(slot, {B, H}, "slot");
  check_device_or_cpu(slot, device, "slot");
  const at::Tensor slot64 = slot.to(device, at::kLong).reshape({S}).contiguous();
  at::Tensor pos32 = as_position32(pos, device, "pos", 0);
  TORCH_CHECK_VALUE(pos32.numel() == B && (pos32.dim() == 1 || pos32.dim() == 2),
                    "pos must have shape [batch] or [batch, 1], got ", pos32.sizes());
  pos32 = pos32.reshape({B});
  if (device.is_cpu()) {  // free: the first slot out of range, named
    const int64_t* index = slot64.data_ptr<int64_t>();
    const int32_t* lens = len.data_ptr<int32_t>();
    for (int64_t s = 0; s < S; ++s) {
      TORCH_CHECK_INDEX(index[s] >= 0 && index[s] < lens[s], "slot must index a live token of its ",
                        "segment: 0 <= slot[b, h] < len[b, h], got slot[", s / H, ", ", s % H, "] = ",
                        index[s], " where len is ", lens[s], " (an empty segment has nothing to replace)");
    }
  } else if (check_bounds) {  // one host sync
    const bool out_of_range = slot64.lt(0).logical_or(slot64.ge(len)).any().item<bool>();
    TORCH_CHECK_INDEX(!out_of_range, "slot must index a live token of its segment: 0 <= slot[b, h] < ",
                      "len[b, h] (an empty segment has nothing to replace)");
  }
  if (S == 0) return;
  KVCACHE_DEVICE_DISPATCH(device, store::replace, st.view, slot64, k.view({S, D}), v.view({S, D}),
                          pos32);
}

void store_compact(at::TensorList pool, const at::Tensor& page_table, const at::Tensor& len,
                   const at::Tensor& keep, int64_t page_size, int64_t head_dim,
                   int64_t score_channels, at::ScalarType dtype, bool stable) {
  const StateView st = state_view(pool, page_table, len, page_size, head_dim, score_channels, dtype);
  check_defined(keep, "keep");
  check_dtype(keep, at::kBool, "keep");
  check_device(keep, page_table.device(), "keep");
  TORCH_CHECK_VALUE(keep.dim() == 1 && keep.size(0) == st.capacity, "keep must be a [capacity] = [",
                    st.capacity, "] bool mask in the store's slot layout, got shape ", keep.sizes());
  check_contiguous(keep, "keep");
  if (st.capacity == 0 || st.segments == 0) return;
  if (stable) {
    KVCACHE_DEVICE_DISPATCH(page_table.device(), store::compact, st.view, len, keep);
  } else {
    KVCACHE_DEVICE_DISPATCH(page_table.device(), store::compact_unordered, st.view, len, keep);
  }
}

void store_add_scores(at::TensorList pool, const at::Tensor& page_table, const at::Tensor& len,
                      const at::Tensor& values, int64_t channel, int64_t page_size,
                      int64_t head_dim, int64_t score_channels, at::ScalarType dtype) {
  const StateView st = state_view(pool, page_table, len, page_size, head_dim, score_channels, dtype);
  TORCH_CHECK_VALUE(channel >= 0 && channel < score_channels, "channel must be in [0, ", score_channels,
                    ") (the store's score channels), got ", channel);
  check_defined(values, "values");
  check_dtype(values, at::kFloat, "values");
  check_device(values, page_table.device(), "values");
  TORCH_CHECK_VALUE(values.dim() == 1 && values.size(0) == st.capacity, "values must be a [capacity] = [",
                    st.capacity, "] float32 tensor in the store's slot layout, got shape ", values.sizes());
  check_contiguous(values, "values");
  store::add_to_scores(pool, st.view.record, page_size, channel, values);
}

at::Tensor store_check(at::TensorList pool, const at::Tensor& page_table, const at::Tensor& len,
                       int64_t page_size, int64_t head_dim, int64_t score_channels,
                       at::ScalarType dtype) {
  // The layout checks of every op, but not the contents (that is what this op reports).
  const StateView st = state_view(pool, page_table, len, page_size, head_dim, score_channels,
                                  dtype, /*check_contents=*/false);
  // Device-side tensor ops: no host sync, on CPU and CUDA alike.
  const int64_t width = page_table.size(1), pages = st.capacity >> st.view.shift;
  const at::Tensor lens = len.to(at::kLong);
  const at::Tensor need = (lens + (page_size - 1)).div(page_size, "floor");  // pages in use
  const at::Tensor in_use = at::arange(width, lens.options()).unsqueeze(0) < need.unsqueeze(1);
  const at::Tensor table = page_table.to(at::kLong);
  const at::Tensor bad_page =
      in_use.logical_and(table.lt(0).logical_or(table.ge(pages))).any(1);
  const auto code = [&](int32_t c) { return at::full({}, c, len.options()); };
  at::Tensor codes = at::zeros_like(len);
  codes = at::where(bad_page, code(kStoreCheckBadPage), codes);
  codes = at::where(need.gt(width), code(kStoreCheckTooFewColumns), codes);
  return at::where(lens.lt(0), code(kStoreCheckNegativeLength), codes);
}

namespace {

// A slot rule (select/slot_rule.h) from the arguments of store_topk,
// checked: rule "mass" (channel 0) or "position"; sinks, recent >= 0; last_pos [rows]
// integers on `device`, needed when recent > 0 (rows: the batch, or -1 when the caller does
// not know it: then any B dividing the segments). `newest` receives last_pos as int64
// contiguous (the rule points into it: keep it alive while the rule is used).
select::SlotRule slot_rule_of(const std::string& rule, int64_t sinks, int64_t recent,
                              const c10::optional<at::Tensor>& last_pos, int64_t rows, int64_t segments,
                              int64_t score_channels, const c10::Device& device, at::Tensor& newest) {
  TORCH_CHECK_VALUE(rule == "mass" || rule == "position", "rule must be 'mass' (score channel 0 "
                    "accumulates the attention each token receives) or 'position', got '", rule, "'");
  TORCH_CHECK_VALUE(rule != "mass" || score_channels >= 1, "rule 'mass' accumulates in score channel 0 "
                    "and scores by it, but this store has no score channels");
  TORCH_CHECK_VALUE(sinks >= 0 && recent >= 0, "sinks and recent must be >= 0, got sinks = ", sinks,
                    " and recent = ", recent);
  select::SlotRule slot_rule;
  slot_rule.by_position = rule == "position";
  slot_rule.sinks = static_cast<int32_t>(std::min<int64_t>(sinks, INT32_MAX));
  if (recent == 0) return slot_rule;
  TORCH_CHECK_VALUE(last_pos.has_value() && last_pos->defined(), "recent > 0 needs last_pos, the "
                    "newest position of every row");
  TORCH_CHECK_TYPE(is_integer_dtype(last_pos->scalar_type()), "last_pos must be an integer tensor, "
                   "got ", last_pos->scalar_type());
  if (rows >= 0) {
    check_shape(*last_pos, {rows}, "last_pos");
  } else {
    rows = last_pos->numel();
    TORCH_CHECK_VALUE(last_pos->dim() == 1 && rows >= 1 && segments % rows == 0, "last_pos must be [B] "
                      "(one per row, B dividing the ", segments, " segments), got shape ", last_pos->sizes());
  }
  check_device(*last_pos, device, "last_pos");
  newest = last_pos->to(at::kLong).contiguous();
  // Beyond 2^32 every int32 position is as recent as it gets (and newest - recent cannot overflow).
  slot_rule.recent = std::min<int64_t>(recent, int64_t{1} << 32);
  slot_rule.newest = newest.data_ptr<int64_t>();
  slot_rule.heads = segments / rows;
  return slot_rule;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> store_topk(at::TensorList pool, const at::Tensor& page_table,
                                              const at::Tensor& len,
                                              const c10::optional<at::Tensor>& scores,
                                              const at::Tensor& k, int64_t group_size,
                                              int64_t page_size, int64_t head_dim,
                                              int64_t score_channels, at::ScalarType dtype,
                                              const c10::optional<std::string>& rule, int64_t sinks,
                                              int64_t recent, const c10::optional<at::Tensor>& last_pos) {
  const StateView st = state_view(pool, page_table, len, page_size, head_dim, score_channels, dtype);
  const c10::Device device = page_table.device();
  const int64_t S = st.segments;
  TORCH_CHECK_VALUE(group_size >= 1 && S % group_size == 0, "group_size must divide the ", S,
                    " segments, got ", group_size);
  const int64_t groups = S / group_size;
  // The longest segment, for the padded scores' check: read on CPU only (on CUDA it would
  // cost a host sync; the kernel reads a token past the padded width as NaN instead).
  int64_t longest = 0;
  if (device.is_cpu() && S > 0) {
    const int32_t* lens = len.data_ptr<int32_t>();
    longest = *std::max_element(lens, lens + S);
  }
  at::Tensor given;
  at::Tensor newest;  // what slot_rule.newest points into
  select::SlotRule slot_rule;
  const bool by_rule = rule.has_value();
  const bool scores_given = scores.has_value() && scores->defined();
  TORCH_CHECK_VALUE(by_rule || (sinks == 0 && recent == 0 && !(last_pos.has_value() && last_pos->defined())),
                    "sinks, recent and last_pos protect tokens under a rule: pass rule");
  if (by_rule) {
    TORCH_CHECK_VALUE(!scores_given, "store_topk takes scores or a rule (which scores each token from its "
                      "record), not both");
    slot_rule = slot_rule_of(*rule, sinks, recent, last_pos, -1, S, score_channels, device, newest);
  } else if (scores_given) {
    given = *scores;
    check_dtype(given, at::kFloat, "scores");
    check_device(given, device, "scores");
    check_contiguous(given, "scores");
    const bool slot_layout = given.dim() == 1 && given.size(0) == st.capacity;
    const bool padded = given.dim() == 3 && given.size(0) * given.size(1) == S &&
                        given.size(2) >= longest;
    TORCH_CHECK_VALUE(slot_layout || padded, "scores must be [capacity] = [", st.capacity,
                      "] in slot layout or [batch, heads, L >= ", longest, "] padded, got shape ",
                      given.sizes());
  } else {
    TORCH_CHECK_VALUE(score_channels > 0, "this store has no score channels: pass scores");
  }
  check_defined(k, "k");
  TORCH_CHECK_TYPE(is_integer_dtype(k.scalar_type()), "k (the budget) must be an integer tensor, got ",
                   k.scalar_type());
  TORCH_CHECK_VALUE(k.dim() == 1 && k.size(0) == groups, "k (the budget) must have shape [", groups,
                    "] (one per ", group_size == 1 ? std::string("segment")
                                                   : "group of " + std::to_string(group_size) + " segments",
                    "), got ", k.sizes());
  check_device_or_cpu(k, device, "k (the budget)");
  // Widen before the clamp: INT32_MAX is out of range of an int8/uint8/int16 budget's dtype.
  at::Tensor k32;
  if (device.is_cpu()) {
    k32 = k.to(at::kCPU, at::kLong).clamp_max(INT32_MAX).to(at::kInt).contiguous();
    for (int64_t g = 0; g < groups; ++g) {
      TORCH_CHECK_VALUE(k32.data_ptr<int32_t>()[g] >= 0, "k (the budget) must be >= 0, got k[", g,
                        "] = ", k32.data_ptr<int32_t>()[g]);
    }
  } else if (k.scalar_type() == at::kInt && k.device() == device && k.is_contiguous()) {
    k32 = k;  // the kernel clamps to [0, live]: an int32 budget needs no conversion
  } else {
    // Checking the values would cost a host sync: on CUDA a negative budget keeps nothing
    // and one beyond the group's live tokens keeps them all (the kernel clamps to [0, live]).
    k32 = k.to(device, at::kLong).clamp(0, INT32_MAX).to(at::kInt).contiguous();
  }
  const auto on_device = at::TensorOptions().device(device);
  at::Tensor keep = at::zeros({st.capacity}, on_device.dtype(at::kBool));
  at::Tensor counts = at::zeros({S}, on_device.dtype(at::kInt));
  if (st.capacity > 0 && groups > 0 && (device.is_cuda() || longest > 0)) {
    KVCACHE_DEVICE_DISPATCH(device, select::paged_topk, st.view, len, given, group_size, k32, keep,
                            counts, by_rule ? &slot_rule : nullptr);
  }
  return {keep, counts};
}

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

at::Tensor attention_plan(const at::Tensor& lens, int64_t rows, const c10::Device& device) {
  check_defined(lens, "lens");
  TORCH_CHECK_VALUE(lens.device().is_cpu() && lens.scalar_type() == at::kInt && lens.dim() == 1,
                    "lens must be a CPU int32 [segments] tensor (the store's host lengths), got ",
                    lens.scalar_type(), " ", lens.sizes(), " on ", lens.device());
  TORCH_CHECK_VALUE(rows >= 0, "rows must be >= 0, got ", rows);
  check_device_supported(device);
  const at::Tensor host = lens.contiguous();
  if (device.is_cpu()) return host.clone();
#ifdef KVCACHE_EXT_WITH_CUDA
  const int32_t* p = host.data_ptr<int32_t>();
  std::vector<int32_t> len(p, p + host.numel());
  // Blocks the tensor-core prefill may take (unless KVCACHE_EXT_TC_PREFILL=0): splits sized for
  // its tiles. The prefill switch is read (and a bad value refused) only for such blocks; a
  // decode plan reads KVCACHE_EXT_TC_DECODE instead (plan_cuda: the tensor-core decode's plan).
  if (rows >= attention::kPrefillTcMinRows && attention::prefill_tc_enabled())
    return attention::plan_prefill_cuda(len, rows, device);
  return attention::plan_cuda(len, rows, device);
#else
  TORCH_CHECK(false, "unreachable");
#endif
}

at::Tensor page_addresses(at::TensorList pool, const at::Tensor& page_table, const at::Tensor& len,
                          int64_t page_size, int64_t head_dim, int64_t score_channels,
                          at::ScalarType dtype) {
  return state_view(pool, page_table, len, page_size, head_dim, score_channels, dtype).page_base;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_run(
    const at::Tensor& q_in, at::TensorList pool, const at::Tensor& page_table,
    const at::Tensor& len, const at::Tensor& plan, const c10::optional<at::Tensor>& q_pos_in,
    double scale, int64_t kv_heads, int64_t page_size, int64_t head_dim, int64_t score_channels,
    at::ScalarType dtype, bool want_mass, bool want_last, bool want_sum_sq, bool want_count) {
  const StateView st = state_view(pool, page_table, len, page_size, head_dim, score_channels, dtype);
  return attend(st, q_in, len, plan, q_pos_in, scale, kv_heads, head_dim, dtype, want_mass,
                want_last, want_sum_sq, want_count);
}

namespace {

// What a decode step does besides appending and attending, checked (store_decode_step's and
// decode_step's arguments past the state): the statistics the attention computes (those asked
// and those accumulated), and the eviction by a rule (budget as int32 on the device).
struct DecodeWork {
  bool wants[4] = {false, false, false, false};  // mass, last, sum_sq, count
  bool asked[4] = {false, false, false, false};
  std::vector<int64_t> accumulate;
  bool evicts = false;
  select::SlotRule rule;
  at::Tensor newest;  // what rule.newest points into
  at::Tensor budget;  // [S] int32 on the device
};

DecodeWork check_decode_work(const c10::Device& device, int64_t batch, int64_t segments,
                             int64_t score_channels, bool want_mass, bool want_last,
                             bool want_sum_sq, bool want_count, at::IntArrayRef accumulate,
                             const c10::optional<std::string>& rule, int64_t sinks, int64_t recent,
                             const c10::optional<at::Tensor>& last_pos,
                             const c10::optional<at::Tensor>& budget) {
  DecodeWork w;
  const bool asked[4] = {want_mass, want_last, want_sum_sq, want_count};
  for (int i = 0; i < 4; ++i) w.asked[i] = w.wants[i] = asked[i];
  // The statistics each channel accumulates, by their index in (mass, last, sum_sq, count):
  // one value per slot each (last, [capacity, G], is not a channel's).
  TORCH_CHECK_VALUE(static_cast<int64_t>(accumulate.size()) <= score_channels, "accumulate names ",
                    accumulate.size(), " channels but the store has ", score_channels, " score channels");
  for (const int64_t stat : accumulate) {
    TORCH_CHECK_VALUE(stat == 0 || stat == 2 || stat == 3, "accumulate takes statistics 0 (mass), 2 "
                      "(sum_sq) and 3 (count), one value per slot, got ", stat);
    w.wants[stat] = true;
  }
  w.accumulate.assign(accumulate.begin(), accumulate.end());
  if (!rule.has_value()) {
    TORCH_CHECK_VALUE(sinks == 0 && recent == 0 && !(last_pos.has_value() && last_pos->defined()) &&
                          !(budget.has_value() && budget->defined()),
                      "sinks, recent, last_pos and budget belong to an eviction by a rule: pass rule");
    return w;
  }
  w.evicts = true;
  w.rule = slot_rule_of(*rule, sinks, recent, last_pos, batch, segments, score_channels, device, w.newest);
  TORCH_CHECK_VALUE(budget.has_value() && budget->defined(), "an eviction by a rule needs budget, "
                    "the tokens each segment keeps");
  const at::Tensor& b = *budget;
  TORCH_CHECK_TYPE(is_integer_dtype(b.scalar_type()), "budget must be an integer tensor, got ", b.scalar_type());
  check_shape(b, {segments}, "budget");
  check_device_or_cpu(b, device, "budget");
  // As store_topk takes k: an int32 budget on the device is taken as it is (the caller keeps
  // one for every step); on CPU a negative one is refused.
  w.budget = b.scalar_type() == at::kInt && b.device() == device && b.is_contiguous()
                 ? b
                 : b.to(device, at::kLong).clamp(0, INT32_MAX).to(at::kInt).contiguous();
  if (device.is_cpu()) {
    for (int64_t s = 0; s < segments; ++s)
      TORCH_CHECK_VALUE(w.budget.data_ptr<int32_t>()[s] >= 0, "budget must be >= 0, got budget[", s,
                        "] = ", w.budget.data_ptr<int32_t>()[s]);
  }
  return w;
}

// A decode step's work on a StateView, past every check: the append, the attention, the
// channels' additions, the eviction by the rule (store_topk's and store_compact's work).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> decode_step_on(
    const StateView& st, at::TensorList pool, const at::Tensor& len, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const AppendInputs& in, const at::Tensor& plan,
    const c10::optional<at::Tensor>& q_pos, double scale, int64_t page_size, DecodeWork& w) {
  const int64_t H = k.size(1), D = k.size(3), S = st.segments;
  append_tokens(st, len, k, v, in.pos32, in.rank, in.counts);
  at::Tensor out, mass, last, sum_sq, count;
  std::tie(out, mass, last, sum_sq, count) = attend(st, q, len, plan, q_pos, scale, H, D, st.dtype,
                                                    w.wants[0], w.wants[1], w.wants[2], w.wants[3]);
  at::Tensor* stats[4] = {&mass, &last, &sum_sq, &count};
  for (size_t c = 0; c < w.accumulate.size(); ++c) {
    const at::Tensor& values = *stats[w.accumulate[c]];
    store::add_to_scores(pool, st.view.record, page_size, static_cast<int64_t>(c),
                         values.scalar_type() == at::kFloat ? values : values.to(at::kFloat));
  }
  if (w.evicts && st.capacity > 0 && S > 0) {
    // store_topk's work by the rule, then store_compact's, unordered (one token moves per
    // place evicted: a slot rule's scores do not depend on the order).
    const auto on_device = at::TensorOptions().device(len.device());
    at::Tensor keep = at::zeros({st.capacity}, on_device.dtype(at::kBool));
    at::Tensor kept = at::zeros({S}, on_device.dtype(at::kInt));
    KVCACHE_DEVICE_DISPATCH(len.device(), select::paged_topk, st.view, len, at::Tensor(), 1, w.budget, keep,
                            kept, &w.rule);
    KVCACHE_DEVICE_DISPATCH(len.device(), store::compact_unordered, st.view, len, keep);
  }
  // A statistic asked for is returned; one computed only to accumulate is not.
  for (int i = 0; i < 4; ++i) {
    if (!w.asked[i] && w.wants[i]) *stats[i] = at::empty({0}, stats[i]->options());
  }
  return {out, mass, last, sum_sq, count};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> store_decode_step(
    at::TensorList pool, const at::Tensor& page_table, const at::Tensor& len, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos,
    const c10::optional<at::Tensor>& rank, const c10::optional<at::Tensor>& counts,
    const at::Tensor& plan, const c10::optional<at::Tensor>& q_pos, double scale, int64_t page_size,
    int64_t score_channels, bool want_mass, bool want_last, bool want_sum_sq, bool want_count,
    at::IntArrayRef accumulate, const c10::optional<std::string>& rule, int64_t sinks,
    int64_t recent, const c10::optional<at::Tensor>& last_pos, const c10::optional<at::Tensor>& budget,
    c10::optional<at::ScalarType> kv_dtype) {
  // Everything is checked before anything is written.
  check_defined(k, "k");
  TORCH_CHECK_VALUE(k.dim() == 4 && k.size(2) == 1, "k must have shape [batch, heads, 1, head_dim] (one "
                    "token per segment: a decode step), got ", k.sizes());
  const at::ScalarType dtype = kv_dtype.value_or(k.scalar_type());
  const int64_t B = k.size(0), H = k.size(1), D = k.size(3);
  const StateView st = state_view(pool, page_table, len, page_size, D, score_channels, dtype);
  const c10::Device device = page_table.device();
  const AppendInputs in = check_append(st, page_table, len, k, v, pos, rank, counts, page_size);
  check_query(q, device, dtype, B, H, D, scale);
  TORCH_CHECK_TYPE(q.scalar_type() == k.scalar_type(), "q must have k's dtype ", k.scalar_type(), ", got ",
                   q.scalar_type());
  TORCH_CHECK_VALUE(q.size(2) == 1, "q must have one query per head (a decode step), got shape ", q.sizes());
  check_defined(plan, "plan");
  DecodeWork w = check_decode_work(device, B, st.segments, score_channels, want_mass, want_last, want_sum_sq,
                                   want_count, accumulate, rule, sinks, recent, last_pos, budget);
  return decode_step_on(st, pool, len, q, k, v, in, plan, q_pos, scale, page_size, w);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> decode_step(
    PageAllocator& allocator, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& pos, const c10::optional<at::Tensor>& valid, const c10::optional<at::Tensor>& q_pos,
    double scale, bool want_mass, bool want_last, bool want_sum_sq, bool want_count,
    at::IntArrayRef accumulate, const c10::optional<std::string>& rule, int64_t sinks, int64_t recent,
    const c10::optional<at::Tensor>& last_pos, const c10::optional<at::Tensor>& budget,
    const c10::optional<at::Tensor>& budget_host) {
  const int64_t B = allocator.batch(), H = allocator.heads(), S = allocator.num_segments();
  const c10::Device device = allocator.device();
  // Everything that the page allocator's append does not check, before it changes anything.
  check_query(q, device, allocator.kv_dtype(), B, H, allocator.head_dim(), scale);
  TORCH_CHECK_TYPE(q.scalar_type() == allocator.dtype(), "q must have the store's dtype ", allocator.dtype(),
                   ", got ", q.scalar_type());
  TORCH_CHECK_VALUE(q.size(2) == 1, "q must have one query per head (a decode step), got shape ", q.sizes());
  check_defined(k, "k");
  TORCH_CHECK_VALUE(k.dim() == 4 && k.size(2) == 1, "k must have shape [batch, heads, 1, head_dim] (one "
                    "token per segment: a decode step), got ", k.sizes());
  DecodeWork w = check_decode_work(device, B, S, allocator.score_channels(), want_mass, want_last, want_sum_sq,
                                   want_count, accumulate, rule, sinks, recent, last_pos, budget);
  std::vector<int64_t> keep_host;  // the budgets on the host: min(len, budget) after the eviction
  if (w.evicts) {
    TORCH_CHECK_VALUE(budget_host.has_value() && budget_host->defined() && budget_host->device().is_cpu() &&
                          is_integer_dtype(budget_host->scalar_type()) && budget_host->numel() == S,
                      "an eviction by a rule needs budget_host, the budget's ", S, " integers on the host");
    const at::Tensor host = budget_host->to(at::kLong).contiguous();
    keep_host.assign(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + S);
    for (int64_t s = 0; s < S; ++s)
      TORCH_CHECK_VALUE(keep_host[s] >= 0, "budget_host must be >= 0, got budget_host[", s, "] = ", keep_host[s]);
  }
  if (q_pos.has_value() && q_pos->defined()) query_positions(*q_pos, device, B, 1);  // checked now
  if (w.evicts || !w.accumulate.empty()) allocator.check_writable("decode_step (its channels or eviction)");
  AppendInputs in;
  std::tie(in.pos32, in.rank, in.counts) = allocator.prepare_append(k, v, pos, valid);
  const at::Tensor plan = allocator.attention_plan(q.size(1) / H);
  if (w.evicts) {  // only when a segment holds more than its budget (the host lengths: no sync)
    const std::vector<int32_t>& held = allocator.len_host();
    bool over = false;
    for (int64_t s = 0; s < S; ++s) {
      over = over || held[s] > keep_host[s];
      keep_host[s] = std::min<int64_t>(held[s], keep_host[s]);
    }
    w.evicts = over;
  }
  StateView st;
  st.view = allocator.view();
  st.dtype = allocator.kv_dtype();
  st.segments = S;
  st.capacity = allocator.capacity();
  auto result = decode_step_on(st, allocator.pool(), allocator.len_device(), q, k, v, in, plan, q_pos, scale,
                               allocator.page_size(), w);
  if (w.evicts) allocator.finish_compact(at::tensor(keep_host, at::kLong));
  return result;
}

}  // namespace kvcache_ext::ops

// ---------------------------------------------------------------------------------------
// Registration. Each function above picks the CPU or CUDA kernel from its tensors' device,
// so the same function implements an op for both dispatch keys.

TORCH_LIBRARY(kvcache_ext, m) {
  m.def("store_append(Tensor(a!)[] pool, Tensor page_table, Tensor(b!) len, Tensor k, Tensor v, "
        "Tensor pos, Tensor? rank, Tensor? counts, int page_size, int score_channels, "
        "ScalarType? kv_dtype=None) -> ()");
  m.def("store_check(Tensor[] pool, Tensor page_table, Tensor len, int page_size, int head_dim, "
        "int score_channels, ScalarType dtype) -> Tensor");
  m.def("store_replace(Tensor(a!)[] pool, Tensor page_table, Tensor len, Tensor slot, Tensor k, "
        "Tensor v, Tensor pos, int page_size, int head_dim, int score_channels, ScalarType dtype, "
        "bool check_bounds) -> ()");
  m.def("store_compact(Tensor(a!)[] pool, Tensor page_table, Tensor(b!) len, Tensor keep, "
        "int page_size, int head_dim, int score_channels, ScalarType dtype, bool stable=True) -> ()");
  m.def("store_add_scores(Tensor(a!)[] pool, Tensor page_table, Tensor len, Tensor values, int channel, "
        "int page_size, int head_dim, int score_channels, ScalarType dtype) -> ()");
  m.def("store_topk(Tensor[] pool, Tensor page_table, Tensor len, Tensor? scores, Tensor k, "
        "int group_size, int page_size, int head_dim, int score_channels, ScalarType dtype, "
        "str? rule=None, int sinks=0, int recent=0, Tensor? last_pos=None) -> (Tensor, Tensor)");
  m.def("segmented_topk(Tensor scores, Tensor pos, Tensor start, Tensor len, Tensor k, "
        "bool check_values=True) -> Tensor");
  m.def("grouped_topk(Tensor scores, Tensor pos, Tensor start, Tensor len, int group_size, "
        "Tensor k, bool check_values=True) -> (Tensor, Tensor)");
  m.def("attention_run(Tensor q, Tensor[] pool, Tensor page_table, Tensor len, Tensor plan, "
        "Tensor? q_pos, float scale, int kv_heads, int page_size, int head_dim, int score_channels, "
        "ScalarType dtype, bool mass, bool last, bool sum_sq, bool count) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("store_decode_step(Tensor(a!)[] pool, Tensor page_table, Tensor(b!) len, Tensor q, Tensor k, "
        "Tensor v, Tensor pos, Tensor? rank, Tensor? counts, Tensor plan, Tensor? q_pos, float scale, "
        "int page_size, int score_channels, bool mass, bool last, bool sum_sq, bool count, "
        "int[] accumulate, str? rule=None, int sinks=0, int recent=0, Tensor? last_pos=None, "
        "Tensor? budget=None, ScalarType? kv_dtype=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvcache_ext, CPU, m) {
  m.impl("store_append", &kvcache_ext::ops::store_append);
  m.impl("store_check", &kvcache_ext::ops::store_check);
  m.impl("store_replace", &kvcache_ext::ops::store_replace);
  m.impl("store_compact", &kvcache_ext::ops::store_compact);
  m.impl("store_add_scores", &kvcache_ext::ops::store_add_scores);
  m.impl("store_topk", &kvcache_ext::ops::store_topk);
  m.impl("segmented_topk", &kvcache_ext::ops::segmented_topk);
  m.impl("grouped_topk", &kvcache_ext::ops::grouped_topk);
  m.impl("attention_run", &kvcache_ext::ops::attention_run);
  m.impl("store_decode_step", &kvcache_ext::ops::store_decode_step);
}

#ifdef KVCACHE_EXT_WITH_CUDA
TORCH_LIBRARY_IMPL(kvcache_ext, CUDA, m) {
  m.impl("store_append", &kvcache_ext::ops::store_append);
  m.impl("store_check", &kvcache_ext::ops::store_check);
  m.impl("store_replace", &kvcache_ext::ops::store_replace);
  m.impl("store_compact", &kvcache_ext::ops::store_compact);
  m.impl("store_add_scores", &kvcache_ext::ops::store_add_scores);
  m.impl("store_topk", &kvcache_ext::ops::store_topk);
  m.impl("segmented_topk", &kvcache_ext::ops::segmented_topk);
  m.impl("grouped_topk", &kvcache_ext::ops::grouped_topk);
  m.impl("attention_run", &kvcache_ext::ops::attention_run);
  m.impl("store_decode_step", &kvcache_ext::ops::store_decode_step);
}
#endif
