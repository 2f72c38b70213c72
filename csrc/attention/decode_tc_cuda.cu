// The tensor-core decode kernel: one block per split of the plan, every query row of the
// segment (G * n <= 16) as one mma M tile, the 4 warps along each KV tile (decode_tiles.h).
// Per block:
// 1. The Q tile (16 rows, rows past R zero) goes to swizzled shared memory with cp.async,
//    then to registers as A fragments, the same in every warp.
// 2. KV tiles of 64 tokens are copied in 2 stages (tc_common.cuh, as the prefill kernel):
//    tile k + 1 is in flight while tile k is computed, page addresses staged two tiles ahead.
//    Int8 pages: raw rows and scale rows, widened to 16 bits before the warps read them, each
//    token's K scale on its logit and V scale on its weight (as the prefill kernel).
// 3. Per tile: a tile no row can see is skipped (block-uniform); warp w computes S = Q K^T
//    over its 16 tokens (2 n-blocks), masks, updates its own online softmax, and adds P V
//    over the same 16 tokens (one k-step; P fed back from the C fragments as in the prefill:
//    the per-warp step is tc_common.cuh's, shared with the prefill).
// 4. After the last tile, the warps' states go through shared memory (over the KV stages,
//    which are done) and are folded in warp order into the split's {m, l, o}, written where
//    attend_split writes them; attention_cuda.cu's merge combines the splits.
// With statistics, step 3 also writes each row's raw logits of the warp's tokens to the logits
// buffer, as attend_split does, and slot_stats turns them into the statistics (the buffer
// costs G * 8 bytes a slot on decode against 4 D of K and V; recomputing would read K again).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cstdint>

#include "attention/decode_tc.h"
#include "attention/decode_tiles.h"
#include "attention/tc_common.cuh"
#include "common/kernel_switch.h"
#include "common/occupancy.h"

namespace kvcache_ext::attention {

namespace {

namespace pf = prefill;
namespace dt = decode_tc;
using namespace tc;  // PTX wrappers, the paged copy, the warp step (tc_common.cuh)

// Shared memory of a block (dynamic): the Q tile, the KV tiles of KvTileCopy (kStages K and V
// tiles; on int8 pages raw, then the widened pair), kStages pos tiles and page lists, the warps'
// m and l, and on int8 pages kStages tiles of scale rows. The warps' o ([kWarps, kRows, D]
// floats) reuse the KV tiles after the loop (D = 128: 32 KiB of 64; D = 64: 16 of 32).
template <typename T, int D, bool Q8>
struct DecodeSmem {
  using Copy = KvTileCopy<T, D, dt::kThreads, Q8>;
  static constexpr int kQBytes = dt::kRows * D * 2;
  static constexpr int kTiles = kQBytes;
  static constexpr int kPos = kTiles + Copy::kTilesBytes;
  static constexpr int kPages = kPos + pf::kStages * pf::kTileN * 4;
  static constexpr int kWarpM = kPages + pf::kStages * pf::kTileN * 8;
  static constexpr int kWarpL = kWarpM + dt::kWarps * dt::kRows * 4;
  static constexpr int kScales = kWarpL + dt::kWarps * dt::kRows * 4;
  static constexpr int kBytes = kScales + Copy::kScaleBytes;
  static constexpr int kWarpO = kTiles;
  static_assert(dt::kWarps * dt::kRows * D * 4 <= Copy::kTilesBytes, "the warps' outputs fit in the KV tiles");
  static_assert(kQBytes % 128 == 0 && kTiles % 128 == 0, "swizzled tiles start on 128 bytes");
};

template <typename T, int D, bool Q8>
__global__ void __launch_bounds__(dt::kThreads) decode_tc_split(SplitArgs p) {
  using L = DecodeSmem<T, D, Q8>;
  extern __shared__ __align__(128) uint8_t smem[];
  if (*p.plan_segments != p.segments) return;  // a foreign plan: merge_segments writes NaN

  const int64_t w = blockIdx.x;
  const int s = p.splits[w].segment;
  const Split split = effective_split(p.splits[w], static_cast<int32_t>(w), p.seg_first_split, p.len[s]);
  const int b = s / p.heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* q = static_cast<const T*>(p.q);

  // 1. Q tile, rows past R zero-filled (their states are never stored).
  for (int idx = threadIdx.x; idx < dt::kRows * D / pf::kChunkElems; idx += dt::kThreads) {
    const pf::RowCol at = pf::copy_chunk(idx, D);
    const bool live = at.row < p.rows;
    const T* src = q + (live ? dt::q_row(s, at.row, p.groups, p.n, p.n_total, p.i0) * D + at.col : 0);
    cp_async_16(shared_address(smem + pf::smem_offset(at.row, at.col, D)), src, live);
  }
  cp_async_commit();

  // Query positions of this lane's two rows (h = 0: row lane / 4, h = 1: + 8) and the largest
  // of the block's rows (the skip rule), reduced over the warp: every warp gets the same.
  int32_t row_pos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = lane / 4 + 8 * h;
    row_pos[h] = p.q_pos && r < p.rows ? p.q_pos[b * p.n_total + dt::query_of(r, p.n, p.i0)] : INT32_MAX;
  }
  int32_t max_query_pos = INT32_MIN;
  if (p.q_pos) {
    if (lane < p.rows) max_query_pos = p.q_pos[b * p.n_total + dt::query_of(lane, p.n, p.i0)];  // rows <= 16 < 32
#pragma unroll
    for (int off = 16; off > 0; off /= 2)
      max_query_pos = max(max_query_pos, __shfl_xor_sync(0xffffffffu, max_query_pos, off));
  }

  // 2. The paged copies of the KV tiles: page lists two tiles ahead, tiles one.
  const typename L::Copy kv(p.view, s, split.end, p.q_pos != nullptr, smem + L::kTiles,
                            reinterpret_cast<int32_t*>(smem + L::kPos), smem + L::kScales,
                            reinterpret_cast<const char**>(smem + L::kPages));
  kv.start(split.begin);

  // Q as A fragments, one set per k-step of 16: the block's 16 rows in every warp; the warp's
  // running state over its tokens.
  uint32_t qf[D / 16][4];
  load_a_fragments<D>(qf, smem, lane, 0);
  WarpState<D> st;
  const int first = dt::warp_first_token(warp);

  int stage = 0;
  for (int t0 = split.begin; t0 < split.end; t0 += pf::kTileN, stage ^= 1) {
    const int tile_len = min(pf::kTileN, split.end - t0);
    kv.advance(t0, stage);
    const uint8_t* k_tile = kv.k_tile(stage);
    const uint8_t* v_tile = kv.v_tile(stage);
    const int32_t* pos = p.q_pos ? kv.pos_tile(stage) : nullptr;
    const ScaleRow* scales = kv.scale_tile(stage);

    // 3. The skip rule, the same in every warp (block-uniform: no barrier inside it); off with
    // statistics, whose pass reads every token's logits. A warp past the tile's end has no
    // token (warp-uniform).
    const bool needed = !pos || p.logits || pf::tile_needed(tile_min_pos(pos, tile_len, lane), max_query_pos);
    if (needed && first < tile_len) {
      // S = Q K^T over the warp's 16 tokens (2 n-blocks of 8), masked.
      float sc[2][4], tile_max[2];
      product_tile<T, D, 2>(sc, qf, k_tile, lane, first);
      mask_tile(sc, first, tile_len, pos, row_pos, p.scale_log2, lane, tile_max, scales);
      if (p.logits) {
        // Each (row, token) of the split once: a quad's 8 tokens of an n-block are consecutive
        // slots within a page, so its stores are 32-byte runs.
#pragma unroll
        for (int nb = 0; nb < 2; ++nb)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const pf::RowCol rc = pf::mma_c(lane, c);
            const int j = first + 8 * nb + rc.col;
            if (j >= tile_len || rc.row >= p.rows) continue;
            const int64_t t = t0 + j;
            const int64_t slot = (static_cast<int64_t>(kv.table[t >> kv.shift]) << kv.shift) | (t & kv.in_page_mask);
            p.logits[rc.row * p.capacity + slot] = sc[nb][c];
          }
      }
      // The online softmax; O += P V over the same tokens (one k-step).
      uint32_t pa[1][4];
      softmax_tile<T>(sc, tile_max, st, pa, scales, first, lane);
      accumulate_pv<T, D>(st.o, pa, v_tile, first, lane);
    }
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
  }

  // 4. The warps' states into shared memory (the loop's last barrier, or the one before the Q
  // fragments for an empty split, ordered every read of the KV stages), then folded per
  // (row, d) in warp order into the split's state.
  float* warp_m = reinterpret_cast<float*>(smem + L::kWarpM);
  float* warp_l = reinterpret_cast<float*>(smem + L::kWarpL);
  float* warp_o = reinterpret_cast<float*>(smem + L::kWarpO);
  st.store(lane, [&](int h) { return int64_t{warp * dt::kRows + lane / 4 + 8 * h}; }, warp_m, warp_l, warp_o);
  __syncthreads();
  const int64_t part_row0 = w * p.rows;
  for (int idx = threadIdx.x; idx < p.rows * D; idx += dt::kThreads) {
    const int r = idx / D, d = idx % D;
    const MergeState<1> merged = dt::merge_warps(warp_m, warp_l, warp_o, r, D, d);
    p.part_o[(part_row0 + r) * D + d] = merged.o[0];
    if (d == 0) {
      p.part_m[part_row0 + r] = merged.m;
      p.part_l[part_row0 + r] = merged.l;
    }
  }
}

}  // namespace

bool decode_tc_enabled() {
  return kernel_switch(kDecodeTcSwitch, false, "the tensor-core decode", "the scalar decode kernel");
}

template <typename T, int D, bool Q8>
void launch_decode_tc(const SplitArgs& a, int64_t splits, cudaStream_t stream) {
  using L = DecodeSmem<T, D, Q8>;
  TORCH_INTERNAL_ASSERT(a.rows >= 1 && a.rows <= dt::kRows, "decode_tc takes 1 to ", dt::kRows, " rows, got ",
                        a.rows);
  if (splits == 0) return;
  // Over 48 KiB of dynamic shared memory (D = 128: about 70 KiB) needs the opt-in.
  C10_CUDA_CHECK(cudaFuncSetAttribute(decode_tc_split<T, D, Q8>, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes));
  decode_tc_split<T, D, Q8><<<static_cast<unsigned int>(splits), dt::kThreads, L::kBytes, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template void launch_decode_tc<at::Half, 64, false>(const SplitArgs&, int64_t, cudaStream_t);
template void launch_decode_tc<at::Half, 128, false>(const SplitArgs&, int64_t, cudaStream_t);
template void launch_decode_tc<at::BFloat16, 64, false>(const SplitArgs&, int64_t, cudaStream_t);
template void launch_decode_tc<at::BFloat16, 128, false>(const SplitArgs&, int64_t, cudaStream_t);
template void launch_decode_tc<at::Half, 64, true>(const SplitArgs&, int64_t, cudaStream_t);
template void launch_decode_tc<at::Half, 128, true>(const SplitArgs&, int64_t, cudaStream_t);
template void launch_decode_tc<at::BFloat16, 64, true>(const SplitArgs&, int64_t, cudaStream_t);
template void launch_decode_tc<at::BFloat16, 128, true>(const SplitArgs&, int64_t, cudaStream_t);

int decode_tc_blocks_per_sm(int device) {
  using L = DecodeSmem<at::BFloat16, 128, false>;
  // The occupancy of a kernel over 48 KiB of dynamic shared memory counts only after the opt-in.
  C10_CUDA_CHECK(cudaFuncSetAttribute(decode_tc_split<at::BFloat16, 128, false>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes));
  return std::max(
      resident_blocks_per_sm(decode_tc_split<at::BFloat16, 128, false>, device, dt::kThreads, L::kBytes), 1);
}

}  // namespace kvcache_ext::attention
