// CUDA attention over the ragged store, flash-decoding style.
//
// The store is paged (store/paged_layout.h): token l of segment s is slot
// view.slot(s, l), its K, V and pos rows lie in that slot's page. Statistics and the raw
// logits are indexed by slot id ("slot layout", [capacity]).
//
// 1. attend_split: each segment's live tokens are cut into splits (sized on the host from
//    the store's host copy of the lengths, so no sync, in whole waves of the GPU's resident
//    blocks: attention_plan.h) and each block attends one split
//    for a tile of up to RB query rows. It walks the split in tiles of kTile tokens: the
//    ids and addresses of the pages a tile touches are staged in shared memory, the
//    logits of the tile go to shared memory, then an online softmax update (running max
//    m, sum l, rescaled partial output) per row. A lane reads 16-byte words of K and V
//    rows and keeps its slice of every query row in registers; K and V are read once per
//    row tile. Out: per split and row, m, l and the unnormalized output, all fp32.
// 2. merge (merge_states.h, FlashInfer's merge-states shape): each thread holds 4 elements
//    of D, a row's threads are one group and a block has several groups ("split lanes").
//    merge_segments: per (segment, group of rows), a segment of one split is a copy-out (a
//    row per lane); otherwise every lane folds its share of the splits and the lanes' states
//    are folded in lane order through shared memory. When a segment may have many splits
//    (batch 1 with few KV heads: hundreds to thousands), merge_runs first folds the long
//    segments' splits in runs, in place, so that both levels take about sqrt(splits) steps
//    (short segments are merged by merge_segments alone). Keeps
//    the final m and 1/l for the statistics; a foreign plan's rows are NaN.
// 3. slot_stats (only when statistics are asked for): attend_split also wrote every raw
//    logit to a [rows, capacity] buffer; this pass turns them into probabilities with the
//    final m and l and writes them per slot (stores in a single pass; passes over query
//    chunks add up). Writing the logits costs 4 bytes per row and
//    slot (G * 4 bytes per slot in decode, 3% of the 512 bytes of K+V at D = 128, bf16);
//    recomputing them instead would read K a second time. Block prefill with statistics
//    runs in passes over chunks of queries so that this buffer stays under 256 MiB.
//
// The plan of splits (attention_plan, ops.h) is built on the host from the store's host copy
// of the lengths and copied up without a sync, once per step and layer; the run (the
// attention_run op) then takes it as a tensor, which keeps the run capturable in a CUDA graph.
// A stale plan (other lengths) gives the same result, a foreign one (other segments) NaN
// rows: attention/attention_plan.h says how, without a host sync.
//
// Logits are kept in base 2 (q is pre-scaled by scale * log2(e)), so exp2f does the softmax.
//
// Int8 pages (store/quantize.h) take the same kernels with E = int8_t for the K and V rows
// while q and the output keep their float type T: a lane widens its int8 words to floats,
// each token's K scale multiplies its logit and its V scale its weight, in float32 as the
// CPU kernel does. The tensor-core kernels widen int8 pages themselves (tc_common.cuh).
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention/attention_kernels.h"
#include "attention/attention_plan.h"
#include "attention/cuda_head_dims.h"
#include "attention/decode_tc.h"
#include "attention/merge_states.h"
#include "attention/split_args.h"
#include "common/occupancy.h"

namespace kvcache_ext::attention {

namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kTile = kPlanTile;  // slots whose logits sit in shared memory at once
constexpr int kUnroll = 4;     // K or V rows a lane has in flight
constexpr int kMaxRows = 4;    // query rows per block: RB is 1, 2 or 4 (more rows: more
                               // blocks on the same split, which meet in L2)
constexpr float kNegInf = -INFINITY;

// ---------------------------------------------------------------------------------------
// 16-byte words to floats

// The 16-bit halves of a 32-bit word, low first (the element at the lower address).
__device__ inline uint16_t low_half(uint32_t x) { return static_cast<uint16_t>(x & 0xffffu); }
__device__ inline uint16_t high_half(uint32_t x) { return static_cast<uint16_t>(x >> 16); }

template <typename T>
__device__ inline void word_to_float(const uint4& w, float* out);

template <>
__device__ inline void word_to_float<float>(const uint4& w, float* out) {
  out[0] = __uint_as_float(w.x);
  out[1] = __uint_as_float(w.y);
  out[2] = __uint_as_float(w.z);
  out[3] = __uint_as_float(w.w);
}

// fp16 and bf16: the word's 16-bit elements are taken as integers and converted by c10's
// types (from_bits), not by reading the word through a pointer of another type.
template <typename T>
__device__ inline void halves_to_float(const uint4& w, float* out) {
  const uint32_t parts[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    out[2 * j] = static_cast<float>(T(low_half(parts[j]), T::from_bits()));
    out[2 * j + 1] = static_cast<float>(T(high_half(parts[j]), T::from_bits()));
  }
}

template <>
__device__ inline void word_to_float<at::Half>(const uint4& w, float* out) {
  halves_to_float<at::Half>(w, out);
}

template <>
__device__ inline void word_to_float<at::BFloat16>(const uint4& w, float* out) {
  halves_to_float<at::BFloat16>(w, out);
}

// int8 (quantized pages): the word's 16 bytes, lowest address first, as the integers they hold.
template <>
__device__ inline void word_to_float<int8_t>(const uint4& w, float* out) {
  const uint32_t parts[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int b = 0; b < 4; ++b) out[4 * j + b] = static_cast<float>(static_cast<int8_t>(parts[j] >> (8 * b)));
}

constexpr int pow2_at_least(int x) {
  int p = 1;
  while (p < x) p *= 2;
  return p;
}

// How a warp covers a row of D elements of T (the pages' type: int8 for quantized pages): LPS lanes per slot (a power of two, for the
// xor reductions), kWords 16-byte words per lane, SPW slots per warp side by side. When the
// row's words are not a power of two (D = 80, 96, 112, 192 in fp16/bf16; 80, 96, 112, 192
// in fp32) the row is padded to LPS * kWords words: lanes at or past kActive hold no part of
// it (they load nothing and compute with zeros).
template <typename T, int D>
struct RowLayout {
  static constexpr int kRowWords = D * static_cast<int>(sizeof(T)) / 16;
  static constexpr int LPS = pow2_at_least(kRowWords) < 32 ? pow2_at_least(kRowWords) : 32;
  static constexpr int kWords = (kRowWords + LPS - 1) / LPS;
  static constexpr int kPerWord = 16 / static_cast<int>(sizeof(T));
  static constexpr int EPL = kWords * kPerWord;  // elements per lane
  static constexpr int kActive = kRowWords / kWords;  // lanes holding a part of the row
  static constexpr int kPadD = LPS * EPL;         // D rounded up to the lanes' cover
  static constexpr int SPW = 32 / LPS;
  static constexpr int kGroups = kWarps * SPW;  // slot groups per block
  static_assert(kRowWords * 16 == D * static_cast<int>(sizeof(T)) && kRowWords % kWords == 0,
                "unsupported head_dim");
  static_assert((LPS & (LPS - 1)) == 0, "the xor reductions need a power-of-two LPS");
};

// Loads this lane's slice of a row of D elements (16-byte aligned: see ragged_attention_cuda).
template <typename T, int D>
__device__ inline void load_slice(const T* row, int lane_in_group,
                                  uint4 (&w)[RowLayout<T, D>::kWords]) {
  using L = RowLayout<T, D>;
  const uint4* p = reinterpret_cast<const uint4*>(row + lane_in_group * L::EPL);
#pragma unroll
  for (int i = 0; i < L::kWords; ++i) w[i] = __ldg(p + i);
}

template <typename T, int D>
__device__ inline void slice_to_float(const uint4 (&w)[RowLayout<T, D>::kWords],
                                      float (&out)[RowLayout<T, D>::EPL]) {
  using L = RowLayout<T, D>;
#pragma unroll
  for (int i = 0; i < L::kWords; ++i) word_to_float<T>(w[i], out + i * L::kPerWord);
}

// ---------------------------------------------------------------------------------------
// Kernel parameters

// SplitArgs (split_args.h) with the scalar kernels' views of it.
template <typename T>
struct Params : SplitArgs {
  __device__ const T* queries() const { return static_cast<const T*>(q); }
  // Row of q and out ([B, Hq, n_total, D] as rows of D) of segment s's row r = g * n + i.
  __device__ int64_t q_row(int64_t s, int r) const {
    return (s * groups + r / n) * n_total + i0 + r % n;
  }
  __device__ int32_t query_pos(int b, int r) const { return q_pos[b * n_total + i0 + r % n]; }
};

// The pages a tile of tokens [t0, t0 + tile_len) of a segment touches (tile_len <= kTile):
// entries first_chunk .. of the segment's page table, first_chunk = t0 >> shift. Their ids
// and addresses sit in shared memory (staged once per tile), so finding token t0 + j's row
// costs no global load. There are at most kTile of them: tile_len for pages of one token,
// at most kTile / 2 + 1 for larger pages. T is the pages' element type (int8_t: quantized
// pages, whose scale rows k_scale and v_scale read).
template <typename T, int D>
struct TileRows {
  static constexpr int64_t kRowBytes = D * static_cast<int64_t>(sizeof(T));  // K and V rows
  const int32_t* page;      // [chunks] page ids (shared memory)
  const char* const* base;  // [chunks] page addresses (shared memory)
  int64_t t0, first_chunk, mask;
  int64_t off_k, off_v, off_pos, off_scale;
  int shift;

  __device__ int chunk(int j) const { return static_cast<int>(((t0 + j) >> shift) - first_chunk); }
  __device__ int64_t in_page(int j) const { return (t0 + j) & mask; }
  __device__ const T* k(int j) const {
    return reinterpret_cast<const T*>(base[chunk(j)] + off_k + in_page(j) * kRowBytes);
  }
  __device__ const T* v(int j) const {
    return reinterpret_cast<const T*>(base[chunk(j)] + off_v + in_page(j) * kRowBytes);
  }
  __device__ int32_t pos(int j) const {
    return *reinterpret_cast<const int32_t*>(base[chunk(j)] + off_pos + in_page(j) * 4);
  }
  // The K (part 0) or V (part 1) scale of token t0 + j, as a float (store/paged_layout.h).
  __device__ float scale(int j, int part) const {
    const auto* row = reinterpret_cast<const c10::Half*>(base[chunk(j)] + off_scale +
                                                         in_page(j) * store::kScaleRowBytes);
    return static_cast<float>(row[part]);
  }
  __device__ int64_t slot(int j) const {
    return (static_cast<int64_t>(page[chunk(j)]) << shift) | in_page(j);
  }
};

// ---------------------------------------------------------------------------------------
// 1. attend_split: block w * row_tiles + t attends split w for rows [t * RB, t * RB + RB).
// The row tiles of a split are neighbours in the grid, so they read its K and V together
// and all but the first find them in L2. T: q and the output; E: the pages' K and V (T, or
// int8_t for quantized pages).

template <typename T, typename E, int D, int RB>
__global__ void __launch_bounds__(kThreads) attend_split(Params<T> p) {
  using L = RowLayout<E, D>;
  constexpr bool kQuantized = std::is_same_v<E, int8_t>;
  __shared__ float tile_p[RB][kTile];         // logits, then probabilities, of a tile
  __shared__ float row_m[RB], row_l[RB], row_alpha[RB];
  __shared__ float reduce[L::kGroups][RB][L::kPadD];  // partial outputs of the slot groups
  __shared__ int32_t chunk_page[kTile];        // the pages of a tile (TileRows)
  __shared__ const char* chunk_base[kTile];

  if (*p.plan_segments != p.segments) return;  // a foreign plan: merge_segments writes NaN
  const int64_t w = blockIdx.x / p.row_tiles;
  const int s = p.splits[w].segment;
  // The live tokens of s that this split covers, whatever lengths the plan was made for.
  const Split split = effective_split(p.splits[w], static_cast<int32_t>(w), p.seg_first_split, p.len[s]);
  const int b = s / p.heads;
  const int row0 = static_cast<int>(blockIdx.x % p.row_tiles) * RB;
  const int nrows = min(RB, p.rows - row0);
  const int32_t* table = p.view.table + static_cast<int64_t>(s) * p.view.width;  // s's pages

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = warp * L::SPW + lane / L::LPS;  // slot group of this lane
  const int lane_in_group = lane % L::LPS;
  const bool active = lane_in_group < L::kActive;  // holds a part of the row (RowLayout)

  // This lane's slice of every query row, pre-scaled (zeros on a lane past the row).
  float q[RB][L::EPL];
  int32_t q_pos[RB];
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    const int row = row0 + min(r, nrows - 1);  // rows past the end repeat the last one
    const T* src = p.queries() + p.q_row(s, row) * D + lane_in_group * L::EPL;
#pragma unroll
    for (int e = 0; e < L::EPL; ++e) q[r][e] = active ? static_cast<float>(src[e]) * p.scale_log2 : 0.f;
    q_pos[r] = p.q_pos ? p.query_pos(b, row) : INT32_MAX;
  }
  float acc[RB][L::EPL];
#pragma unroll
  for (int r = 0; r < RB; ++r)
#pragma unroll
    for (int e = 0; e < L::EPL; ++e) acc[r][e] = 0.f;
  if (threadIdx.x < RB) {
    row_m[threadIdx.x] = kNegInf;
    row_l[threadIdx.x] = 0.f;
  }

  TileRows<E, D> tile;
  tile.page = chunk_page;
  tile.base = chunk_base;
  tile.shift = p.view.shift;
  tile.mask = p.view.page_size() - 1;
  tile.off_k = p.view.record.offset[store::kK];
  tile.off_v = p.view.record.offset[store::kV];
  tile.off_pos = p.view.record.offset[store::kPos];
  tile.off_scale = p.view.record.offset[store::kScale];

  for (int t0 = split.begin; t0 < split.end; t0 += kTile) {
    const int tile_len = min(kTile, split.end - t0);

    // The tile's pages. The previous tile's last barrier has ordered every read of them.
    tile.t0 = t0;
    tile.first_chunk = tile.t0 >> tile.shift;
    const int chunks = tile.chunk(tile_len - 1) + 1;
    for (int c = threadIdx.x; c < chunks; c += kThreads) {
      const int32_t page = table[tile.first_chunk + c];
      chunk_page[c] = page;
      chunk_base[c] = reinterpret_cast<const char*>(p.view.page_base[page]);
    }
    __syncthreads();

    // Logits of the tile. Every lane of a warp takes part in the shuffles, so the loop
    // bound is uniform over the warp and slots past the tile are computed as zeros.
    for (int j0 = warp * L::SPW; j0 < tile_len; j0 += L::kGroups * kUnroll) {
      uint4 words[kUnroll][L::kWords];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = j0 + u * L::kGroups + lane / L::LPS;
        if (j < tile_len && active) load_slice<E, D>(tile.k(j), lane_in_group, words[u]);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = j0 + u * L::kGroups + lane / L::LPS;
        float kf[L::EPL];
        if (j < tile_len && active) {
          slice_to_float<E, D>(words[u], kf);
        } else {
#pragma unroll
          for (int e = 0; e < L::EPL; ++e) kf[e] = 0.f;
        }
        float dot[RB];
#pragma unroll
        for (int r = 0; r < RB; ++r) {
          dot[r] = 0.f;
#pragma unroll
          for (int e = 0; e < L::EPL; ++e) dot[r] = fmaf(q[r][e], kf[e], dot[r]);
#pragma unroll
          for (int off = L::LPS / 2; off > 0; off /= 2)
            dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], off);
        }
        if (j < tile_len && lane_in_group == 0) {
          const int32_t slot_pos = p.q_pos ? tile.pos(j) : 0;
          const float k_scale = kQuantized ? tile.scale(j, 0) : 1.f;
#pragma unroll
          for (int r = 0; r < RB; ++r) tile_p[r][j] = slot_pos <= q_pos[r] ? dot[r] * k_scale : kNegInf;
        }
      }
    }
    __syncthreads();

    // Online softmax update, one warp per row. With statistics the warp first stores the
    // row's raw logits, lane j to token j: consecutive tokens of a page are consecutive
    // slots, so the stores coalesce.
    for (int r = warp; r < RB; r += kWarps) {
      if (p.logits && r < nrows) {
        float* logits_row = p.logits + (row0 + r) * p.capacity;
        for (int j = lane; j < tile_len; j += 32) logits_row[tile.slot(j)] = tile_p[r][j];
      }
      float tile_max = kNegInf;
      for (int j = lane; j < tile_len; j += 32) tile_max = fmaxf(tile_max, tile_p[r][j]);
#pragma unroll
      for (int off = 16; off > 0; off /= 2)
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
      const float m_old = row_m[r];
      const float m_new = fmaxf(m_old, tile_max);
      __syncwarp();  // every lane has read row_m[r] before lane 0 rewrites it
      float tile_sum = 0.f;
      for (int j = lane; j < tile_len; j += 32) {
        // A row that has seen no visible slot yet (m_new = -inf) gets probability 0.
        const float prob = m_new == kNegInf ? 0.f : exp2f(tile_p[r][j] - m_new);
        tile_p[r][j] = prob;
        tile_sum += prob;
      }
#pragma unroll
      for (int off = 16; off > 0; off /= 2) tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, off);
      if (lane == 0) {
        const float alpha = m_new == kNegInf ? 1.f : exp2f(m_old - m_new);
        row_alpha[r] = alpha;
        row_l[r] = row_l[r] * alpha + tile_sum;
        row_m[r] = m_new;
      }
    }
    __syncthreads();

    // Weighted sum of the tile's V rows into this lane's partial output.
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      const float alpha = row_alpha[r];
#pragma unroll
      for (int e = 0; e < L::EPL; ++e) acc[r][e] *= alpha;
    }
    for (int j0 = group; j0 < tile_len; j0 += L::kGroups * kUnroll) {
      uint4 words[kUnroll][L::kWords];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = j0 + u * L::kGroups;
        if (j < tile_len && active) load_slice<E, D>(tile.v(j), lane_in_group, words[u]);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = j0 + u * L::kGroups;
        if (j >= tile_len || !active) continue;  // no shuffles here: lanes may leave
        float vf[L::EPL];
        slice_to_float<E, D>(words[u], vf);
        const float v_scale = kQuantized ? tile.scale(j, 1) : 1.f;
#pragma unroll
        for (int r = 0; r < RB; ++r) {
          const float prob = tile_p[r][j] * v_scale;
#pragma unroll
          for (int e = 0; e < L::EPL; ++e) acc[r][e] = fmaf(prob, vf[e], acc[r][e]);
        }
      }
    }
    __syncthreads();  // tile_p and the tile's pages are overwritten by the next tile
  }

  // Sum the slot groups' partial outputs in a fixed order (deterministic).
#pragma unroll
  for (int r = 0; r < RB; ++r)
#pragma unroll
    for (int e = 0; e < L::EPL; ++e) reduce[group][r][lane_in_group * L::EPL + e] = acc[r][e];
  __syncthreads();
  const int64_t part_row0 = w * p.rows + row0;
  for (int idx = threadIdx.x; idx < nrows * D; idx += kThreads) {
    const int r = idx / D, d = idx % D;
    float sum = 0.f;
#pragma unroll
    for (int g = 0; g < L::kGroups; ++g) sum += reduce[g][r][d];
    p.part_o[(part_row0 + r) * D + d] = sum;
  }
  if (threadIdx.x < nrows) {
    p.part_m[part_row0 + threadIdx.x] = row_m[threadIdx.x];
    p.part_l[part_row0 + threadIdx.x] = row_l[threadIdx.x];
  }
}

// ---------------------------------------------------------------------------------------
// 2. merge (merge_states.h): each split's (m, l, o) of a row are folded into the output.
// A thread holds kMergeVec elements of D (one 16-byte word of part_o); kLanesD threads cover
// a row and kLanes rows of threads ("split lanes") share a block.

constexpr int kMergeThreads = 128;
constexpr int kMergeVec = 4;

template <int D>
struct MergeLayout {
  static constexpr int kLanesD = D / kMergeVec;
  static constexpr int kLanes = kMergeThreads / kLanesD;
  static constexpr int kThreads = kLanes * kLanesD;
  static_assert(D % kMergeVec == 0 && kLanes >= 1, "unsupported head_dim");
};

using MergeVec = MergeState<kMergeVec>;

// part_o of (split w, row r), this thread's word; 16-byte aligned (D % 4 == 0).
__device__ inline float4* part_word(float* part_o, int64_t pr, int D, int t) {
  return reinterpret_cast<float4*>(part_o + pr * D) + t;
}

// Level 1, only when a segment may have many splits (merge_run_length): the plan's splits are
// cut into runs of `run` consecutive ones, and the splits of each long segment (more than
// `run` splits: merge_two_levels) in a run are folded in order into the slot of the first of
// them (its piece head): o in place in part_o (a thread reads and writes only its own word),
// m and l into run_m / run_l. A long segment cannot lie inside a run, so it holds the run's
// first or last split: a run has at most two pieces. No barrier: one group of kLanesD
// threads per (run, row).
template <typename T, int D>
__global__ void __launch_bounds__(kMergeThreads)
    merge_runs(Params<T> p, int64_t W, int run, float* run_m, float* run_l) {
  using ML = MergeLayout<D>;
  if (*p.plan_segments != p.segments) return;  // merge_segments writes the NaN rows
  const int64_t runs = (W + run - 1) / run;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * ML::kLanes + threadIdx.x / ML::kLanesD;
  if (item >= runs * p.rows) return;
  const int r = static_cast<int>(item / runs);
  const int64_t w0 = (item % runs) * run, w1 = min(w0 + run, W);
  const int t = threadIdx.x % ML::kLanesD;

  for (int side = 0; side < 2; ++side) {
    const int32_t seg = p.splits[side == 0 ? w0 : w1 - 1].segment;
    if (side == 1 && seg == p.splits[w0].segment) break;  // one segment: side 0 took the run
    const int32_t first = p.seg_first_split[seg], last = p.seg_first_split[seg + 1];
    if (!merge_two_levels(first, last, run)) continue;
    const int64_t head = max(static_cast<int64_t>(first), w0);
    const int64_t end = min(static_cast<int64_t>(last), w1);
    MergeVec st = MergeVec::empty();
    // Four splits' words are loaded before any is merged (latency); the head, written last,
    // has been read by then.
    constexpr int kBatch = 4;
    for (int64_t wb = head; wb < end; wb += kBatch) {
      float m[kBatch], l[kBatch];
      float4 o[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (wb + u < end) {
          const int64_t pr = (wb + u) * p.rows + r;
          m[u] = p.part_m[pr];
          l[u] = p.part_l[pr];
          o[u] = *part_word(p.part_o, pr, D, t);
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (wb + u >= end) break;
        const float ov[kMergeVec] = {o[u].x, o[u].y, o[u].z, o[u].w};
        st.merge(m[u], l[u], ov);
      }
    }
    const int64_t pr = head * p.rows + r;
    *part_word(p.part_o, pr, D, t) = make_float4(st.o[0], st.o[1], st.o[2], st.o[3]);
    if (t == 0) {
      run_m[pr] = st.m;
      run_l[pr] = st.l;
    }
  }
}

// Level 2: block (s, row group) writes rows [group * kLanes, + kLanes) of segment s. A segment
// of one split is a copy-out, one row per split lane. Otherwise the rows are merged one after
// another by the whole block: lane y folds pieces y, y + kLanes, ... in order (a long
// segment's pieces are level 1's, a short one's its splits), then lane 0 folds the lanes'
// states in lane order (a fixed order: deterministic). Also keeps the final m and 1/l for
// slot_stats, and writes NaN rows for a plan of another store.
template <typename T, int D>
__global__ void __launch_bounds__(kMergeThreads)
    merge_segments(Params<T> p, int run, const float* run_m, const float* run_l, T* out,
                   float* final_m, float* final_inv_l) {
  using ML = MergeLayout<D>;
  __shared__ float lane_m[ML::kLanes], lane_l[ML::kLanes];
  __shared__ float4 lane_o[ML::kLanes][ML::kLanesD];

  const int row_groups = (p.rows + ML::kLanes - 1) / ML::kLanes;
  const int64_t s = blockIdx.x / row_groups;
  const int row0 = static_cast<int>(blockIdx.x % row_groups) * ML::kLanes;
  const int y = threadIdx.x / ML::kLanesD, t = threadIdx.x % ML::kLanesD;
  const auto write_row = [&](int r, const MergeVec& st) {
    T* o = out + p.q_row(s, r) * D + t * kMergeVec;
#pragma unroll
    for (int e = 0; e < kMergeVec; ++e) o[e] = static_cast<T>(st.out(e));
    if (final_m && t == 0) {
      final_m[s * p.rows + r] = st.m;
      final_inv_l[s * p.rows + r] = st.inv_l();
    }
  };
  // Pieces' m and l: level 1's for a long segment, the splits' own otherwise (set below).
  const float* piece_m = p.part_m;
  const float* piece_l = p.part_l;
  const auto load = [&](int64_t w, int r, MergeVec& st) {  // piece w's state of row r
    const int64_t pr = w * p.rows + r;
    const float4 o = *part_word(p.part_o, pr, D, t);
    const float ov[kMergeVec] = {o.x, o.y, o.z, o.w};
    st.merge(piece_m[pr], piece_l[pr], ov);
  };

  if (*p.plan_segments != p.segments) {  // a plan of another store: refused, loudly
    const int r = row0 + y;
    if (r >= p.rows) return;
    MergeVec st = MergeVec::empty();
    st.m = st.l = NAN;
    for (int e = 0; e < kMergeVec; ++e) st.o[e] = NAN;
    write_row(r, st);
    if (final_m && t == 0) final_inv_l[s * p.rows + r] = NAN;
    return;
  }
  const int first = p.seg_first_split[s], last = p.seg_first_split[s + 1];
  const bool two_levels = merge_two_levels(first, last, run);
  const int step = two_levels ? run : 1;
  if (two_levels) {
    piece_m = run_m;
    piece_l = run_l;
  }
  const int pieces = merge_pieces(first, last, step);
  if (pieces == 1) {  // one split; the same for the whole block: no barrier is skipped
    const int r = row0 + y;
    if (r >= p.rows) return;
    MergeVec st = MergeVec::empty();
    load(first, r, st);
    write_row(r, st);
    return;
  }
  for (int i = 0; i < ML::kLanes && row0 + i < p.rows; ++i) {
    const int r = row0 + i;
    MergeVec st = MergeVec::empty();
    // Four pieces' words are loaded before any is merged (latency), then folded in order.
    constexpr int kBatch = 4;
    for (int j0 = y; j0 < pieces; j0 += kBatch * ML::kLanes) {
      float m[kBatch], l[kBatch];
      float4 o[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int j = j0 + u * ML::kLanes;
        if (j < pieces) {
          const int64_t pr = static_cast<int64_t>(merge_piece_head(first, step, j)) * p.rows + r;
          m[u] = piece_m[pr];
          l[u] = piece_l[pr];
          o[u] = *part_word(p.part_o, pr, D, t);
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (j0 + u * ML::kLanes >= pieces) break;
        const float ov[kMergeVec] = {o[u].x, o[u].y, o[u].z, o[u].w};
        st.merge(m[u], l[u], ov);
      }
    }
    lane_o[y][t] = make_float4(st.o[0], st.o[1], st.o[2], st.o[3]);
    if (t == 0) {
      lane_m[y] = st.m;
      lane_l[y] = st.l;
    }
    __syncthreads();
    if (y == 0) {
      for (int k = 1; k < ML::kLanes; ++k) {
        const float4 o = lane_o[k][t];
        const float ov[kMergeVec] = {o.x, o.y, o.z, o.w};
        st.merge(lane_m[k], lane_l[k], ov);
      }
      write_row(r, st);
    }
    __syncthreads();  // the lanes' states are overwritten by the next row
  }
}

// ---------------------------------------------------------------------------------------
// 3. slot_stats: block w turns the logits of split w's tokens into the statistics of this
// pass's queries and writes them to the tokens' slots. Every live slot is the token of one
// split (effective_split), so one thread owns it: a single pass stores its values (the op
// zero-filled the statistics, so slots no live token holds stay 0); passes over query
// chunks (block prefill with a logits buffer too small for all queries) add up.

struct StatsOut {
  const float* final_m;      // [S, rows]
  const float* final_inv_l;  // [S, rows]
  float* mass;               // [capacity] or null
  float* last;               // [capacity, G] or null
  float* sum_sq;             // [capacity] or null
  int32_t* count;            // [capacity] or null
  bool accumulate;           // += (one of several passes) rather than = (the only pass)
};

template <typename V>
__device__ inline void put(V* dst, V value, bool accumulate) {
  *dst = accumulate ? *dst + value : value;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) slot_stats(Params<T> p, StatsOut st) {
  if (*p.plan_segments != p.segments) return;
  const int s = p.splits[blockIdx.x].segment;
  const Split split = effective_split(p.splits[blockIdx.x], static_cast<int32_t>(blockIdx.x),
                                      p.seg_first_split, p.len[s]);
  const int b = s / p.heads;
  const float* m = st.final_m + static_cast<int64_t>(s) * p.rows;
  const float* inv_l = st.final_inv_l + static_cast<int64_t>(s) * p.rows;
  const int G = p.groups, n = p.n;
  for (int j = split.begin + threadIdx.x; j < split.end; j += kThreads) {
    const int64_t slot = p.view.slot(s, j);
    const int32_t slot_pos =
        p.q_pos ? *reinterpret_cast<const int32_t*>(p.view.row(store::kPos, slot)) : 0;
    float slot_mass = 0.f, slot_sq = 0.f;
    int32_t seen = 0;
    for (int i = 0; i < n; ++i) {
      float group_mass = 0.f;
      for (int g = 0; g < G; ++g) {
        const int r = g * n + i;
        const float logit = p.logits[r * p.capacity + slot];
        const float prob = (logit == kNegInf || inv_l[r] == 0.f) ? 0.f : exp2f(logit - m[r]) * inv_l[r];
        group_mass += prob;
        if (st.last && p.i0 + i == p.n_total - 1) st.last[slot * G + g] = prob;
      }
      slot_mass += group_mass;
      const float mean = group_mass / static_cast<float>(G);
      slot_sq += mean * mean;
      seen += (!p.q_pos || slot_pos <= p.query_pos(b, i)) ? 1 : 0;
    }
    if (st.mass) put(st.mass + slot, slot_mass, st.accumulate);
    if (st.sum_sq) put(st.sum_sq + slot, slot_sq, st.accumulate);
    if (st.count) put(st.count + slot, seen, st.accumulate);
  }
}

// ---------------------------------------------------------------------------------------
// Host side

int rows_per_block(int64_t rows) {
  int rb = 1;
  while (rb < rows && rb < kMaxRows) rb *= 2;
  return rb;
}

// Blocks of attend_split an SM holds at once, for the waves of plan_splits. The plan does
// not know the call's dtype and head_dim, so it takes bf16 at head_dim 128, the commonest; for
// another instantiation that holds a different number of blocks per SM the waves are only
// approximately whole.
template <int RB>
int attend_blocks_per_sm(int device) {
  return std::max(resident_blocks_per_sm(attend_split<at::BFloat16, at::BFloat16, 128, RB>, device, kThreads), 1);
}

// Whether a call of at most `rows` query rows per KV head a pass goes to the tensor-core decode
// kernel (decode_tc.h) when T and D allow it: switched on, and few enough rows. The plan asks
// the same (without T and D) to size its splits for that kernel.
bool decode_tc_rows(int64_t rows) { return rows <= kDecodeTcMaxRows && decode_tc_enabled(); }

// The plan of attention_plan (ops.h) on the device (layout: attention/attention_plan.h); one
// host-to-device copy from pinned memory, no sync.
at::Tensor make_plan(const std::vector<int32_t>& len, int64_t rows, const c10::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  const int index = c10::cuda::current_device();
  // The tensor-core decode takes every row of a split in one block: one row tile.
  const bool tc = decode_tc_rows(rows);
  const int rb = tc ? static_cast<int>(rows) : rows_per_block(rows);
  const int64_t row_tiles = (rows + rb - 1) / rb;
  const int resident = tc        ? decode_tc_blocks_per_sm(index)
                       : rb == 1 ? attend_blocks_per_sm<1>(index)
                       : rb == 2 ? attend_blocks_per_sm<2>(index)
                                 : attend_blocks_per_sm<4>(index);
  std::vector<Split> splits;
  std::vector<int32_t> first;
  plan_splits(len, row_tiles, at::cuda::getCurrentDeviceProperties()->multiProcessorCount, splits,
              first, resident);
  const std::vector<int32_t> words = plan_words(splits, first);
  at::Tensor plan_host = at::empty({static_cast<int64_t>(words.size())},
                                   at::TensorOptions().dtype(at::kInt).pinned_memory(true));
  std::memcpy(plan_host.data_ptr<int32_t>(), words.data(), words.size() * sizeof(int32_t));
  // The caching host allocator keeps the pinned buffer until the copy has run.
  return plan_host.to(device, at::kInt, /*non_blocking=*/true);
}

template <typename T, typename E, int D>
void launch_attend(int rb, const Params<T>& prm, int64_t blocks, cudaStream_t stream) {
  const auto grid = static_cast<unsigned int>(blocks);
  switch (rb) {
    case 1: attend_split<T, E, D, 1><<<grid, kThreads, 0, stream>>>(prm); break;
    case 2: attend_split<T, E, D, 2><<<grid, kThreads, 0, stream>>>(prm); break;
    default: attend_split<T, E, D, 4><<<grid, kThreads, 0, stream>>>(prm); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// With statistics the raw logits of a pass are kept ([G * queries, capacity] floats): block
// prefill runs in passes over chunks of queries so that this stays under the bound.
constexpr int64_t kMaxLogitsBytes = int64_t{256} << 20;

// T: q and the output; E: the pages' K and V (T, or int8_t for quantized pages).
template <typename T, typename E, int D>
void run(const Problem& p, Result& r) {
  const int64_t n_total = p.q.size(2);
  const int64_t S = p.segments;
  const int64_t capacity = p.capacity;
  TORCH_INTERNAL_ASSERT(p.plan.defined() ||
                        (p.len_host && static_cast<int64_t>(p.len_host->size()) == S));
  // 16-byte loads of K and V rows: D * sizeof(E) is a multiple of 16 (RowLayout), and
  // every row of a part starts at page base + offset + row * row bytes, where page bases
  // are 16-byte aligned (slab allocations of records that are multiples of 16 bytes).
  const store::PageRecord& rec = p.view.record;
  TORCH_INTERNAL_ASSERT(rec.row_bytes[store::kK] == D * static_cast<int64_t>(sizeof(E)) &&
                            rec.quantized() == (std::is_same_v<E, int8_t>) &&
                            rec.row_bytes[store::kV] == rec.row_bytes[store::kK] &&
                            rec.offset[store::kK] % 16 == 0 && rec.offset[store::kV] % 16 == 0 &&
                            rec.offset[store::kPos] % 4 == 0 && rec.bytes % 16 == 0,
                        "the CUDA attention kernel needs 16-byte aligned K and V rows of ", D,
                        " elements");
  const bool stats = r.mass.defined() || r.last.defined() || r.sum_sq.defined() || r.count.defined();
  const int64_t per_query_bytes = p.groups * std::max<int64_t>(capacity, 1) * 4;
  const int64_t chunk =
      stats ? std::clamp<int64_t>(kMaxLogitsBytes / per_query_bytes, 1, n_total) : n_total;
  const int64_t max_rows = p.groups * chunk;
  TORCH_CHECK_VALUE(max_rows <= INT32_MAX / 2, "too many query rows per KV head: ", max_rows);
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto f32 = p.q.options().dtype(at::kFloat);

  // The plan (attention_plan), made here when the caller brought none. Every pass over a
  // chunk of queries uses it: its splits are sized for the chunk's rows.
  const at::Tensor plan = p.plan.defined() ? p.plan : make_plan(*p.len_host, max_rows, p.q.device());
  const int64_t W = plan_splits_count(plan.numel(), S);
  TORCH_CHECK_VALUE(W >= 0, "the attention plan (", plan.numel(), " words) does not fit ", S,
                    " segments: make it with attention_plan");

  // The tensor-core decode (decode_tc.h) for 16-bit q with K and V of T or int8, head_dim 64
  // or 128 and at most 16 rows a pass, when switched on; it writes the logits buffer as
  // attend_split does.
  constexpr bool kQ8 = std::is_same_v<E, int8_t>;
  constexpr bool kTcTypes = sizeof(T) == 2 && (std::is_same_v<E, T> || kQ8) && (D == 64 || D == 128);
  const bool tc = kTcTypes && decode_tc_rows(max_rows);

  for (int64_t i0 = 0; i0 < n_total; i0 += chunk) {
    const int64_t n = std::min(chunk, n_total - i0);
    const int64_t rows = p.groups * n;
    const int rb = tc ? static_cast<int>(rows) : rows_per_block(rows);
    const int64_t row_tiles = (rows + rb - 1) / rb;
    // Grid x of attend_split and the merge (at most kMergeThreads / 4 rows per block, and at
    // most W * rows groups of merge_runs); slot_stats has W blocks.
    TORCH_CHECK_VALUE(W * row_tiles <= INT32_MAX, "attention grid too large: ", W, " splits x ",
                      row_tiles, " row tiles");
    TORCH_CHECK_VALUE(std::max(S, W) * rows <= INT32_MAX, "attention grid too large: ", S,
                      " segments x ", rows, " rows");

    at::Tensor logits = stats && W > 0 ? at::empty({rows, capacity}, f32) : at::Tensor();
    at::Tensor part_m = at::empty({W, rows}, f32), part_l = at::empty({W, rows}, f32);
    at::Tensor part_o = at::empty({W, rows, D}, f32);
    at::Tensor final_m = stats ? at::empty({S, rows}, f32) : at::Tensor();
    at::Tensor final_inv_l = stats ? at::empty({S, rows}, f32) : at::Tensor();

    Params<T> prm{split_args(p, plan, W)};
    prm.i0 = static_cast<int32_t>(i0);
    prm.n = static_cast<int32_t>(n);
    prm.rows = static_cast<int32_t>(rows);
    prm.row_tiles = static_cast<int32_t>(row_tiles);
    prm.logits = logits.defined() ? logits.data_ptr<float>() : nullptr;
    prm.part_m = part_m.data_ptr<float>();
    prm.part_l = part_l.data_ptr<float>();
    prm.part_o = part_o.data_ptr<float>();

    if (tc) {
      if constexpr (kTcTypes) launch_decode_tc<T, D, kQ8>(prm, W, stream);
    } else if (W > 0) {
      launch_attend<T, E, D>(rb, prm, W * row_tiles, stream);
    }
    // The merge: level 1 only when some segment may have many splits (merge_states.h).
    using ML = MergeLayout<D>;
    const int run = merge_run_length(W, S, ML::kLanes);
    at::Tensor run_m = run > 1 ? at::empty({W, rows}, f32) : at::Tensor();
    at::Tensor run_l = run > 1 ? at::empty({W, rows}, f32) : at::Tensor();
    if (run > 1) {
      const int64_t groups = (W + run - 1) / run * rows;
      merge_runs<T, D><<<static_cast<unsigned int>((groups + ML::kLanes - 1) / ML::kLanes),
                         ML::kThreads, 0, stream>>>(prm, W, run, run_m.data_ptr<float>(),
                                                    run_l.data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (S > 0) {
      merge_segments<T, D><<<static_cast<unsigned int>(S * ((rows + ML::kLanes - 1) / ML::kLanes)),
                             ML::kThreads, 0, stream>>>(
          prm, run, run > 1 ? run_m.data_ptr<float>() : nullptr,
          run > 1 ? run_l.data_ptr<float>() : nullptr, r.out.data_ptr<T>(),
          stats ? final_m.data_ptr<float>() : nullptr, stats ? final_inv_l.data_ptr<float>() : nullptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (stats && W > 0) {
      StatsOut st;
      st.final_m = final_m.data_ptr<float>();
      st.final_inv_l = final_inv_l.data_ptr<float>();
      st.mass = r.mass.defined() ? r.mass.data_ptr<float>() : nullptr;
      st.last = r.last.defined() ? r.last.data_ptr<float>() : nullptr;
      st.sum_sq = r.sum_sq.defined() ? r.sum_sq.data_ptr<float>() : nullptr;
      st.count = r.count.defined() ? r.count.data_ptr<int32_t>() : nullptr;
      st.accumulate = chunk < n_total;
      slot_stats<T><<<static_cast<unsigned int>(W), kThreads, 0, stream>>>(prm, st);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
}

// Runs the instantiation for q's head_dim, one of Sizes; false when there is none.
template <typename T, typename E, int... Sizes>
bool run_sized(HeadDims<Sizes...>, const Problem& p, Result& r) {
  return ((p.q.size(3) == Sizes && (run<T, E, Sizes>(p, r), true)) || ...);
}

template <typename T>
void run_head_dim(const Problem& p, Result& r) {
  const bool found = p.view.record.quantized() ? run_sized<T, int8_t>(CudaHeadDims{}, p, r)
                                               : run_sized<T, T>(CudaHeadDims{}, p, r);
  TORCH_CHECK_VALUE(found, "the CUDA attention kernel supports head_dim ",
                    cuda_head_dims_text(), ", got ", p.q.size(3),
                    "; run this model's attention on the CPU or ask for the size");
}

}  // namespace

at::Tensor plan_cuda(const std::vector<int32_t>& len, int64_t rows, const c10::Device& device) {
  return make_plan(len, std::max<int64_t>(rows, 1), device);
}

void ragged_attention_cuda(const Problem& p, Result& r) {
  const c10::cuda::CUDAGuard guard(p.q.device());
  // The alignment of K and V rows for 16-byte loads is checked in run(), per head_dim.
  switch (p.q.scalar_type()) {
    case at::kFloat: run_head_dim<float>(p, r); break;
    case at::kHalf: run_head_dim<at::Half>(p, r); break;
    case at::kBFloat16: run_head_dim<at::BFloat16>(p, r); break;
    default:
      TORCH_CHECK_TYPE(false, "the CUDA attention kernel supports float32, float16 and bfloat16, got ",
                       p.q.scalar_type());
  }
}

}  // namespace kvcache_ext::attention
