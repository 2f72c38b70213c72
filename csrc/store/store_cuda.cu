// CUDA kernels of the ragged store: same semantics as store_cpu.cpp, bit for bit.
//
// Tokens are found through a PagedView (store/paged_layout.h): token i of segment s lives
// in slot view.slot(s, i), and part b of a slot at view.row(b, slot). Rows are moved as raw
// bytes in the widest unit (16, 8, 4, 2 or 1 bytes) that divides the row size and the base
// addresses involved, so there is no dtype dispatch. Within the store, part b of any slot
// starts at page_base + offset[b] + row * row_bytes[b], where page bases are 16-byte aligned
// (slab allocations of records that are multiples of 16 bytes) and offsets are multiples of
// 16: the unit only depends on row_bytes[b] and on the other side's base address. Every
// kernel moves rows block-cooperatively: the units of a batch of rows are spread over the
// threads, which keeps the accesses coalesced however short a row is.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "store/store_kernels.h"

namespace kvcache_ext::store {

namespace {

// Widest unit that divides the row size and every given base address: then every row
// address (base + r * row_bytes) is aligned to it. Rows in the store need no address here
// (see the top of this file); inputs may be views starting at any element, so their base
// addresses are checked rather than assumed to have the allocator's alignment.
int vec_width(int64_t row_bytes, std::initializer_list<const void*> bases) {
  for (int w : {16, 8, 4, 2}) {
    bool ok = row_bytes % w == 0;
    for (const void* p : bases) ok = ok && reinterpret_cast<uintptr_t>(p) % w == 0;
    if (ok) return w;
  }
  return 1;
}

// The store's rows are aligned as the file header says only if every part starts at a
// 16-byte boundary of a record whose size is a multiple of 16 (page_record guarantees it).
void check_record(const PageRecord& record) {
  bool ok = record.bytes % 16 == 0;
  for (int b = 0; b < 4; ++b) ok = ok && record.offset[b] % 16 == 0 && record.row_bytes[b] >= 0;
  TORCH_INTERNAL_ASSERT(ok, "the CUDA store kernels need 16-byte aligned page parts");
}

// The copy loops index units with int (cheap division); this bound keeps rows * units of
// any batch of rows (at most 256 rows) far below 2^31.
void check_row_bytes(int64_t row_bytes) {
  TORCH_CHECK_VALUE(row_bytes <= (int64_t{1} << 22),
                    "the CUDA store kernels support rows of at most 4 MiB, got ", row_bytes,
                    " bytes");
}

// Keeps the y grid dimension (segments) within CUDA's limit; kernels loop over the rest.
unsigned int segment_grid(int64_t segments) {
  return static_cast<unsigned int>(std::min<int64_t>(segments, 65535));
}

// Rows of part b (kK, kV, kPos, kScores) of the store's slots: what view.row(b, slot) gives,
// with only the few fields the copy loops need (small functors stay in registers).
struct PartRows {
  const int64_t* page_base;
  int64_t offset, row_bytes, mask;
  int shift;
  __device__ char* operator()(int64_t slot) const {
    return reinterpret_cast<char*>(page_base[slot >> shift]) + offset + (slot & mask) * row_bytes;
  }
};

__host__ __device__ inline PartRows part_rows(const PagedView& view, int b) {
  return PartRows{view.page_base, view.record.offset[b], view.record.row_bytes[b],
                  view.page_size() - 1, view.shift};
}

// Block-cooperative copy of `count` rows of row_bytes bytes each, in units of Vec.
// rows(i, dst, src) gives the addresses of row i, or returns false to skip it.
template <typename Vec, typename Rows>
__device__ void copy_rows_as(const Rows& rows, int count, int64_t row_bytes) {
  const int units = static_cast<int>(row_bytes / sizeof(Vec));
  const int total = count * units;
  for (int u = threadIdx.x; u < total; u += blockDim.x) {
    const int i = u / units;
    char* dst;
    const char* src;
    if (!rows(i, dst, src)) continue;
    const int c = u - i * units;
    reinterpret_cast<Vec*>(dst)[c] = reinterpret_cast<const Vec*>(src)[c];
  }
}

// `width` is uniform over the grid, so the switch does not diverge.
template <typename Rows>
__device__ void copy_rows(const Rows& rows, int count, int64_t row_bytes, int width) {
  switch (width) {
    case 16: copy_rows_as<uint4>(rows, count, row_bytes); break;
    case 8: copy_rows_as<uint2>(rows, count, row_bytes); break;
    case 4: copy_rows_as<uint32_t>(rows, count, row_bytes); break;
    case 2: copy_rows_as<uint16_t>(rows, count, row_bytes); break;
    default: copy_rows_as<uint8_t>(rows, count, row_bytes); break;
  }
}

// ---------------------------------------------------------------------------------------
// append / replace: both write whole tokens (K, V, pos, zeroed scores) into chosen slots.

constexpr int kTokensPerBlock = 32;
constexpr int kTokenThreads = 128;

// append: token t of segment s becomes token len[s] + rank of the segment (rank = t when
// undefined); returns its slot id, or -1 when the token is not stored.
struct AppendSlot {
  PagedView view;
  const int32_t* len;
  const int32_t* rank;  // nullptr: every token is stored, in order
  int64_t n;
  __device__ int64_t operator()(int64_t s, int64_t t) const {
    const int64_t r = rank ? rank[s * n + t] : t;
    return r < 0 ? -1 : view.slot(s, len[s] + r);
  }
};

// replace: the one token of segment s overwrites its token index[s].
struct ReplaceSlot {
  PagedView view;
  const int64_t* index;
  __device__ int64_t operator()(int64_t s, int64_t /*t*/) const { return view.slot(s, index[s]); }
};

// Token rows: token first_token + i of the input to slot[i] of the store (skipped if < 0).
struct TokenRows {
  const char* src;
  PartRows dst;           // K or V rows of the store
  const int64_t* slot;    // shared memory
  int64_t first_token;
  __device__ bool operator()(int i, char*& d, const char*& s) const {
    if (slot[i] < 0) return false;
    s = src + (first_token + i) * dst.row_bytes;
    d = dst(slot[i]);
    return true;
  }
};

// Block (x, y) writes tokens [x * kTokensPerBlock, ...) of segment y (and y + gridDim.y, ...).
// new_k/new_v: [S, n, D] rows; new_pos: [S / heads, n]. Distinct tokens of a segment go to
// distinct token indices (ranks are distinct), hence distinct slots (a segment's slot mapping
// is injective), and segments own disjoint pages, so no two writes collide. Only slots of
// tokens being written are touched.
template <typename SlotOf>
__global__ void __launch_bounds__(kTokenThreads)
    write_tokens_kernel(PagedView view, int width_k, int width_v, const char* new_k,
                        const char* new_v, const int32_t* new_pos, int64_t segments, int64_t n,
                        int64_t heads, SlotOf slot_of) {
  __shared__ int64_t slot[kTokensPerBlock];
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTokensPerBlock;
  const int count = static_cast<int>(min(static_cast<int64_t>(kTokensPerBlock), n - t0));
  const int64_t channels = view.record.row_bytes[kScores] / static_cast<int64_t>(sizeof(float));
  const int64_t row_bytes = view.record.row_bytes[kK];  // == row_bytes[kV]
  for (int64_t s = blockIdx.y; s < segments; s += gridDim.y) {
    if (static_cast<int>(threadIdx.x) < count) {
      const int64_t t = t0 + threadIdx.x;
      const int64_t d = slot_of(s, t);
      slot[threadIdx.x] = d;
      if (d >= 0) {
        *reinterpret_cast<int32_t*>(view.row(kPos, d)) = new_pos[(s / heads) * n + t];
        float* scores = reinterpret_cast<float*>(view.row(kScores, d));
        for (int64_t c = 0; c < channels; ++c) scores[c] = 0.0f;
      }
    }
    __syncthreads();  // slot[] is complete
    const int64_t first_token = s * n + t0;
    copy_rows(TokenRows{new_k, part_rows(view, kK), slot, first_token}, count, row_bytes, width_k);
    copy_rows(TokenRows{new_v, part_rows(view, kV), slot, first_token}, count, row_bytes, width_v);
    __syncthreads();  // slot[] is rewritten for the next segment
  }
}

template <typename SlotOf>
void launch_write_tokens(const PagedView& view, const at::Tensor& new_k, const at::Tensor& new_v,
                         const at::Tensor& new_pos, int64_t segments, int64_t n,
                         const SlotOf& slot_of) {
  if (segments == 0 || n == 0) return;
  check_record(view.record);
  // new_k/new_v rows have the store's row size: same dtype and head_dim (checked by the caller).
  const int64_t row_bytes = view.record.row_bytes[kK];
  TORCH_INTERNAL_ASSERT(view.record.row_bytes[kV] == row_bytes &&
                        new_k.size(-1) * new_k.element_size() == row_bytes);
  check_row_bytes(row_bytes);
  const int width_k = vec_width(row_bytes, {new_k.data_ptr()});
  const int width_v = vec_width(row_bytes, {new_v.data_ptr()});
  const int64_t heads = segments / new_pos.size(0);
  const dim3 grid(static_cast<unsigned int>((n + kTokensPerBlock - 1) / kTokensPerBlock),
                  segment_grid(segments));
  write_tokens_kernel<<<grid, kTokenThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      view, width_k, width_v, static_cast<const char*>(new_k.data_ptr()),
      static_cast<const char*>(new_v.data_ptr()), new_pos.data_ptr<int32_t>(), segments, n, heads,
      slot_of);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---------------------------------------------------------------------------------------
// compact
//
// One block per segment walks the segment's live tokens i = 0 .. len - 1 (logical token
// indices) in tiles of `tile` tokens, in order. For each tile:
//   1. a block-wide exclusive scan of the keep flags (keep[view.slot(s, i)]) gives every
//      kept token its index q among the tile's kept tokens; src_slot[q] records its slot.
//      Its destination is token kept + q, where `kept` counts the kept tokens of the
//      earlier tiles; dst_slot[q] = view.slot(s, kept + q).
//   2. the kept rows (K, V, pos, scores) are read into shared memory (staging), barrier;
//   3. the staged rows are written to their destinations, barrier.
// Why this is race-free, in place:
//   - In token indices, destinations satisfy dst <= src and dst < tile end, so a write in
//     step 3 lands on a token that is either before the tile (read, if kept, in an earlier
//     tile's step 2, which the barriers order before) or inside the tile (read in this
//     tile's step 2, completed at the barrier). No token at or beyond the tile end is
//     written, so what later tiles read is still the original data. A segment's slot
//     mapping i -> view.slot(s, i) is injective (distinct tokens are distinct rows of its
//     own pages), so the same holds for the slots themselves: the slot a write lands on
//     belongs to no other token index of the segment.
//   - __syncthreads() makes the block's global writes visible to the whole block, so
//     the next tile (whose reads lie beyond every write so far) and step 3 see a
//     consistent state; the trailing barrier also keeps step 3's reads of the staging
//     buffer and of src_slot/dst_slot ahead of the next tile's overwrites.
//   - Segments own disjoint pages, and keep, the page table and the page bases are only
//     read, so blocks never interact. Only tokens < len[s] are read or written: the slots
//     of a segment's pages past its length (and every other slot) are never touched.
// A token whose destination is itself is not copied: such tokens form the fully kept
// prefix of the segment, and a tile lying entirely in it is skipped.
// No second full-size buffer is needed: the staging is one tile of shared memory.
// len[s] is read and rewritten by the block of segment s only, in this one kernel, so the
// device copy of the lengths is never seen half-updated by later work on the stream.

constexpr int kCompactThreads = 256;  // also the most tokens in a tile
constexpr int64_t kCompactSmemBudget = 48 * 1024;  // no opt-in needed up to here
constexpr int64_t kScanBytes = 2048;  // room for the scan's temporary storage
using CompactScan = cub::BlockScan<int, kCompactThreads>;

__host__ __device__ constexpr int64_t align16(int64_t x) { return (x + 15) & ~int64_t{15}; }

// Byte offsets of the pieces of the dynamic shared memory, each 16-byte aligned (the
// buffer itself is declared as uint4). Host and device compute it with the same code.
struct CompactLayout {
  int64_t src_slot;  // int64_t[kCompactThreads]
  int64_t dst_slot;  // int64_t[kCompactThreads]
  int64_t stage[4];  // tile rows of each part
  int64_t total;
};

__host__ __device__ inline CompactLayout compact_layout(int64_t tile, const int64_t* row_bytes) {
  CompactLayout l{};
  int64_t off = kScanBytes;  // the scan's storage comes first, at offset 0
  l.src_slot = off;
  off += align16(sizeof(int64_t) * kCompactThreads);
  l.dst_slot = off;
  off += align16(sizeof(int64_t) * kCompactThreads);
  for (int b = 0; b < 4; ++b) {
    l.stage[b] = off;
    off += align16(tile * row_bytes[b]);
  }
  l.total = off;
  return l;
}

// Kept row q of the tile: from its slot in the store to row q of the staging buffer.
struct GatherRows {
  PartRows rows;  // of the part being moved
  char* stage;
  const int64_t* src_slot;
  const int64_t* dst_slot;
  __device__ bool operator()(int q, char*& d, const char*& s) const {
    const int64_t from = src_slot[q];
    if (from == dst_slot[q]) return false;  // already in place
    s = rows(from);
    d = stage + q * rows.row_bytes;
    return true;
  }
};

// Staged row q to its destination, token kept + q of the segment.
struct ScatterRows {
  PartRows rows;
  const char* stage;
  const int64_t* src_slot;
  const int64_t* dst_slot;
  __device__ bool operator()(int q, char*& d, const char*& s) const {
    const int64_t to = dst_slot[q];
    if (src_slot[q] == to) return false;  // already in place
    s = stage + q * rows.row_bytes;
    d = rows(to);
    return true;
  }
};

// w[b]: the unit part b is moved in.
struct CompactWidths {
  int w[4];
};

// The shared memory of a compaction block, carved from the dynamic buffer.
struct CompactSmem {
  CompactLayout layout;
  char* base;
  __device__ CompactScan::TempStorage& scan() const { return *reinterpret_cast<CompactScan::TempStorage*>(base); }
  __device__ int64_t* src_slot() const { return reinterpret_cast<int64_t*>(base + layout.src_slot); }
  __device__ int64_t* dst_slot() const { return reinterpret_cast<int64_t*>(base + layout.dst_slot); }
};

// One tile of segment s: its live tokens [b, b + rows), rows = min(tile, n - b), whose kept
// tokens go to tokens kept, kept + 1, ... (steps 1-3 above). `between` runs after the tile's
// rows are read and before any is written, with a barrier before it; every thread calls it.
// Returns the tile's kept tokens (the same in every thread).
template <typename Between>
__device__ int compact_tile(const PagedView& view, const CompactWidths& width, int64_t s,
                            int64_t b, int64_t n, int64_t kept, const bool* keep, int tile,
                            const CompactSmem& sm, const Between& between) {
  const int64_t rows = min(static_cast<int64_t>(tile), n - b);
  const int64_t i = b + threadIdx.x;
  // Only live tokens (i < n) are looked up: the table has no page past the segment's.
  const int64_t slot = threadIdx.x < rows ? view.slot(s, i) : -1;
  const int flag = (slot >= 0 && keep[slot]) ? 1 : 0;
  int q, tile_kept;
  CompactScan(sm.scan()).ExclusiveSum(flag, q, tile_kept);
  // Uniform over the block: nothing moves while every token so far is kept.
  const bool moves = kept != b || tile_kept != rows;
  int64_t* src_slot = sm.src_slot();
  int64_t* dst_slot = sm.dst_slot();
  if (moves) {
    if (flag) src_slot[q] = slot;
    // kept + tile_kept <= b + rows <= n: every destination is a live token.
    if (static_cast<int>(threadIdx.x) < tile_kept) dst_slot[threadIdx.x] = view.slot(s, kept + threadIdx.x);
  }
  __syncthreads();  // src_slot and dst_slot are complete
  const int64_t* row_bytes = view.record.row_bytes;
  if (moves) {
    for (int bi = 0; bi < 4; ++bi) {
      copy_rows(GatherRows{part_rows(view, bi), sm.base + sm.layout.stage[bi], src_slot, dst_slot},
                tile_kept, row_bytes[bi], width.w[bi]);
    }
    __syncthreads();  // every kept row of the tile has been read
  }
  between(tile_kept);
  if (moves) {
    for (int bi = 0; bi < 4; ++bi) {
      copy_rows(ScatterRows{part_rows(view, bi), sm.base + sm.layout.stage[bi], src_slot, dst_slot},
                tile_kept, row_bytes[bi], width.w[bi]);
    }
  }
  __syncthreads();  // staging, the slot lists and the scan storage are reused by the next tile
  return tile_kept;
}

__device__ CompactSmem compact_smem(const PagedView& view, int tile) {
  static_assert(sizeof(CompactScan::TempStorage) <= kScanBytes, "kScanBytes is too small");
  extern __shared__ uint4 smem_raw[];
  return CompactSmem{compact_layout(tile, view.record.row_bytes), reinterpret_cast<char*>(smem_raw)};
}

// One block per segment, its tiles in order. The pages are read and written through plain
// pointers (no __restrict__, no __ldg): the same memory is written during the kernel.
__global__ void __launch_bounds__(kCompactThreads)
    compact_kernel(PagedView view, CompactWidths width, int32_t* len, const bool* keep, int tile) {
  const CompactSmem sm = compact_smem(view, tile);
  const int64_t s = blockIdx.x;
  const int64_t n = len[s];
  int64_t kept = 0;  // kept tokens in the tiles before this one
  for (int64_t b = 0; b < n; b += tile) {
    kept += compact_tile(view, width, s, b, n, kept, keep, tile, sm, [](int) {});
  }
  // Every thread has read len[s] above (and, for n > 0, passed a barrier since).
  __syncthreads();
  if (threadIdx.x == 0) len[s] = static_cast<int32_t>(kept);
}

// ---------------------------------------------------------------------------------------
// compact, several blocks per segment (stores with fewer segments than SMs, where one
// block per segment would leave most of the GPU idle on long segments)
//
// Three kernels on the stream: count the kept tokens of every tile; move the tiles, one
// block each; write the new lengths. The move is the one-block kernel's step for one tile
// (compact_tile), with its destination kept = the kept tokens of the segment's earlier tiles
// (from the counts). Tiles of a segment now run at once, so a tile's writes must wait:
//   - tile c writes tokens [kept_c, kept_c + tile_kept_c), which lie in tiles
//     kept_c / tile .. c (kept_c <= c * tile, and the range ends before tile c does);
//   - so before writing, tile c waits until each of tiles kept_c / tile .. c - 1 has read
//     its rows (read_done, set once a tile's reads are complete: every thread has passed
//     the barrier after them, so their loads have returned); its own reads are done;
//   - no other tile writes into tile c's rows before tile c has read them, by the same
//     rule from the writer's side; destinations of different tiles are disjoint.
// Waits only go to earlier tiles of the same segment. Blocks take their tile from a
// ticket (an atomic counter) in (segment, tile) order, not from blockIdx: a block waits
// only on tickets taken before its own, by blocks that are running or done, which never
// wait on it, so the waits always end (the single-pass scan's argument in CUB).
// The lengths are read by every block and rewritten only by the third kernel.

__global__ void __launch_bounds__(kCompactThreads)
    compact_count_kernel(PagedView view, const int32_t* len, const bool* keep, int tile,
                         int64_t tiles, int32_t* counts) {
  const int64_t s = blockIdx.x / tiles, c = blockIdx.x % tiles;
  const int64_t i = c * tile + threadIdx.x, n = len[s];
  const bool kept = threadIdx.x < tile && i < n && keep[view.slot(s, i)];
  const int count = __syncthreads_count(kept);
  if (threadIdx.x == 0) counts[blockIdx.x] = count;
}

__global__ void __launch_bounds__(kCompactThreads)
    compact_tiles_kernel(PagedView view, CompactWidths width, const int32_t* len,
                         const bool* keep, int tile, int64_t tiles, const int32_t* counts,
                         unsigned int* ticket, int* read_done) {
  const CompactSmem sm = compact_smem(view, tile);
  __shared__ unsigned int my_ticket;
  __shared__ unsigned long long kept_before;
  if (threadIdx.x == 0) {
    my_ticket = atomicAdd(ticket, 1u);
    kept_before = 0;
  }
  __syncthreads();
  const int64_t s = my_ticket / tiles, c = my_ticket % tiles;
  const int64_t n = len[s], b = c * tile;
  if (b >= n) return;  // past the segment's tokens: no later tile of it waits on this one
  unsigned long long part = 0;
  for (int64_t t = threadIdx.x; t < c; t += blockDim.x) part += counts[s * tiles + t];
  atomicAdd(&kept_before, part);
  __syncthreads();
  const int64_t kept = static_cast<int64_t>(kept_before);
  compact_tile(view, width, s, b, n, kept, keep, tile, sm, [&](int) {
    if (threadIdx.x == 0) {
      __threadfence();
      atomicExch(read_done + s * tiles + c, 1);
      for (int64_t t = kept / tile; t < c; ++t) {
        while (atomicAdd(read_done + s * tiles + t, 0) == 0) __nanosleep(100);
      }
      __threadfence();
    }
    __syncthreads();
  });
}

__global__ void compact_lengths_kernel(const int32_t* counts, int64_t tiles, int32_t* len) {
  __shared__ unsigned long long total;
  if (threadIdx.x == 0) total = 0;
  __syncthreads();
  unsigned long long part = 0;
  for (int64_t t = threadIdx.x; t < tiles; t += blockDim.x) part += counts[blockIdx.x * tiles + t];
  atomicAdd(&total, part);
  __syncthreads();
  if (threadIdx.x == 0) len[blockIdx.x] = static_cast<int32_t>(total);
}

}  // namespace

void append_cuda(const PagedView& view, const at::Tensor& len, const at::Tensor& new_k,
                 const at::Tensor& new_v, const at::Tensor& new_pos, const at::Tensor& rank) {
  const c10::cuda::CUDAGuard guard(len.device());
  const int64_t segments = new_k.size(0), n = new_k.size(1);
  const AppendSlot slot_of{view, len.data_ptr<int32_t>(),
                           rank.defined() ? rank.data_ptr<int32_t>() : nullptr, n};
  launch_write_tokens(view, new_k, new_v, new_pos, segments, n, slot_of);
}

void replace_cuda(const PagedView& view, const at::Tensor& slot, const at::Tensor& new_k,
                  const at::Tensor& new_v, const at::Tensor& new_pos) {
  const c10::cuda::CUDAGuard guard(slot.device());
  // One token per segment: new_k/new_v [S, D] read as [S, 1, D], new_pos [B] as [B, 1].
  const ReplaceSlot slot_of{view, slot.data_ptr<int64_t>()};
  launch_write_tokens(view, new_k, new_v, new_pos, new_k.size(0), 1, slot_of);
}

void compact_cuda(const PagedView& view, const at::Tensor& len, const at::Tensor& keep) {
  const int64_t segments = len.numel();
  // With no pages (a fresh store) every length is already 0 and nothing moves.
  if (segments == 0 || keep.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(len.device());
  check_record(view.record);
  const int64_t* row_bytes = view.record.row_bytes;
  CompactWidths width{};
  int64_t row_total = 0;
  for (int b = 0; b < 4; ++b) {
    check_row_bytes(row_bytes[b]);
    // Store rows and the staging buffer are 16-byte aligned: only the row size counts.
    width.w[b] = vec_width(row_bytes[b], {});
    row_total += row_bytes[b];
  }
  // As many tokens per tile as fit in 48 KiB (4 * 15: alignment padding of the pieces).
  // row_total >= 4: pos rows are 4 bytes.
  const int64_t fixed = compact_layout(0, row_bytes).total + 4 * 15;
  int64_t tile = std::min<int64_t>(kCompactThreads, (kCompactSmemBudget - fixed) / row_total);
  int64_t smem = 0;
  if (tile >= 1) {
    smem = compact_layout(tile, row_bytes).total;
  } else {
    // Rows over ~40 KiB (head_dim > 5000 in fp32): one token per tile, with opt-in memory.
    tile = 1;
    smem = compact_layout(tile, row_bytes).total;
    const int64_t optin = at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin;
    TORCH_CHECK_VALUE(smem <= optin, "compact: one token (", row_total,
                      " bytes of K, V, pos and scores) does not fit in the device's shared memory (",
                      optin, " bytes)");
    C10_CUDA_CHECK(cudaFuncSetAttribute(compact_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // Tiles per segment: enough for the most tokens its page-table row can hold (the host
  // knows no lengths; blocks past a segment's length return at once).
  const int64_t tiles = (view.width * view.page_size() + tile - 1) / tile;
  if (segments >= sms || tiles <= 1) {
    compact_kernel<<<static_cast<unsigned int>(segments), kCompactThreads, static_cast<size_t>(smem),
                     stream>>>(view, width, len.data_ptr<int32_t>(), keep.data_ptr<bool>(),
                               static_cast<int>(tile));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  TORCH_CHECK_VALUE(segments * tiles < INT32_MAX, "compact: ", segments, " segments of ", tiles,
                    " tiles exceed the grid");
  // Its few bytes of static shared memory come on top of the dynamic buffer, which may be
  // the whole 48 KiB a launch gets without opting in: opt in always.
  C10_CUDA_CHECK(cudaFuncSetAttribute(compact_tiles_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  const auto on_device = len.options();
  const at::Tensor counts = at::empty({segments * tiles}, on_device);
  // read_done flags, then the ticket counter, zeroed together.
  const at::Tensor sync = at::zeros({segments * tiles + 1}, on_device);
  const auto blocks = static_cast<unsigned int>(segments * tiles);
  compact_count_kernel<<<blocks, kCompactThreads, 0, stream>>>(
      view, len.data_ptr<int32_t>(), keep.data_ptr<bool>(), static_cast<int>(tile), tiles,
      counts.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  compact_tiles_kernel<<<blocks, kCompactThreads, static_cast<size_t>(smem), stream>>>(
      view, width, len.data_ptr<int32_t>(), keep.data_ptr<bool>(), static_cast<int>(tile), tiles,
      counts.data_ptr<int32_t>(), reinterpret_cast<unsigned int*>(sync.data_ptr<int32_t>() + segments * tiles),
      sync.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  compact_lengths_kernel<<<static_cast<unsigned int>(segments), kCompactThreads, 0, stream>>>(
      counts.data_ptr<int32_t>(), tiles, len.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kvcache_ext::store
