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
// their KV caches). An op's `dtype` (or `kv_dtype`) is the pages' element type: float32,
// float16 or bfloat16, the dtype of the K, V and q handed to the ops; or int8, pages that
// quantize K and V as they store them (store/quantize.h) and take K, V and q of any of those
// float dtypes (CPU only: on CUDA an int8 store is refused). The ops check the shapes, dtypes and devices of the state; its contents
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

// store_append: writes n tokens (k, v [B, H, n, D], pos [B, n] or [n] integers) after the
// live tokens of every segment. rank [S, n] int32 (-1: not stored) and counts [S] int32 (tokens
// stored per segment) come together, for appends of some tokens only; without them every
// token is stored. The segments' pages must already hold len + counts tokens. len += counts.
// kv_dtype: the pages' element type (int8: quantized as stored); none: k's dtype.
void store_append(at::TensorList pool, const at::Tensor& page_table, const at::Tensor& len,
                  const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos,
                  const c10::optional<at::Tensor>& rank, const c10::optional<at::Tensor>& counts,
                  int64_t page_size, int64_t score_channels,
                  c10::optional<at::ScalarType> kv_dtype = c10::nullopt);

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
// The eviction of a decode step by a scorer's slot rule (RaggedKVStore.evict_by_rule), an op
// so that a CUDA graph can capture it (kvcache_ext/hf/decode_graph.py).
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

// store_decode_step: a decode step of one layer in one op, what eager and captured decode
// steps both run (RaggedKVStore.decode_step), exactly
//   store_append of k, v [B, H, 1, D] at pos (pos, rank and counts as store_append takes them)
//   + attention_run of q [B, Hq, 1, D] with `plan` (and q_pos, scale) and the statistics asked
//   + for each channel c in order: score channel c += statistic accumulate[c], an index in
//     (mass, last, sum_sq, count): 0, 2 or 3 (store_add_scores)
//   + with `rule`: store_topk of budget[s] tokens per segment by the rule (sinks, recent,
//     last_pos as store_topk takes them) and store_compact unordered
// through the functions those ops run, on one state view; everything is checked before
// anything is written. The host steps stay with the caller: the pages for the new token
// before (PageAllocator::prepare_append, or pages already held in a CUDA graph), the lengths
// after an eviction (finish_compact with min(len, budget), or note_kept_in_pages). kv_dtype
// as store_append takes it; q has k's dtype. Returns (out, mass, last, sum_sq, count); a
// statistic not asked for is an empty tensor (one computed only to accumulate too).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> store_decode_step(
    at::TensorList pool, const at::Tensor& page_table, const at::Tensor& len, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos,
    const c10::optional<at::Tensor>& rank, const c10::optional<at::Tensor>& counts,
    const at::Tensor& plan, const c10::optional<at::Tensor>& q_pos, double scale, int64_t page_size,
    int64_t score_channels, bool want_mass, bool want_last, bool want_sum_sq, bool want_count,
    at::IntArrayRef accumulate, const c10::optional<std::string>& rule = c10::nullopt,
    int64_t sinks = 0, int64_t recent = 0, const c10::optional<at::Tensor>& last_pos = c10::nullopt,
    const c10::optional<at::Tensor>& budget = c10::nullopt,
    c10::optional<at::ScalarType> kv_dtype = c10::nullopt);

// decode_step (not an op): store_decode_step on a store's page allocator, its host steps
// included, in one host call: the eager decode step (RaggedKVStore.decode_step; torch.compile
// and a CUDA graph take the op). It checks q, scale and the eviction's and channels' arguments
// first (nothing changes when it refuses them), then runs
//   allocator.prepare_append(k, v, pos, valid) + allocator.attention_plan
//   + store_decode_step's work on the state view the allocator keeps (no per-slab lookup)
//   + after an eviction, allocator.finish_compact(min(len, budget_host)): the new lengths
//     known on the host, no read-back; the eviction runs only when a segment holds more than
//     its budget.
// budget [S] integers on the store's device and budget_host the same on the host come with
// `rule`. Returns what store_decode_step returns. Why it is not only the op: a step through
// the op and the allocator's Python-called host steps costs a host-bound decode step more
// than the 5 % by which a pybind path may stay (docs/architecture.md, "One decode step").
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> decode_step(
    PageAllocator& allocator, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& pos, const c10::optional<at::Tensor>& valid, const c10::optional<at::Tensor>& q_pos,
    double scale, bool want_mass, bool want_last, bool want_sum_sq, bool want_count,
    at::IntArrayRef accumulate, const c10::optional<std::string>& rule, int64_t sinks, int64_t recent,
    const c10::optional<at::Tensor>& last_pos, const c10::optional<at::Tensor>& budget,
    const c10::optional<at::Tensor>& budget_host);

// page_addresses (not an op): the device tensor of page addresses that the ops called on this
// state on the current stream read (cached per pool and stream, see ops.cpp). A CUDA graph
// captured over the ops holds the raw pointer: its owner (kvcache_ext.hf.decode_graph) keeps
// this tensor alive for the graph's life, whatever the cache drops.
at::Tensor page_addresses(at::TensorList pool, const at::Tensor& page_table, const at::Tensor& len,
                          int64_t page_size, int64_t head_dim, int64_t score_channels,
                          at::ScalarType dtype);

}  // namespace kvcache_ext::ops
