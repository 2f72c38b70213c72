// The kernels as torch custom ops (namespace kvcache_ext, registered in ops.cpp with
// TORCH_LIBRARY; see README "Custom ops"). Every op takes tensors and plain numbers only:
// the state of a layer's store is
//   pool       the store's slabs of pages, uint8 [pages_i, record bytes] each (the pages of
//              slab i are numbered after those of the slabs before it);
//   page_table [S, width] int32, the pages of each segment in token order;
//   len        [S] int32, the live tokens of each segment;
// owned by the Python RaggedKVStore and passed to every op (as vLLM and FlashInfer pass
// their KV caches). The ops check the shapes, dtypes and devices of the state; its contents
// (page ids, and that the pages cover the lengths) are checked on CPU and trusted on CUDA,
// where reading them would cost a device sync: they are what the store's page allocator
// (RaggedKVStore, C++) made.
//
// These functions are what the ops run (their CPU and CUDA implementation: each picks the
// kernel by device); the C++ RaggedKVStore calls them too, so both share one path.
#pragma once
#include <ATen/ATen.h>

#include <tuple>

#include "store/paged_layout.h"

namespace kvcache_ext::ops {

// The PagedView of a state, after checking it; `page_base` keeps the view's page addresses
// alive (a cached [pages] int64 tensor on the state's device, see ops.cpp).
struct StateView {
  store::PagedView view;
  at::Tensor page_base;
  int64_t segments = 0;
  int64_t capacity = 0;  // pages * page_size: the length of slot-layout tensors
};
StateView state_view(at::TensorList pool, const at::Tensor& page_table, const at::Tensor& len,
                     int64_t page_size, int64_t head_dim, int64_t score_channels,
                     at::ScalarType dtype);

// store_append: writes n tokens (k, v [B, H, n, D], pos [B, n] or [n] integers) after the
// live tokens of every segment. rank [S, n] int32 (-1: not stored) and counts [S] int32 (tokens
// stored per segment) come together, for appends of some tokens only; without them every
// token is stored. The segments' pages must already hold len + counts tokens. len += counts.
void store_append(at::TensorList pool, const at::Tensor& page_table, const at::Tensor& len,
                  const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos,
                  const c10::optional<at::Tensor>& rank, const c10::optional<at::Tensor>& counts,
                  int64_t page_size, int64_t score_channels);

// store_replace: token slot[b, h] (0 <= slot < len) of every segment becomes the token
// k, v [B, H, 1, D] at position pos [B]. Bounds are checked on CPU always, on CUDA when
// check_bounds (one host sync).
void store_replace(at::TensorList pool, const at::Tensor& page_table, const at::Tensor& len,
                   const at::Tensor& slot, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& pos, int64_t page_size, int64_t head_dim,
                   int64_t score_channels, at::ScalarType dtype, bool check_bounds);

// store_compact: keeps, in order, the live tokens whose flag in keep ([capacity] bool, slot
// layout) is set; writes the new lengths into len. Frees no page (the allocator does).
void store_compact(at::TensorList pool, const at::Tensor& page_table, const at::Tensor& len,
                   const at::Tensor& keep, int64_t page_size, int64_t head_dim,
                   int64_t score_channels, at::ScalarType dtype);

// store_topk (CPU): the k best live tokens of every group of group_size segments, read
// through the pages. scores: none (score channel 0), [capacity] or [B, H, L] float32.
// Returns keep [capacity] bool and counts [S] int32.
std::tuple<at::Tensor, at::Tensor> store_topk(at::TensorList pool, const at::Tensor& page_table,
                                              const at::Tensor& len,
                                              const c10::optional<at::Tensor>& scores,
                                              const at::Tensor& k, int64_t group_size,
                                              int64_t page_size, int64_t head_dim,
                                              int64_t score_channels, at::ScalarType dtype);

// attention_plan (not an op: it reads the lengths on the host): the work partition of an
// attention call over segments of the given lengths (lens: CPU int32 [S]) for `rows` query
// rows per segment (G * n), on `device`. CPU: the lengths themselves (int32 [S], the CPU
// kernel cuts its units from them). CUDA: int32 [3 W + S + 1] on the device: W splits
// (segment, first token, end token), then the first split of every segment; copied up
// without a sync. A plan is valid until the lengths change (the next append or compact).
at::Tensor attention_plan(const at::Tensor& lens, int64_t rows, const c10::Device& device);

// The checks of attention_run's q and scale against a store's layout (batch items, KV
// heads, head_dim, dtype, device), for a caller that must refuse them before it changes the
// store (RaggedKVStore::append_and_attend).
void check_query(const at::Tensor& q, const c10::Device& device, at::ScalarType dtype,
                 int64_t batch, int64_t kv_heads, int64_t head_dim, double scale);

// attention_run: the attention of q [B, Hq, n, D] over the state (kv_heads H per batch item,
// so S = B * H; Hq a multiple of H), with the plan of the
// current lengths. Returns (out, mass, last, sum_sq, count); a statistic not asked for is
// an empty tensor.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_run(
    const at::Tensor& q, at::TensorList pool, const at::Tensor& page_table,
    const at::Tensor& len, const at::Tensor& plan, const c10::optional<at::Tensor>& q_pos,
    double scale, int64_t kv_heads, int64_t page_size, int64_t head_dim, int64_t score_channels,
    at::ScalarType dtype, bool want_mass, bool want_last, bool want_sum_sq, bool want_count);

// The work of store_append and attention_run on a StateView, past the checks of the state:
// one the ops made with state_view, or the one the store's page allocator keeps
// (RaggedKVStore::own_state), which needs no per-slab checks or page-address lookup: a
// store's decode step costs the same however many slabs its pages lie in.
// append_tokens: k, v [B, H, n, D] contiguous, pos32 [B, n] int32 contiguous, rank and counts
// both undefined or as store_append takes them; the pages must hold len + counts tokens.
void append_tokens(const StateView& st, const at::Tensor& len, const at::Tensor& k,
                   const at::Tensor& v, const at::Tensor& pos32, const at::Tensor& rank,
                   const at::Tensor& counts);
// attend: attention_run's checks of q, scale and plan, then its work.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attend(
    const StateView& st, const at::Tensor& q, const at::Tensor& len, const at::Tensor& plan,
    const c10::optional<at::Tensor>& q_pos, double scale, int64_t kv_heads, int64_t head_dim,
    at::ScalarType dtype, bool want_mass, bool want_last, bool want_sum_sq, bool want_count);

}  // namespace kvcache_ext::ops
