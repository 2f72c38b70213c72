// The kernels as torch custom ops (namespace kvcache_ext, registered in ops.cpp with
// TORCH_LIBRARY; see README "Custom ops"): one door per kernel. Python (kvcache_ext.kernels),
// the gtests (csrc/tests) and the benchmarks reach every kernel through these functions, the
// CPU and CUDA implementation of the ops (each picks the kernel by device); every input is
// checked here, the kernels (store/, select/, attention/) trust theirs.
//
// Every op takes tensors and plain numbers only: the state of a layer's store is
//   pool       the store's slabs of pages, uint8 [pages_i, record bytes] each (the pages of
//              slab i are numbered after those of the slabs before it);
//   page_table [S, width] int32, the pages of each segment in token order;
//   len        [S] int32, the live tokens of each segment;
// owned by the Python RaggedKVStore and passed to every op (as vLLM and FlashInfer pass
// their KV caches). The ops check the shapes, dtypes and devices of the state; its contents
// (page ids, and that the pages cover the lengths) are checked on CPU and trusted on CUDA,
// where reading them would cost a device sync: they are what the store's page allocator
// (PageAllocator, store/page_allocator.h) made. The allocator is not an op: it runs on the
// host before an append (prepare_append) and after a compaction (finish_compact).
#pragma once
#include <ATen/ATen.h>

#include <string>
#include <tuple>

#include "store/paged_layout.h"

namespace kvcache_ext {
class PageAllocator;  // store/page_allocator.h
}  // namespace kvcache_ext

namespace kvcache_ext::ops {

// The page-size rule of every store: a power of two in [1, kMaxPageSize] tokens (Python
// reads the bound as kvcache_ext._C.MAX_PAGE_SIZE). page_shift checks it and returns
// log2(page_size); a ValueError names the rule otherwise.
constexpr int64_t kMaxPageSize = 1024;
int32_t page_shift(int64_t page_size);

// The PagedView of a state, as the kernels take it; `page_base` keeps the view's page
// addresses alive (a [pages] int64 tensor on the state's device). The ops make it from the
// state they are handed (checked, page addresses cached by pool, see ops.cpp); the page
// allocator keeps its own (PageAllocator::own_state).
struct StateView {
  store::PagedView view;
  at::Tensor page_base;
  int64_t segments = 0;
  int64_t capacity = 0;  // pages * page_size: the length of slot-layout tensors
};

// store_append: writes n tokens (k, v [B, H, n, D], pos [B, n] or [n] integers) after the
// live tokens of every segment. rank [S, n] int32 (-1: not stored) and counts [S] int32 (tokens
// stored per segment) come together, for appends of some tokens only; without them every
// token is stored. The segments' pages must already hold len + counts tokens. len += counts.
void store_append(at::TensorList pool, const at::Tensor& page_table, const at::Tensor& len,
                  const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos,
                  const c10::optional<at::Tensor>& rank, const c10::optional<at::Tensor>& counts,
                  int64_t page_size, int64_t score_channels);

// store_check: what every op trusts of the state's contents, reported per segment without a
// host sync (int32 [S], on the state's device): 0 consistent, kStoreCheckNegativeLength
// (len < 0), kStoreCheckTooFewColumns (len needs more pages than the page table has columns),
// kStoreCheckBadPage (a page the live tokens lie in is not a page of the pool). The ops check
// this themselves on CPU stores (free there); on CUDA reading it costs a sync, so they trust it
// and this op is the opt-in check (RaggedKVStore.validate raises on a bad segment).
constexpr int32_t kStoreCheckNegativeLength = 1, kStoreCheckTooFewColumns = 2, kStoreCheckBadPage = 3;
// What each code says, for the error RaggedKVStore.validate raises (exported as
// _C.STORE_CHECK_FAULTS): the fault text at index code - 1.
constexpr const char* kStoreCheckFaults[] = {
    "len < 0", "len needs more pages than the page table has columns",
    "a page its live tokens lie in is not a page of the pool"};
at::Tensor store_check(at::TensorList pool, const at::Tensor& page_table, const at::Tensor& len,
                       int64_t page_size, int64_t head_dim, int64_t score_channels,
                       at::ScalarType dtype);

// store_replace: token slot[b, h] (0 <= slot < len) of every segment becomes the token
// k, v [B, H, 1, D] at position pos [B]. Bounds are checked on CPU always, on CUDA when
// check_bounds (one host sync).
void store_replace(at::TensorList pool, const at::Tensor& page_table, const at::Tensor& len,
                   const at::Tensor& slot, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& pos, int64_t page_size, int64_t head_dim,
                   int64_t score_channels, at::ScalarType dtype, bool check_bounds);

// store_compact: keeps the live tokens whose flag in keep ([capacity] bool, slot layout) is
// set; writes the new lengths into len. Frees no page (the allocator does). stable: in their
// order (every token after the first evicted one moves); else the kept tokens among a
// segment's first new-length ones stay where they are and the kept ones past them fill the
// evicted places, in token order (a token moves per place filled: store/store_kernels.h).
void store_compact(at::TensorList pool, const at::Tensor& page_table, const at::Tensor& len,
                   const at::Tensor& keep, int64_t page_size, int64_t head_dim,
                   int64_t score_channels, at::ScalarType dtype, bool stable = true);

// store_add_scores: score channel `channel` of every slot += values ([capacity] float32,
// slot layout), in place in the pages (a policy's channel update: H2O's accumulated
// attention mass). Slots that hold no live token get theirs too (nothing reads them).
void store_add_scores(at::TensorList pool, const at::Tensor& page_table, const at::Tensor& len,
                      const at::Tensor& values, int64_t channel, int64_t page_size,
                      int64_t head_dim, int64_t score_channels, at::ScalarType dtype);

// store_topk: the k best live tokens of every group of group_size segments, read through
// the pages where they lie (CPU and CUDA; one kernel launch on CUDA, no host sync). scores:
// none (score channel 0), [capacity] or [B, H, L] float32. Returns keep [capacity] bool and
// counts [S] int32. k: [groups] integers; on CPU every k must be >= 0 and L >= every length
// (both checked); on CUDA nothing is read back: a negative k keeps nothing, and a token
// past a padded L is scored NaN (evicted first).
// rule (scores then none): each token scored from its record by a slot rule
// (select/slot_rule.h): "mass" channel 0, "position" its position; +inf where protected
// (position < sinks, or position > last_pos[b] - recent when recent > 0; last_pos [B]
// integers on the store's device, each row's newest position, B = S / the row's segments).
// The eviction of the compiled decode step (append_attend_evict) as an op, so that a CUDA
// graph can capture it (kvcache_ext/hf/decode_graph.py).
std::tuple<at::Tensor, at::Tensor> store_topk(at::TensorList pool, const at::Tensor& page_table,
                                              const at::Tensor& len,
                                              const c10::optional<at::Tensor>& scores,
                                              const at::Tensor& k, int64_t group_size,
                                              int64_t page_size, int64_t head_dim,
                                              int64_t score_channels, at::ScalarType dtype,
                                              const c10::optional<std::string>& rule = c10::nullopt,
                                              int64_t sinks = 0, int64_t recent = 0,
                                              const c10::optional<at::Tensor>& last_pos = c10::nullopt);

// segmented_topk: keeps the k[s] best live slots of every segment s (all of them when
// k[s] >= len[s]), in the order of select/radix_select.h (ties to the lower position, NaN
// evicted first). scores [capacity] float32, pos [capacity] int32, start [S] int64, len [S]
// int32, k [S] integers. Returns keep [capacity] bool (false outside live slots).
// check_values: the checks that read values (segments in order inside the buffers, k >= 0),
// one host sync on CUDA together; false for callers that made the layout themselves (the
// store's select), which then costs no sync (a negative k keeps nothing).
at::Tensor segmented_topk(const at::Tensor& scores, const at::Tensor& pos, const at::Tensor& start,
                          const at::Tensor& len, const at::Tensor& k, bool check_values = true);

// grouped_topk: Ada-KV's allocation step. Segments [g * group_size, (g + 1) * group_size)
// form group g, and the k[g] best live slots of the whole group are kept, wherever they
// fall. Returns keep [capacity] bool and the number kept per segment, counts [S] int32.
std::tuple<at::Tensor, at::Tensor> grouped_topk(const at::Tensor& scores, const at::Tensor& pos,
                                                const at::Tensor& start, const at::Tensor& len,
                                                int64_t group_size, const at::Tensor& k,
                                                bool check_values = true);

// attention_plan (not an op: it reads the lengths on the host): the work partition of an
// attention call over segments of the given lengths (lens: CPU int32 [S]) for `rows` query
// rows per segment (G * n), on `device`. CPU: the lengths themselves (int32 [S]; the CPU
// kernel cuts its units from the store's current lengths). CUDA: int32 [3 W + S + 2] on the
// device: W splits (segment, first token, end token), the first split of every segment, then
// S; copied up without a sync (attention/attention_plan.h). A plan is balanced for the
// lengths it was made for; with other lengths of the same store (a stale plan) both devices
// give the same result, CUDA's unbalanced (what a decode step replayed from a CUDA graph
// attends with: a plan of the lengths its pages hold, PageAllocator::attention_plan_of_pages).
// A plan of another S is refused on CPU and gives NaN rows on CUDA (no sync could check it).
at::Tensor attention_plan(const at::Tensor& lens, int64_t rows, const c10::Device& device);

// attention_run: the attention of q [B, Hq, n, D] over the state (kv_heads H per batch item,
// so S = B * H; Hq a multiple of H), with the plan of the current lengths. Returns (out,
// mass, last, sum_sq, count); a statistic not asked for is an empty tensor.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_run(
    const at::Tensor& q, at::TensorList pool, const at::Tensor& page_table,
    const at::Tensor& len, const at::Tensor& plan, const c10::optional<at::Tensor>& q_pos,
    double scale, int64_t kv_heads, int64_t page_size, int64_t head_dim, int64_t score_channels,
    at::ScalarType dtype, bool want_mass, bool want_last, bool want_sum_sq, bool want_count);

// page_addresses (not an op): the device tensor of page addresses that the ops called on this
// state on the current stream read (cached per pool and stream, see ops.cpp). A CUDA graph
// captured over the ops holds the raw pointer: its owner (kvcache_ext.hf.decode_graph) keeps
// this tensor alive for the graph's life, whatever the cache drops.
at::Tensor page_addresses(at::TensorList pool, const at::Tensor& page_table, const at::Tensor& len,
                          int64_t page_size, int64_t head_dim, int64_t score_channels,
                          at::ScalarType dtype);

// ---- The eager decode fast path (not an op) ----------------------------------------------
// append_and_attend: a decode step's store work for one layer in one host call, what the
// patched model's eager decode runs when a step only appends (one token per sequence, no
// padding, a policy that never evicts while decoding). It is exactly
//   allocator.prepare_append(k, v, pos) + store_append
//   + allocator.attention_plan(G * n) + attention_run (no statistics)
// through the same functions those ops run past their checks of the state (the append and
// attention kernels, and attention_run's checks of q, scale and plan), on the state view the
// allocator keeps (PageAllocator::own_state) instead of one made from the pool: no per-slab
// checks or page-address lookup, so the call costs the same however many slabs the pages
// lie in. q and scale are checked first: nothing is stored when they are refused. Returns
// out [B, Hq, n, D]. torch.compile traces the ops instead (kvcache_ext/engine).
// Why it stays: through the ops and the allocator's Python-called host steps, a layer's decode
// call took 1.39x (SnapKV) and 1.42x (Ada-SnapKV) as long as here (+95 and +106 us per call),
// a whole decode step 1.03x and 1.06x (bench/decode_calls.py --context 2048 --batch 4
// --paths fast,ops, SmolLM2-135M fp32 on 2 CPU cores, interleaved turns;
// bench/results/decode-calls-cpu-2026-11-27.json).
at::Tensor append_and_attend(PageAllocator& allocator, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& v, const at::Tensor& pos, double scale);

// append_attend_evict: the eager decode step of a policy that evicts in the store's slot layout
// while decoding (H2O and StreamingLLM under equal head budgets), in one host call: the decode
// fast path of every step such a policy takes, eviction or not. It is exactly
//   append_and_attend, with the attention mass of every slot when rule == "mass"
//   + (rule "mass") score channel 0 += that mass, in every slot (store_add_scores)
//   + when budget is given and a segment holds more than its budget[b, h] tokens:
//       store_topk of budget[b, h] per segment by the rule (its rule, sinks, recent and
//       last_pos arguments) + store_compact (stable = false: one token moves per evicted one)
//       + allocator.finish_compact(min(len, budget[b, h])): the new lengths known, no read-back
// through the functions those ops run past their checks, on the allocator's own state view.
// budget [B, H] integers on the store's device (int32: taken as it is, no conversion; a
// negative one keeps nothing) and budget_host, the same on the host (>= 0), come together
// (none: no eviction this step); last_pos [B] integers on the device, each row's
// newest position, is needed when recent > 0. Everything is checked before anything is
// stored. Returns out [B, Hq, 1, D]. No host sync (the lengths are known on the host).
// Why it exists: through Python (append, attend, the channel update, protection, select,
// compact), H2O evicting every step decoded at 0.50x one-shot SnapKV on an H100 and on this
// CPU's 8B-shaped host model alike, every step host-bound (bench/e2e.py --model host).
at::Tensor append_attend_evict(PageAllocator& allocator, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& pos, double scale,
                               const std::string& rule, int64_t sinks, int64_t recent,
                               const c10::optional<at::Tensor>& last_pos,
                               const c10::optional<at::Tensor>& budget,
                               const c10::optional<at::Tensor>& budget_host);

}  // namespace kvcache_ext::ops
