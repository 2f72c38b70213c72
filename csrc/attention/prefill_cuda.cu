// CUDA attention over the ragged store for prefill blocks, on tensor cores: the default for the
// CUDA calls prefill_tc_applies accepts (KVCACHE_EXT_TC_PREFILL=0 sends them to the scalar
// kernel of attention_cuda.cu, as does every call it rejects).
//
// The tiling, masking, softmax, merge, fragment maps and swizzle are those of
// attention/prefill_tiles.h, whose host emulation (csrc/tests/test_prefill_tiles.cpp) matches a
// float64 attention on CPU. Per block: one split of a segment (the plan of attention_plan.h,
// shared with attention_cuda.cu) for one M tile of 64 packed query rows (the G heads of the
// segment's KV head times 64 / G queries); 4 warps of 16 rows each.
// 1. The Q tile goes to swizzled shared memory with cp.async, then to registers as mma A
//    fragments (ldmatrix), once.
// 2. KV tiles of 64 tokens: K, V and pos rows are copied with cp.async (16 bytes a chunk;
//    tokens past the split zero-filled, so that P = 0 never meets garbage V) into swizzled
//    shared memory, 2 stages: tile k + 1 is in flight while tile k is computed. Each tile's
//    page addresses are staged in shared memory two tiles ahead (one lookup per page). Int8
//    pages (store/quantize.h): the stages hold the raw rows and scale rows, and the block
//    widens each tile into 16-bit tiles before the warps read it; each token's K scale joins
//    its logit's factor and its V scale its weight (prefill_tiles.h).
// 3. Per tile: a tile no query of the M tile can see (causal rule from positions) is skipped;
//    S = Q K^T by mma.sync m16n8k16 (fp32 accumulators), mask, online softmax in registers
//    (a quad of lanes shares a row), P rounded to T and fed back as A fragments without
//    passing through shared memory, O += P V (V through ldmatrix.trans).
// 4. The split's state {m, l, o} (base 2, unnormalised o) goes to global memory; merge_splits
//    combines the splits of each (segment, row) into the output and, with statistics, keeps
//    each row's log-sum-exp.
// 5. Statistics (prefill_stats, only when asked for; G <= 64): P recomputed by KV tile from
//    that log-sum-exp, K as mma A fragments once per tile, the segment's query rows walked in
//    M tiles as B fragments, the sums per slot in registers, each live slot stored once (no
//    logits buffer, no query chunks; prefill_tiles.h says how the heads of a query are
//    grouped for sum_sq).
//
// Against SDPA it wins on blocks of 64 causal queries and trails on blocks of 256 (docs/gpu.md
// has the figures). Left for later, in this order: (1) the
// 256-query block (ncu: tensor-core use, bank conflicts, exposed copies; a 3-stage pipeline or
// wgmma); (2) in prefill_stats, a block-level skip of M tiles no query of which sees the KV
// tile, before their Q copy (today each warp skips the mma only); (3) a parallel merge
// (FlashInfer's merge-states shape).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "attention/attention_kernels.h"
#include "attention/attention_plan.h"
#include "attention/prefill_tiles.h"
#include "attention/split_args.h"
#include "attention/tc_common.cuh"
#include "common/kernel_switch.h"

namespace kvcache_ext::attention {

namespace {

namespace pf = prefill;
using namespace tc;  // PTX wrappers, the paged copy, the warp step (tc_common.cuh)

// ---------------------------------------------------------------------------------------
// Shared memory of a block (dynamic): Q tile, then the KV tiles of KvTileCopy (kStages K tiles,
// kStages V tiles; on int8 pages raw, then the widened pair), kStages pos tiles, kStages lists of
// a KV tile's page addresses, and on int8 pages kStages tiles of scale rows. The tiles the warps
// read are rows of D 16-bit elements, swizzled (prefill_tiles.h).

template <typename T, int D, bool Q8>
struct SmemLayout {
  using Copy = KvTileCopy<T, D, pf::kThreads, Q8>;
  static constexpr int kQBytes = pf::kTileM * D * 2;
  static constexpr int kTiles = kQBytes;
  static constexpr int kPos = kTiles + Copy::kTilesBytes;
  static constexpr int kPages = kPos + pf::kStages * pf::kTileN * 4;
  static constexpr int kScales = kPages + pf::kStages * pf::kTileN * 8;
  static constexpr int kBytes = kScales + Copy::kScaleBytes;
  static_assert(D % 64 == 0, "the swizzle needs rows of a multiple of 128 bytes");
};

// ---------------------------------------------------------------------------------------
// The block: split w = blockIdx.x / row_tiles for M tile blockIdx.x % row_tiles (the M tiles
// of a split are neighbours in the grid, so they read its K and V together from L2).

template <typename T, int D, bool Q8>
__global__ void __launch_bounds__(pf::kThreads) prefill_split(SplitArgs p) {
  using L = SmemLayout<T, D, Q8>;
  extern __shared__ __align__(128) uint8_t smem[];
  if (*p.plan_segments != p.segments) return;  // a foreign plan: merge_splits writes NaN

  const int64_t w = blockIdx.x / p.row_tiles;
  const int tile = static_cast<int>(blockIdx.x % p.row_tiles);
  const int s = p.splits[w].segment;
  const Split split = effective_split(p.splits[w], static_cast<int32_t>(w), p.seg_first_split, p.len[s]);
  const int b = s / p.heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = tile * pf::kTileM;

  // 1. Q tile, rows past R zero-filled (their results are never stored).
  for (int idx = threadIdx.x; idx < pf::kTileM * D / pf::kChunkElems; idx += pf::kThreads) {
    const pf::RowCol at = pf::copy_chunk(idx, D);
    const int prow = row0 + at.row;
    const bool live = prow < p.rows;
    const T* src = static_cast<const T*>(p.q) + (live ? pf::q_row(s, prow, p.groups, p.n) * D + at.col : 0);
    cp_async_16(shared_address(smem + pf::smem_offset(at.row, at.col, D)), src, live);
  }
  cp_async_commit();

  // Query positions of this lane's two rows (h = 0: row lane / 4, h = 1: + 8), and the
  // largest of the M tile (the skip rule), reduced over the warp: every warp gets the same.
  int32_t row_pos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int prow = row0 + warp * pf::kWarpRows + lane / 4 + 8 * h;
    row_pos[h] = p.q_pos && prow < p.rows ? p.q_pos[b * p.n + pf::unpack_row(prow, p.groups).i] : INT32_MAX;
  }
  int32_t max_query_pos = INT32_MIN;
  if (p.q_pos) {
    for (int r = lane; r < pf::kTileM; r += 32) {
      const int prow = row0 + r;
      if (prow < p.rows) max_query_pos = max(max_query_pos, p.q_pos[b * p.n + pf::unpack_row(prow, p.groups).i]);
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) max_query_pos = max(max_query_pos, __shfl_xor_sync(0xffffffffu, max_query_pos, off));
  }

  // 2. The paged copies of the KV tiles (tc_common.cuh): page lists two tiles ahead, tiles one.
  const typename L::Copy kv(p.view, s, split.end, p.q_pos != nullptr, smem + L::kTiles,
                            reinterpret_cast<int32_t*>(smem + L::kPos), smem + L::kScales,
                            reinterpret_cast<const char**>(smem + L::kPages));

  kv.start(split.begin);

  // Q as A fragments, one set per k-step of 16; the warp's running state.
  uint32_t qf[D / 16][4];
  load_a_fragments<D>(qf, smem, lane, warp * pf::kWarpRows);
  WarpState<D> st;

  int stage = 0;
  for (int t0 = split.begin; t0 < split.end; t0 += pf::kTileN, stage ^= 1) {
    const int tile_len = min(pf::kTileN, split.end - t0);
    kv.advance(t0, stage);
    const uint8_t* k_tile = kv.k_tile(stage);
    const uint8_t* v_tile = kv.v_tile(stage);
    const int32_t* pos = p.q_pos ? kv.pos_tile(stage) : nullptr;
    const ScaleRow* scales = kv.scale_tile(stage);

    // 3. The skip rule, the same in every warp (block-uniform: no barrier inside it).
    if (!pos || pf::tile_needed(tile_min_pos(pos, tile_len, lane), max_query_pos)) {
      // S = Q K^T over 8 n-blocks of 8 tokens, masked; the online softmax; O += P V.
      float sc[pf::kTileN / 8][4], tile_max[2];
      product_tile<T, D>(sc, qf, k_tile, lane);
      mask_tile(sc, 0, tile_len, pos, row_pos, p.scale_log2, lane, tile_max, scales);
      uint32_t pa[pf::kTileN / 16][4];
      softmax_tile<T>(sc, tile_max, st, pa, scales, 0, lane);
      accumulate_pv<T, D>(st.o, pa, v_tile, 0, lane);
    }
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
  }

  // 4. The split state of the lane's rows.
  st.store(
      lane,
      [&](int h) {
        const int prow = row0 + warp * pf::kWarpRows + lane / 4 + 8 * h;
        return prow < p.rows ? w * p.rows + prow : int64_t{-1};
      },
      p.part_m, p.part_l, p.part_o);
}

// ---------------------------------------------------------------------------------------
// merge_splits: one thread per (segment, packed row, d); the splits of a segment are few
// for prefill (their lengths were sized for its many rows), so each thread folds them in order
// (merge_states.h, the decode kernel's arithmetic).

template <typename T, int D>
__global__ void __launch_bounds__(256) merge_splits(SplitArgs p, T* out) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(p.segments) * p.rows * D) return;
  const int d = static_cast<int>(idx % D);
  const int64_t item = idx / D;
  const int64_t s = item / p.rows;
  const int prow = static_cast<int>(item % p.rows);
  T* o = out + pf::q_row(s, prow, p.groups, p.n) * D + d;
  if (*p.plan_segments != p.segments) {  // a plan of another store: refused, loudly
    *o = static_cast<T>(NAN);
    return;
  }
  const MergeState<1> st = pf::merge_element(p.part_m, p.part_l, p.part_o, p.seg_first_split[s],
                                              p.seg_first_split[s + 1], p.rows, prow, D, d);
  if (p.lse && d == 0) p.lse[item] = pf::row_lse(st.m, st.l);  // the statistics pass's p = exp2(x - lse)
  *o = static_cast<T>(st.out(0));
}

// ---------------------------------------------------------------------------------------
// prefill_stats: the statistics from the merged lse, recomputing P by KV tile (the pass of
// prefill_tiles.h). Block w * block_tiles + k owns KV tiles k, k + block_tiles, ... of split
// w (a stale plan's last split may have grown past the tiles the grid was sized for) and,
// per tile, walks every M tile of the segment's (padded) query rows; each live slot of the
// tile gets its statistics stored once, dead slots keep the op's zero fill.

struct StatsOut {
  float* mass;     // [capacity] or null
  float* last;     // [capacity, G] or null
  float* sum_sq;   // [capacity] or null
  int32_t* count;  // [capacity] or null
  int32_t padded_log2;  // log2 Gp: Gp rows per query in the pass
  int32_t stats_tiles;  // M tiles of n * Gp rows
  int32_t block_tiles;  // blocks per split
  float inv_groups;     // 1 / G: the mean over heads
};

// Shared memory of a statistics block (dynamic): the K tile, kStages Q tiles (swizzled rows
// of D), the tile's token positions, per Q stage the rows' lse and query positions, the K
// tile's page addresses, and on int8 pages the raw K tile and the tile's scale rows.
template <int D, bool Q8>
struct StatsSmem {
  static constexpr int kKBytes = pf::kTileN * D * 2;
  static constexpr int kQBytes = pf::kTileM * D * 2;
  static constexpr int kK = 0;
  static constexpr int kQ = kKBytes;
  static constexpr int kPos = kQ + pf::kStages * kQBytes;
  static constexpr int kLse = kPos + pf::kTileN * 4;
  static constexpr int kQPos = kLse + pf::kStages * pf::kTileM * 4;
  static constexpr int kPages = kQPos + pf::kStages * pf::kTileM * 4;
  static constexpr int kRaw = kPages + pf::kTileN * 8;  // 128-byte aligned: the sizes above are
  static constexpr int kScales = kRaw + (Q8 ? pf::kTileN * D : 0);
  static constexpr int kBytes = kScales + (Q8 ? pf::kTileN * 4 : 0);
  static_assert(kRaw % 128 == 0, "the raw K tile starts on 128 bytes");
};

template <typename T, int D, bool Q8>
__global__ void __launch_bounds__(pf::kThreads) prefill_stats(SplitArgs p, StatsOut st) {
  using L = StatsSmem<D, Q8>;
  extern __shared__ __align__(128) uint8_t smem[];
  if (*p.plan_segments != p.segments) return;  // a foreign plan: out is NaN, statistics zeros

  const int64_t w = blockIdx.x / st.block_tiles;
  const int first_tile = static_cast<int>(blockIdx.x % st.block_tiles);
  const int s = p.splits[w].segment;
  const Split split = effective_split(p.splits[w], static_cast<int32_t>(w), p.seg_first_split, p.len[s]);
  const int b = s / p.heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t* table = p.view.table + static_cast<int64_t>(s) * p.view.width;
  const int64_t in_page_mask = p.view.page_size() - 1;
  constexpr int64_t kRowBytes = D * (Q8 ? 1 : 2);
  const int lp = st.padded_log2, Gp = 1 << lp, G = p.groups;
  const int last_tile = pf::last_query_tile(p.n, lp);
  // Both powers of two: masks, not divisions, in the inner loop.
  const int gl = pf::group_lanes(Gp), gn_mask = pf::group_nblocks(Gp) - 1;
  const bool group_leader = (lane & (gl - 1)) == 0;  // the first of the gl lanes of a query
  int32_t* pos_s = reinterpret_cast<int32_t*>(smem + L::kPos);
  const char** pages = reinterpret_cast<const char**>(smem + L::kPages);
  ScaleRow* scales = reinterpret_cast<ScaleRow*>(smem + L::kScales);

  // Issues the copies of M tile mt's Q rows into stage `stage` (dead rows zero-filled) and
  // writes its rows' lse and query positions (plain stores, visible after the next barrier).
  auto load_q = [&](int mt, int stage) {
    uint8_t* q_dst = smem + L::kQ + stage * L::kQBytes;
    for (int idx = threadIdx.x; idx < pf::kTileM * D / pf::kChunkElems; idx += pf::kThreads) {
      const pf::RowCol at = pf::copy_chunk(idx, D);
      const pf::StatsRow row = pf::stats_row(mt * pf::kTileM + at.row, lp, G, p.n);
      const T* src = static_cast<const T*>(p.q) + (row.live ? pf::q_row(s, pf::packed_row(row.g, row.i, G), G, p.n) * D + at.col : 0);
      cp_async_16(shared_address(q_dst + pf::smem_offset(at.row, at.col, D)), src, row.live);
    }
    cp_async_commit();
    for (int r = threadIdx.x; r < pf::kTileM; r += pf::kThreads) {
      const pf::StatsRow row = pf::stats_row(mt * pf::kTileM + r, lp, G, p.n);
      float* lse = reinterpret_cast<float*>(smem + L::kLse) + stage * pf::kTileM;
      int32_t* qpos = reinterpret_cast<int32_t*>(smem + L::kQPos) + stage * pf::kTileM;
      lse[r] = row.live ? p.lse[static_cast<int64_t>(s) * p.rows + pf::packed_row(row.g, row.i, G)] : INFINITY;
      qpos[r] = !row.live ? INT32_MIN : p.q_pos ? p.q_pos[b * p.n + row.i] : INT32_MAX;
    }
  };

  // int64: t0 + block_tiles * kTileN may pass INT32_MAX on a segment of over 2^30 tokens.
  for (int64_t t0 = split.begin + static_cast<int64_t>(first_tile) * pf::kTileN; t0 < split.end;
       t0 += static_cast<int64_t>(st.block_tiles) * pf::kTileN) {
    const int tile_len = static_cast<int>(min(static_cast<int64_t>(pf::kTileN), split.end - t0));
    // The tile's page addresses, one table and one page-base load per page (the previous
    // tile's copies, which read them, are behind the barrier that closed its last M tile).
    const pf::TilePages tp = pf::tile_pages(t0, tile_len, p.view.shift);
    for (int c = threadIdx.x; c < tp.count; c += pf::kThreads)
      pages[c] = reinterpret_cast<const char*>(p.view.page_base[table[tp.first + c]]);
    __syncthreads();
    // The K tile (on int8 pages its raw rows) and its positions (and scale rows), one commit
    // group with Q tile 0 (rows past the split zero-filled: their S is 0, masked below).
    constexpr int kChunk = Q8 ? pf::kRawChunkElems : pf::kChunkElems;
    for (int idx = threadIdx.x; idx < pf::kTileN * D / kChunk; idx += pf::kThreads) {
      const pf::RowCol at = Q8 ? pf::raw_copy_chunk(idx, D) : pf::copy_chunk(idx, D);
      const bool live = at.row < tile_len;
      const int64_t token = t0 + (live ? at.row : 0);
      const char* page = pages[pf::tile_page_of(t0, live ? at.row : 0, tp.first, p.view.shift)];
      const int dst = Q8 ? L::kRaw + pf::raw_offset(at.row, at.col, D) : L::kK + pf::smem_offset(at.row, at.col, D);
      cp_async_16(shared_address(smem + dst),
                  page + p.view.record.offset[store::kK] + (token & in_page_mask) * kRowBytes + at.col * (Q8 ? 1 : 2),
                  live);
    }
    if (p.q_pos || Q8) {
      for (int j = threadIdx.x; j < pf::kTileN; j += pf::kThreads) {
        const bool live = j < tile_len;
        const int64_t in_page = (t0 + (live ? j : 0)) & in_page_mask;
        const char* page = pages[pf::tile_page_of(t0, live ? j : 0, tp.first, p.view.shift)];
        if (p.q_pos) cp_async_4(shared_address(pos_s + j), page + p.view.record.offset[store::kPos] + in_page * 4, live);
        if (Q8)
          cp_async_4(shared_address(scales + j),
                     page + p.view.record.offset[store::kScale] + in_page * store::kScaleRowBytes, live);
      }
    }
    load_q(0, 0);
    cp_async_wait<0>();
    __syncthreads();
    if constexpr (Q8) {
      KvTileCopy<T, D, pf::kThreads, true>::widen(smem + L::kRaw, smem + L::kK);
      __syncthreads();
    }

    // The warp's 16 tokens as A fragments, once per KV tile; the lane's two tokens (h = 0:
    // row lane / 4, h = 1: + 8), their slots and positions; the warp's smallest position.
    uint32_t kf[D / 16][4];
    load_a_fragments<D>(kf, smem + L::kK, lane, warp * pf::kWarpRows);
    bool token_live[2];
    int32_t token_pos[2];
    int64_t slot[2];
    float factor[2];  // S to base-2 logits: the attention's own factor (prefill_tiles.h)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int j = warp * pf::kWarpRows + lane / 4 + 8 * h;
      token_live[h] = j < tile_len;
      token_pos[h] = p.q_pos ? pos_s[j] : 0;
      slot[h] = token_live[h] ? p.view.slot(s, t0 + j) : 0;
      factor[h] = pf::logit_factor(p.scale_log2, Q8 ? __half2float(scales[j].k) : 1.f);
    }
    int32_t warp_min_pos = INT32_MAX;
    if (p.q_pos) {
      const int j = warp * pf::kWarpRows + lane % pf::kWarpRows;
      warp_min_pos = j < tile_len ? pos_s[j] : INT32_MAX;
#pragma unroll
      for (int off = 16; off > 0; off /= 2) warp_min_pos = min(warp_min_pos, __shfl_xor_sync(0xffffffffu, warp_min_pos, off));
    }

    float mass[2] = {0.f, 0.f}, sum_sq[2] = {0.f, 0.f};
    int32_t seen[2] = {0, 0};
    int stage = 0;
    for (int mt = 0; mt < st.stats_tiles; ++mt, stage ^= 1) {
      // Stage stage ^ 1 was last read in iteration mt - 1, which ended in a barrier.
      if (mt + 1 < st.stats_tiles) load_q(mt + 1, stage ^ 1);
      const uint8_t* q_tile = smem + L::kQ + stage * L::kQBytes;
      const float* lse = reinterpret_cast<const float*>(smem + L::kLse) + stage * pf::kTileM;
      const int32_t* qpos = reinterpret_cast<const int32_t*>(smem + L::kQPos) + stage * pf::kTileM;

      // The skip rule per warp: no query of the M tile sees any of the warp's tokens.
      bool needed = true;
      if (p.q_pos) {
        int32_t max_query_pos = max(qpos[lane], qpos[lane + 32]);
#pragma unroll
        for (int off = 16; off > 0; off /= 2)
          max_query_pos = max(max_query_pos, __shfl_xor_sync(0xffffffffu, max_query_pos, off));
        needed = pf::tile_needed(warp_min_pos, max_query_pos);
      }
      if (needed) {
        // S^T = K Q^T: 8 n-blocks of 8 query rows.
        float sc[pf::kTileM / 8][4];
        product_tile<T, D>(sc, kf, q_tile, lane);
        // Probabilities (c / 2 is the lane's token h), mass, count.
#pragma unroll
        for (int nb = 0; nb < pf::kTileM / 8; ++nb)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int h = c / 2;
            const int col = 8 * nb + pf::mma_c(lane, c).col;
            const pf::StatsRow row = pf::stats_row(mt * pf::kTileM + col, lp, G, p.n);
            const bool vis = token_live[h] && row.live && (!p.q_pos || pf::visible(token_pos[h], qpos[col]));
            const float prob = vis ? pf::stats_weight(sc[nb][c] * factor[h], lse[col]) : 0.f;
            sc[nb][c] = prob;
            mass[h] += prob;
            seen[h] += vis && row.g == 0 ? 1 : 0;  // a query once: at its head 0
          }
        // last: the tile of the last query stores its heads' p (each (slot, g) in one lane).
        if (st.last && mt == last_tile) {
#pragma unroll
          for (int nb = 0; nb < pf::kTileM / 8; ++nb)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              const pf::StatsRow row = pf::stats_row(mt * pf::kTileM + 8 * nb + pf::mma_c(lane, c).col, lp, G, p.n);
              if (token_live[c / 2] && row.live && row.i == p.n - 1) st.last[slot[c / 2] * G + row.g] = sc[nb][c];
            }
        }
        // sum_sq: each query's head sum, in the lane (its two columns, gn n-blocks), then
        // over the gl lanes holding the query; the first of them adds the squared mean.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (Gp == 1) {
#pragma unroll
            for (int nb = 0; nb < pf::kTileM / 8; ++nb)
              sum_sq[h] += sc[nb][2 * h] * sc[nb][2 * h] + sc[nb][2 * h + 1] * sc[nb][2 * h + 1];
            continue;
          }
          float part = 0.f;
#pragma unroll
          for (int nb = 0; nb < pf::kTileM / 8; ++nb) {
            part += sc[nb][2 * h] + sc[nb][2 * h + 1];
            if (((nb + 1) & gn_mask) != 0) continue;  // warp-uniform: the shuffles see every lane
            if (gl >= 2) part += __shfl_xor_sync(0xffffffffu, part, 1);
            if (gl >= 4) part += __shfl_xor_sync(0xffffffffu, part, 2);
            const float mean = part * st.inv_groups;
            if (group_leader) sum_sq[h] += mean * mean;
            part = 0.f;
          }
        }
      }
      cp_async_wait<0>();
      __syncthreads();  // tile mt + 1 visible to every warp; every warp done with stage
    }

    // The quad's sums of each token, stored once by its first lane.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int off = 1; off < 4; off *= 2) {
        mass[h] += __shfl_xor_sync(0xffffffffu, mass[h], off);
        sum_sq[h] += __shfl_xor_sync(0xffffffffu, sum_sq[h], off);
        seen[h] += __shfl_xor_sync(0xffffffffu, seen[h], off);
      }
      if (lane % 4 != 0 || !token_live[h]) continue;
      if (st.mass) st.mass[slot[h]] = mass[h];
      if (st.sum_sq) st.sum_sq[slot[h]] = sum_sq[h];
      if (st.count) st.count[slot[h]] = seen[h];
    }
  }
}

// ---------------------------------------------------------------------------------------
// Host side

// Q8: the pages are int8 (store/quantize.h), q and the output T.
template <typename T, int D, bool Q8>
void run_prefill(const Problem& p, Result& r) {
  using L = SmemLayout<T, D, Q8>;
  const int64_t n = p.q.size(2), S = p.segments;
  const int64_t rows = p.groups * n;
  const store::PageRecord& rec = p.view.record;
  constexpr int64_t kRowBytes = D * (Q8 ? 1 : 2);
  TORCH_INTERNAL_ASSERT(rec.quantized() == Q8 && rec.row_bytes[store::kK] == kRowBytes &&
                            rec.row_bytes[store::kV] == kRowBytes && rec.offset[store::kK] % 16 == 0 &&
                            rec.offset[store::kV] % 16 == 0 && rec.offset[store::kPos] % 4 == 0 &&
                            rec.offset[store::kScale] % 4 == 0 && rec.bytes % 16 == 0,
                        "the tensor-core prefill needs 16-byte aligned K and V rows of ", D, " elements");
  TORCH_CHECK_VALUE(rows <= INT32_MAX / 2, "too many query rows per KV head: ", rows);
  const at::Tensor plan = p.plan.defined() ? p.plan : plan_prefill_cuda(*p.len_host, rows, p.q.device());
  const int64_t W = plan_splits_count(plan.numel(), S);
  TORCH_CHECK_VALUE(W >= 0, "the attention plan (", plan.numel(), " words) does not fit ", S,
                    " segments: make it with attention_plan");
  const int64_t row_tiles = pf::row_tiles(static_cast<int>(rows));
  TORCH_CHECK_VALUE(W * row_tiles <= INT32_MAX, "prefill grid too large: ", W, " splits x ", row_tiles, " row tiles");
  const auto f32 = p.q.options().dtype(at::kFloat);
  at::Tensor part_m = at::empty({W, rows}, f32), part_l = at::empty({W, rows}, f32);
  at::Tensor part_o = at::empty({W, rows, D}, f32);
  const bool stats = r.mass.defined() || r.last.defined() || r.sum_sq.defined() || r.count.defined();
  const at::Tensor lse = stats ? at::empty({S, rows}, f32) : at::Tensor();

  SplitArgs prm = split_args(p, plan, W);
  prm.rows = static_cast<int32_t>(rows);
  prm.row_tiles = static_cast<int32_t>(row_tiles);
  prm.part_m = part_m.data_ptr<float>();
  prm.part_l = part_l.data_ptr<float>();
  prm.part_o = part_o.data_ptr<float>();
  prm.lse = stats ? lse.data_ptr<float>() : nullptr;

  const auto stream = at::cuda::getCurrentCUDAStream();
  if (W > 0) {
    // Over 48 KiB of dynamic shared memory (D = 128: 81.5 KiB) needs the opt-in.
    C10_CUDA_CHECK(cudaFuncSetAttribute(prefill_split<T, D, Q8>, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes));
    prefill_split<T, D, Q8><<<static_cast<unsigned int>(W * row_tiles), pf::kThreads, L::kBytes, stream>>>(prm);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const int64_t items = S * rows * D;
  constexpr int kMergeThreads = 256;
  TORCH_CHECK_VALUE((items + kMergeThreads - 1) / kMergeThreads <= INT32_MAX, "prefill merge grid too large");
  merge_splits<T, D><<<static_cast<unsigned int>((items + kMergeThreads - 1) / kMergeThreads), kMergeThreads, 0,
                       stream>>>(prm, r.out.data_ptr<T>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  if (stats && W > 0) {
    // As many blocks per split as the attention had (one per M tile): each owns every
    // row_tiles-th KV tile of its split; a split of fewer KV tiles leaves blocks idle (they
    // leave at once). The op zero-filled the statistics; the pass stores each live slot's.
    using SL = StatsSmem<D, Q8>;
    const int padded_log2 = pf::padded_groups_log2(static_cast<int>(p.groups));
    TORCH_INTERNAL_ASSERT((1 << padded_log2) <= pf::kMaxStatsGroups, "prefill_tc_applies let G = ", p.groups,
                          " through");
    StatsOut st;
    st.mass = r.mass.defined() ? r.mass.data_ptr<float>() : nullptr;
    st.last = r.last.defined() ? r.last.data_ptr<float>() : nullptr;
    st.sum_sq = r.sum_sq.defined() ? r.sum_sq.data_ptr<float>() : nullptr;
    st.count = r.count.defined() ? r.count.data_ptr<int32_t>() : nullptr;
    st.padded_log2 = padded_log2;
    st.stats_tiles = pf::stats_tiles(static_cast<int>(n), padded_log2);  // n Gp < 2 G n: within int32
    st.block_tiles = static_cast<int32_t>(row_tiles);
    st.inv_groups = 1.f / static_cast<float>(p.groups);
    C10_CUDA_CHECK(cudaFuncSetAttribute(prefill_stats<T, D, Q8>, cudaFuncAttributeMaxDynamicSharedMemorySize, SL::kBytes));
    prefill_stats<T, D, Q8><<<static_cast<unsigned int>(W * row_tiles), pf::kThreads, SL::kBytes, stream>>>(prm, st);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename T, bool Q8>
void run_prefill_head_dim(const Problem& p, Result& r) {
  switch (p.q.size(3)) {
    case 64: run_prefill<T, 64, Q8>(p, r); break;
    case 128: run_prefill<T, 128, Q8>(p, r); break;
    default: TORCH_INTERNAL_ASSERT(false, "prefill_tc_applies let head_dim ", p.q.size(3), " through");
  }
}

template <typename T>
void run_prefill_pages(const Problem& p, Result& r) {
  if (p.view.record.quantized()) {
    run_prefill_head_dim<T, true>(p, r);
  } else {
    run_prefill_head_dim<T, false>(p, r);
  }
}

}  // namespace

at::Tensor plan_prefill_cuda(const std::vector<int32_t>& len, int64_t rows, const c10::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  std::vector<Split> splits;
  std::vector<int32_t> first;
  const int64_t row_tiles = (std::max<int64_t>(rows, 1) + pf::kTileM - 1) / pf::kTileM;
  plan_splits(len, row_tiles, at::cuda::getCurrentDeviceProperties()->multiProcessorCount, splits, first);
  const std::vector<int32_t> words = plan_words(splits, first);
  at::Tensor plan_host = at::empty({static_cast<int64_t>(words.size())},
                                   at::TensorOptions().dtype(at::kInt).pinned_memory(true));
  std::memcpy(plan_host.data_ptr<int32_t>(), words.data(), words.size() * sizeof(int32_t));
  // The caching host allocator keeps the pinned buffer until the copy has run (no sync).
  return plan_host.to(device, at::kInt, /*non_blocking=*/true);
}

bool prefill_tc_enabled() {
  return kernel_switch(kPrefillTcSwitch, true, "the tensor-core prefill", "the scalar prefill kernel");
}

bool prefill_tc_applies(const Problem& p, const Result& r) {
  const bool stats = r.mass.defined() || r.last.defined() || r.sum_sq.defined() || r.count.defined();
  const at::ScalarType t = p.q.scalar_type();
  const int64_t D = p.q.size(3);
  // The switch last: a decode call (too few rows) never reads the environment.
  return p.q.is_cuda() && (!stats || p.groups <= pf::kMaxStatsGroups) &&
         (t == at::kHalf || t == at::kBFloat16) && (D == 64 || D == 128) &&
         p.groups * p.q.size(2) >= kPrefillTcMinRows && prefill_tc_enabled();
}

void prefill_attention_cuda(const Problem& p, Result& r) {
  const c10::cuda::CUDAGuard guard(p.q.device());
  switch (p.q.scalar_type()) {
    case at::kHalf: run_prefill_pages<at::Half>(p, r); break;
    case at::kBFloat16: run_prefill_pages<at::BFloat16>(p, r); break;
    default: TORCH_INTERNAL_ASSERT(false, "prefill_tc_applies let ", p.q.scalar_type(), " through");
  }
}

}  // namespace kvcache_ext::attention
