// The device-independent logic of the tensor-core prefill kernel (prefill_cuda.cu), host and
// device code alike (no CUDA headers), so that the CPU gtest (tests/test_prefill_tiles.cpp)
// runs the kernel's tile loop through exactly these functions: the packing of query rows into
// M tiles, which KV tiles a query tile needs, the causal mask, the online softmax, the merge of
// splits, the mma.sync m16n8k16 fragment maps, the ldmatrix address maps and the shared-memory
// swizzle.
//
// Tiling. Segment s = (b, h) serves R = G * n query rows: the G query heads of KV head h times
// the n new tokens. The kernel packs them query-major, packed row p = i * G + g, so that an
// M tile of kTileM consecutive packed rows holds every head of kTileM / G consecutive queries:
// the tile's query positions form a narrow range and the causal mask cuts whole KV tiles away
// at the diagonal, whatever G is. A block attends one split of the segment's live tokens
// (attention_plan.h) for one M tile, walking the split in KV tiles of kTileN tokens; each of
// its 4 warps owns 16 rows of the M tile (one mma M dimension).
//
// Logits are in base 2 (scaled by scale * log2(e) in fp32 after the mma), as in
// attention_cuda.cu, so exp2 does the softmax and the split states {m, l, o} merge the same way.
#pragma once

#include <cmath>
#include <cstdint>

#include "attention/merge_states.h"

#if defined(__CUDACC__)
#define KVCACHE_PREFILL_HD __host__ __device__
#else
#define KVCACHE_PREFILL_HD
#endif

namespace kvcache_ext::attention::prefill {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kWarpRows = 16;                 // mma M: rows per warp
constexpr int kTileM = kWarps * kWarpRows;    // packed query rows per block
constexpr int kTileN = 64;                    // tokens per KV tile (divides the plan's 128)
constexpr int kChunkElems = 8;                // 16-bit elements per 16-byte chunk
constexpr int kStages = 2;                    // KV tiles in shared memory at once

// ---------------------------------------------------------------------------------------
// Query packing

struct RowOf {  // the (head in group, query) of a packed row
  int g, i;
};
KVCACHE_PREFILL_HD inline int packed_row(int g, int i, int groups) { return i * groups + g; }
KVCACHE_PREFILL_HD inline RowOf unpack_row(int p, int groups) { return {p % groups, p / groups}; }
KVCACHE_PREFILL_HD inline int row_tiles(int rows) { return (rows + kTileM - 1) / kTileM; }

// Row of q and out ([B, Hq, n, D] viewed as rows of D) of packed row p of segment s.
KVCACHE_PREFILL_HD inline int64_t q_row(int64_t s, int p, int groups, int n) {
  const RowOf r = unpack_row(p, groups);
  return (s * groups + r.g) * n + r.i;
}

// ---------------------------------------------------------------------------------------
// Causal mask from positions

// Token of position slot_pos is visible to a query at query_pos (the reference's rule: the
// slot's own position, not its index, since eviction leaves gaps). Without q_pos every live
// token is visible: the kernel passes INT32_MAX as every query's position.
KVCACHE_PREFILL_HD inline bool visible(int32_t slot_pos, int32_t query_pos) {
  return slot_pos <= query_pos;
}

// A KV tile is needed by an M tile iff some query of the M tile sees some token of the KV
// tile: the smallest position of the KV tile's live tokens against the largest query
// position of the M tile's rows. No order of positions along the segment is assumed.
KVCACHE_PREFILL_HD inline bool tile_needed(int32_t min_slot_pos, int32_t max_query_pos) {
  return visible(min_slot_pos, max_query_pos);
}

// ---------------------------------------------------------------------------------------
// Online softmax (base 2) and the merge of split states

// A row's running state over the tiles it has seen: max logit m (-inf until a visible token),
// sum l of exp2(logit - m), and the output o (kept by the caller) scaled to the same m.
struct SoftmaxStep {
  float m_new;  // the new running max
  float alpha;  // factor on the old l and o: exp2(m_old - m_new), 1 while m_new is -inf
};

KVCACHE_PREFILL_HD inline float neg_inf() { return -INFINITY; }

KVCACHE_PREFILL_HD inline SoftmaxStep softmax_step(float m_old, float tile_max) {
  const float m_new = m_old > tile_max ? m_old : tile_max;
  if (m_new == neg_inf()) return {m_new, 1.f};  // nothing visible yet: keep l = 0, o = 0
  return {m_new, exp2f(m_old - m_new)};         // m_old = -inf gives 0: nothing to keep
}

// Probability weight of a logit against the running max; masked logits (-inf) give 0, and a
// row that has seen nothing visible (m = -inf) gives 0 rather than exp2(-inf + inf) = NaN.
KVCACHE_PREFILL_HD inline float softmax_weight(float logit, float m) {
  return m == neg_inf() ? 0.f : exp2f(logit - m);
}

// Merge of the split states {m_w, l_w, o_w} of one row, element d of its output: the splits
// [first, last) folded in order by merge_states.h, as the decode kernel merges (a row that saw
// no token in any split outputs zeros). part_* are [W, rows(, D)].
KVCACHE_PREFILL_HD inline MergeState<1> merge_element(const float* part_m, const float* part_l,
                                                      const float* part_o, int first, int last,
                                                      int64_t rows, int row, int D, int d) {
  MergeState<1> st = MergeState<1>::empty();
  for (int w = first; w < last; ++w) {
    const int64_t pr = static_cast<int64_t>(w) * rows + row;
    st.merge(part_m[pr], part_l[pr], part_o + pr * D + d);
  }
  return st;
}

// The merged state of a row as its log-sum-exp lse = m + log2(l) (base 2), kept for the
// statistics pass: p = exp2(logit - lse). A row that saw no token gets +inf, so that every
// weight of it is exp2(x - inf) = 0 (x finite, or -inf when masked) with no branch.
KVCACHE_PREFILL_HD inline float row_lse(float m, float l) { return l > 0.f ? m + log2f(l) : INFINITY; }
KVCACHE_PREFILL_HD inline float stats_weight(float logit, float lse) { return exp2f(logit - lse); }

// ---------------------------------------------------------------------------------------
// The statistics pass (prefill_stats in prefill_cuda.cu)
//
// After the merge, a block owns a KV tile of kTileN tokens of one split (each warp 16 of
// them) and walks the segment's queries in M tiles of kTileM rows, recomputing the
// probabilities from the saved lse (as FlashAttention-2's backward does): S^T = K Q^T by
// mma.sync, K the A operand (ldmatrix_q's map on the K tile), Q the B operand (ldmatrix_k's
// map on the Q tile), so that a lane's C fragment holds two tokens (rows lane / 4 and
// lane / 4 + 8) and, per n-block of 8 query rows, columns 2 (lane % 4) and 2 (lane % 4) + 1.
// Each token's sums stay in registers; the quad adds them at the end and its first lane
// stores them once (the block owns the tile: no atomics, no read-modify-write).
//
// Rows of the pass: a query's G heads are padded to Gp = the power of two >= G rows, stats
// row P = i * Gp + g (rows g >= G dead), so that a query's heads fill an aligned block of Gp
// adjacent rows: within a lane (the two columns of an n-block, Gp >= 2), then over
// group_lanes(Gp) neighbouring lanes of the quad (shfl_xor 1, 2) and group_nblocks(Gp)
// consecutive n-blocks. The mean over heads, squared, needs no shared memory for any G up to
// kMaxStatsGroups (a query within one M tile). Padding costs (Gp - G) / Gp of the pass's mma
// work (G = 3, 6: 1/4; G = 7: 1/8; G = 1, 2, 4, 8: none).
constexpr int kMaxStatsGroups = kTileM;

// log2 of Gp (shifts and masks, not divisions, in the kernel's inner loop).
KVCACHE_PREFILL_HD inline int padded_groups_log2(int groups) {
  int lg = 0;
  while ((1 << lg) < groups) ++lg;
  return lg;
}
struct StatsRow {
  int g, i;
  bool live;  // a head of the group (g < G) of a query of the block (i < n)
};
KVCACHE_PREFILL_HD inline StatsRow stats_row(int row, int padded_log2, int groups, int n) {
  const int g = row & ((1 << padded_log2) - 1), i = row >> padded_log2;
  return {g, i, g < groups && i < n};
}
KVCACHE_PREFILL_HD inline int stats_tiles(int n, int padded_log2) {
  return static_cast<int>(((static_cast<int64_t>(n) << padded_log2) + kTileM - 1) / kTileM);
}
// The M tile that holds the last query's rows (all of them: Gp divides kTileM).
KVCACHE_PREFILL_HD inline int last_query_tile(int n, int padded_log2) {
  return static_cast<int>((static_cast<int64_t>(n - 1) << padded_log2) / kTileM);
}
// Lanes of a quad whose columns hold one query's rows: Gp = 1 (every column a query) and
// 2 (the lane's two columns): one; Gp = 4: two; Gp >= 8: the whole quad.
KVCACHE_PREFILL_HD inline int group_lanes(int padded) { return padded <= 2 ? 1 : padded == 4 ? 2 : 4; }
// Consecutive n-blocks of 8 rows one query spans: one up to Gp = 8, Gp / 8 beyond.
KVCACHE_PREFILL_HD inline int group_nblocks(int padded) { return padded <= 8 ? 1 : padded / 8; }

// ---------------------------------------------------------------------------------------
// mma.sync.aligned.m16n8k16 fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16"):
// lane = 4 * group + quad_lane; every register holds two 16-bit elements (A, B) or one fp32
// (C/D), element e of a register being the lower (e = 0) or upper half.

struct RowCol {
  int row, col;
};

// A (16 x 16, row-major), registers a0..a3, element e: a0 rows 0-7 / cols 0-7, a1 rows 8-15,
// a2 cols 8-15, a3 both.
KVCACHE_PREFILL_HD inline RowCol mma_a(int lane, int reg, int e) {
  return {lane / 4 + 8 * (reg % 2), 2 * (lane % 4) + e + 8 * (reg / 2)};
}
// B (16 x 8, "col": element (k, n)), registers b0, b1: {row = k, col = n}.
KVCACHE_PREFILL_HD inline RowCol mma_b(int lane, int reg, int e) {
  return {2 * (lane % 4) + e + 8 * reg, lane / 4};
}
// C/D (16 x 8, fp32), c0..c3: c0, c1 row lane / 4, c2, c3 row lane / 4 + 8.
KVCACHE_PREFILL_HD inline RowCol mma_c(int lane, int c) {
  return {lane / 4 + 8 * (c / 2), 2 * (lane % 4) + c % 2};
}

// ldmatrix.sync.aligned.m8n8.x4: lanes 8j .. 8j + 7 give the row addresses of matrix j, and
// register j of every lane receives that matrix's elements (row lane / 4, cols 2 (lane % 4)
// + e); with .trans it receives (row 2 (lane % 4) + e, col lane / 4) of the stored matrix.
KVCACHE_PREFILL_HD inline RowCol ldmatrix_element(int lane, int e, bool trans) {
  return trans ? RowCol{2 * (lane % 4) + e, lane / 4} : RowCol{lane / 4, 2 * (lane % 4) + e};
}

// The (row, column) of the shared tile whose 8-element chunk a lane points ldmatrix.x4 at, for
// the three loads of the kernel. Each is the inverse of the fragment it feeds: register j of
// the load is fragment register j (A) or b0, b1 of two consecutive fragments (B).
//
// Q (rows = packed query rows, cols = d) as A of k-step k0, warp rows row0.. row0 + 15:
// matrices (rows 0-7, cols k0), (rows 8-15, k0), (rows 0-7, k0 + 8), (rows 8-15, k0 + 8).
KVCACHE_PREFILL_HD inline RowCol ldmatrix_q(int lane, int row0, int k0) {
  return {row0 + lane % 8 + 8 * ((lane / 8) % 2), k0 + 8 * (lane / 16)};
}
// K (rows = tokens, cols = d) as B of S = Q K^T: for tokens n0 .. n0 + 7 the matrices are
// (k0), (k0 + 8), (k0 + 16), (k0 + 24): b0, b1 of k-step k0, then of k-step k0 + 16.
KVCACHE_PREFILL_HD inline RowCol ldmatrix_k(int lane, int n0, int k0) {
  return {n0 + lane % 8, k0 + 8 * (lane / 8)};
}
// V (rows = tokens, cols = d) as B of O = P V, loaded with .trans: for tokens k0 .. k0 + 15,
// the matrices are (tokens k0, d n0), (k0 + 8, n0), (k0, n0 + 8), (k0 + 8, n0 + 8): b0, b1 of
// the n-block n0, then of n0 + 8.
KVCACHE_PREFILL_HD inline RowCol ldmatrix_v(int lane, int k0, int n0) {
  return {k0 + lane % 8 + 8 * ((lane / 8) % 2), n0 + 8 * (lane / 16)};
}

// ---------------------------------------------------------------------------------------
// Pages of a KV tile: the tile's tokens [t0, t0 + len) lie in entries first .. first + count - 1
// of the segment's page table. The kernels stage those pages' base addresses in shared memory
// once per tile (one table and one page-base load per page, not per row) and find each row's
// page there. At most ceil((kTileN - 1) / P) + 1 of them for pages of P tokens: kTileN at P = 1.
struct TilePages {
  int64_t first;
  int count;
};
KVCACHE_PREFILL_HD inline TilePages tile_pages(int64_t t0, int len, int shift) {
  const int64_t first = t0 >> shift;
  return {first, len > 0 ? static_cast<int>(((t0 + len - 1) >> shift) - first + 1) : 0};
}
// Index into the staged pages of row `row` of the tile.
KVCACHE_PREFILL_HD inline int tile_page_of(int64_t t0, int row, int64_t first, int shift) {
  return static_cast<int>(((t0 + row) >> shift) - first);
}

// ---------------------------------------------------------------------------------------
// Shared-memory swizzle: a tile of rows of D 16-bit elements (D / 8 chunks of 16 bytes, D a
// multiple of 64) stores chunk c of row r at chunk c ^ (r % 8) of that row. A row is a
// multiple of 128 bytes (all 32 banks), so the 8 rows an ldmatrix phase reads, at one logical
// chunk, land on 8 different 16-byte bank groups: no conflict; the cp.async writes of a row's
// chunks stay within the row (a bijection on each row).
KVCACHE_PREFILL_HD inline int swizzled_chunk(int row, int chunk) { return chunk ^ (row % 8); }

// Byte offset of element (row, col) (col a multiple of 8 for a chunk) in a tile of row_elems
// 16-bit elements per row.
KVCACHE_PREFILL_HD inline int smem_offset(int row, int col, int row_elems) {
  return row * row_elems * 2 + swizzled_chunk(row, col / kChunkElems) * 16 + (col % kChunkElems) * 2;
}

// The cp.async copy of a tile: thread t's it-th 16-byte chunk is chunk index it * kThreads + t
// of the tile in row-major order, so 8 consecutive threads write 8 chunks of one row (D = 64:
// a whole row; D = 128: half a row), which the swizzle keeps on 8 different bank groups.
KVCACHE_PREFILL_HD inline RowCol copy_chunk(int index, int row_elems) {
  const int row_chunks = row_elems / kChunkElems;
  return {index / row_chunks, (index % row_chunks) * kChunkElems};
}

// ---------------------------------------------------------------------------------------
// int8 pages (store/quantize.h). A KV tile's rows are copied as stored, D bytes a row, into an
// unswizzled raw tile of 16-byte chunks (raw_copy_chunk: 16 elements a chunk, in row-major
// order); once the tile has landed, the block widens it into the swizzled 16-bit tiles the
// warps read: the 8 elements of copy_chunk(index) come from bytes raw_offset(row, col) on. The
// integers (|q| <= 127) are exact in fp16 and bf16, and the token's scales are applied where the
// scalar kernels apply them: the K scale to the logit (logit_factor), the V scale to the weight
// before P is rounded to T. Each token's scale row (K's, then V's, float16) is copied beside its
// position.
constexpr int kRawChunkElems = 16;  // int8 elements per 16-byte chunk

KVCACHE_PREFILL_HD inline RowCol raw_copy_chunk(int index, int row_elems) {
  const int row_chunks = row_elems / kRawChunkElems;
  return {index / row_chunks, (index % row_chunks) * kRawChunkElems};
}
KVCACHE_PREFILL_HD inline int raw_offset(int row, int col, int row_elems) { return row * row_elems + col; }

// The factor from a Q K^T product to its base-2 logit: the call's scale * log2(e), times the
// token's K scale on int8 pages (1 otherwise). The attention and the statistics pass both take
// it from here, so that the pass recomputes the attention's own logits.
KVCACHE_PREFILL_HD inline float logit_factor(float scale_log2, float k_scale) { return scale_log2 * k_scale; }

}  // namespace kvcache_ext::attention::prefill
