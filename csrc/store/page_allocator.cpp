// The host page allocator of a layer's store (page_allocator.h).
#include "store/page_allocator.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "common/checks.h"
#include "common/device_dispatch.h"
#include "ops.h"
#include "store/score_channels.h"

namespace kvcache_ext {

namespace {
// Asks Linux to back a CPU slab with 2 MiB pages where it covers whole ones (the kernel's
// transparent huge pages are often "madvise" only). Compaction and attention read pages of
// a few KiB scattered over the slab: with 4 KiB pages nearly every one costs a TLB miss,
// which slows compaction at low keep fractions (bench/kernels.py). Advisory:
// a kernel without huge pages refuses it and nothing changes.
void advise_huge_pages(const at::Tensor& slab) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const auto begin = reinterpret_cast<uintptr_t>(slab.data_ptr());
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = (begin + slab.nbytes()) & ~(kHuge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
  (void)slab;
#endif
}

// A host vector as a tensor on `device`. To CUDA through pinned memory without waiting: the
// store's bookkeeping uploads (new page addresses, the page table, a repack's page lists)
// then cost no host sync (the caching host allocator holds the pinned buffer until the copy
// has run, and the copy is ordered before later work on the stream).
template <typename T>
at::Tensor to_device(const std::vector<T>& host, at::ScalarType dtype, const c10::Device& device) {
  const auto options = at::TensorOptions().dtype(dtype).pinned_memory(device.is_cuda());
  at::Tensor t = at::empty({static_cast<int64_t>(host.size())}, options);
  if (!host.empty()) std::memcpy(t.data_ptr(), host.data(), host.size() * sizeof(T));
  return device.is_cuda() ? t.to(device, dtype, /*non_blocking=*/true) : t;
}
}  // namespace

PageAllocator::PageAllocator(int64_t batch, int64_t heads, int64_t head_dim,
                             int64_t score_channels, const at::Tensor& like, int64_t page_size,
                             c10::optional<at::ScalarType> kv_dtype)
    : batch_(batch), heads_(heads), head_dim_(head_dim), score_channels_(score_channels),
      page_size_(page_size) {
  TORCH_CHECK_VALUE(batch >= 1, "batch must be >= 1, got ", batch);
  TORCH_CHECK_VALUE(heads >= 1, "heads must be >= 1, got ", heads);
  TORCH_CHECK_VALUE(batch <= INT32_MAX / heads, "batch * heads must be < 2^31, got ", batch,
                    " * ", heads);
  TORCH_CHECK_VALUE(head_dim >= 1 && head_dim <= 65536, "head_dim must be in [1, 65536], got ",
                    head_dim);
  TORCH_CHECK_VALUE(score_channels >= 0 && score_channels <= 65536,
                    "score_channels must be in [0, 65536], got ", score_channels);
  shift_ = ops::page_shift(page_size);
  const auto dtype = like.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                   "the store holds float32, float16 or bfloat16 K/V, got ", dtype);
  check_device_supported(like.device());
  kv_options_ = like.options();
  kv_dtype_ = kv_dtype.value_or(dtype);
  TORCH_CHECK_TYPE(kv_dtype_ == dtype || kv_dtype_ == at::kChar, "kv_dtype must be the store's dtype ", dtype,
                   " or int8 (quantized pages), got ", kv_dtype_);
  record_ = store::page_record(page_size, head_dim, c10::elementSize(kv_dtype_), score_channels,
                               /*quantized=*/kv_dtype_ == at::kChar);
  const int64_t S = num_segments();
  const auto meta = at::TensorOptions().device(like.device());
  page_base_ = at::empty({0}, meta.dtype(at::kLong));
  table_ = at::empty({S, 0}, meta.dtype(at::kInt));
  len_ = at::zeros({S}, meta.dtype(at::kInt));
  pages_h_.assign(S, 0);
  len_h_.assign(S, 0);
}

int64_t PageAllocator::num_tokens() const {
  return std::accumulate(len_h_.begin(), len_h_.end(), int64_t{0});
}

int64_t PageAllocator::nbytes() const {
  int64_t total = 0;
  for (size_t i = shared_slabs_; i < slabs_.size(); ++i) total += slabs_[i].nbytes();
  for (const auto* t : {&page_base_, &table_, &len_}) total += t->nbytes();
  return total;
}

store::PagedView PageAllocator::view() const {
  return store::PagedView{page_base_.data_ptr<int64_t>(), table_.data_ptr<int32_t>(), width_,
                          shift_, record_};
}

at::Tensor PageAllocator::page_table() const {
  return at::tensor(table_h_, at::kInt).view({num_segments(), width_}).to(device());
}

at::Tensor PageAllocator::attention_plan(int64_t rows) const {
  const at::Tensor lens = at::from_blob(const_cast<int32_t*>(len_h_.data()),
                                        {static_cast<int64_t>(len_h_.size())}, at::kInt);
  return ops::attention_plan(lens, rows, device());
}

at::Tensor PageAllocator::attention_plan_of_pages(int64_t rows) const {
  std::vector<int32_t> held(pages_h_.size());
  for (size_t s = 0; s < held.size(); ++s) held[s] = pages_h_[s] << shift_;  // < 2^31 slots
  const at::Tensor lens = at::from_blob(held.data(), {static_cast<int64_t>(held.size())}, at::kInt);
  return ops::attention_plan(lens, rows, device());
}

int64_t PageAllocator::segment_without_room(int64_t n) const {
  for (int64_t s = 0; s < num_segments(); ++s)
    if (len_h_[s] + n > (int64_t{pages_h_[s]} << shift_)) return s;
  return -1;
}

void PageAllocator::cancel_append(const std::vector<int32_t>& lengths) {
  const int64_t S = num_segments();
  TORCH_CHECK_VALUE(static_cast<int64_t>(lengths.size()) == S, "cancel_append takes ", S,
                    " lengths (one per segment), got ", lengths.size());
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK_VALUE(lengths[s] >= 0 && lengths[s] <= len_h_[s], "cancel_append's length of segment ", s,
                      " is ", lengths[s], "; it takes one between 0 and the segment's ", len_h_[s]);
  std::copy(lengths.begin(), lengths.end(), len_h_.begin());
}

void PageAllocator::note_appended(int64_t n) {
  TORCH_CHECK_VALUE(n >= 0, "note_appended takes a number of tokens >= 0, got ", n);
  const int64_t s = segment_without_room(n);
  TORCH_CHECK_VALUE(s < 0, "segment ", s, " holds ", s < 0 ? 0 : len_h_[s], " tokens in pages for ",
                    s < 0 ? 0 : int64_t{pages_h_[s]} << shift_, ": no room for ", n,
                    " more without new pages (reserve them first)");
  for (int32_t& len : len_h_) len += static_cast<int32_t>(n);
}

void PageAllocator::note_kept_in_pages(const at::Tensor& budget) {
  const int64_t S = num_segments();
  check_defined(budget, "budget");
  TORCH_CHECK_VALUE(budget.device().is_cpu() && is_integer_dtype(budget.scalar_type()) && budget.numel() == S,
                    "note_kept_in_pages takes the budgets as ", S, " integers on the host (one per "
                    "segment), got a ", budget.scalar_type(), " tensor of ", budget.numel(), " elements on ",
                    budget.device());
  const at::Tensor kept = budget.to(at::kLong).contiguous().view({S});
  const int64_t* k = kept.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK_VALUE(k[s] >= 0, "note_kept_in_pages takes budgets >= 0, got ", k[s], " for segment ", s);
  for (int64_t s = 0; s < S; ++s) len_h_[s] = static_cast<int32_t>(std::min<int64_t>(len_h_[s], k[s]));
}

at::Tensor PageAllocator::part_of(const at::Tensor& slab, int part) const {
  return store::slab_part(slab, record_, part, page_size_, kv_dtype_);
}

at::Tensor PageAllocator::gather_part(int part) const {
  std::vector<at::Tensor> pieces;
  for (const auto& slab : slabs_) {
    at::Tensor p = part_of(slab, part);
    pieces.push_back(p.reshape(part == store::kPos ? std::vector<int64_t>{-1}
                                                   : std::vector<int64_t>{p.size(0) * page_size_, p.size(2)}));
  }
  if (pieces.empty()) {
    const auto meta = at::TensorOptions().device(device());
    if (part == store::kPos) return at::empty({0}, meta.dtype(at::kInt));
    if (part == store::kScores) return at::empty({0, score_channels_}, meta.dtype(at::kFloat));
    if (part == store::kScale) return at::empty({0, 2}, meta.dtype(at::kHalf));
    return at::empty({0, head_dim_}, meta.dtype(kv_dtype_));
  }
  return at::cat(pieces, 0);  // a copy even for one slab: callers cannot write the store
}

at::Tensor PageAllocator::gather_rows(int part) const {
  const at::Tensor rows = gather_part(part);
  if (!record_.quantized()) return rows;
  // The twin of kvcache_ext.reference.dequantize: steps times the row's scale, in float32.
  const at::Tensor scale = gather_part(store::kScale).select(1, part == store::kK ? 0 : 1).to(at::kFloat);
  return (rows.to(at::kFloat) * scale.unsqueeze(1)).to(dtype());
}

size_t PageAllocator::slab_of(int64_t page) const {
  return std::upper_bound(slab_first_.begin(), slab_first_.end(), page) - slab_first_.begin() - 1;
}

void PageAllocator::check_writable(const char* what) const {
  TORCH_CHECK_VALUE(!shares_pages_, what, " would write tokens that this store shares with "
                    "another (a store forked from it, or the one it was forked from: a shared "
                    "prefix), which are read-only; repack the store first to give it pages of its own");
}

PageAllocator PageAllocator::fork() {
  PageAllocator child(*this);  // the slabs' tensors are shared, not copied
  shares_pages_ = child.shares_pages_ = true;
  child.shared_slabs_ = slabs_.size();
  child.free_.clear();         // this store's free pages stay its own
  child.len_ = len_.clone();   // the ops advance a store's device lengths in place
  child.slot_rows_ = at::Tensor();
  child.page_rows_h_.clear();
  child.slab_allocations_ = child.repacks_ = 0;
  const int64_t S = num_segments();
  std::vector<int64_t> partial;  // segments whose last live page is partly filled
  for (int64_t s = 0; s < S; ++s) {
    const int32_t used = static_cast<int32_t>((len_h_[s] + page_size_ - 1) >> shift_);
    for (int64_t j = used; j < pages_h_[s]; ++j) child.table_h_[s * width_ + j] = -1;
    child.pages_h_[s] = used;
    if (len_h_[s] & (page_size_ - 1)) partial.push_back(s);
  }
  if (!partial.empty()) {
    const int32_t first = child.allocate_slab(static_cast<int64_t>(partial.size()));
    std::vector<std::vector<int64_t>> from(slabs_.size()), to(slabs_.size());
    for (size_t i = 0; i < partial.size(); ++i) {
      const int64_t s = partial[i];
      int32_t& entry = child.table_h_[s * width_ + child.pages_h_[s] - 1];
      const size_t slab = slab_of(entry);
      from[slab].push_back(entry - slab_first_[slab]);
      to[slab].push_back(static_cast<int64_t>(i));
      entry = first + static_cast<int32_t>(i);
    }
    at::Tensor& copies = child.slabs_.back();
    for (size_t i = 0; i < slabs_.size(); ++i) {
      if (from[i].empty()) continue;
      copies.index_copy_(0, to_device(to[i], at::kLong, device()),
                         slabs_[i].index_select(0, to_device(from[i], at::kLong, device())));
    }
    child.upload_page_base();
  }
  child.table_uploaded_.clear();  // the child's own table on the device
  child.upload_table();
  return child;
}

void PageAllocator::set_scores(const at::Tensor& scores) {
  check_writable("set_scores");
  check_defined(scores, "scores");
  check_dtype(scores, at::kFloat, "scores");
  check_device(scores, device(), "scores");
  check_shape(scores, {capacity(), score_channels_}, "scores");
  for (size_t i = 0; i < slabs_.size(); ++i) {
    at::Tensor dst = part_of(slabs_[i], store::kScores);
    const int64_t slots = dst.size(0) * page_size_;
    dst.copy_(scores.narrow(0, slab_first_[i] * page_size_, slots).view(dst.sizes()));
  }
}

void PageAllocator::check_tokens(const at::Tensor& t, int64_t n, const char* name) const {
  check_defined(t, name);
  TORCH_CHECK_TYPE(t.scalar_type() == dtype(), name, " must have the store's dtype ", dtype(),
                   ", got ", t.scalar_type());
  check_device(t, device(), name);
  check_shape(t, {batch_, heads_, n, head_dim_}, name);
  check_contiguous(t, name);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> PageAllocator::prepare_append(
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos,
    const c10::optional<at::Tensor>& valid) {
  check_defined(k, "k");
  TORCH_CHECK_VALUE(k.dim() == 4, "k must have shape [batch, heads, n, head_dim], got ", k.sizes());
  const int64_t n = k.size(2);
  check_tokens(k, n, "k");
  check_tokens(v, n, "v");
  const at::Tensor pos32 = append_positions(pos, device(), batch_, n);
  const int64_t S = num_segments();

  std::vector<int64_t> incoming(S, n);
  at::Tensor rank;    // undefined: every token is stored
  at::Tensor counts;  // tokens stored per segment, on the device; undefined: n each
  if (valid.has_value() && valid->defined()) {
    const at::Tensor& mask = *valid;
    check_dtype(mask, at::kBool, "valid");
    check_device(mask, device(), "valid");
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
  if (n == 0) return {pos32, rank, counts};
  std::vector<int64_t> need(S);
  for (int64_t s = 0; s < S; ++s) need[s] = len_h_[s] + incoming[s];
  ensure_pages(need, page_size_ / 2);
  // The device lengths advance in the store_append op (len += counts): both copies of the
  // lengths move without a host-device transfer.
  for (int64_t s = 0; s < S; ++s) len_h_[s] = static_cast<int32_t>(need[s]);
  return {pos32, rank, counts};
}

void PageAllocator::finish_compact(const c10::optional<at::Tensor>& known) {
  // The compaction op has run by now: the store's callers (RaggedKVStore.compact,
  // evict_by_rule) check_writable before it.
  check_writable("a compaction");
  const int64_t S = num_segments();
  if (known.has_value()) {
    const at::Tensor& given = *known;
    TORCH_CHECK_VALUE(given.device().is_cpu() && !given.is_floating_point() &&
                          given.scalar_type() != at::kBool && given.numel() == S,
                      "finish_compact's known lengths must be ", S, " integers on the host (one per "
                      "segment), got a ", given.scalar_type(), " tensor of ", given.numel(),
                      " elements on ", given.device());
    const at::Tensor lens = given.to(at::kLong).contiguous().view({S});
    const int64_t* kept = lens.data_ptr<int64_t>();
    for (int64_t s = 0; s < S; ++s)
      TORCH_CHECK_VALUE(kept[s] >= 0 && kept[s] <= len_h_[s], "finish_compact's known length of "
                        "segment ", s, " is ", kept[s], "; a compaction keeps between 0 and the "
                        "segment's ", len_h_[s], " tokens");
    int64_t wrong = -1;   // a segment whose given length is not what the op kept (CPU only)
    if (len_.is_cpu()) {  // the op's own lengths cost nothing to read here: they must agree
      const int32_t* op_len = len_.data_ptr<int32_t>();
      for (int64_t s = 0; s < S && wrong < 0; ++s)
        if (op_len[s] != kept[s]) wrong = s;
    }
    if (wrong >= 0) {
      // The compaction has run: take its lengths and free the pages before refusing, so
      // that the store stays consistent.
      const int32_t wrong_kept = len_.data_ptr<int32_t>()[wrong];
      finish_compact(c10::nullopt);
      TORCH_CHECK_VALUE(false, "finish_compact's known length of segment ", wrong, " is ",
                        kept[wrong], ", but the compaction kept ", wrong_kept, " tokens");
    }
    for (int64_t s = 0; s < S; ++s) len_h_[s] = static_cast<int32_t>(kept[s]);
  } else if (capacity() > 0) {
    const at::Tensor lens = len_.to(at::kCPU);  // host sync: the new lengths depend on keep
    std::copy_n(lens.data_ptr<int32_t>(), S, len_h_.begin());
  }
  if (capacity() == 0) return;
  // Pages past a segment's last token are free again (host bookkeeping only: the kernels
  // never read the table past a segment's pages, so nothing is copied up).
  for (int64_t s = 0; s < num_segments(); ++s) {
    const int64_t used = (len_h_[s] + page_size_ - 1) >> shift_;
    for (int64_t j = used; j < pages_h_[s]; ++j) {
      free_.push_back(table_h_[s * width_ + j]);
      table_h_[s * width_ + j] = -1;
    }
    pages_h_[s] = static_cast<int32_t>(used);
  }
}

const at::Tensor& PageAllocator::slot_rows() {
  std::vector<int64_t> rows(num_pages(), 0);
  for (int64_t s = 0; s < num_segments(); ++s)
    for (int64_t j = 0; j < pages_h_[s]; ++j) rows[table_h_[s * width_ + j]] = s / heads_;
  if (!slot_rows_.defined() || rows != page_rows_h_) {
    std::vector<int64_t> slots(capacity());
    for (int64_t p = 0; p < num_pages(); ++p)
      std::fill_n(slots.begin() + p * page_size_, page_size_, rows[p]);
    slot_rows_ = to_device(slots, at::kLong, device());
    page_rows_h_ = std::move(rows);
  }
  return slot_rows_;
}

void PageAllocator::reserve(int64_t extra) {
  TORCH_CHECK_VALUE(extra >= 0 && extra <= INT32_MAX,
                    "reserve takes a number of tokens in [0, 2^31 - 1], got ", extra);
  std::vector<int64_t> need(num_segments());
  for (size_t s = 0; s < need.size(); ++s) need[s] = len_h_[s] + extra;  // < 2^32: no overflow
  ensure_pages(need, 0);
}

void PageAllocator::ensure_pages(const std::vector<int64_t>& need, int64_t lookahead) {
  const int64_t S = num_segments();
  std::vector<int64_t> missing(S);
  int64_t total_missing = 0, widest = width_;
  const auto count_missing = [&](int64_t ahead) {
    total_missing = 0;
    for (int64_t s = 0; s < S; ++s) {
      const int64_t pages = (std::min<int64_t>(need[s] + ahead, INT32_MAX) + page_size_ - 1) >> shift_;
      missing[s] = std::max<int64_t>(0, pages - pages_h_[s]);
      total_missing += missing[s];
      widest = std::max(widest, pages);
    }
  };
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK_VALUE(need[s] <= INT32_MAX, "a segment cannot hold more than 2^31 - 1 tokens");
  count_missing(0);
  if (total_missing == 0) return;
  // A new slab costs the same whatever it holds: when one is needed, it also holds the next
  // page of every segment that will fill its last page within `lookahead` tokens. Heads of
  // unequal lengths (Ada-KV) fill their pages on different decode steps; without this, most
  // steps would allocate a one-page slab.
  if (lookahead > 0 && total_missing > free_pages()) count_missing(lookahead);
  // Free pages first, in the order they were freed (a segment that freed a page takes it
  // back, and the device's table is then already right), then one new slab for the rest:
  // the pages a segment has never move.
  std::vector<int32_t> fresh;
  const int64_t from_free = std::min<int64_t>(total_missing, free_pages());
  fresh.assign(free_.end() - from_free, free_.end());
  free_.resize(free_.size() - from_free);
  if (total_missing > from_free) {
    const int32_t first = allocate_slab(total_missing - from_free);
    for (int64_t i = 0; i < total_missing - from_free; ++i) fresh.push_back(first + static_cast<int32_t>(i));
    upload_page_base();
  }
  if (widest > width_) {  // the page table widens: a copy of the table only
    std::vector<int32_t> wider(S * widest, -1);
    for (int64_t s = 0; s < S; ++s)
      std::copy_n(table_h_.begin() + s * width_, width_, wider.begin() + s * widest);
    table_h_ = std::move(wider);
    width_ = widest;
  }
  size_t next = 0;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t j = 0; j < missing[s]; ++j) table_h_[s * width_ + pages_h_[s]++] = fresh[next++];
  upload_table();
}

int32_t PageAllocator::allocate_slab(int64_t pages) {
  const int64_t first = num_pages();
  TORCH_CHECK_VALUE(first + pages <= (INT32_MAX >> shift_),
                    "the store cannot hold more than 2^31 - 1 slots");
  at::Tensor slab = at::empty({pages, record_.bytes}, kv_options_.dtype(at::kByte));
  if (slab.is_cpu()) advise_huge_pages(slab);
  const int64_t base = reinterpret_cast<int64_t>(slab.data_ptr());
  for (int64_t p = 0; p < pages; ++p) page_base_h_.push_back(base + p * record_.bytes);
  slabs_.push_back(std::move(slab));
  ++state_version_;
  slab_first_.push_back(first);
  ++slab_allocations_;
  return static_cast<int32_t>(first);
}

void PageAllocator::upload_page_base() {
  // Only when pages are allocated: decoding allocates once per page_size steps at most.
  page_base_ = to_device(page_base_h_, at::kLong, device());
}

void PageAllocator::upload_table() {
  bool current = table_uploaded_.size() == table_h_.size();
  for (size_t i = 0; current && i < table_h_.size(); ++i)
    current = table_h_[i] < 0 || table_h_[i] == table_uploaded_[i];
  if (current) return;  // e.g. per-step eviction: each head takes back the page it freed
  table_uploaded_ = table_h_;
  table_ = to_device(table_h_, at::kInt, device()).view({num_segments(), width_});
  ++state_version_;
}

void PageAllocator::repack(int64_t extra) {
  TORCH_CHECK_VALUE(extra >= 0 && extra <= INT32_MAX,
                    "repack takes a number of tokens in [0, 2^31 - 1], got ", extra);
  const int64_t S = num_segments();
  std::vector<int64_t> keep_pages(S);  // pages with live tokens move; the rest are new
  std::vector<int32_t> new_pages(S);
  int64_t total = 0, moved = 0, widest = 0;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK_VALUE(len_h_[s] + extra <= INT32_MAX, "a segment cannot hold more than 2^31 - 1 tokens");
    keep_pages[s] = (len_h_[s] + page_size_ - 1) >> shift_;
    new_pages[s] = static_cast<int32_t>((len_h_[s] + extra + page_size_ - 1) >> shift_);
    total += new_pages[s];
    moved += keep_pages[s];
    widest = std::max<int64_t>(widest, new_pages[s]);
  }
  // Old page id -> new page id of every page that holds live tokens, grouped by old slab.
  std::vector<int64_t> new_table(S * widest, -1);
  std::vector<std::vector<int64_t>> from(slabs_.size()), to(slabs_.size());
  int64_t next = 0;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t j = 0; j < new_pages[s]; ++j) {
      if (j < keep_pages[s]) {
        const int64_t old = table_h_[s * width_ + j];
        const size_t slab = slab_of(old);
        from[slab].push_back(old - slab_first_[slab]);
        to[slab].push_back(next);
      }
      new_table[s * widest + j] = next++;
    }
  }
  TORCH_CHECK_VALUE(total <= (INT32_MAX >> shift_), "the store cannot hold more than 2^31 - 1 slots");
  at::Tensor slab = at::empty({total, record_.bytes}, kv_options_.dtype(at::kByte));
  for (size_t i = 0; i < slabs_.size(); ++i) {
    if (from[i].empty()) continue;
    const at::Tensor src = to_device(from[i], at::kLong, device());
    const at::Tensor dst = to_device(to[i], at::kLong, device());
    slab.index_copy_(0, dst, slabs_[i].index_select(0, src));
  }
  slabs_.clear();
  shares_pages_ = false;  // every live token now lies in the new slab, this store's alone
  shared_slabs_ = 0;
  ++state_version_;
  slab_first_.clear();
  page_base_h_.clear();
  free_.clear();
  if (total > 0) {
    slabs_.push_back(slab);
    slab_first_.push_back(0);
    ++slab_allocations_;
  }
  const int64_t base = reinterpret_cast<int64_t>(slab.data_ptr());
  for (int64_t p = 0; p < total; ++p) page_base_h_.push_back(base + p * record_.bytes);
  table_h_.assign(new_table.begin(), new_table.end());
  width_ = widest;
  pages_h_ = new_pages;
  if (moved > 0) ++repacks_;
  upload_page_base();
  upload_table();
}

}  // namespace kvcache_ext
