// The device code both tensor-core attention kernels share (prefill_cuda.cu, decode_tc_cuda.cu):
// PTX wrappers (cp.async, ldmatrix, mma.sync m16n8k16), the warp's product of an A fragment
// set with a swizzled shared tile, the paged copy of KV tiles into shared memory in stages (its
// pipeline's start and per-tile head), and a warp's step of the attention over one KV tile
// (its fragments of Q, its running state, mask, online softmax, P V). The maps they follow (fragments, ldmatrix addresses, swizzle, copy order, a tile's
// pages) are prefill_tiles.h's, emulated on the host by csrc/tests/test_prefill_tiles.cpp.
// sm_80 and newer (cp.async, bf16 mma); included by .cu files only.
#pragma once

#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

#include "attention/prefill_tiles.h"
#include "store/paged_layout.h"

namespace kvcache_ext::attention::tc {

namespace pf = prefill;

// ---------------------------------------------------------------------------------------
// PTX wrappers

__device__ inline uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1; live = false writes 16 zero bytes (src unread, but
// it must still be a valid address).
__device__ inline void cp_async_16(uint32_t dst, const void* src, bool live) {
  const int bytes = live ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ inline void cp_async_4(uint32_t dst, const void* src, bool live) {
  const int bytes = live ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int Pending>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

__device__ inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a b, m16n8k16, fp32 accumulators; T is the 16-bit type of a and b.
template <typename T>
__device__ inline void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ inline void mma_16816<at::BFloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ inline void mma_16816<at::Half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                           uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// acc = A B^T for one warp: A its 16 rows as mma fragments (D / 16 k-steps), B the 8 NB rows
// n0 .. n0 + 8 NB - 1 of a swizzled shared-memory tile of D columns (one ldmatrix.x4 gives b0 b1
// of two k-steps of an n-block). The prefill's S = Q K^T (n0 = 0), the statistics pass's
// S^T = K Q^T, and the decode kernel's S = Q K^T over its warp's 16 tokens (n0 = 16 warp).
template <typename T, int D, int NB>
__device__ inline void product_tile(float (&acc)[NB][4], const uint32_t (&a)[D / 16][4],
                                    const uint8_t* b_tile, int lane, int n0 = 0) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[nb][c] = 0.f;
#pragma unroll
  for (int k2 = 0; k2 < D / 32; ++k2) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      uint32_t b[4];
      const pf::RowCol at = pf::ldmatrix_k(lane, n0 + 8 * nb, 32 * k2);
      ldmatrix_x4(b, shared_address(b_tile + pf::smem_offset(at.row, at.col, D)));
      mma_16816<T>(acc[nb], a[2 * k2], b[0], b[1]);
      mma_16816<T>(acc[nb], a[2 * k2 + 1], b[2], b[3]);
    }
  }
}

// Two floats rounded to T in one register, lo in the lower half (element e = 0 of a fragment
// register).
template <typename T>
__device__ inline uint32_t pack2(float lo, float hi);
template <>
__device__ inline uint32_t pack2<at::BFloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}
template <>
__device__ inline uint32_t pack2<at::Half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}

// ---------------------------------------------------------------------------------------
// The paged copy of KV tiles (T: the 16-bit type the warps read): pf::kTileN tokens of K, V (and, with query positions, pos) of
// one segment into stage `stage` of swizzled shared tiles, Threads threads taking part.
// Dead rows (past the split) are zero-filled, so that P = 0 never meets garbage V; a dead row
// reads nothing but still names a valid address (the tile's first token). Each tile's page
// addresses are staged first in a list of its own (stage_pages: one table and one page-base
// load per page, plain stores that the caller's next barrier publishes); load() reads them.
//
// Int8 pages (Q8): the stages hold the raw int8 rows and each token's scale row; advance()
// widens the current stage into one pair of swizzled 16-bit tiles (prefill_tiles.h), which
// k_tile and v_tile return, and scale_tile gives the stage's scales.

// Pairs of float16 (K scale, V scale) a token, as the pages store them (store/paged_layout.h).
struct ScaleRow {
  __half k, v;
};

template <typename T, int D, int Threads, bool Q8 = false>
struct KvTileCopy {
  static constexpr int kKVBytes = pf::kTileN * D * 2;  // a 16-bit K or V tile, as the warps read it
  static constexpr int kStageBytes = Q8 ? pf::kTileN * D : kKVBytes;  // a K or V tile as copied
  static constexpr int64_t kRowBytes = D * (Q8 ? 1 : 2);
  // The shared memory of the K and V tiles: kStages copies of each, and for int8 pages the
  // widened pair after them.
  static constexpr int kTilesBytes = 2 * pf::kStages * kStageBytes + (Q8 ? 2 * kKVBytes : 0);
  // The scale rows of kStages tiles (int8 pages only).
  static constexpr int kScaleBytes = Q8 ? pf::kStages * pf::kTileN * 4 : 0;
  static_assert(kStageBytes % 128 == 0, "tiles start on 128 bytes");

  const int64_t* page_base;  // the view's
  const int32_t* table;      // the segment's page ids
  int shift;
  int64_t in_page_mask;
  int64_t off_k, off_v, off_pos, off_scale;
  int end;                   // the split's end: tokens at or past it are dead
  bool with_pos;             // copy positions (the call has query positions)
  uint8_t* k;                // stage 0 of kStages K tiles
  uint8_t* v;                // stage 0 of kStages V tiles
  uint8_t* k_wide;           // int8 pages: the widened K tile, then V's
  int32_t* pos;              // stage 0 of kStages position tiles (kTileN each)
  ScaleRow* scales;          // int8 pages: stage 0 of kStages scale tiles (kTileN each)
  const char** pages;        // stage 0 of kStages page lists (kTileN each)

  // tiles: kTilesBytes, 128-byte aligned; scale_tiles: kScaleBytes (unused for 16-bit pages).
  __device__ KvTileCopy(const store::PagedView& view, int64_t segment, int split_end, bool positions,
                        uint8_t* tiles, int32_t* pos_tiles, uint8_t* scale_tiles, const char** page_lists)
      : page_base(view.page_base),
        table(view.table + segment * view.width),
        shift(view.shift),
        in_page_mask(view.page_size() - 1),
        off_k(view.record.offset[store::kK]),
        off_v(view.record.offset[store::kV]),
        off_pos(view.record.offset[store::kPos]),
        off_scale(view.record.offset[store::kScale]),
        end(split_end),
        with_pos(positions),
        k(tiles),
        v(tiles + pf::kStages * kStageBytes),
        k_wide(tiles + 2 * pf::kStages * kStageBytes),
        pos(pos_tiles),
        scales(reinterpret_cast<ScaleRow*>(scale_tiles)),
        pages(page_lists) {}

  // The page addresses of the tile at token t0 (when it is in the split) into list `stage`.
  __device__ void stage_pages(int t0, int stage) const {
    if (t0 >= end) return;
    const pf::TilePages tp = pf::tile_pages(t0, min(pf::kTileN, end - t0), shift);
    for (int c = threadIdx.x; c < tp.count; c += Threads)
      pages[stage * pf::kTileN + c] = reinterpret_cast<const char*>(page_base[table[tp.first + c]]);
  }

  // Issues the copies of the tile at token t0 into stage `stage` (one commit group), its
  // rows' pages from list `stage`.
  __device__ void load(int t0, int stage) const {
    const int tile_len = min(pf::kTileN, end - t0);
    const int64_t first_page = t0 >> shift;
    const char* const* page_of_tile = pages + stage * pf::kTileN;
    uint8_t* k_dst = k + stage * kStageBytes;
    uint8_t* v_dst = v + stage * kStageBytes;
    constexpr int kChunk = Q8 ? pf::kRawChunkElems : pf::kChunkElems;
    for (int idx = threadIdx.x; idx < pf::kTileN * D / kChunk; idx += Threads) {
      const pf::RowCol at = Q8 ? pf::raw_copy_chunk(idx, D) : pf::copy_chunk(idx, D);
      const bool live = at.row < tile_len;
      const int64_t token = t0 + (live ? at.row : 0);
      const char* page = page_of_tile[pf::tile_page_of(t0, live ? at.row : 0, first_page, shift)];
      const int64_t row = (token & in_page_mask) * kRowBytes + at.col * (Q8 ? 1 : 2);
      const int off = Q8 ? pf::raw_offset(at.row, at.col, D) : pf::smem_offset(at.row, at.col, D);
      cp_async_16(shared_address(k_dst + off), page + off_k + row, live);
      cp_async_16(shared_address(v_dst + off), page + off_v + row, live);
    }
    if (with_pos || Q8) {
      int32_t* pos_dst = pos + stage * pf::kTileN;
      ScaleRow* scale_dst = scales + stage * pf::kTileN;
      for (int j = threadIdx.x; j < pf::kTileN; j += Threads) {
        const bool live = j < tile_len;
        const int64_t token = t0 + (live ? j : 0);
        const char* page = page_of_tile[pf::tile_page_of(t0, live ? j : 0, first_page, shift)];
        const int64_t in_page = token & in_page_mask;
        if (with_pos) cp_async_4(shared_address(pos_dst + j), page + off_pos + in_page * 4, live);
        if (Q8) cp_async_4(shared_address(scale_dst + j), page + off_scale + in_page * store::kScaleRowBytes, live);
      }
    }
    cp_async_commit();
  }

  // The pipeline's start, once the caller has committed its own copy group (its Q tile): the
  // first two tiles' page lists and the first tile's copies. Returns when the caller's group has
  // landed, behind a barrier. Block-uniform (every thread calls it, with the same begin).
  __device__ void start(int begin) const {
    if (begin < end) {
      stage_pages(begin, 0);
      stage_pages(begin + pf::kTileN, 1);
      __syncthreads();
      load(begin, 0);
      cp_async_wait<1>();  // the caller's group (the older one) has landed
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
  }

  // The head of the iteration over the tile at t0, in stage `stage` (the caller's loop ends each
  // iteration with a barrier): issues the next tile's copies into the other stage, which the
  // previous iteration read, waits for tile t0 and makes it visible to every warp, then stages
  // the page list of tile t0 + 2 kTileN. Every thread has issued tile t0's copies (before the
  // previous iteration's barrier) and the next one's (here), so list `stage` is free; the next
  // iteration's copies read it after this iteration's closing barrier. Int8 pages: then widens
  // tile t0 (the previous iteration's closing barrier freed the widened tiles) behind a barrier.
  __device__ void advance(int t0, int stage) const {
    if (t0 + pf::kTileN < end) {
      load(t0 + pf::kTileN, stage ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    stage_pages(t0 + 2 * pf::kTileN, stage);
    if constexpr (Q8) {
      widen(k + stage * kStageBytes, k_wide);
      widen(v + stage * kStageBytes, k_wide + kKVBytes);
      __syncthreads();
    }
  }

  __device__ const uint8_t* k_tile(int stage) const { return Q8 ? k_wide : k + stage * kStageBytes; }
  __device__ const uint8_t* v_tile(int stage) const { return Q8 ? k_wide + kKVBytes : v + stage * kStageBytes; }
  __device__ const int32_t* pos_tile(int stage) const { return pos + stage * pf::kTileN; }
  __device__ const ScaleRow* scale_tile(int stage) const { return Q8 ? scales + stage * pf::kTileN : nullptr; }

  // A raw int8 tile into a swizzled 16-bit one, 8 elements a thread at a time (the integers are
  // exact in T). Every thread of the block calls it; the caller's barrier publishes the result.
  __device__ static void widen(const uint8_t* raw, uint8_t* wide) {
    for (int idx = threadIdx.x; idx < pf::kTileN * D / pf::kChunkElems; idx += Threads) {
      const pf::RowCol at = pf::copy_chunk(idx, D);
      const uint2 bytes = *reinterpret_cast<const uint2*>(raw + pf::raw_offset(at.row, at.col, D));
      const uint32_t words[2] = {bytes.x, bytes.y};
      uint32_t out[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // elements 2e, 2e + 1: bytes 2e, 2e + 1 of the little-endian words
        const uint32_t pair = words[e / 2] >> (16 * (e % 2));
        out[e] = pack2<T>(static_cast<float>(static_cast<int8_t>(pair & 0xffu)),
                          static_cast<float>(static_cast<int8_t>((pair >> 8) & 0xffu)));
      }
      *reinterpret_cast<uint4*>(wide + pf::smem_offset(at.row, at.col, D)) = make_uint4(out[0], out[1], out[2], out[3]);
    }
  }
};

// ---------------------------------------------------------------------------------------
// One KV tile of the attention for a warp: its 16 query rows (a lane holds rows lane / 4 and
// lane / 4 + 8, h = 0 and 1, a quad of lanes a row) against NB n-blocks of 8 of the tile's tokens
// starting at tile token `first`. Logits in base 2; prefill_tiles.h's mask and softmax.

// A warp's A fragments of rows row0 .. row0 + 15 of a swizzled shared tile of D columns, one set
// per k-step of 16 (the attention's Q, the statistics pass's K).
template <int D>
__device__ inline void load_a_fragments(uint32_t (&a)[D / 16][4], const uint8_t* tile, int lane, int row0) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const pf::RowCol at = pf::ldmatrix_q(lane, row0, 16 * kk);
    ldmatrix_x4(a[kk], shared_address(tile + pf::smem_offset(at.row, at.col, D)));
  }
}

// A warp's running softmax state for the lane's two rows: the unnormalised output (C fragments
// of D / 8 n-blocks), the running max m and this lane's part of the sum l (its quad adds them).
template <int D>
struct WarpState {
  float o[D / 8][4];
  float m[2], l[2];

  __device__ WarpState() {
#pragma unroll
    for (int nb = 0; nb < D / 8; ++nb)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[nb][c] = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m[h] = pf::neg_inf();
      l[h] = 0.f;
    }
  }

  // Stores the state of the lane's rows h (row index(h), skipped when negative) into row-major
  // m, l ([rows]) and o ([rows, D]), l summed over the quad first. Every lane of the warp calls it.
  template <typename RowIndex>
  __device__ void store(int lane, RowIndex index, float* m_out, float* l_out, float* o_out) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] = quad_sum(l[h]);
      const int64_t row = index(h);
      if (row < 0) continue;
      if (lane % 4 == 0) {
        m_out[row] = m[h];
        l_out[row] = l[h];
      }
#pragma unroll
      for (int nb = 0; nb < D / 8; ++nb) {
        const int col = 8 * nb + pf::mma_c(lane, 2 * h).col;  // even: 8-byte aligned
        *reinterpret_cast<float2*>(o_out + row * D + col) = make_float2(o[nb][2 * h], o[nb][2 * h + 1]);
      }
    }
  }

 private:
  __device__ static float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
  }
};

// The smallest position among the tile's tokens (every lane of the warp gets it): the skip rule.
__device__ inline int32_t tile_min_pos(const int32_t* pos, int tile_len, int lane) {
  int32_t min_pos = INT32_MAX;
  for (int j = lane; j < tile_len; j += 32) min_pos = min(min_pos, pos[j]);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) min_pos = min(min_pos, __shfl_xor_sync(0xffffffffu, min_pos, off));
  return min_pos;
}

// Scales the warp's S = Q K^T to base 2 and masks it: a token is live when it lies in the tile and
// the row sees it (pos null: every live token); masked logits are -inf. scales: the tile's
// scale rows on int8 pages (each token's K scale joins the factor), null otherwise. Returns each
// of the lane's rows' maximum over the quad.
template <int NB>
__device__ inline void mask_tile(float (&sc)[NB][4], int first, int tile_len, const int32_t* pos,
                                 const int32_t (&row_pos)[2], float scale_log2, int lane, float (&tile_max)[2],
                                 const ScaleRow* scales = nullptr) {
  tile_max[0] = tile_max[1] = pf::neg_inf();
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int j = first + 8 * nb + pf::mma_c(lane, c).col;
      const bool live = j < tile_len && (!pos || pf::visible(pos[j], row_pos[c / 2]));
      const float factor = pf::logit_factor(scale_log2, scales ? __half2float(scales[j].k) : 1.f);
      sc[nb][c] = live ? sc[nb][c] * factor : pf::neg_inf();
      tile_max[c / 2] = fmaxf(tile_max[c / 2], sc[nb][c]);
    }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
  }
}

// The online softmax step of the tile: the rows' running max and this lane's part of their
// sums, o rescaled; P summed in fp32, then rounded to T as A fragments: the C fragments of
// n-blocks 2j and 2j + 1 are the A fragment of k-step j (c0 c1 -> a0 / a2, c2 c3 -> a1 / a3), so
// P never passes through shared memory. On int8 pages (scales not null) each weight is
// multiplied by its token's V scale before the rounding (the sums keep the weights alone);
// first is the tile token of the first n-block.
template <typename T, int NB, int D>
__device__ inline void softmax_tile(const float (&sc)[NB][4], const float (&tile_max)[2], WarpState<D>& st,
                                    uint32_t (&pa)[NB / 2][4], const ScaleRow* scales = nullptr, int first = 0,
                                    int lane = 0) {
  pf::SoftmaxStep step[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    step[h] = pf::softmax_step(st.m[h], tile_max[h]);
    st.m[h] = step[h].m_new;
    st.l[h] *= step[h].alpha;
  }
#pragma unroll
  for (int nb = 0; nb < D / 8; ++nb)
#pragma unroll
    for (int c = 0; c < 4; ++c) st.o[nb][c] *= step[c / 2].alpha;
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    float prob[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      prob[c] = pf::softmax_weight(sc[nb][c], step[c / 2].m_new);
      st.l[c / 2] += prob[c];
      if (scales) prob[c] *= __half2float(scales[first + 8 * nb + pf::mma_c(lane, c).col].v);
    }
    pa[nb / 2][2 * (nb % 2)] = pack2<T>(prob[0], prob[1]);
    pa[nb / 2][2 * (nb % 2) + 1] = pack2<T>(prob[2], prob[3]);
  }
}

// O += P V over KS k-steps of 16 tokens from tile token `first`: one ldmatrix.x4.trans gives
// b0 b1 of n-blocks 2 n2 and 2 n2 + 1.
template <typename T, int D, int KS>
__device__ inline void accumulate_pv(float (&o)[D / 8][4], const uint32_t (&pa)[KS][4], const uint8_t* v_tile,
                                     int first, int lane) {
#pragma unroll
  for (int j = 0; j < KS; ++j) {
#pragma unroll
    for (int n2 = 0; n2 < D / 16; ++n2) {
      uint32_t vb[4];
      const pf::RowCol at = pf::ldmatrix_v(lane, first + 16 * j, 16 * n2);
      ldmatrix_x4_trans(vb, shared_address(v_tile + pf::smem_offset(at.row, at.col, D)));
      mma_16816<T>(o[2 * n2], pa[j], vb[0], vb[1]);
      mma_16816<T>(o[2 * n2 + 1], pa[j], vb[2], vb[3]);
    }
  }
}

}  // namespace kvcache_ext::attention::tc
