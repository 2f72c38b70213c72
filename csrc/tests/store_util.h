// The store of the gtests, and helpers that read its paged layout (store/paged_layout.h):
// the slots of each segment's tokens, the pages' addresses, the invariants of the page
// bookkeeping, and snapshots of where the pages are.
//
// OpStore is the store as the Python RaggedKVStore runs it (kvcache_ext/kernels/store.py):
// the page allocator for the host steps, and every kernel through the C++ function of its
// op (ops.h) on the allocator's state, so that the gtests test what Python runs. The
// layout helpers compute everything from the allocator's public API (page_table(),
// pages_host(), view(), ...) and the layout documented in paged_layout.h, never with the
// store's own helpers (page_record, PagedView::slot), so that a wrong helper is caught too.
#pragma once
#include <tuple>

#include "ops.h"
#include "store/page_allocator.h"
#include "tests/test_util.h"

namespace kvtest {

using kvcache_ext::PageAllocator;

class OpStore : public PageAllocator {
 public:
  using PageAllocator::PageAllocator;
  explicit OpStore(PageAllocator&& allocator) : PageAllocator(std::move(allocator)) {}  // a fork
  using Attention = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

  // RaggedKVStore.append: the allocator's prepare_append, then the store_append op.
  void append(const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos,
              const c10::optional<at::Tensor>& valid = c10::nullopt) {
    const auto [pos32, rank, counts] = prepare_append(k, v, pos, valid);
    kvcache_ext::ops::store_append(pool(), page_table_device(), len_device(), k, v, pos32, rank,
                                   counts, page_size(), score_channels(), kv_dtype());
  }
  // RaggedKVStore.replace: the store_replace op.
  void replace(const at::Tensor& slot, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& pos, bool check_bounds) {
    kvcache_ext::ops::store_replace(pool(), page_table_device(), len_device(), slot, k, v, pos,
                                    page_size(), head_dim(), score_channels(), kv_dtype(), check_bounds);
  }
  // RaggedKVStore.compact: the store_compact op (stable, or unordered), then the allocator's
  // finish_compact.
  void compact(const at::Tensor& keep, bool stable = true) {
    kvcache_ext::ops::store_compact(pool(), page_table_device(), len_device(), keep, page_size(),
                                    head_dim(), score_channels(), kv_dtype(), stable);
    finish_compact();
  }
  // RaggedKVStore.select: the store_topk op, k per segment or (grouped) per
  // batch item.
  std::tuple<at::Tensor, at::Tensor> select(const c10::optional<at::Tensor>& scores,
                                            const at::Tensor& k, bool grouped) const {
    return kvcache_ext::ops::store_topk(pool(), page_table_device(), len_device(), scores, k,
                                        grouped ? heads() : 1, page_size(), head_dim(),
                                        score_channels(), kv_dtype());
  }
  // ragged_attention: the allocator's attention_plan, then the attention_run op. A statistic
  // not asked for is an empty tensor.
  Attention attend(const at::Tensor& q, double scale, const c10::optional<at::Tensor>& q_pos,
                   bool mass, bool last, bool sum_sq, bool count) const {
    const int64_t rows = q.defined() && q.dim() == 4 ? q.size(1) / heads() * q.size(2) : 1;
    return kvcache_ext::ops::attention_run(q, pool(), page_table_device(), len_device(),
                                           attention_plan(rows), q_pos, scale, heads(), page_size(),
                                           head_dim(), score_channels(), kv_dtype(), mass, last,
                                           sum_sq, count);
  }
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t align16(int64_t x) { return (x + 15) / 16 * 16; }

// Bytes of one page: [K: P rows of D elements] [V] [pos: P int32] [scores: P rows of C
// float32] [int8 pages: P rows of two float16 scales], each part padded to a multiple of 16
// bytes.
inline int64_t expected_page_bytes(int64_t P, int64_t D, int64_t element_size, int64_t C,
                                   bool quantized = false) {
  return 2 * align16(P * D * element_size) + align16(P * 4) + align16(P * C * 4) +
         (quantized ? align16(P * 4) : 0);
}

// The page table on the host: ids[s * width + j], -1 where segment s has no page j.
struct HostTable {
  int64_t width = 0;
  std::vector<int32_t> ids;
  int32_t at(int64_t s, int64_t j) const { return ids[s * width + j]; }
};

inline HostTable host_table(const PageAllocator& st) {
  const at::Tensor t = st.page_table();
  HostTable h;
  h.width = t.dim() == 2 ? t.size(1) : 0;
  h.ids = to_vec<int32_t>(t.to(at::kInt));
  return h;
}

// Slot of token i of a segment whose pages are `pages` (slot = page * P + i mod P).
inline int64_t slot_of(const std::vector<int32_t>& pages, int64_t P, int64_t i) {
  return int64_t{pages[i / P]} * P + i % P;
}

// The pages each segment owns, in token order (the first pages_host()[s] columns).
inline std::vector<std::vector<int32_t>> segment_pages(const PageAllocator& st) {
  const HostTable t = host_table(st);
  const std::vector<int32_t> pages = st.pages_host();
  std::vector<std::vector<int32_t>> out(st.num_segments());
  for (int64_t s = 0; s < st.num_segments(); ++s) {
    for (int64_t j = 0; j < std::min<int64_t>(pages[s], t.width); ++j) out[s].push_back(t.at(s, j));
  }
  return out;
}

// Slots of each segment's live tokens, in token order. PagingConsistent checks first that
// the segment has pages for them.
inline std::vector<std::vector<int64_t>> live_slots(const PageAllocator& st) {
  const auto pages = segment_pages(st);
  const std::vector<int32_t>& len = st.len_host();
  std::vector<std::vector<int64_t>> out(pages.size());
  for (size_t s = 0; s < pages.size(); ++s) {
    for (int64_t i = 0; i < len[s]; ++i) out[s].push_back(slot_of(pages[s], st.page_size(), i));
  }
  return out;
}

// Address of every page as the kernels see it (view().page_base), read back to the host.
inline std::vector<int64_t> page_addresses(const PageAllocator& st) {
  const int64_t n = st.num_pages();
  if (n == 0) return {};
  const kvcache_ext::store::PagedView view = st.view();
  const at::Tensor t = at::from_blob(const_cast<int64_t*>(view.page_base), {n},
                                     at::TensorOptions().dtype(at::kLong).device(st.device()));
  return to_vec<int64_t>(t);
}

// Where everything is: enough to tell whether a page moved, was added or given back.
struct Placement {
  HostTable table;
  std::vector<int32_t> pages, len;
  std::vector<int64_t> addresses;
  int64_t num_pages = 0, free_pages = 0, num_slabs = 0, slab_allocations = 0, repacks = 0;
};

inline Placement placement(const PageAllocator& st) {
  Placement p;
  p.table = host_table(st);
  p.pages = st.pages_host();
  p.len = st.len_host();
  p.addresses = page_addresses(st);
  p.num_pages = st.num_pages();
  p.free_pages = st.free_pages();
  p.num_slabs = st.num_slabs();
  p.slab_allocations = st.slab_allocations();
  p.repacks = st.repacks();
  return p;
}

// Nothing about the pages changed: same table, same page addresses, same counters.
inline ::testing::AssertionResult SamePlacement(const Placement& a, const Placement& b) {
  auto fail = [](const char* what) {
    return ::testing::AssertionFailure() << "the store's " << what << " changed";
  };
  if (a.table.width != b.table.width || a.table.ids != b.table.ids) return fail("page table");
  if (a.pages != b.pages) return fail("pages per segment (pages_host)");
  if (a.len != b.len) return fail("lengths (len_host)");
  if (a.addresses != b.addresses) return fail("page addresses");
  if (a.num_pages != b.num_pages) return fail("num_pages");
  if (a.free_pages != b.free_pages) return fail("free_pages");
  if (a.num_slabs != b.num_slabs) return fail("num_slabs");
  if (a.slab_allocations != b.slab_allocations) return fail("slab_allocations");
  if (a.repacks != b.repacks) return fail("repacks");
  return ::testing::AssertionSuccess();
}

// No page moved from `before` to `now`: every page that existed keeps its address, and every
// page a segment owned and still owns (its first min(before, now) pages) is the same page.
inline ::testing::AssertionResult PagesStayed(const Placement& before, const Placement& now) {
  const size_t common = std::min(before.addresses.size(), now.addresses.size());
  for (size_t p = 0; p < common; ++p) {
    if (before.addresses[p] != now.addresses[p]) {
      return ::testing::AssertionFailure() << "page " << p << " moved";
    }
  }
  for (size_t s = 0; s < before.pages.size() && s < now.pages.size(); ++s) {
    for (int64_t j = 0; j < std::min(before.pages[s], now.pages[s]); ++j) {
      if (before.table.at(s, j) != now.table.at(s, j)) {
        return ::testing::AssertionFailure()
               << "page " << j << " of segment " << s << " was page " << before.table.at(s, j)
               << ", now page " << now.table.at(s, j);
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// True when some segment's pages are not in increasing id order (a page reused from
// elsewhere in the store), for checking that a scenario fragments the store as it means to.
inline bool pages_out_of_order(const PageAllocator& st) {
  for (const auto& pages : segment_pages(st)) {
    for (size_t j = 1; j < pages.size(); ++j) {
      if (pages[j] < pages[j - 1]) return true;
    }
  }
  return false;
}

// The invariants of the paged bookkeeping, whatever operations led there.
inline ::testing::AssertionResult PagingConsistent(const PageAllocator& st) {
  auto fail = [] { return ::testing::AssertionFailure(); };
  const int64_t S = st.num_segments(), P = st.page_size();
  if (P < 1 || P > 1024 || (P & (P - 1)) != 0) return fail() << "page_size " << P;
  // Lengths.
  const at::Tensor len_t = st.len();
  if (len_t.scalar_type() != at::kInt || len_t.sizes() != at::IntArrayRef({S}) ||
      len_t.device() != st.device()) {
    return fail() << "len() must be [S] int32 on the store's device, got " << len_t.sizes() << " "
                  << len_t.scalar_type() << " on " << len_t.device();
  }
  const std::vector<int32_t>& len = st.len_host();
  if (to_vec<int32_t>(len_t) != len) return fail() << "len_host() disagrees with len()";
  int64_t tokens = 0;
  for (const int32_t l : len) tokens += l;
  if (st.num_tokens() != tokens) return fail() << "num_tokens() " << st.num_tokens() << " != " << tokens;
  // Page table.
  const at::Tensor table_t = st.page_table();
  if (table_t.scalar_type() != at::kInt || table_t.dim() != 2 || table_t.size(0) != S ||
      table_t.device() != st.device()) {
    return fail() << "page_table() must be [S, width] int32 on the store's device, got "
                  << table_t.sizes() << " " << table_t.scalar_type() << " on " << table_t.device();
  }
  const HostTable table = host_table(st);
  const std::vector<int32_t> pages = st.pages_host();
  if (static_cast<int64_t>(pages.size()) != S) return fail() << "pages_host() has " << pages.size() << " entries";
  const int64_t num_pages = st.num_pages();
  std::vector<bool> owned(num_pages, false);
  int64_t owned_pages = 0;
  for (int64_t s = 0; s < S; ++s) {
    if (pages[s] < ceil_div(len[s], P)) {
      return fail() << "segment " << s << " has " << pages[s] << " pages for " << len[s] << " tokens";
    }
    if (pages[s] > table.width) return fail() << "segment " << s << " has more pages than the table's width";
    for (int64_t j = 0; j < table.width; ++j) {
      const int32_t id = table.at(s, j);
      if (j >= pages[s]) {
        if (id != -1) return fail() << "page_table[" << s << ", " << j << "] = " << id << " past the segment's pages, expected -1";
        continue;
      }
      if (id < 0 || id >= num_pages) return fail() << "page_table[" << s << ", " << j << "] = " << id << " of " << num_pages << " pages";
      if (owned[id]) return fail() << "page " << id << " is owned twice";
      owned[id] = true;
      ++owned_pages;
    }
  }
  if (owned_pages + st.free_pages() != num_pages) {
    return fail() << owned_pages << " pages owned + " << st.free_pages() << " free != " << num_pages << " pages held";
  }
  if (st.capacity() != num_pages * P) return fail() << "capacity() " << st.capacity() << " != pages * page_size";
  // Bytes: the pages held, their addresses, the table, the lengths.
  const int64_t page_bytes = expected_page_bytes(P, st.head_dim(), at::elementSize(st.kv_dtype()),
                                                 st.score_channels(), st.kv_dtype() == at::kChar);
  const int64_t want_bytes = num_pages * page_bytes + num_pages * 8 + S * table.width * 4 + S * 4;
  if (st.nbytes() != want_bytes) {
    return fail() << "nbytes() " << st.nbytes() << ", expected " << want_bytes << " (" << num_pages
                  << " pages of " << page_bytes << " bytes, a table of width " << table.width << ")";
  }
  // Slabs.
  if ((num_pages > 0) != (st.num_slabs() > 0) || st.num_slabs() > num_pages ||
      st.num_slabs() > st.slab_allocations()) {
    return fail() << st.num_slabs() << " slabs for " << num_pages << " pages after "
                  << st.slab_allocations() << " slab allocations";
  }
  // Page addresses: 16-byte aligned, pages do not overlap.
  std::vector<int64_t> addr = page_addresses(st);
  if (static_cast<int64_t>(addr.size()) != num_pages) return fail() << "view() has " << addr.size() << " page addresses";
  for (const int64_t a : addr) {
    if (a == 0 || a % 16 != 0) return fail() << "page address " << a << " is not 16-byte aligned";
  }
  std::sort(addr.begin(), addr.end());
  for (size_t p = 1; p < addr.size(); ++p) {
    if (addr[p] - addr[p - 1] < page_bytes) return fail() << "pages overlap";
  }
  // The view the kernels get.
  const kvcache_ext::store::PagedView view = st.view();
  if (view.width != table.width || view.page_size() != P || view.record.bytes != page_bytes) {
    return fail() << "view(): width " << view.width << ", page size " << view.page_size()
                  << ", record " << view.record.bytes << " bytes; expected " << table.width << ", "
                  << P << ", " << page_bytes;
  }
  if (st.device().is_cpu()) {  // its pointers are host pointers: slot() must match the table
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t i = 0; i < len[s]; ++i) {
        const int64_t want = int64_t{table.at(s, i / P)} * P + i % P;
        if (view.slot(s, i) != want) return fail() << "view().slot(" << s << ", " << i << ") = " << view.slot(s, i) << ", expected " << want;
      }
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace kvtest
