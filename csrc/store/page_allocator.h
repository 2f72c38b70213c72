// PageAllocator: the host side of one layer's ragged store (docs/store.md): it
// makes and grows the state that the ops (ops.h) take, and keeps the host bookkeeping of
// the pages (which segment owns which page, the free pages, the slabs, a host copy of the
// lengths). It runs no kernel: append, replace, compact, selection and attention are ops,
// called on its state (pool(), page_table_device(), len_device()) by the Python
// RaggedKVStore (kvcache_ext/kernels/store.py), which wraps this class, and by the gtests.
// Around the ops:
//   append  = prepare_append (pages for the new tokens, host lengths) + the store_append op;
//   compact = the store_compact op + finish_compact (the new lengths, pages given back);
//   attention = attention_plan (the work partition of the host lengths) + the attention_run op.
// replace and selection change no page and need nothing from it but the state.
#pragma once
#include <ATen/ATen.h>

#include <tuple>
#include <vector>

#include "ops.h"
#include "store/paged_layout.h"

namespace kvcache_ext {

class PageAllocator {
 public:
  // The device bookkeeping a store holds besides its pages (nbytes counts it): the address of
  // every page (page_base_, int64), the page table's entries (table_, int32, width per
  // segment) and every segment's length (len_, int32).
  static constexpr int64_t kPageAddressBytes = sizeof(int64_t);
  static constexpr int64_t kTableEntryBytes = sizeof(int32_t);
  static constexpr int64_t kLengthBytes = sizeof(int32_t);

  // `like` only carries the dtype and device of K and V as they are handed in and read out.
  // page_size: tokens per page, a power of two up to ops::kMaxPageSize; it is also the unit
  // by which a segment grows. kv_dtype: what the pages hold, like's dtype (the default) or
  // int8 (quantized as stored, store/quantize.h).
  PageAllocator(int64_t batch, int64_t heads, int64_t head_dim, int64_t score_channels,
                const at::Tensor& like, int64_t page_size,
                c10::optional<at::ScalarType> kv_dtype = c10::nullopt);

  // The host half of an append of n tokens to every segment (k, v [B, H, n, D]; pos [B, n]
  // or [n] integers; valid [B, n] or [B, H, n] bool, only the valid tokens stored, in
  // order): checks them, gives the segments pages for the tokens to store and advances the
  // host lengths. Returns what the store_append op takes besides the state: pos as int32
  // [B, n], and rank [S, n] / counts [S] int32 (undefined when every token is stored).
  // Nothing changes when it refuses its input.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> prepare_append(
      const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos,
      const c10::optional<at::Tensor>& valid);
  // Undoes prepare_append's host lengths when the op after it refused its input before
  // writing anything: the host lengths go back to `lengths` (what len_host() gave before it;
  // each between 0 and the current one). The pages it gave stay, as free room.
  void cancel_append(const std::vector<int32_t>& lengths);
  // The host half of an append of n tokens to every segment whose pages already hold them:
  // advances the host lengths. For a decode step replayed from a CUDA graph, whose captured
  // store_append op (len += n on the device) ran without prepare_append. Raises, changing
  // nothing, when a segment's pages lack room for them (pages are added by reserve, which a
  // graph captured before it cannot see: capture it again).
  void note_appended(int64_t n);
  // Whether every segment's pages hold n more tokens.
  bool has_room(int64_t n) const { return segment_without_room(n) < 0; }
  // The host half of a top-k of budget[s] tokens per segment and a compaction replayed from a
  // CUDA graph (the store_topk and store_compact ops, without finish_compact): the host
  // lengths become min(len, budget[s]), and every page stays held (the next replay appends
  // into them; finish_compact would give the emptied ones back). budget: [S] integers on the
  // host, >= 0. Nothing changes when it is refused.
  void note_kept_in_pages(const at::Tensor& budget);
  // The host half of a compaction, after the store_compact op: reads the new lengths (the
  // one host sync of an eviction) and gives back the pages left empty. `known` ([S] integers
  // on the host) gives the new lengths instead, from a caller that knows what it kept (a
  // top-k of k per segment keeps min(len, k)): no sync. Checked against the op's lengths on
  // a CPU store (free there); trusted on CUDA, where reading them is the sync it saves.
  void finish_compact(const c10::optional<at::Tensor>& known = c10::nullopt);
  // Gives every segment pages for `extra` more tokens (new pages only where needed).
  void reserve(int64_t extra);
  // Moves the live tokens into one new slab with pages for len + extra tokens per segment
  // and gives back every other page: the only operation that moves every token.
  void repack(int64_t extra);
  void shrink_to_fit() { repack(0); }
  // A store that continues this one's sequences (a shared prefix, docs/store.md, `fork()`):
  // the same segments and tokens, reading this store's pages of live tokens in place (not
  // copied), and putting the tokens appended to it in pages of its own. A segment whose last
  // page is partly filled gets a copy of that page (its next token goes there: the one page
  // copied on write); the pages this store held for tokens to come stay this store's. From
  // then on both stores are read-only where they share: compaction, score writes and
  // replacing tokens are refused on both (check_writable), appends (which write only pages
  // a store owns alone) are not. A repack gives a store pages of its own again.
  PageAllocator fork();
  // Whether another store reads some of this store's pages, or this one another's (fork).
  bool shares_pages() const { return shares_pages_; }
  // Raises a ValueError naming `what` when shares_pages(): it would write tokens another
  // store reads.
  void check_writable(const char* what) const;

  // Copies in slot layout ([capacity, ...]); slots that hold no live token are undefined.
  // K and V in the store's dtype (int8 pages: dequantized).
  at::Tensor k() const { return gather_rows(store::kK); }
  at::Tensor v() const { return gather_rows(store::kV); }
  at::Tensor pos() const { return gather_part(store::kPos); }
  at::Tensor scores() const { return gather_part(store::kScores); }
  // [capacity] int64 on the store's device: the batch row of the segment that owns each
  // slot's page (row 0 for a free page: nothing should read it), for work done in slot layout
  // that needs a slot's row (RaggedKVStore.slot_rows). Kept, and uploaded again only when a
  // page changed hands: per-step eviction, where a head takes back the page it freed, never.
  const at::Tensor& slot_rows();
  // Writes the score channels of every slot from a [capacity, C] float32 tensor.
  void set_scores(const at::Tensor& scores);
  at::Tensor len() const { return len_.clone(); }   // [S] int32, on the store's device
  at::Tensor page_table() const;                     // [S, width] int32 copy, -1: no page
  const std::vector<int32_t>& len_host() const { return len_h_; }
  std::vector<int32_t> pages_host() const { return pages_h_; }  // pages per segment

  // The state the ops take (ops.h): the slabs of pages, the page table and the lengths, on
  // the store's device. The Python store holds them between calls; they are other tensors
  // after a call that allocates pages or repacks (state_version() counts those calls), and
  // the ops mutate them in place (the pages; the lengths in store_append and store_compact).
  const std::vector<at::Tensor>& pool() const { return slabs_; }
  const at::Tensor& page_table_device() const { return table_; }
  // The work partition of an attention call over the host lengths (ops::attention_plan)
  // for `rows` query rows per segment: the plan of the attention_run op.
  at::Tensor attention_plan(int64_t rows) const;
  // The plan of the lengths the segments' pages hold (pages x page_size): a stale plan gives
  // the same result (ops::attention_plan), so it serves every length up to those, balanced
  // for full pages. What a captured decode step attends with while its tokens fill the pages.
  at::Tensor attention_plan_of_pages(int64_t rows) const;

  // What kernels read: device pointers into the pages. Valid until the next call that
  // allocates pages or repacks.
  store::PagedView view() const;
  const at::Tensor& len_device() const { return len_; }

  int64_t capacity() const { return num_pages() * page_size_; }  // slots in slot layout
  int64_t num_pages() const { return static_cast<int64_t>(page_base_h_.size()); }
  int64_t free_pages() const { return static_cast<int64_t>(free_.size()); }
  int64_t num_slabs() const { return static_cast<int64_t>(slabs_.size()); }
  int64_t slab_allocations() const { return slab_allocations_; }  // since construction
  int64_t repacks() const { return repacks_; }                    // since construction
  // Counts the changes of the state tensors (a new slab, a new page table, a repack): a holder
  // of state() takes it again when this moved.
  int64_t state_version() const { return state_version_; }
  int64_t num_tokens() const;  // live tokens, summed over segments
  // Bytes held by the buffers of the store, less the pages it reads from the store it was
  // forked from (which that store counts).
  int64_t nbytes() const;
  int64_t batch() const { return batch_; }
  int64_t heads() const { return heads_; }
  int64_t head_dim() const { return head_dim_; }
  int64_t score_channels() const { return score_channels_; }
  int64_t num_segments() const { return batch_ * heads_; }
  int64_t page_size() const { return page_size_; }
  at::ScalarType dtype() const { return kv_options_.dtype().toScalarType(); }
  at::ScalarType kv_dtype() const { return kv_dtype_; }  // what the pages hold (int8 or dtype())
  at::Device device() const { return kv_options_.device(); }
  at::Tensor like() const { return at::empty({0}, kv_options_); }  // dtype and device for Python

 private:
  void check_tokens(const at::Tensor& t, int64_t n, const char* name) const;
  // The first segment whose pages lack room for n more tokens, or -1.
  int64_t segment_without_room(int64_t n) const;
  // Gives segment s pages for need[s] tokens, taking free pages first and allocating one
  // slab for the rest; when a slab is allocated, pages for need[s] + lookahead tokens.
  void ensure_pages(const std::vector<int64_t>& need, int64_t lookahead);
  // Allocates a slab of `pages` pages; returns the id of its first page.
  int32_t allocate_slab(int64_t pages);
  void upload_page_base();
  // Copies the page table up unless the device already has every page a segment owns
  // (entries past a segment's pages are never read, so they may be stale there).
  void upload_table();
  at::Tensor gather_part(int part) const;
  // K or V rows of every slot in dtype(), dequantized from int8 pages.
  at::Tensor gather_rows(int part) const;
  // The slab that holds page `page`.
  size_t slab_of(int64_t page) const;
  // Part b of every page of a slab as a [pages, P, ...] view of the slab.
  at::Tensor part_of(const at::Tensor& slab, int part) const;

  int64_t batch_, heads_, head_dim_, score_channels_, page_size_;
  int32_t shift_;
  store::PageRecord record_;
  at::TensorOptions kv_options_;
  at::ScalarType kv_dtype_;
  std::vector<at::Tensor> slabs_;       // uint8 [pages, record bytes] each
  std::vector<int64_t> slab_first_;     // id of each slab's first page
  std::vector<int64_t> page_base_h_;    // address of each page
  std::vector<int32_t> free_;           // ids of the pages no segment owns
  int64_t width_ = 0;                   // columns of the page table
  std::vector<int32_t> table_h_;        // [S, width] page ids, -1 beyond a segment's pages
  std::vector<int32_t> table_uploaded_; // what table_ holds
  std::vector<int32_t> pages_h_;        // pages per segment
  std::vector<int32_t> len_h_;          // host mirror of len_: no device sync to plan
  std::vector<int64_t> page_rows_h_;    // the row of each page's owner, as slot_rows_ holds it
  at::Tensor slot_rows_;                // slot_rows(), on the store's device
  at::Tensor page_base_, table_, len_;  // on the store's device: int64, int32, int32
  int64_t slab_allocations_ = 0, repacks_ = 0, state_version_ = 0;
  bool shares_pages_ = false;           // fork: pages read by two stores
  size_t shared_slabs_ = 0;             // leading slabs of the store this one was forked from
};

}  // namespace kvcache_ext
