// CPU kernels of the ragged store: parallel over segments, rows moved with memcpy (or
// quantized on the way in, for int8 pages).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "store/quantize.h"
#include "store/store_kernels.h"

namespace kvcache_ext::store {

namespace {

// Below this many bytes to write, a call runs on the calling thread: handing work to the
// other threads and waiting for them costs more than the copy, as it does for a decode
// step's append of one token per segment.
constexpr int64_t kSerialBytes = int64_t{1} << 20;

// Segments are independent; a grain of 1 lets one long segment not serialize the rest.
template <typename F>
void for_each_segment(int64_t num_segments, int64_t bytes, const F& f) {
  if (bytes < kSerialBytes) {
    for (int64_t s = 0; s < num_segments; ++s) f(s);
    return;
  }
  at::parallel_for(0, num_segments, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) f(s);
  });
}

// Writes one token: its K and V rows (copied as they are, or quantized into int8 pages with
// their scales), its position, and zero scores. T: the element type of the rows given.
template <typename T>
void write_token(const PagedView& view, int64_t slot, const T* k, const T* v, int32_t pos, int64_t D) {
  const PageRecord& r = view.record;
  if (r.quantized()) {
    auto* scales = reinterpret_cast<c10::Half*>(view.row(kScale, slot));
    scales[0] = quantize_row(k, D, reinterpret_cast<int8_t*>(view.row(kK, slot)));
    scales[1] = quantize_row(v, D, reinterpret_cast<int8_t*>(view.row(kV, slot)));
  } else {
    std::memcpy(view.row(kK, slot), k, r.row_bytes[kK]);
    std::memcpy(view.row(kV, slot), v, r.row_bytes[kV]);
  }
  std::memcpy(view.row(kPos, slot), &pos, sizeof(int32_t));
  std::memset(view.row(kScores, slot), 0, r.row_bytes[kScores]);
}

// Calls f(T()) with T the element type of the rows given (float32, float16 or bfloat16: what
// the ops accept).
template <typename F>
void with_row_type(const at::Tensor& rows, const F& f) {
  switch (rows.scalar_type()) {
    case at::kFloat: return f(float());
    case at::kHalf: return f(c10::Half());
    case at::kBFloat16: return f(c10::BFloat16());
    default: TORCH_CHECK(false, "the store writes float32, float16 or bfloat16 K/V, got ", rows.scalar_type());
  }
}

// Moves n consecutive tokens of one page to n consecutive rows of one page, every part.
// Within one page the destination rows may overlap the source rows; they are lower, so a
// forward copy is right (memmove for the K and V rows, a word loop for the small parts).
void move_rows(const PagedView& view, int64_t from_slot, int64_t to_slot, int64_t n) {
  for (int b = 0; b < kParts; ++b) {
    char* to = view.row(b, to_slot);
    const char* from = view.row(b, from_slot);
    const int64_t bytes = n * view.record.row_bytes[b];
    if (b == kK || b == kV) {
      std::memmove(to, from, bytes);
    } else {  // pos, score and scale rows: whole int32 / float32 / float16-pair words
      auto* to_w = reinterpret_cast<int32_t*>(to);
      const auto* from_w = reinterpret_cast<const int32_t*>(from);
      for (int64_t w = 0; w < bytes / 4; ++w) to_w[w] = from_w[w];
    }
  }
}

}  // namespace

void append_cpu(const PagedView& view, const at::Tensor& len, const at::Tensor& new_k,
                const at::Tensor& new_v, const at::Tensor& new_pos, const at::Tensor& rank) {
  const int64_t S = new_k.size(0), n = new_k.size(1), D = new_k.size(2), heads = S / new_pos.size(0);
  const int32_t* pos = new_pos.data_ptr<int32_t>();
  const int32_t* rank_p = rank.defined() ? rank.data_ptr<int32_t>() : nullptr;
  const int32_t* len_p = len.data_ptr<int32_t>();
  with_row_type(new_k, [&](auto type) {
    using T = decltype(type);
    const T* k = static_cast<const T*>(new_k.data_ptr());
    const T* v = static_cast<const T*>(new_v.data_ptr());
    for_each_segment(S, 2 * S * n * D * sizeof(T), [&](int64_t s) {
      for (int64_t t = 0; t < n; ++t) {
        const int64_t r = rank_p ? rank_p[s * n + t] : t;
        if (r < 0) continue;
        write_token(view, view.slot(s, len_p[s] + r), k + (s * n + t) * D, v + (s * n + t) * D,
                    pos[(s / heads) * n + t], D);
      }
    });
  });
}

void replace_cpu(const PagedView& view, const at::Tensor& slot, const at::Tensor& new_k,
                 const at::Tensor& new_v, const at::Tensor& new_pos) {
  const int64_t S = new_k.size(0), D = new_k.size(1), heads = S / new_pos.size(0);
  const int32_t* pos = new_pos.data_ptr<int32_t>();
  const int64_t* slot_p = slot.data_ptr<int64_t>();
  with_row_type(new_k, [&](auto type) {
    using T = decltype(type);
    const T* k = static_cast<const T*>(new_k.data_ptr());
    const T* v = static_cast<const T*>(new_v.data_ptr());
    for_each_segment(S, 2 * S * D * sizeof(T), [&](int64_t s) {
      write_token(view, view.slot(s, slot_p[s]), k + s * D, v + s * D, pos[s / heads], D);
    });
  });
}

// One move of compaction: n consecutive tokens from slot `from` to slot `to`.
struct Move {
  int64_t from, to, n;
};

// Asks for the first rows of a move's source ahead of time. At a low keep fraction most
// moves are one token from a page the hardware prefetcher cannot guess, so without this
// every move waits for memory in turn (bench/kernels.py measures compaction against the
// machine's copy bandwidth).
void prefetch_source(const PagedView& view, const Move& m) {
  for (int b = 0; b < kParts; ++b) {
    const char* row = view.row(b, m.from);
    const int64_t bytes = std::min<int64_t>(m.n * view.record.row_bytes[b], 512);
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(row + at);
  }
}

void compact_cpu(const PagedView& view, const at::Tensor& len, const at::Tensor& keep) {
  int32_t* len_p = len.data_ptr<int32_t>();
  const bool* keep_p = keep.data_ptr<bool>();
  const int64_t P = view.page_size(), row_mask = P - 1;
  constexpr size_t kAhead = 4;  // moves prefetched ahead of the one being copied
  int64_t live = 0;  // tokens: what a compaction may move, at most
  for (int64_t s = 0; s < len.numel(); ++s) live += len_p[s];
  const int64_t token_bytes = view.record.row_bytes[kK] + view.record.row_bytes[kV];
  for_each_segment(len.numel(), live * token_bytes, [&](int64_t s) {
    const int64_t n = len_p[s];
    // First the moves, from the keep flags alone; then the copies, the next ones prefetched.
    thread_local std::vector<Move> moves;
    moves.clear();
    int64_t kept = 0;  // tokens kept so far: where the next kept token goes
    // One source page at a time: its keep flags are contiguous in slot layout.
    for (int64_t i = 0; i < n;) {
      const int64_t page_slot = view.table[s * view.width + (i >> view.shift)] << view.shift;
      const bool* flags = keep_p + page_slot;
      const int64_t page_end = std::min(n, (i | row_mask) + 1);
      while (i < page_end) {
        if (!flags[i & row_mask]) {
          ++i;
          continue;
        }
        // A run of kept tokens [i, j) of this page, cut where the destination page ends,
        // moves with one copy per part. Tokens before the first dropped one stay put.
        const int64_t limit = std::min(page_end, i + P - (kept & row_mask));
        int64_t j = i + 1;
        while (j < limit && flags[j & row_mask]) ++j;
        if (kept != i) moves.push_back({page_slot | (i & row_mask), view.slot(s, kept), j - i});
        kept += j - i;
        i = j;
      }
    }
    for (size_t m = 0; m < std::min(kAhead, moves.size()); ++m) prefetch_source(view, moves[m]);
    for (size_t m = 0; m < moves.size(); ++m) {
      if (m + kAhead < moves.size()) prefetch_source(view, moves[m + kAhead]);
      move_rows(view, moves[m].from, moves[m].to, moves[m].n);
    }
    len_p[s] = static_cast<int32_t>(kept);
  });
}

void compact_unordered_cpu(const PagedView& view, const at::Tensor& len, const at::Tensor& keep) {
  int32_t* len_p = len.data_ptr<int32_t>();
  const bool* keep_p = keep.data_ptr<bool>();
  int64_t live = 0;  // flags read, at most; the tokens moved are fewer than the evicted
  for (int64_t s = 0; s < len.numel(); ++s) live += len_p[s];
  for_each_segment(len.numel(), live, [&](int64_t s) {
    const int64_t n = len_p[s];
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i) kept += keep_p[view.slot(s, i)] ? 1 : 0;
    // The r-th kept token of [kept, n) fills the r-th evicted place of [0, kept): the two
    // ranges are apart, so no move reads what another wrote.
    int64_t hole = 0;
    for (int64_t i = kept; i < n; ++i) {
      if (!keep_p[view.slot(s, i)]) continue;
      while (keep_p[view.slot(s, hole)]) ++hole;
      move_rows(view, view.slot(s, i), view.slot(s, hole), 1);
      ++hole;
    }
    len_p[s] = static_cast<int32_t>(kept);
  });
}

}  // namespace kvcache_ext::store
