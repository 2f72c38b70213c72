// RaggedKVStore: the KV cache of one attention layer, one ragged segment per (batch item,
// KV head), stored in pages (store/paged_layout.h). See DESIGN.md "Ragged store" and
// README "Store API".
#pragma once
#include <ATen/ATen.h>

#include <tuple>
#include <vector>

#include "ops.h"
#include "store/paged_layout.h"

namespace kvcache_ext {

class RaggedKVStore {
 public:
  // `like` only carries the dtype and device of K and V. page_size: tokens per page, a
  // power of two; it is also the unit by which a segment grows.
  RaggedKVStore(int64_t batch, int64_t heads, int64_t head_dim, int64_t score_channels,
                const at::Tensor& like, int64_t page_size);

  // Appends n tokens to every segment: k, v [B, H, n, D]; pos [B, n] or [n]. With
  // valid ([B, n] or [B, H, n] bool), only the valid tokens are stored, in order.
  void append(const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos,
              const c10::optional<at::Tensor>& valid);
  // append's host half: checks, gives the segments pages for the tokens to store and
  // advances the host lengths. Returns what the store_append op (ops.h) takes besides the
  // state: pos as int32, and rank [S, n] / counts [S] int32 (undefined when every token
  // is stored). append = prepare_append + the op.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> prepare_append(
      const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos,
      const c10::optional<at::Tensor>& valid);
  // A decode step's store work in one host call: append(k, v, pos) of every token, then the
  // attention of q [B, Hq, n, D] over the store (attention_plan + ops::attention_run, no
  // statistics). Returns out [B, Hq, n, D]. q is checked before anything is stored. The
  // patched model's eager decode runs this; torch.compile traces the two ops instead.
  at::Tensor append_and_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& pos, double scale);
  // Overwrites token slot[b, h] (an index in [0, len)) of every segment with the token
  // k, v [B, H, 1, D] at position pos [B]. A slot given on the host is always bounds-checked
  // (against the host lengths: free); check_bounds checks one on a CUDA device (a host sync).
  void replace(const at::Tensor& slot, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& pos, bool check_bounds);
  // Keeps the live tokens whose flag in keep ([capacity] bool, slot layout) is set, in
  // order. Pages left empty go back to the store's free pages.
  void compact(const at::Tensor& keep);
  // compact's host half, after the store_compact op: reads the new lengths (the one host
  // sync of an eviction) and frees the pages left empty.
  void finish_compact();
  // The k best live tokens (selection_key.h's order), CPU stores only: keep [capacity] bool
  // in slot layout and counts [S] int32 kept per segment. scores: none (channel 0 of the
  // store's scores), [capacity] (slot layout) or [B, H, L >= longest segment] (padded),
  // float32. grouped = false: k [S] integers, per segment; true: k [B], per batch item over
  // its heads (Ada-KV's allocation).
  std::tuple<at::Tensor, at::Tensor> select(const c10::optional<at::Tensor>& scores,
                                            const at::Tensor& k, bool grouped) const;
  // Gives every segment pages for `extra` more tokens (new pages only where needed).
  void reserve(int64_t extra);
  // Moves the live tokens into one new slab with pages for len + extra tokens per segment
  // and gives back every other page: the only operation that moves every token.
  void repack(int64_t extra);
  void shrink_to_fit() { repack(0); }

  // Copies in slot layout ([capacity, ...]); slots that hold no live token are undefined.
  at::Tensor k() const { return gather_part(store::kK); }
  at::Tensor v() const { return gather_part(store::kV); }
  at::Tensor pos() const { return gather_part(store::kPos); }
  at::Tensor scores() const { return gather_part(store::kScores); }
  // Writes the score channels of every slot from a [capacity, C] float32 tensor.
  void set_scores(const at::Tensor& scores);
  at::Tensor len() const { return len_.clone(); }   // [S] int32, on the store's device
  at::Tensor page_table() const;                     // [S, width] int32 copy, -1: no page
  const std::vector<int32_t>& len_host() const { return len_h_; }
  std::vector<int32_t> pages_host() const { return pages_h_; }  // pages per segment

  // The state the ops take (ops.h): the slabs of pages, the page table and the lengths, on
  // the store's device. The Python store holds them between calls; they change (other
  // tensors) when pages are allocated or the store is repacked, and are mutated by the ops.
  const std::vector<at::Tensor>& pool() const { return slabs_; }
  const at::Tensor& page_table_device() const { return table_; }
  // The work partition of an attention call over the current lengths (ops::attention_plan)
  // for `rows` query rows per segment.
  at::Tensor attention_plan(int64_t rows) const;

  // What kernels read: device pointers into the store. Valid until the next call that
  // changes the store.
  store::PagedView view() const;
  const at::Tensor& len_device() const { return len_; }
  // The state as the ops' kernels take it, from what the page allocator keeps (page_base_,
  // table_): no per-slab checks or lookups, unlike ops::state_view on pool().
  ops::StateView own_state() const;

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
  int64_t nbytes() const;      // bytes held by every buffer of the store
  int64_t batch() const { return batch_; }
  int64_t heads() const { return heads_; }
  int64_t head_dim() const { return head_dim_; }
  int64_t score_channels() const { return score_channels_; }
  int64_t num_segments() const { return batch_ * heads_; }
  int64_t page_size() const { return page_size_; }
  at::ScalarType dtype() const { return kv_options_.dtype().toScalarType(); }
  at::Device device() const { return kv_options_.device(); }
  at::Tensor like() const { return at::empty({0}, kv_options_); }  // dtype and device for Python

 private:
  void check_tokens(const at::Tensor& t, int64_t n, const char* name) const;
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
  // Part b of every page of a slab as a [pages, P, ...] view of the slab.
  at::Tensor part_of(const at::Tensor& slab, int part) const;

  int64_t batch_, heads_, head_dim_, score_channels_, page_size_;
  int32_t shift_;
  store::PageRecord record_;
  at::TensorOptions kv_options_;
  std::vector<at::Tensor> slabs_;       // uint8 [pages, record bytes] each
  std::vector<int64_t> slab_first_;     // id of each slab's first page
  std::vector<int64_t> page_base_h_;    // address of each page
  std::vector<int32_t> free_;           // ids of the pages no segment owns
  int64_t width_ = 0;                   // columns of the page table
  std::vector<int32_t> table_h_;        // [S, width] page ids, -1 beyond a segment's pages
  std::vector<int32_t> table_uploaded_; // what table_ holds
  std::vector<int32_t> pages_h_;        // pages per segment
  std::vector<int32_t> len_h_;          // host mirror of len_: no device sync to plan
  at::Tensor page_base_, table_, len_;  // on the store's device: int64, int32, int32
  int64_t slab_allocations_ = 0, repacks_ = 0, state_version_ = 0;
};

}  // namespace kvcache_ext
