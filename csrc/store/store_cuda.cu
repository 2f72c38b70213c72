// CUDA kernels of the ragged store: same semantics as store_cpu.cpp, bit for bit.
//
// Rows are moved as raw bytes in the widest unit (16, 8, 4, 2 or 1 bytes) that divides the
// row size and the base addresses involved, so there is no dtype dispatch. Every kernel
// moves rows block-cooperatively: the units of a batch of rows are spread over the threads,
// which keeps the accesses coalesced however short a row is.
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

constexpr int kK = 0, kV = 1, kPos = 2, kScores = 3;

// Raw views of the four per-slot buffers, passed to kernels by value. Row r of buffer b
// starts at base[b] + r * row_bytes[b]; width[b] is the unit it is moved in for this call.
struct RowBuffers {
  char* base[4];
  int64_t row_bytes[4];
  int width[4];
};

RowBuffers rows_of(const SlotBuffers& b) {
  RowBuffers r{};
  const at::Tensor* ts[4] = {&b.k, &b.v, &b.pos, &b.scores};
  for (int i = 0; i < 4; ++i) {
    r.base[i] = static_cast<char*>(ts[i]->data_ptr());
    // size(0) is the capacity; a [capacity, 0] scores buffer has rows of 0 bytes.
    r.row_bytes[i] = ts[i]->numel() == 0 ? 0 : ts[i]->nbytes() / ts[i]->size(0);
    r.width[i] = 1;
  }
  return r;
}

// Widest unit that divides the row size and every base address: then every row address
// (base + r * row_bytes) is aligned to it. Views may start at any element, so the base
// addresses are checked rather than assumed to have the allocator's alignment.
int vec_width(int64_t row_bytes, std::initializer_list<const void*> bases) {
  for (int w : {16, 8, 4, 2}) {
    bool ok = row_bytes % w == 0;
    for (const void* p : bases) ok = ok && reinterpret_cast<uintptr_t>(p) % w == 0;
    if (ok) return w;
  }
  return 1;
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
// relocate

constexpr int kRelocateRows = 64;  // rows per block: 16 KiB of K+V at 128 bytes a row
constexpr int kRelocateThreads = 256;

// Consecutive rows: row i of src and dst.
struct SpanRows {
  const char* src;
  char* dst;
  int64_t row_bytes;
  __device__ bool operator()(int i, char*& d, const char*& s) const {
    s = src + i * row_bytes;
    d = dst + i * row_bytes;
    return true;
  }
};

// Block (x, y) copies rows [x * kRelocateRows, ...) of segment y (and y + gridDim.y, ...).
__global__ void __launch_bounds__(kRelocateThreads)
    relocate_kernel(RowBuffers src, RowBuffers dst, const int64_t* src_start,
                    const int64_t* dst_start, const int32_t* len, int64_t segments) {
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRelocateRows;
  for (int64_t s = blockIdx.y; s < segments; s += gridDim.y) {
    const int64_t rows = min(static_cast<int64_t>(kRelocateRows), len[s] - r0);
    if (rows <= 0) continue;  // no barrier in this kernel, so blocks may leave early
    for (int b = 0; b < 4; ++b) {
      const int64_t rb = src.row_bytes[b];
      copy_rows(SpanRows{src.base[b] + (src_start[s] + r0) * rb, dst.base[b] + (dst_start[s] + r0) * rb, rb},
                static_cast<int>(rows), rb, src.width[b]);
    }
  }
}

// ---------------------------------------------------------------------------------------
// append / replace: both write whole tokens (K, V, pos, zeroed scores) into chosen slots.

constexpr int kTokensPerBlock = 32;
constexpr int kTokenThreads = 128;

// append: token t of segment s goes to start + len + rank (rank = t when undefined).
struct AppendSlot {
  const int64_t* start;
  const int32_t* len;
  const int32_t* rank;  // nullptr: every token is stored, in order
  int64_t n;
  __device__ int64_t operator()(int64_t s, int64_t t) const {
    const int64_t r = rank ? rank[s * n + t] : t;
    return r < 0 ? -1 : start[s] + len[s] + r;
  }
};

// replace: the one token of segment s goes to start + slot.
struct ReplaceSlot {
  const int64_t* start;
  const int64_t* slot;
  __device__ int64_t operator()(int64_t s, int64_t /*t*/) const { return start[s] + slot[s]; }
};

// Token rows: token first_token + i of the input to slot[i] of the store (skipped if < 0).
struct TokenRows {
  const char* src;
  char* dst;
  int64_t row_bytes;
  const int64_t* slot;  // shared memory
  int64_t first_token;
  __device__ bool operator()(int i, char*& d, const char*& s) const {
    if (slot[i] < 0) return false;
    s = src + (first_token + i) * row_bytes;
    d = dst + slot[i] * row_bytes;
    return true;
  }
};

// Block (x, y) writes tokens [x * kTokensPerBlock, ...) of segment y (and y + gridDim.y, ...).
// new_k/new_v: [S, n, D] rows; new_pos: [S / heads, n]. Distinct tokens of a segment go to
// distinct slots (ranks are distinct) and segments do not overlap, so no two writes collide.
template <typename SlotOf>
__global__ void __launch_bounds__(kTokenThreads)
    write_tokens_kernel(RowBuffers buf, const char* new_k, const char* new_v,
                        const int32_t* new_pos, int64_t segments, int64_t n, int64_t heads,
                        SlotOf slot_of) {
  __shared__ int64_t slot[kTokensPerBlock];
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTokensPerBlock;
  const int count = static_cast<int>(min(static_cast<int64_t>(kTokensPerBlock), n - t0));
  int32_t* pos = reinterpret_cast<int32_t*>(buf.base[kPos]);
  float* scores = reinterpret_cast<float*>(buf.base[kScores]);
  const int64_t channels = buf.row_bytes[kScores] / static_cast<int64_t>(sizeof(float));
  for (int64_t s = blockIdx.y; s < segments; s += gridDim.y) {
    if (static_cast<int>(threadIdx.x) < count) {
      const int64_t t = t0 + threadIdx.x;
      const int64_t d = slot_of(s, t);
      slot[threadIdx.x] = d;
      if (d >= 0) {
        pos[d] = new_pos[(s / heads) * n + t];
        for (int64_t c = 0; c < channels; ++c) scores[d * channels + c] = 0.0f;
      }
    }
    __syncthreads();  // slot[] is complete
    const int64_t first_token = s * n + t0;
    copy_rows(TokenRows{new_k, buf.base[kK], buf.row_bytes[kK], slot, first_token}, count,
              buf.row_bytes[kK], buf.width[kK]);
    copy_rows(TokenRows{new_v, buf.base[kV], buf.row_bytes[kV], slot, first_token}, count,
              buf.row_bytes[kV], buf.width[kV]);
    __syncthreads();  // slot[] is rewritten for the next segment
  }
}

template <typename SlotOf>
void launch_write_tokens(const SlotBuffers& buf, const at::Tensor& new_k, const at::Tensor& new_v,
                         const at::Tensor& new_pos, int64_t segments, int64_t n,
                         const SlotOf& slot_of) {
  if (segments == 0 || n == 0) return;
  RowBuffers rows = rows_of(buf);
  // new_k/new_v rows have the store's row size: same dtype and head_dim (checked by the caller).
  check_row_bytes(rows.row_bytes[kK]);
  rows.width[kK] = vec_width(rows.row_bytes[kK], {rows.base[kK], new_k.data_ptr()});
  rows.width[kV] = vec_width(rows.row_bytes[kV], {rows.base[kV], new_v.data_ptr()});
  const int64_t heads = segments / new_pos.size(0);
  const dim3 grid(static_cast<unsigned int>((n + kTokensPerBlock - 1) / kTokensPerBlock),
                  segment_grid(segments));
  write_tokens_kernel<<<grid, kTokenThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      rows, static_cast<const char*>(new_k.data_ptr()), static_cast<const char*>(new_v.data_ptr()),
      new_pos.data_ptr<int32_t>(), segments, n, heads, slot_of);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---------------------------------------------------------------------------------------
// compact
//
// One block per segment walks the segment's slots in tiles of `tile` slots, in order.
// For each tile:
//   1. a block-wide exclusive scan of the keep flags gives every kept slot its index q
//      among the tile's kept slots; src_of[q] records the slot. Its destination is
//      kept + q, where `kept` counts the kept slots of the earlier tiles.
//   2. the kept rows (K, V, pos, scores) are read into shared memory (staging), barrier;
//   3. the staged rows are written to their destinations, barrier.
// Why this is race-free, in place:
//   - Destinations satisfy dst <= src and dst < tile end, so a write in step 3 lands on a
//     slot that is either before the tile (read, if kept, in an earlier tile's step 2,
//     which the barriers order before) or inside the tile (read in this tile's step 2,
//     completed at the barrier). No slot at or beyond the tile end is written, so what
//     later tiles read is still the original data.
//   - __syncthreads() makes the block's global writes visible to the whole block, so
//     the next tile (whose reads lie beyond every write so far) and step 3 see a
//     consistent state; the trailing barrier also keeps step 3's reads of the staging
//     buffer and of src_of ahead of the next tile's overwrites.
//   - Segments own disjoint slot ranges and keep is only read, so blocks never interact.
// A slot whose destination is itself is not copied: such slots form the fully kept
// prefix of the segment, and a tile lying entirely in it is skipped.
// No second full-size buffer is needed: the staging is one tile of shared memory.

constexpr int kCompactThreads = 256;  // also the most slots in a tile
constexpr int64_t kCompactSmemBudget = 48 * 1024;  // no opt-in needed up to here
constexpr int64_t kScanBytes = 2048;  // room for the scan's temporary storage
using CompactScan = cub::BlockScan<int, kCompactThreads>;

__host__ __device__ constexpr int64_t align16(int64_t x) { return (x + 15) & ~int64_t{15}; }

// Byte offsets of the pieces of the dynamic shared memory, each 16-byte aligned (the
// buffer itself is declared as uint4). Host and device compute it with the same code.
struct CompactLayout {
  int64_t src_of;    // int[kCompactThreads]
  int64_t stage[4];  // tile rows of each buffer
  int64_t total;
};

__host__ __device__ inline CompactLayout compact_layout(int64_t tile, const int64_t* row_bytes) {
  CompactLayout l{};
  int64_t off = kScanBytes;  // the scan's storage comes first, at offset 0
  l.src_of = off;
  off += align16(sizeof(int) * kCompactThreads);
  for (int b = 0; b < 4; ++b) {
    l.stage[b] = off;
    off += align16(tile * row_bytes[b]);
  }
  l.total = off;
  return l;
}

// Kept row q of the tile: from its slot in the store to row q of the staging buffer.
struct GatherRows {
  const char* segment;  // row 0 of the segment in this buffer
  char* stage;
  int64_t row_bytes;
  const int* src_of;
  int64_t kept;
  __device__ bool operator()(int q, char*& d, const char*& s) const {
    const int64_t from = src_of[q];
    if (from == kept + q) return false;  // already in place
    s = segment + from * row_bytes;
    d = stage + q * row_bytes;
    return true;
  }
};

// Staged row q to its destination kept + q.
struct ScatterRows {
  char* segment;
  const char* stage;
  int64_t row_bytes;
  const int* src_of;
  int64_t kept;
  __device__ bool operator()(int q, char*& d, const char*& s) const {
    if (src_of[q] == kept + q) return false;  // already in place
    s = stage + q * row_bytes;
    d = segment + (kept + q) * row_bytes;
    return true;
  }
};

// One block per segment. Buffers are read and written through plain pointers (no
// __restrict__, no __ldg): the same memory is written during the kernel.
__global__ void __launch_bounds__(kCompactThreads)
    compact_kernel(RowBuffers buf, const int64_t* start, int32_t* len, const bool* keep,
                   int tile) {
  static_assert(sizeof(CompactScan::TempStorage) <= kScanBytes, "kScanBytes is too small");
  extern __shared__ uint4 smem_raw[];
  char* smem = reinterpret_cast<char*>(smem_raw);
  const CompactLayout layout = compact_layout(tile, buf.row_bytes);
  auto& scan_storage = *reinterpret_cast<CompactScan::TempStorage*>(smem);
  int* src_of = reinterpret_cast<int*>(smem + layout.src_of);

  const int64_t s = blockIdx.x;
  const int64_t first = start[s];
  const int64_t n = len[s];
  int64_t kept = 0;  // kept slots in the tiles before this one
  for (int64_t b = 0; b < n; b += tile) {
    const int64_t rows = min(static_cast<int64_t>(tile), n - b);
    const int64_t i = b + threadIdx.x;
    const int flag = (threadIdx.x < rows && keep[first + i]) ? 1 : 0;
    int q, tile_kept;
    CompactScan(scan_storage).ExclusiveSum(flag, q, tile_kept);
    if (flag) src_of[q] = static_cast<int>(i);
    __syncthreads();  // src_of is complete
    // Uniform over the block: nothing moves while every slot so far is kept.
    if (kept != b || tile_kept != rows) {
      for (int bi = 0; bi < 4; ++bi) {
        const int64_t rb = buf.row_bytes[bi];
        copy_rows(GatherRows{buf.base[bi] + first * rb, smem + layout.stage[bi], rb, src_of, kept},
                  tile_kept, rb, buf.width[bi]);
      }
      __syncthreads();  // every kept row of the tile has been read
      for (int bi = 0; bi < 4; ++bi) {
        const int64_t rb = buf.row_bytes[bi];
        copy_rows(ScatterRows{buf.base[bi] + first * rb, smem + layout.stage[bi], rb, src_of, kept},
                  tile_kept, rb, buf.width[bi]);
      }
    }
    kept += tile_kept;
    __syncthreads();  // staging, src_of and the scan storage are reused by the next tile
  }
  // Every thread has read len[s] above (and, for n > 0, passed a barrier since).
  __syncthreads();
  if (threadIdx.x == 0) len[s] = static_cast<int32_t>(kept);
}

}  // namespace

void relocate_cuda(const SlotBuffers& src, const SlotBuffers& dst, const at::Tensor& src_start,
                   const at::Tensor& dst_start, const at::Tensor& len, int64_t max_len) {
  const int64_t segments = len.numel();
  if (segments == 0 || max_len <= 0) return;
  const c10::cuda::CUDAGuard guard(src.k.device());
  RowBuffers from = rows_of(src);
  const RowBuffers to = rows_of(dst);
  for (int b = 0; b < 4; ++b) {
    from.width[b] = vec_width(from.row_bytes[b], {from.base[b], to.base[b]});
  }
  check_row_bytes(from.row_bytes[kK]);
  check_row_bytes(from.row_bytes[kScores]);
  const dim3 grid(static_cast<unsigned int>((max_len + kRelocateRows - 1) / kRelocateRows),
                  segment_grid(segments));
  relocate_kernel<<<grid, kRelocateThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      from, to, src_start.data_ptr<int64_t>(), dst_start.data_ptr<int64_t>(),
      len.data_ptr<int32_t>(), segments);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void append_cuda(const SlotBuffers& buf, const at::Tensor& start, const at::Tensor& len,
                 const at::Tensor& new_k, const at::Tensor& new_v, const at::Tensor& new_pos,
                 const at::Tensor& rank) {
  const c10::cuda::CUDAGuard guard(buf.k.device());
  const int64_t segments = new_k.size(0), n = new_k.size(1);
  const AppendSlot slot_of{start.data_ptr<int64_t>(), len.data_ptr<int32_t>(),
                           rank.defined() ? rank.data_ptr<int32_t>() : nullptr, n};
  launch_write_tokens(buf, new_k, new_v, new_pos, segments, n, slot_of);
}

void replace_cuda(const SlotBuffers& buf, const at::Tensor& start, const at::Tensor& slot,
                  const at::Tensor& new_k, const at::Tensor& new_v, const at::Tensor& new_pos) {
  const c10::cuda::CUDAGuard guard(buf.k.device());
  // One token per segment: new_k/new_v [S, D] read as [S, 1, D], new_pos [B] as [B, 1].
  const ReplaceSlot slot_of{start.data_ptr<int64_t>(), slot.data_ptr<int64_t>()};
  launch_write_tokens(buf, new_k, new_v, new_pos, new_k.size(0), 1, slot_of);
}

void compact_cuda(const SlotBuffers& buf, const at::Tensor& start, const at::Tensor& len,
                  const at::Tensor& keep) {
  const int64_t segments = len.numel();
  // With no slots (a fresh store) every length is already 0 and nothing moves.
  if (segments == 0 || buf.pos.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(buf.k.device());
  RowBuffers rows = rows_of(buf);
  int64_t row_total = 0;
  for (int b = 0; b < 4; ++b) {
    check_row_bytes(rows.row_bytes[b]);
    // The staging buffer is 16-byte aligned, so only the store's base counts.
    rows.width[b] = vec_width(rows.row_bytes[b], {rows.base[b]});
    row_total += rows.row_bytes[b];
  }
  // As many slots per tile as fit in 48 KiB (4 * 15: alignment padding of the pieces).
  // row_total >= 4: there are slots, so pos rows are 4 bytes.
  const int64_t fixed = compact_layout(0, rows.row_bytes).total + 4 * 15;
  int64_t tile = std::min<int64_t>(kCompactThreads, (kCompactSmemBudget - fixed) / row_total);
  int64_t smem = 0;
  if (tile >= 1) {
    smem = compact_layout(tile, rows.row_bytes).total;
  } else {
    // Rows over ~45 KiB (head_dim > 5000 in fp32): one slot per tile, with opt-in memory.
    tile = 1;
    smem = compact_layout(tile, rows.row_bytes).total;
    const int64_t optin = at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin;
    TORCH_CHECK_VALUE(smem <= optin, "compact: one slot (", row_total,
                      " bytes of K, V, pos and scores) does not fit in the device's shared memory (",
                      optin, " bytes)");
    C10_CUDA_CHECK(cudaFuncSetAttribute(compact_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  }
  compact_kernel<<<static_cast<unsigned int>(segments), kCompactThreads, static_cast<size_t>(smem),
                   at::cuda::getCurrentCUDAStream()>>>(rows, start.data_ptr<int64_t>(),
                                                       len.data_ptr<int32_t>(),
                                                       keep.data_ptr<bool>(), static_cast<int>(tile));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kvcache_ext::store
