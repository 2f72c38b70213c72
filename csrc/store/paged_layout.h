// The paged layout of a RaggedKVStore, read by the store's kernels and by attention, on
// CPU and CUDA alike.
//
// A layer's tokens live in pages of P = 2^shift tokens. A page is one record of bytes:
//   [K: P rows of D elements] [V: P rows] [pos: P int32] [scores: P rows of C float32]
//   [scales: P rows of 2 float16, int8 pages only]
// each part starting at a 16-byte boundary (`offset`), so every K and V row is as aligned
// as its size allows (the CUDA kernels move 16-byte words). A store of int8 pages keeps each
// token's K and V row quantized symmetrically with one scale each (store/quantize.h): the
// scales are a part of the token's record, so every kernel that moves a token's parts
// (compaction, repack, fork) moves its scales with it; other stores' scale part is empty. Pages are allocated in slabs
// (one allocation holding several pages); page_base[p] is the address of page p wherever
// its slab lies, so the store grows by allocating the new pages only and never moves the
// pages it already has.
//
// Segment s = b * heads + h owns the pages table[s * width + j], j = 0, 1, ..., in token
// order: its token i is row i mod P of page table[s * width + i / P]. A slot id is
// page * P + row, so per-token tensors kept outside the store (keep masks, scores, attention
// statistics) are indexed by slot: [capacity = pages * P] ("slot layout").
#pragma once
#include <cstdint>

#ifdef __CUDACC__
#define KVCACHE_HOST_DEVICE __host__ __device__
#else
#define KVCACHE_HOST_DEVICE
#endif

namespace kvcache_ext::store {

// The parts of a token, in the order of a page record.
constexpr int kK = 0, kV = 1, kPos = 2, kScores = 3, kScale = 4;
constexpr int kParts = 5;
// A quantized token's scale row: K's scale, then V's, as float16.
constexpr int64_t kScaleRowBytes = 4;

// Byte layout of a page: where each part starts and the size of one token's row in it.
struct PageRecord {
  int64_t offset[kParts];
  int64_t row_bytes[kParts];
  int64_t bytes;  // the whole page, a multiple of 16

  // Whether K and V rows are int8 with a scale per row (the scale part is not empty).
  KVCACHE_HOST_DEVICE bool quantized() const { return row_bytes[kScale] > 0; }
};

// quantized: int8 K and V rows (kv_element_size 1) and a scale row per token.
inline PageRecord page_record(int64_t page_size, int64_t head_dim, int64_t kv_element_size,
                              int64_t score_channels, bool quantized = false) {
  PageRecord r{};
  r.row_bytes[kK] = r.row_bytes[kV] = head_dim * kv_element_size;
  r.row_bytes[kPos] = 4;
  r.row_bytes[kScores] = score_channels * 4;
  r.row_bytes[kScale] = quantized ? kScaleRowBytes : 0;
  int64_t at = 0;
  for (int b = 0; b < kParts; ++b) {
    r.offset[b] = at;
    at += (page_size * r.row_bytes[b] + 15) / 16 * 16;
  }
  r.bytes = at;
  return r;
}

// What a kernel needs to find a segment's tokens. Plain data, passed to CUDA kernels by
// value; the pointers are on the store's device.
struct PagedView {
  const int64_t* page_base;  // [pages] address of each page
  const int32_t* table;      // [segments, width] page ids of each segment, in token order
  int64_t width;
  int32_t shift;             // page size P = 1 << shift
  PageRecord record;

  KVCACHE_HOST_DEVICE int64_t page_size() const { return int64_t{1} << shift; }
  // Slot id of token i of segment s.
  KVCACHE_HOST_DEVICE int64_t slot(int64_t s, int64_t i) const {
    const int64_t page = table[s * width + (i >> shift)];
    return (page << shift) | (i & (page_size() - 1));
  }
  // Row of part b (kK, kV, kPos, kScores, kScale) of a slot.
  KVCACHE_HOST_DEVICE char* row(int b, int64_t slot) const {
    return reinterpret_cast<char*>(page_base[slot >> shift]) + record.offset[b] +
           (slot & (page_size() - 1)) * record.row_bytes[b];
  }
  // Row of part b of token i of segment s. Rows i .. (i | (P - 1)) follow it contiguously.
  KVCACHE_HOST_DEVICE char* token(int b, int64_t s, int64_t i) const { return row(b, slot(s, i)); }
};

}  // namespace kvcache_ext::store
