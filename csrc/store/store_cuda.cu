// CUDA kernels of the ragged store: same semantics as store_cpu.cpp, bit for bit.
//
// Tokens are found through a PagedView (store/paged_layout.h): token i of segment s lives
// in slot view.slot(s, i), and part b of a slot at view.row(b, slot). Rows are moved as raw
// bytes in the widest unit (16, 8, 4, 2 or 1 bytes) that divides the row size and the base
// addresses involved, so there is no dtype dispatch, except where int8 pages quantize the K
// and V rows written into them (store/quantize.h; the dtype is the input's). Within the store, part b of any slot
// starts at page_base + offset[b] + row * row_bytes[b], where page bases are 16-byte aligned
// (slab allocations of records that are multiples of 16 bytes) and offsets are multiples of
// 16: the unit only depends on row_bytes[b] and on the other side's base address. Every
// kernel moves rows block-cooperatively: the units of a batch of rows are spread over the
// threads, which keeps the accesses coalesced however short a row is.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include "common/occupancy.h"
#include "store/compact_schedule.h"
#include "store/quantize.h"
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
  for (int b = 0; b < kParts; ++b) ok = ok && record.offset[b] % 16 == 0 && record.row_bytes[b] >= 0;
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

// Rows of part b (kK, kV, kPos, kScores, kScale) of the store's slots: what view.row(b, slot) gives,
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

// Quantizes `count` K or V rows (part kK or kV) into int8 pages, one warp per row: input row
// first_token + i of src ([.., D] of T) to slot[i] (skipped if < 0), its scale into the
// slot's scale row. The maximum is reduced over the warp in any order (quant_max does not
// depend on it), then every value is quantized as quantize_row does: bit for bit the CPU's.
template <typename T>
__device__ void quantize_rows(const T* src, const PagedView& view, int part, const int64_t* slot,
                              int64_t first_token, int count) {
  const int64_t D = view.record.row_bytes[part];  // int8: one byte per element
  const int lane = threadIdx.x % 32;
  for (int i = threadIdx.x / 32; i < count; i += blockDim.x / 32) {
    if (slot[i] < 0) continue;  // uniform over the warp
    const T* x = src + (first_token + i) * D;
    float amax = 0.f;
    for (int64_t d = lane; d < D; d += 32) amax = quant_max(amax, fabsf(static_cast<float>(x[d])));
#pragma unroll
    for (int off = 16; off > 0; off /= 2) amax = quant_max(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const c10::Half scale = quant_scale(amax);
    const float s = static_cast<float>(scale);
    int8_t* q = reinterpret_cast<int8_t*>(view.row(part, slot[i]));
    for (int64_t d = lane; d < D; d += 32) q[d] = s > 0.f ? quantize_value(static_cast<float>(x[d]), s) : 0;
    if (lane == 0) reinterpret_cast<c10::Half*>(view.row(kScale, slot[i]))[part == kK ? 0 : 1] = scale;
  }
}

// Block (x, y) writes tokens [x * kTokensPerBlock, ...) of segment y (and y + gridDim.y, ...).
// new_k/new_v: [S, n, D] rows; new_pos: [S / heads, n]. In is void when the rows are copied
// as they are, else the input's element type, which int8 pages quantize. Distinct tokens of a segment go to
// distinct token indices (ranks are distinct), hence distinct slots (a segment's slot mapping
// is injective), and segments own disjoint pages, so no two writes collide. Only slots of
// tokens being written are touched.
template <typename In, typename SlotOf>
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
    if constexpr (std::is_void_v<In>) {
      copy_rows(TokenRows{new_k, part_rows(view, kK), slot, first_token}, count, row_bytes, width_k);
      copy_rows(TokenRows{new_v, part_rows(view, kV), slot, first_token}, count, row_bytes, width_v);
    } else {
      quantize_rows(reinterpret_cast<const In*>(new_k), view, kK, slot, first_token, count);
      quantize_rows(reinterpret_cast<const In*>(new_v), view, kV, slot, first_token, count);
    }
    __syncthreads();  // slot[] is rewritten for the next segment
  }
}

template <typename SlotOf>
void launch_write_tokens(const PagedView& view, const at::Tensor& new_k, const at::Tensor& new_v,
                         const at::Tensor& new_pos, int64_t segments, int64_t n,
                         const SlotOf& slot_of) {
  if (segments == 0 || n == 0) return;
  check_record(view.record);
  // new_k/new_v rows have the store's head_dim and, unless int8 pages quantize them, its
  // dtype (checked by the caller): the store's row size.
  const bool quantized = view.record.quantized();
  const int64_t row_bytes = view.record.row_bytes[kK];
  TORCH_INTERNAL_ASSERT(view.record.row_bytes[kV] == row_bytes &&
                        new_k.size(-1) * (quantized ? 1 : new_k.element_size()) == row_bytes &&
                        new_k.scalar_type() == new_v.scalar_type());
  check_row_bytes(row_bytes);
  const int width_k = vec_width(row_bytes, {new_k.data_ptr()});
  const int width_v = vec_width(row_bytes, {new_v.data_ptr()});
  const int64_t heads = segments / new_pos.size(0);
  const dim3 grid(static_cast<unsigned int>((n + kTokensPerBlock - 1) / kTokensPerBlock),
                  segment_grid(segments));
  const auto launch = [&](auto in) {
    using In = typename decltype(in)::type;
    write_tokens_kernel<In><<<grid, kTokenThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        view, width_k, width_v, static_cast<const char*>(new_k.data_ptr()),
        static_cast<const char*>(new_v.data_ptr()), new_pos.data_ptr<int32_t>(), segments, n, heads,
        slot_of);
  };
  if (!quantized) {
    launch(std::type_identity<void>{});
  } else {
    switch (new_k.scalar_type()) {
      case at::kFloat: launch(std::type_identity<float>{}); break;
      case at::kHalf: launch(std::type_identity<at::Half>{}); break;
      case at::kBFloat16: launch(std::type_identity<at::BFloat16>{}); break;
      default: TORCH_INTERNAL_ASSERT(false, "int8 pages quantize float rows, got ", new_k.scalar_type());
    }
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---------------------------------------------------------------------------------------
// compact
//
// One tiled kernel for every segment count (the schedule, its wait rule and why they are
// safe: store/compact_schedule.h). Three launches on the stream:
//   1. the scratch words are zeroed (a memset);
//   2. compact_plan_kernel (one block) copies the old lengths and numbers the tiles of every
//      segment in (segment, tile) order: tile_begin[s] = the tiles of segments before s,
//      ceil(len / span) each; tile_begin[segments] = all tiles;
//   3. compact_kernel: blocks that stay resident take tiles by ticket (an atomic counter),
//      so tickets, and tiles, are handed out in launch order and a tile's predecessors
//      were taken by blocks that are running or done: a spin-wait only ever waits on such a
//      block, which never waits on it, so it ends (the single-pass scan's argument in CUB;
//      blockIdx order alone does not promise that a waited-for block is ever scheduled).
//      A segment's tiles go to whichever blocks take them, so a long segment is spread over
//      the GPU whatever the number of segments.
// A tile (span tokens, up to kMaxSpan) counts its kept tokens with a block scan, publishes
// the count, finds its destination by decoupled look-back (warp 0 reads 32 predecessors'
// words at a time), then moves its kept rows through `cap` rows of shared-memory staging
// (cp.async on sm_80+): its few top ranks that later tiles could overwrite first when that
// avoids a chain of waits (plan_tile), the others in ascending chunks: read the chunk,
// publish the tile's read progress, wait for at most two earlier tiles (the wait rule),
// write the chunk.
// Lengths: every block reads the old lengths from the copy made by the plan kernel, never
// from len, so the tile that ends a segment writes its new length into len as soon as its
// look-back is done, while other tiles still run: nobody in this kernel reads len.
// Memory ordering between blocks (thread 0 of a block publishes and waits for the block):
//   - look-back words pack status and value in one 64-bit word written by one atomicExch
//     and read by one volatile 64-bit load: a reader sees both or neither, and nothing else
//     is published with them, so no fence is needed;
//   - read progress says "these source rows have been read". The rows are loaded into
//     shared memory (cp.async.wait_all returns once they have landed), every thread passes
//     a barrier, then thread 0 fences and publishes: the loads are complete before the flag
//     can be seen. The waiting thread spins on volatile loads, fences, then the block passes
//     a barrier before any thread writes: writes cannot move ahead of the observed flag.
//   - the written rows are read by no block of this kernel (every source row is read once,
//     before anything lands on it), so the writes need no publishing; the next kernel on
//     the stream sees them.
// Pages are read and written through plain pointers (no __restrict__, no __ldg): the same
// memory is written during the kernel. Reads through L1 (cp.async.ca for 4- and 8-byte
// units) are safe for the same reason: a row's bytes change only after it has been read.

constexpr int kCompactThreads = 256;  // also the most rows in a chunk
constexpr int kSpanItems = 4;         // tokens a thread counts in a tile
constexpr int64_t kMaxSpan = int64_t{kCompactThreads} * kSpanItems;
constexpr int64_t kMinSpan = 128;
// Dynamic shared memory per block: three blocks per SM on H100/H200 (228 KiB each) keep
// enough reads in flight; a choice to tune on the GPU (bench/kernels.py compaction rows).
constexpr int64_t kCompactSmemBudget = 72 * 1024;
constexpr int64_t kScanBytes = 2048;  // room for the block scan's temporary storage
using CompactScan = cub::BlockScan<int, kCompactThreads>;

__host__ __device__ constexpr int64_t align16(int64_t x) { return (x + 15) & ~int64_t{15}; }

// Byte offsets of the pieces of the dynamic shared memory, each 16-byte aligned (the
// buffer itself is declared as uint4). Host and device compute it with the same code.
struct CompactLayout {
  int64_t kept_local;  // int32_t[kMaxSpan]: local index of each kept token, by rank
  int64_t src_slot;    // int64_t[kCompactThreads]: the chunk's source slots
  int64_t dst_slot;    // int64_t[kCompactThreads]: and destination slots
  int64_t stage[kParts];  // cap rows of each part
  int64_t total;
};

__host__ __device__ inline CompactLayout compact_layout(int64_t cap, const int64_t* row_bytes) {
  CompactLayout l{};
  int64_t off = kScanBytes;  // the scan's storage comes first, at offset 0
  l.kept_local = off;
  off += align16(sizeof(int32_t) * kMaxSpan);
  l.src_slot = off;
  off += align16(sizeof(int64_t) * kCompactThreads);
  l.dst_slot = off;
  off += align16(sizeof(int64_t) * kCompactThreads);
  for (int b = 0; b < kParts; ++b) {
    l.stage[b] = off;
    off += align16(cap * row_bytes[b]);
  }
  l.total = off;
  return l;
}

// Global scratch of one compaction, zeroed before the plan kernel (one int64 tensor).
struct CompactScratch {
  unsigned long long* status;  // [max_tiles] look-back words (compact_schedule.h)
  int32_t* progress;           // [max_tiles] read progress words (compact_schedule.h)
  int64_t* tile_begin;         // [segments + 1] first ticket of each segment's tiles
  int32_t* old_len;            // [segments] the lengths before the compaction
  unsigned int* ticket;        // the next tile to take
};

struct CompactPlan {
  int64_t segments, span, cap;
};

// w[b]: the unit part b is moved in.
struct CompactWidths {
  int w[kParts];
};

// One unit global -> shared without a register round trip where the hardware can (sm_80+,
// 4/8/16-byte units): a thread issues all its units of a chunk before any has landed.
template <typename Vec>
__device__ inline void copy_unit_async(Vec* to_shared, const Vec* from_global) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (sizeof(Vec) >= 4) {
    const auto to = static_cast<unsigned int>(__cvta_generic_to_shared(to_shared));
    if constexpr (sizeof(Vec) == 16) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to), "l"(from_global)
                   : "memory");
    } else {
      asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(to), "l"(from_global),
                   "n"(static_cast<int>(sizeof(Vec)))
                   : "memory");
    }
  } else {
    *to_shared = *from_global;
  }
#else
  *to_shared = *from_global;
#endif
}

// Waits for this thread's cp.async copies (a barrier then shows them to the block).
__device__ inline void wait_async_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// The chunk's rows of one part, from the store to the staging buffer: row q from slot
// src_slot[q]; a row whose destination is its own slot stays put (neither read nor written).
template <typename Vec>
__device__ void stage_rows_as(const PartRows& rows, char* stage, const int64_t* src_slot,
                              const int64_t* dst_slot, int count) {
  const int units = static_cast<int>(rows.row_bytes / static_cast<int64_t>(sizeof(Vec)));
  const int total = count * units;
  for (int u = threadIdx.x; u < total; u += blockDim.x) {
    const int q = u / units;
    const int64_t from = src_slot[q];
    if (from == dst_slot[q]) continue;
    const int c = u - q * units;
    copy_unit_async(reinterpret_cast<Vec*>(stage + q * rows.row_bytes) + c,
                    reinterpret_cast<const Vec*>(rows(from)) + c);
  }
}

__device__ void stage_rows(const PartRows& rows, char* stage, const int64_t* src_slot,
                           const int64_t* dst_slot, int count, int width) {
  switch (width) {
    case 16: stage_rows_as<uint4>(rows, stage, src_slot, dst_slot, count); break;
    case 8: stage_rows_as<uint2>(rows, stage, src_slot, dst_slot, count); break;
    case 4: stage_rows_as<uint32_t>(rows, stage, src_slot, dst_slot, count); break;
    case 2: stage_rows_as<uint16_t>(rows, stage, src_slot, dst_slot, count); break;
    default: stage_rows_as<uint8_t>(rows, stage, src_slot, dst_slot, count); break;
  }
}

// Staged row q to its destination slot dst_slot[q] (rows that stay put are skipped).
struct ScatterRows {
  PartRows rows;
  const char* stage;
  const int64_t* src_slot;
  const int64_t* dst_slot;
  __device__ bool operator()(int q, char*& d, const char*& s) const {
    const int64_t to = dst_slot[q];
    if (src_slot[q] == to) return false;
    s = stage + q * rows.row_bytes;
    d = rows(to);
    return true;
  }
};

__device__ inline unsigned long long load_volatile(const unsigned long long* p) {
  return *reinterpret_cast<const volatile unsigned long long*>(p);
}
__device__ inline int32_t load_volatile(const int32_t* p) {
  return *reinterpret_cast<const volatile int32_t*>(p);
}

__device__ inline void spin_pause() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  __nanosleep(64);
#endif
}

__device__ inline int64_t warp_sum(int64_t x) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Warp 0: the segment of ticket t, searched forward from `from` (the segment of the
// block's previous ticket: a block's tickets grow, so its segments do), 32 at a time. The
// segment is the first s with tile_begin[s + 1] > t; tile_begin[segments] > t ends it.
__device__ int64_t segment_of_ticket(const int64_t* tile_begin, int64_t segments, int64_t from,
                                     int64_t t) {
  const int lane = threadIdx.x & 31;
  for (int64_t base = from;; base += 32) {
    const int64_t s = min(base + lane, segments - 1);
    const unsigned past = __ballot_sync(0xffffffffu, tile_begin[s + 1] > t);
    if (past) return base + __ffs(past) - 1;
  }
}

// Warp 0: kept tokens of the segment's tiles before tile t (local index c > 0), from the
// words its predecessors publish (compact_schedule.h). Lane l looks at predecessor k0 + l;
// the window is used once every lane's word is published; the closest inclusive word
// ends the walk, and the words past it (further back) are not counted.
__device__ int64_t look_back(const unsigned long long* status, int64_t t, int64_t c) {
  namespace cs = compact_schedule;
  const int lane = threadIdx.x & 31;
  int64_t sum = 0;
  for (int64_t k0 = 1;; k0 += 32) {
    const int64_t k = k0 + lane;
    // Before the segment's first tile: nothing more (never used, tile 0 is inclusive).
    uint64_t word = cs::status_word(cs::kInclusive, 0);
    if (k <= c) {
      // Every predecessor holds a ticket taken earlier, so it runs and publishes.
      while (cs::status_of(word = load_volatile(status + (t - k))) == cs::kInvalid) spin_pause();
    }
    int64_t value = 0;
    const bool ends = cs::look_back_step(word, value);
    const unsigned inclusive = __ballot_sync(0xffffffffu, ends);
    const int last_lane = inclusive ? __ffs(inclusive) - 1 : 31;
    sum += warp_sum(lane <= last_lane ? value : 0);
    if (inclusive) return sum;
  }
}

// Numbers the tiles (see the top of this section) and snapshots the lengths. One block.
// A length is taken within [0, most_tokens]: checking lengths against the page table is
// the op's job (ops.cpp); the clamp only keeps a bad length from running past the scratch
// and past the segment's page-table row.
__global__ void __launch_bounds__(kCompactThreads)
    compact_plan_kernel(const int32_t* len, int64_t segments, int64_t span, int64_t most_tokens,
                        CompactScratch sc) {
  using Scan = cub::BlockScan<int64_t, kCompactThreads>;
  __shared__ typename Scan::TempStorage scan;
  int64_t carry = 0;  // tiles of the segments before this chunk of segments
  for (int64_t s0 = 0; s0 < segments; s0 += kCompactThreads) {
    const int64_t s = s0 + threadIdx.x;
    const int32_t n = s < segments ? static_cast<int32_t>(max(int64_t{0}, min(int64_t{len[s]}, most_tokens))) : 0;
    if (s < segments) sc.old_len[s] = n;
    int64_t begin = 0, chunk_tiles = 0;
    Scan(scan).ExclusiveSum(compact_schedule::tiles_of(n, span), begin, chunk_tiles);
    if (s < segments) sc.tile_begin[s] = carry + begin;
    carry += chunk_tiles;
    __syncthreads();  // the scan storage is reused
  }
  if (threadIdx.x == 0) sc.tile_begin[segments] = carry;
}

__global__ void __launch_bounds__(kCompactThreads)
    compact_kernel(PagedView view, CompactWidths width, int32_t* len, const bool* keep,
                   CompactPlan plan, CompactScratch sc) {
  namespace cs = compact_schedule;
  extern __shared__ uint4 smem_raw[];
  static_assert(sizeof(CompactScan::TempStorage) <= kScanBytes, "kScanBytes is too small");
  char* const smem = reinterpret_cast<char*>(smem_raw);
  const CompactLayout layout = compact_layout(plan.cap, view.record.row_bytes);
  CompactScan::TempStorage& scan_storage = *reinterpret_cast<CompactScan::TempStorage*>(smem);
  int32_t* const kept_local = reinterpret_cast<int32_t*>(smem + layout.kept_local);
  int64_t* const src_slot = reinterpret_cast<int64_t*>(smem + layout.src_slot);
  int64_t* const dst_slot = reinterpret_cast<int64_t*>(smem + layout.dst_slot);
  __shared__ int64_t shared_ticket, shared_segment, shared_kept_before;
  const int64_t* row_bytes = view.record.row_bytes;
  const int64_t span = plan.span;
  const bool warp0 = threadIdx.x < 32;
  // Written by the plan kernel, earlier on the stream.
  const int64_t all_tiles = sc.tile_begin[plan.segments];
  int64_t seg = 0;
  for (;;) {
    if (threadIdx.x == 0) shared_ticket = atomicAdd(sc.ticket, 1u);
    __syncthreads();
    const int64_t t = shared_ticket;
    if (t >= all_tiles) break;  // the same ticket in every thread: the whole block leaves
    if (warp0) {
      seg = segment_of_ticket(sc.tile_begin, plan.segments, seg, t);
      if (threadIdx.x == 0) shared_segment = seg;
    }
    __syncthreads();
    seg = shared_segment;
    const int64_t c = t - sc.tile_begin[seg];  // local index of the tile in its segment
    const int64_t n = sc.old_len[seg];
    const int64_t first_token = c * span;
    const int64_t rows = cs::tile_rows(n, span, c);  // >= 1: the segment has tile c

    // 1. Count: thread x holds tokens x * kSpanItems + k; the scan ranks the kept ones.
    // Only live tokens are looked up: the table has no page past the segment's.
    int flag[kSpanItems], rank[kSpanItems];
    for (int k = 0; k < kSpanItems; ++k) {
      const int64_t local = int64_t{threadIdx.x} * kSpanItems + k;
      flag[k] = (local < rows && keep[view.slot(seg, first_token + local)]) ? 1 : 0;
    }
    int tile_kept_int = 0;
    CompactScan(scan_storage).ExclusiveSum(flag, rank, tile_kept_int);
    for (int k = 0; k < kSpanItems; ++k) {
      if (flag[k]) kept_local[rank[k]] = static_cast<int32_t>(threadIdx.x * kSpanItems + k);
    }
    const int64_t tile_kept = tile_kept_int;
    if (threadIdx.x == 0) {
      atomicExch(sc.status + t, static_cast<unsigned long long>(cs::first_word(c, tile_kept)));
    }

    // 2. Destination: kept tokens of the earlier tiles, by look-back.
    if (warp0) {
      const int64_t before = c == 0 ? 0 : look_back(sc.status, t, c);
      if (threadIdx.x == 0) {
        shared_kept_before = before;
        if (c > 0) {
          const uint64_t word = cs::status_word(cs::kInclusive, static_cast<uint32_t>(before + tile_kept));
          atomicExch(sc.status + t, static_cast<unsigned long long>(word));
        }
        // The segment's last tile knows its new length (len is read by nobody here).
        if (first_token + rows == n) len[seg] = static_cast<int32_t>(before + tile_kept);
      }
    }
    __syncthreads();  // kept_local and shared_kept_before are complete
    const int64_t kept_before = shared_kept_before;

    // 3. Moves (compact_schedule.h, plan_tile): the tail first if the plan has one, then
    // ascending chunks (read, publish progress, wait for at most two tiles, write), then
    // the tail's write. Every branch below is uniform over the block.
    // Ranks [r0, r0 + count) into staging rows [row0, row0 + count): slot lists, then the
    // rows; when it returns every thread's reads have landed.
    auto read_ranks = [&](int64_t r0, int count, int64_t row0) {
      if (static_cast<int>(threadIdx.x) < count) {
        const int64_t m = r0 + threadIdx.x;  // rank of the kept token in the tile
        src_slot[row0 + threadIdx.x] = view.slot(seg, first_token + kept_local[m]);
        // kept_before + m < kept_before + tile_kept <= n: a live token of the segment.
        dst_slot[row0 + threadIdx.x] = view.slot(seg, kept_before + m);
      }
      __syncthreads();  // the slot lists are complete
      for (int b = 0; b < kParts; ++b) {
        stage_rows(part_rows(view, b), smem + layout.stage[b] + row0 * row_bytes[b], src_slot + row0,
                   dst_slot + row0, count, width.w[b]);
      }
      wait_async_copies();
      __syncthreads();  // every row is in shared memory: the reads are done
    };
    // Thread 0 announces what the tile has read (after read_ranks' barrier).
    auto publish_progress = [&](uint32_t word) {
      if (threadIdx.x == 0) {
        __threadfence();  // the block's reads come before the word that announces them
        atomicExch(sc.progress + t, static_cast<int32_t>(word));
      }
    };
    // Staging rows [row0, row0 + count) to the destinations of ranks [r0, r0 + count), once
    // the earlier tiles under them have read their tokens there (THE WAIT RULE).
    auto wait_and_write = [&](int64_t r0, int count, int64_t row0) {
      if (threadIdx.x == 0) {
        const int64_t dst_begin = kept_before + r0, dst_end = dst_begin + count;
        const cs::TileRange waits = cs::overlapped_tiles(c, span, dst_begin, dst_end);
        for (int64_t d = waits.first; d <= waits.last; ++d) {
          // Tile d of the segment took ticket t - c + d, before this tile: it runs or is
          // done, and its reads wait for nothing of this tile.
          while (!cs::may_write(static_cast<uint32_t>(load_volatile(sc.progress + (t - c + d))), d,
                                span, dst_begin, dst_end)) {
            spin_pause();
          }
        }
        __threadfence();  // the writes below come after the progress they waited for
      }
      __syncthreads();  // the destinations have been read by whoever needed them
      for (int b = 0; b < kParts; ++b) {
        copy_rows(ScatterRows{part_rows(view, b), smem + layout.stage[b] + row0 * row_bytes[b],
                              src_slot + row0, dst_slot + row0},
                  count, row_bytes[b], width.w[b]);
      }
      __syncthreads();  // staging and slot lists are reused
    };
    if (cs::tile_moves_nothing(c, span, rows, kept_before, tile_kept)) {
      // Reads nothing, writes nothing: tiles waiting on it may go on at once.
      if (threadIdx.x == 0) atomicExch(sc.progress + t, static_cast<int32_t>(cs::progress_word(span, span, span)));
    } else {
      // Every thread computes the same plan from the shared kept_local.
      const cs::TilePlan tp = cs::plan_tile(kept_local, tile_kept, c, span, kept_before, plan.cap);
      const int tail = static_cast<int>(tile_kept - tp.tail_rank);  // staging rows [0, tail)
      if (tp.tail_from < span) {
        read_ranks(tp.tail_rank, tail, 0);
        publish_progress(cs::progress_word(0, tp.tail_from, span));
      }
      for (int64_t m0 = 0; m0 < tp.tail_rank; m0 += tp.chunk) {
        const int count = static_cast<int>(cs::chunk_at(kept_before, tp.tail_rank, m0, tp.chunk).count);
        read_ranks(m0, count, tail);
        publish_progress(cs::progress_word(cs::read_prefix(kept_local, m0 + count, tile_kept, span),
                                           tp.tail_from, span));
        wait_and_write(m0, count, tail);
      }
      if (tail > 0) wait_and_write(tp.tail_rank, tail, 0);
    }
    // kept_local, the scan storage and shared_ticket are reused by the next tile.
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------------------
// compact_unordered: one block per segment (looping over the segments past the grid). The
// block counts the kept tokens (kept), numbers the evicted places among the first kept
// tokens (holes) and the kept tokens past them (movers), both in token order, with block
// scans over chunks of the segment, and the r-th mover fills the r-th hole. The hole of rank
// r is noted in `hole_of` at the slot of the segment's token r (r < kept: the segment's own
// slots, so segments never share scratch); the movers then read it, after a barrier. Holes
// lie below kept and movers at or past it: no copy reads a row another writes.

constexpr int kUnorderedThreads = 256;  // also the most moves copied together

// Rows of part b of the moves of a chunk: from[i] to to[i] (slots, in shared memory).
struct MoveRows {
  PartRows part;
  const int64_t* from;
  const int64_t* to;
  __device__ bool operator()(int i, char*& d, const char*& s) const {
    d = part(to[i]);
    s = part(from[i]);
    return true;
  }
};

__global__ void __launch_bounds__(kUnorderedThreads)
    compact_unordered_kernel(PagedView view, CompactWidths width, int32_t* len, const bool* keep,
                             int32_t* hole_of, int64_t segments) {
  using Scan = cub::BlockScan<int, kUnorderedThreads>;
  using Reduce = cub::BlockReduce<int, kUnorderedThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } temp;
  __shared__ int kept_in_block;
  __shared__ int64_t from[kUnorderedThreads], to[kUnorderedThreads];
  for (int64_t s = blockIdx.x; s < segments; s += gridDim.x) {
    const int n = len[s];
    int mine = 0;
    for (int i = threadIdx.x; i < n; i += kUnorderedThreads) mine += keep[view.slot(s, i)] ? 1 : 0;
    const int total = Reduce(temp.reduce).Sum(mine);
    if (threadIdx.x == 0) kept_in_block = total;
    __syncthreads();
    const int kept = kept_in_block;
    int base = 0;  // holes (then movers) numbered in the chunks before
    for (int c = 0; c < kept; c += kUnorderedThreads) {
      const int i = c + threadIdx.x;
      const int hole = i < kept && !keep[view.slot(s, i)] ? 1 : 0;
      int rank, count;
      Scan(temp.scan).ExclusiveSum(hole, rank, count);
      if (hole) hole_of[view.slot(s, base + rank)] = i;
      base += count;
      __syncthreads();  // the scan's storage is reused; the holes are read below
    }
    base = 0;
    for (int c = kept; c < n; c += kUnorderedThreads) {
      const int i = c + threadIdx.x;
      const int mover = i < n && keep[view.slot(s, i)] ? 1 : 0;
      int rank, count;
      Scan(temp.scan).ExclusiveSum(mover, rank, count);
      if (mover) {
        from[rank] = view.slot(s, i);
        to[rank] = view.slot(s, hole_of[view.slot(s, base + rank)]);
      }
      __syncthreads();
      for (int b = 0; b < kParts; ++b)
        copy_rows(MoveRows{part_rows(view, b), from, to}, count, view.record.row_bytes[b], width.w[b]);
      base += count;
      __syncthreads();  // from/to and the scan's storage are reused
    }
    if (threadIdx.x == 0) len[s] = kept;
    __syncthreads();  // kept_in_block is reused by the next segment
  }
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

namespace {

// What the launch of compact_kernel needs from the runtime, asked once per device and size:
// an eviction step compacts every layer, and these queries cost microseconds of host time
// each. With smem > 0 the kernel is also allowed that much dynamic shared memory (over
// 48 KiB needs the opt-in); the allowance only grows, so a launch with a smaller size that
// was allowed before stays allowed.
struct CompactLaunchConfig {
  int64_t static_smem;  // bytes of the kernel's static __shared__ variables
  int blocks_per_sm;    // resident blocks per SM with smem bytes of dynamic shared memory
};

CompactLaunchConfig compact_launch_config(int device, int64_t smem) {
  static std::mutex lock;
  static std::map<int, int64_t> static_smem, allowed;
  const std::lock_guard<std::mutex> guard(lock);
  if (!static_smem.count(device)) {
    cudaFuncAttributes attributes{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, compact_kernel));
    static_smem[device] = static_cast<int64_t>(attributes.sharedSizeBytes);
  }
  CompactLaunchConfig config{static_smem[device], 0};
  if (smem > 0) {
    if (allowed[device] < smem) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(compact_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
      allowed[device] = smem;
    }
    config.blocks_per_sm =
        resident_blocks_per_sm(compact_kernel, device, kCompactThreads, static_cast<size_t>(smem));
  }
  return config;
}

}  // namespace

void compact_cuda(const PagedView& view, const at::Tensor& len, const at::Tensor& keep) {
  namespace cs = compact_schedule;
  const int64_t segments = len.numel();
  // With no pages (a fresh store) every length is already 0 and nothing moves.
  if (segments == 0 || keep.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(len.device());
  check_record(view.record);
  const int64_t* row_bytes = view.record.row_bytes;
  CompactWidths width{};
  int64_t row_total = 0;
  for (int b = 0; b < kParts; ++b) {
    check_row_bytes(row_bytes[b]);
    // Store rows and the staging buffer are 16-byte aligned: only the row size counts.
    width.w[b] = vec_width(row_bytes[b], {});
    row_total += row_bytes[b];
  }
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const int device = len.get_device();
  // Dynamic shared memory a block may have: the opt-in maximum less the static variables.
  const int64_t most = static_cast<int64_t>(props->sharedMemPerBlockOptin) -
                       compact_launch_config(device, 0).static_smem;
  // Rows per chunk: as many as fit in the budget (kParts * 15: alignment padding of the
  // staging parts), at most one per thread. row_total >= 4: pos rows are 4 bytes.
  const int64_t fixed = compact_layout(0, row_bytes).total + kParts * 15;
  const int64_t cap = cs::chunk_rows(std::min(kCompactSmemBudget, most), fixed, row_total, kCompactThreads);
  const int64_t smem = compact_layout(cap, row_bytes).total;
  // One row of staging always fits unless a token is over ~210 KiB (fp32 head_dim > ~27000).
  TORCH_CHECK_VALUE(smem <= most, "compact: one token (", row_total,
                    " bytes of K, V, pos, scores and scales) does not fit in the device's shared memory (",
                    most, " bytes)");
  const int per_sm = compact_launch_config(device, smem).blocks_per_sm;
  const int64_t resident = static_cast<int64_t>(props->multiProcessorCount) * std::max(per_sm, 1);
  // Tiles of kMaxSpan tokens unless the store could not give every resident block two
  // tiles: then shorter ones, down to kMinSpan. The host knows no lengths (no sync), only
  // the tokens a segment's page-table row can hold; tiles past a length do not exist.
  const int64_t most_tokens = view.width * view.page_size();
  const int64_t span = cs::choose_span(segments, most_tokens, resident, kMaxSpan, kMinSpan);
  const int64_t max_tiles = segments * cs::tiles_of(most_tokens, span);
  if (max_tiles == 0) return;  // no page in any table row: every length is 0
  TORCH_CHECK_VALUE(max_tiles < INT32_MAX, "compact: ", segments, " segments of up to ",
                    most_tokens, " tokens make too many tiles");
  // Scratch in int64 words: status [max_tiles], progress (int32) [max_tiles], tile_begin
  // [segments + 1], old_len (int32) [segments], ticket; zeroed (status kInvalid, progress 0,
  // ticket 0).
  const int64_t progress_words = (max_tiles + 1) / 2, old_len_words = (segments + 1) / 2;
  const at::Tensor scratch =
      at::zeros({max_tiles + progress_words + segments + 1 + old_len_words + 1}, len.options().dtype(at::kLong));
  int64_t* words = scratch.data_ptr<int64_t>();
  CompactScratch sc{};
  sc.status = reinterpret_cast<unsigned long long*>(words);
  sc.progress = reinterpret_cast<int32_t*>(words + max_tiles);
  sc.tile_begin = words + max_tiles + progress_words;
  sc.old_len = reinterpret_cast<int32_t*>(sc.tile_begin + segments + 1);
  sc.ticket = reinterpret_cast<unsigned int*>(sc.tile_begin + segments + 1 + old_len_words);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  compact_plan_kernel<<<1, kCompactThreads, 0, stream>>>(len.data_ptr<int32_t>(), segments, span,
                                                         most_tokens, sc);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const auto blocks = static_cast<unsigned int>(std::min(max_tiles, resident));
  compact_kernel<<<blocks, kCompactThreads, static_cast<size_t>(smem), stream>>>(
      view, width, len.data_ptr<int32_t>(), keep.data_ptr<bool>(), CompactPlan{segments, span, cap}, sc);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void compact_unordered_cuda(const PagedView& view, const at::Tensor& len, const at::Tensor& keep) {
  const int64_t segments = len.numel();
  if (segments == 0 || keep.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(len.device());
  check_record(view.record);
  CompactWidths width{};
  for (int b = 0; b < kParts; ++b) {
    check_row_bytes(view.record.row_bytes[b]);
    width.w[b] = vec_width(view.record.row_bytes[b], {});  // rows are 16-byte aligned: the size counts
  }
  // Written before it is read (hole r of a segment at the slot of its token r): not zeroed.
  const at::Tensor hole_of = at::empty({keep.numel()}, len.options());
  const auto blocks = static_cast<unsigned int>(std::min<int64_t>(segments, INT32_MAX));
  compact_unordered_kernel<<<blocks, kUnorderedThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      view, width, len.data_ptr<int32_t>(), keep.data_ptr<bool>(), hole_of.data_ptr<int32_t>(), segments);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kvcache_ext::store
