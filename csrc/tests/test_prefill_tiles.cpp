// The tensor-core prefill kernel's device-independent logic (attention/prefill_tiles.h), on the
// host: an emulation of the kernel's tile loop (prefill_cuda.cu) that goes through the same
// maps (packed rows, swizzled shared tiles, ldmatrix addresses and results, mma fragments,
// masking, online softmax, split merge), with mma emulated in fp32 by rebuilding the 16 x 16
// and 16 x 8 operands from the 32 lanes' fragments, must match a float64 attention on random
// ragged paged inputs, on 16-bit pages and on int8 pages (raw tiles widened, the scales on the
// logits and weights); the swizzle must be a bijection without bank conflicts for every
// ldmatrix and cp.async phase of the kernel. The CUDA kernel itself is compared with the
// reference in tests/test_prefill_tc.py (skips without a GPU).
#include <gtest/gtest.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "attention/attention_plan.h"
#include "attention/decode_tiles.h"
#include "attention/prefill_tiles.h"
#include "store/paged_layout.h"
#include "store/quantize.h"
#include "tests/test_util.h"

namespace {

namespace pf = kvcache_ext::attention::prefill;
namespace dt = kvcache_ext::attention::decode_tc;
using kvcache_ext::attention::effective_split;
using kvcache_ext::attention::plan_splits;
using kvcache_ext::attention::Split;
namespace store = kvcache_ext::store;

// 16-bit storage types of the kernel: bits <-> float through c10's types.
template <typename T>
uint16_t to_bits(float x) {
  return T(x).x;
}
template <typename T>
float from_bits(uint16_t b) {
  return static_cast<float>(T(b, T::from_bits()));
}

// ---------------------------------------------------------------------------------------
// Warp primitives, emulated

using Smem = std::vector<uint8_t>;
uint16_t smem_half(const Smem& smem, int byte) {
  uint16_t v;
  std::memcpy(&v, smem.data() + byte, 2);
  return v;
}

// ldmatrix.x4 (.trans): lane l points at the 16-byte chunk at (row, col) = where(l); register j
// of each lane gets two 16-bit elements. Returns regs[lane][j][e].
template <typename Where>
std::vector<std::array<std::array<uint16_t, 2>, 4>> ldmatrix_x4(const Smem& smem, int row_elems,
                                                                 bool trans, Where where) {
  std::vector<std::array<std::array<uint16_t, 2>, 4>> regs(32);
  for (int lane = 0; lane < 32; ++lane)
    for (int j = 0; j < 4; ++j)
      for (int e = 0; e < 2; ++e) {
        const pf::RowCol in = pf::ldmatrix_element(lane, e, trans);  // within matrix j
        const pf::RowCol at = where(8 * j + in.row);                 // that row's chunk
        regs[lane][j][e] = smem_half(smem, pf::smem_offset(at.row, at.col + in.col, row_elems));
      }
  return regs;
}

// Banks an ldmatrix / cp.async phase of 8 lanes touches: 16 bytes each, from the tile's
// 128-byte aligned base. Conflict-free iff all 32 banks are distinct.
template <typename Where>
void expect_phases_conflict_free(int row_elems, Where where, const char* what) {
  for (int phase = 0; phase < 4; ++phase) {
    std::set<int> banks;
    for (int l = 8 * phase; l < 8 * phase + 8; ++l) {
      const pf::RowCol at = where(l);
      ASSERT_EQ(at.col % pf::kChunkElems, 0) << what;
      const int byte = pf::smem_offset(at.row, at.col, row_elems);
      for (int w = 0; w < 4; ++w) banks.insert((byte / 4 + w) % 32);
    }
    EXPECT_EQ(banks.size(), 32u) << what << " D = " << row_elems << " phase " << phase;
  }
}

// One lane's fragments.
using AFrag = std::array<std::array<float, 2>, 4>;  // a0..a3, two elements each
using BFrag = std::array<std::array<float, 2>, 2>;  // b0, b1
using CFrag = std::array<float, 4>;

// D += A B over a warp, from the fragments through the maps of mma.m16n8k16.
void mma(std::vector<CFrag>& c, const std::vector<AFrag>& a, const std::vector<BFrag>& b) {
  float A[16][16], B[16][8];
  for (int lane = 0; lane < 32; ++lane)
    for (int e = 0; e < 2; ++e) {
      for (int reg = 0; reg < 4; ++reg) {
        const pf::RowCol rc = pf::mma_a(lane, reg, e);
        A[rc.row][rc.col] = a[lane][reg][e];
      }
      for (int reg = 0; reg < 2; ++reg) {
        const pf::RowCol rc = pf::mma_b(lane, reg, e);
        B[rc.row][rc.col] = b[lane][reg][e];
      }
    }
  for (int lane = 0; lane < 32; ++lane)
    for (int k = 0; k < 4; ++k) {
      const pf::RowCol rc = pf::mma_c(lane, k);
      float sum = 0.f;
      for (int kk = 0; kk < 16; ++kk) sum += A[rc.row][kk] * B[kk][rc.col];
      c[lane][k] += sum;
    }
}

// ---------------------------------------------------------------------------------------
// A ragged paged problem in host memory

struct Problem {
  int B, H, G, n, D, shift;
  float scale;
  bool causal;
  std::vector<int32_t> len;                 // [S]
  std::vector<std::vector<uint8_t>> pages;  // page records
  std::vector<int64_t> page_base;
  std::vector<int32_t> table;               // [S, width]
  int64_t width;
  store::PageRecord record;
  std::vector<uint16_t> q;                  // [B, H * G, n, D] bits
  std::vector<int32_t> q_pos;               // [B, n]
  bool q8 = false;                          // int8 pages (store/quantize.h)

  int S() const { return B * H; }
  int rows() const { return G * n; }
  store::PagedView view() const {
    store::PagedView v{};
    v.page_base = page_base.data();
    v.table = table.data();
    v.width = width;
    v.shift = shift;
    v.record = record;
    return v;
  }
  int32_t query_pos(int b, int i) const { return causal ? q_pos[b * n + i] : INT32_MAX; }
  // Token l of segment s's K (part kK) or V (kV) scale: 1 on 16-bit pages.
  float scale_of(int part, int s, int l) const {
    if (!q8) return 1.f;
    const auto* row = reinterpret_cast<const c10::Half*>(view().token(store::kScale, s, l));
    return static_cast<float>(row[part == store::kK ? 0 : 1]);
  }
  // Element d of that K or V row as the kernels read it (the stored integer on int8 pages).
  float stored(int part, int s, int l, int d) const {
    const char* row = view().token(part, s, l);
    if (q8) return static_cast<float>(reinterpret_cast<const int8_t*>(row)[d]);
    return from_bits_any(reinterpret_cast<const uint16_t*>(row)[d]);
  }
  // Its value: the stored element times the row's scale (exact in double).
  double value(int part, int s, int l, int d) const { return double(stored(part, s, l, d)) * scale_of(part, s, l); }
  float (*from_bits_any)(uint16_t) = nullptr;  // the 16-bit type's bits -> float
};

// q8: int8 pages, K and V drawn in float32 and quantized as the store does (store/quantize.h).
template <typename T>
Problem make_problem(std::mt19937& rng, int B, int H, int G, int n, int D, int shift, bool causal,
                     bool shuffled_positions, int max_len, bool edge_segments = false, bool q8 = false) {
  Problem p{B, H, G, n, D, shift, 1.f / std::sqrt(static_cast<float>(D)), causal};
  p.q8 = q8;
  p.from_bits_any = &from_bits<T>;
  const int S = B * H;
  const int P = 1 << shift;
  p.len.resize(S);
  for (int s = 0; s < S; ++s) {
    const int kind = static_cast<int>(kvtest::uniform_int(rng, 0, 5));  // empty, one, short, long
    p.len[s] = kind == 0 ? 0 : kind == 1 ? 1 : kind == 2 ? static_cast<int>(kvtest::uniform_int(rng, 2, 70))
                                                       : static_cast<int>(kvtest::uniform_int(rng, 2, max_len));
  }
  if (edge_segments && S >= 3) {  // an empty and a one-token segment whatever the draw gave
    p.len[0] = 0;
    p.len[S - 1] = 1;
  }
  int32_t longest = 1;
  for (int32_t l : p.len) longest = std::max(longest, l);
  p.width = (longest + P - 1) / P;
  p.record = store::page_record(P, D, q8 ? 1 : 2, 0, q8);
  std::normal_distribution<float> normal(0.f, 1.f);
  // Pages of all segments, in a shuffled order (a page id says nothing about its segment).
  int pages = 0;
  for (int s = 0; s < S; ++s) pages += (p.len[s] + P - 1) / P;
  std::vector<int32_t> ids(pages);
  for (int i = 0; i < pages; ++i) ids[i] = i;
  std::shuffle(ids.begin(), ids.end(), rng);
  p.pages.assign(pages, std::vector<uint8_t>(p.record.bytes, 0xff));  // NaN bits past the tokens
  for (auto& pg : p.pages) p.page_base.push_back(reinterpret_cast<int64_t>(pg.data()));
  p.table.assign(static_cast<size_t>(S) * p.width, -1);
  int next = 0;
  const store::PagedView v = p.view();
  for (int s = 0; s < S; ++s) {
    for (int c = 0; c < (p.len[s] + P - 1) / P; ++c) p.table[s * p.width + c] = ids[next++];
    // Positions with gaps (evicted tokens), optionally out of order.
    std::vector<int32_t> pos(p.len[s]);
    int32_t at = static_cast<int32_t>(kvtest::uniform_int(rng, 0, 3));
    for (auto& x : pos) x = (at += static_cast<int32_t>(kvtest::uniform_int(rng, 1, 3)));
    if (shuffled_positions) std::shuffle(pos.begin(), pos.end(), rng);
    for (int l = 0; l < p.len[s]; ++l) {
      if (q8) {
        // Rows of different magnitudes (a scale per row must follow each).
        const float magnitude = std::exp2(static_cast<float>(kvtest::uniform_int(rng, -3, 3)));
        std::vector<float> x(D);
        auto* scale = reinterpret_cast<c10::Half*>(const_cast<char*>(v.token(store::kScale, s, l)));
        for (int part : {store::kK, store::kV}) {
          for (auto& e : x) e = magnitude * normal(rng);
          auto* row = reinterpret_cast<int8_t*>(const_cast<char*>(v.token(part, s, l)));
          scale[part == store::kK ? 0 : 1] = store::quantize_row(x.data(), D, row);
        }
      } else {
        auto* k = reinterpret_cast<uint16_t*>(const_cast<char*>(v.token(store::kK, s, l)));
        auto* vv = reinterpret_cast<uint16_t*>(const_cast<char*>(v.token(store::kV, s, l)));
        for (int d = 0; d < D; ++d) {
          k[d] = to_bits<T>(normal(rng));
          vv[d] = to_bits<T>(normal(rng));
        }
      }
      std::memcpy(const_cast<char*>(v.token(store::kPos, s, l)), &pos[l], 4);
    }
  }
  p.q.resize(static_cast<size_t>(B) * H * G * n * D);
  for (auto& x : p.q) x = to_bits<T>(normal(rng));
  p.q_pos.resize(static_cast<size_t>(B) * n);
  for (int b = 0; b < B; ++b) {
    // Queries from before the earliest token to past the longest segment's last position.
    const int32_t first = static_cast<int32_t>(kvtest::uniform_int(rng, 0, 3 * longest / 2));
    for (int i = 0; i < n; ++i) p.q_pos[b * n + i] = first + 2 * i;
  }
  return p;
}

// The kernels' page list of a KV tile [t0, t0 + len) of segment s: the pages' addresses
// staged once (tile_pages), each row's page found in the list (tile_page_of) rather than in
// the page table. at() throws on an index outside the list.
struct StagedPages {
  std::vector<const char*> base;
  int64_t t0, first, mask;
  int shift;
  store::PageRecord record;
  StagedPages(const Problem& p, int s, int64_t tile_t0, int len)
      : t0(tile_t0), mask((int64_t{1} << p.shift) - 1), shift(p.shift), record(p.record) {
    const pf::TilePages tp = pf::tile_pages(t0, len, shift);
    EXPECT_LE(tp.count, pf::kTileN);
    first = tp.first;
    for (int c = 0; c < tp.count; ++c)
      base.push_back(reinterpret_cast<const char*>(p.page_base[p.table[s * p.width + tp.first + c]]));
  }
  const char* row(int part, int r) const {
    return base.at(pf::tile_page_of(t0, r, first, shift)) + record.offset[part] + ((t0 + r) & mask) * record.row_bytes[part];
  }
};

// float64 attention of the bf16 / fp16 values: out [B, Hq, n, D].
template <typename T>
std::vector<double> reference(const Problem& p) {
  const store::PagedView v = p.view();
  std::vector<double> out(p.q.size(), 0.0);
  for (int s = 0; s < p.S(); ++s) {
    const int b = s / p.H;
    for (int g = 0; g < p.G; ++g)
      for (int i = 0; i < p.n; ++i) {
        const int64_t row = (static_cast<int64_t>(s) * p.G + g) * p.n + i;
        std::vector<double> logit(p.len[s]);
        double m = -INFINITY;
        for (int l = 0; l < p.len[s]; ++l) {
          int32_t pos;
          std::memcpy(&pos, v.token(store::kPos, s, l), 4);
          if (!pf::visible(pos, p.query_pos(b, i))) {
            logit[l] = -INFINITY;
            continue;
          }
          double dot = 0.0;
          for (int d = 0; d < p.D; ++d) dot += double(from_bits<T>(p.q[row * p.D + d])) * p.value(store::kK, s, l, d);
          logit[l] = dot * p.scale;
          m = std::max(m, logit[l]);
        }
        if (m == -INFINITY) continue;  // no visible token: zeros
        double sum = 0.0;
        std::vector<double> o(p.D, 0.0);
        for (int l = 0; l < p.len[s]; ++l) {
          if (logit[l] == -INFINITY) continue;
          const double w = std::exp(logit[l] - m);
          sum += w;
          for (int d = 0; d < p.D; ++d) o[d] += w * p.value(store::kV, s, l, d);
        }
        for (int d = 0; d < p.D; ++d) out[row * p.D + d] = o[d] / sum;
      }
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Pieces both kernels' emulations share

// Int8 pages: a raw tile of part `part` (rows past tile_len zero-filled) as the cp.async chunks
// of raw_copy_chunk land it, then widened into the swizzled 16-bit tile by copy_chunk's chunks
// (tc_common.cuh's KvTileCopy::widen).
template <typename T>
void copy_and_widen(const StagedPages& pages, int part, int D, int tile_len, Smem& wide) {
  Smem raw(pf::kTileN * D, 0xab);  // garbage until written: a chunk never copied shows
  for (int idx = 0; idx < pf::kTileN * D / pf::kRawChunkElems; ++idx) {
    const pf::RowCol at = pf::raw_copy_chunk(idx, D);
    uint8_t* dst = raw.data() + pf::raw_offset(at.row, at.col, D);
    if (at.row < tile_len) std::memcpy(dst, pages.row(part, at.row) + at.col, 16);
    else std::memset(dst, 0, 16);
  }
  for (int idx = 0; idx < pf::kTileN * D / pf::kChunkElems; ++idx) {
    const pf::RowCol at = pf::copy_chunk(idx, D);
    const auto* src = reinterpret_cast<const int8_t*>(raw.data() + pf::raw_offset(at.row, at.col, D));
    for (int e = 0; e < pf::kChunkElems; ++e) {
      const uint16_t bits = to_bits<T>(static_cast<float>(src[e]));
      std::memcpy(wide.data() + pf::smem_offset(at.row, at.col, D) + 2 * e, &bits, 2);
    }
  }
}

// The tile's K and V scales (zeros past tile_len, as the zero-filled copies give; ones on
// 16-bit pages).
struct TileScales {
  std::vector<float> k, v;
};
TileScales tile_scales(const Problem& p, const StagedPages& pages, int tile_len) {
  TileScales sc{std::vector<float>(pf::kTileN, p.q8 ? 0.f : 1.f), std::vector<float>(pf::kTileN, p.q8 ? 0.f : 1.f)};
  if (!p.q8) return sc;
  for (int j = 0; j < tile_len; ++j) {
    const auto* row = reinterpret_cast<const c10::Half*>(pages.row(store::kScale, j));
    sc.k[j] = static_cast<float>(row[0]);
    sc.v[j] = static_cast<float>(row[1]);
  }
  return sc;
}

// The cp.async copy of the KV tile at t0 (tile_len live tokens) of segment s into swizzled K and
// V tiles (rows past the split zero-filled; on int8 pages widened from raw tiles) and its
// positions and scales; returns the smallest position.
template <typename T>
int32_t copy_kv_tile(const Problem& p, int s, int64_t t0, int tile_len, Smem& k_smem, Smem& v_smem,
                     std::vector<int32_t>& pos, TileScales* scales) {
  const int D = p.D;
  const StagedPages pages(p, s, t0, tile_len);
  *scales = tile_scales(p, pages, tile_len);
  if (p.q8) {
    copy_and_widen<T>(pages, store::kK, D, tile_len, k_smem);
    copy_and_widen<T>(pages, store::kV, D, tile_len, v_smem);
  }
  for (int idx = 0; !p.q8 && idx < pf::kTileN * D / pf::kChunkElems; ++idx) {
    const pf::RowCol at = pf::copy_chunk(idx, D);
    const int off = pf::smem_offset(at.row, at.col, D);
    if (at.row < tile_len) {
      std::memcpy(k_smem.data() + off, pages.row(store::kK, at.row) + at.col * 2, 16);
      std::memcpy(v_smem.data() + off, pages.row(store::kV, at.row) + at.col * 2, 16);
    } else {
      std::memset(k_smem.data() + off, 0, 16);
      std::memset(v_smem.data() + off, 0, 16);
    }
  }
  int32_t min_pos = INT32_MAX;
  for (int j = 0; j < tile_len; ++j) {
    std::memcpy(&pos[j], pages.row(store::kPos, j), 4);
    min_pos = std::min(min_pos, pos[j]);
  }
  return min_pos;
}

// A warp's Q fragments (rows row0 .. row0 + 15 of the swizzled Q tile), one set per k-step.
template <typename T>
std::vector<std::vector<AFrag>> q_fragments(const Smem& q_smem, int D, int row0) {
  std::vector<std::vector<AFrag>> qf(D / 16, std::vector<AFrag>(32));
  for (int kk = 0; kk < D / 16; ++kk) {
    const auto regs = ldmatrix_x4(q_smem, D, false, [&](int l) { return pf::ldmatrix_q(l, row0, 16 * kk); });
    for (int lane = 0; lane < 32; ++lane)
      for (int j = 0; j < 4; ++j)
        for (int e = 0; e < 2; ++e) qf[kk][lane][j][e] = from_bits<T>(regs[lane][j][e]);
  }
  return qf;
}

// The B fragments (b0, b1) of one ldmatrix.x4's registers 2 half and 2 half + 1.
template <typename T>
std::vector<BFrag> b_fragments(const std::vector<std::array<std::array<uint16_t, 2>, 4>>& regs, int half) {
  std::vector<BFrag> bf(32);
  for (int lane = 0; lane < 32; ++lane)
    for (int r = 0; r < 2; ++r)
      for (int e = 0; e < 2; ++e) bf[lane][r][e] = from_bits<T>(regs[lane][2 * half + r][e]);
  return bf;
}

// A warp's running state, lane by lane: O accumulators ([D / 8] n-blocks of C fragments), the
// running max m and this lane's part of the sum l of its rows lane / 4 and lane / 4 + 8 (h = 0, 1).
struct WarpState {
  std::vector<std::vector<CFrag>> o;
  std::vector<std::array<float, 2>> m, l;
  explicit WarpState(int D)
      : o(D / 8, std::vector<CFrag>(32, CFrag{})), m(32, {pf::neg_inf(), pf::neg_inf()}), l(32, {0.f, 0.f}) {}
  // Row h's sum over the lane's quad (shfl_xor 1, 2).
  float quad_l(int lane, int h) const {
    float sum = 0.f;
    for (int q = lane & ~3; q < (lane & ~3) + 4; ++q) sum += l[q][h];
    return sum;
  }
};

// One warp's step over a KV tile, as tc_common.cuh runs it (product_tile, mask_tile,
// softmax_tile, accumulate_pv): S = Q K^T over `blocks` n-blocks of 8 tokens from tile token
// `first`, scaled to base 2, masked (live(row of the warp, token of the tile)), the online
// softmax (a quad shares a row; P summed in fp32, then rounded to T as A fragments), O += P V.
// Returns the masked logits ([blocks][32] C fragments).
// scales: the tile's K scales (on the logits) and V scales (on the weights before rounding).
template <typename T, typename Live>
std::vector<std::vector<CFrag>> warp_tile_step(WarpState& st, const std::vector<std::vector<AFrag>>& qf,
                                               const Smem& k_smem, const Smem& v_smem, int D, int first, int blocks,
                                               float scale_log2, const TileScales& scales, Live live) {
  std::vector<std::vector<CFrag>> sc(blocks, std::vector<CFrag>(32, CFrag{}));
  for (int k2 = 0; k2 < D / 32; ++k2)
    for (int nb = 0; nb < blocks; ++nb) {
      const auto regs = ldmatrix_x4(k_smem, D, false, [&](int lane) { return pf::ldmatrix_k(lane, first + 8 * nb, 32 * k2); });
      for (int half = 0; half < 2; ++half) mma(sc[nb], qf[2 * k2 + half], b_fragments<T>(regs, half));
    }
  std::vector<std::array<float, 2>> tile_max(32, {pf::neg_inf(), pf::neg_inf()});
  for (int lane = 0; lane < 32; ++lane)
    for (int nb = 0; nb < blocks; ++nb)
      for (int c = 0; c < 4; ++c) {
        const pf::RowCol rc = pf::mma_c(lane, c);
        float& x = sc[nb][lane][c];
        const int j = first + 8 * nb + rc.col;
        x = live(rc.row, j) ? x * pf::logit_factor(scale_log2, scales.k[j]) : pf::neg_inf();
        tile_max[lane][c / 2] = std::max(tile_max[lane][c / 2], x);
      }
  for (int lane = 0; lane < 32; ++lane)  // shfl_xor 1, 2 within the quad
    for (int h = 0; h < 2; ++h)
      for (int q = lane & ~3; q < (lane & ~3) + 4; ++q) tile_max[lane][h] = std::max(tile_max[lane][h], tile_max[q][h]);
  std::vector<std::vector<AFrag>> pa(blocks / 2, std::vector<AFrag>(32, AFrag{}));  // per k-step of 16 tokens
  for (int lane = 0; lane < 32; ++lane) {
    pf::SoftmaxStep step[2];
    for (int h = 0; h < 2; ++h) {
      step[h] = pf::softmax_step(st.m[lane][h], tile_max[lane][h]);
      st.m[lane][h] = step[h].m_new;
      st.l[lane][h] *= step[h].alpha;
    }
    for (auto& nb_frags : st.o)
      for (int c = 0; c < 4; ++c) nb_frags[lane][c] *= step[c / 2].alpha;
    for (int nb = 0; nb < blocks; ++nb)
      for (int c = 0; c < 4; ++c) {
        const float prob = pf::softmax_weight(sc[nb][lane][c], step[c / 2].m_new);
        st.l[lane][c / 2] += prob;  // fp32, before the V scale and the rounding of P (as the kernel)
        const float weight = prob * scales.v[first + 8 * nb + pf::mma_c(lane, c).col];
        // C of n-blocks 2j, 2j + 1 is A of k-step j: c0 c1 -> a0 / a2, c2 c3 -> a1 / a3.
        pa[nb / 2][lane][(c / 2) + 2 * (nb % 2)][c % 2] = from_bits<T>(to_bits<T>(weight));
      }
  }
  for (int j = 0; j < blocks / 2; ++j)
    for (int n2 = 0; n2 < D / 16; ++n2) {
      const auto regs = ldmatrix_x4(v_smem, D, true, [&](int lane) { return pf::ldmatrix_v(lane, first + 16 * j, 16 * n2); });
      for (int half = 0; half < 2; ++half) mma(st.o[2 * n2 + half], pa[j], b_fragments<T>(regs, half));
    }
  return sc;
}

// ---------------------------------------------------------------------------------------
// The kernel's block, emulated: split `split` of segment s for M tile `tile`. Writes the
// split states of its rows (packed order) into part_m, part_l, part_o ([rows], [rows, D]).

struct Counters {
  int tiles = 0, skipped = 0, merged_segments = 0;  // merged: segments of more than one split
};

template <typename T>
void emulate_block(const Problem& p, int s, Split split, int tile, float* part_m, float* part_l,
                   float* part_o, Counters& count) {
  const int D = p.D, R = p.rows(), b = s / p.H;
  const float scale_log2 = p.scale * 1.4426950408889634f;

  // Q tile, swizzled; rows past R are zeros.
  Smem q_smem(pf::kTileM * D * 2, 0);
  int32_t max_query_pos = INT32_MIN;
  std::vector<int32_t> row_pos(pf::kTileM, INT32_MIN);
  for (int idx = 0; idx < pf::kTileM * D / pf::kChunkElems; ++idx) {
    const pf::RowCol at = pf::copy_chunk(idx, D);
    const int prow = tile * pf::kTileM + at.row;
    if (prow >= R) continue;
    const uint16_t* src = p.q.data() + pf::q_row(s, prow, p.G, p.n) * D + at.col;
    std::memcpy(q_smem.data() + pf::smem_offset(at.row, at.col, D), src, 16);
  }
  for (int r = 0; r < pf::kTileM; ++r) {
    const int prow = tile * pf::kTileM + r;
    if (prow >= R) continue;
    row_pos[r] = p.query_pos(b, pf::unpack_row(prow, p.G).i);
    max_query_pos = std::max(max_query_pos, row_pos[r]);
  }

  // Per warp: Q fragments and the running state.
  std::vector<std::vector<std::vector<AFrag>>> qf;
  for (int w = 0; w < pf::kWarps; ++w) qf.push_back(q_fragments<T>(q_smem, D, 16 * w));
  std::vector<WarpState> st(pf::kWarps, WarpState(D));

  Smem k_smem(pf::kTileN * D * 2), v_smem(pf::kTileN * D * 2);
  std::vector<int32_t> pos(pf::kTileN);
  TileScales scales;
  for (int t0 = split.begin; t0 < split.end; t0 += pf::kTileN) {
    const int tile_len = std::min(pf::kTileN, split.end - t0);
    ++count.tiles;
    const int32_t min_pos = copy_kv_tile<T>(p, s, t0, tile_len, k_smem, v_smem, pos, &scales);
    if (p.causal && !pf::tile_needed(min_pos, max_query_pos)) {
      ++count.skipped;
      continue;
    }
    for (int w = 0; w < pf::kWarps; ++w)
      warp_tile_step<T>(st[w], qf[w], k_smem, v_smem, D, 0, pf::kTileN / 8, scale_log2, scales, [&](int row, int j) {
        return j < tile_len && (!p.causal || pf::visible(pos[j], row_pos[16 * w + row]));
      });
  }
  // Split states of the block's rows: l summed over the quad.
  for (int w = 0; w < pf::kWarps; ++w)
    for (int lane = 0; lane < 32; ++lane)
      for (int h = 0; h < 2; ++h) {
        const int prow = tile * pf::kTileM + 16 * w + lane / 4 + 8 * h;
        if (prow >= R) continue;
        if (lane % 4 == 0) {
          part_m[prow] = st[w].m[lane][h];
          part_l[prow] = st[w].quad_l(lane, h);
        }
        for (int nb = 0; nb < D / 8; ++nb)
          for (int c = 2 * h; c < 2 * h + 2; ++c) part_o[static_cast<int64_t>(prow) * D + 8 * nb + pf::mma_c(lane, c).col] = st[w].o[nb][lane][c];
      }
}

// The whole kernel: every (split, M tile) block, then the merge. Returns out [B, Hq, n, D];
// lse, when given, gets each (segment, packed row)'s merged log-sum-exp ([S, R]), as the
// merge kernel keeps it for the statistics pass.
template <typename T>
std::vector<float> emulate(const Problem& p, int64_t sms, Counters& count, std::vector<float>* lse = nullptr) {
  std::vector<Split> splits;
  std::vector<int32_t> first;
  const int R = p.rows(), D = p.D;
  plan_splits(p.len, pf::row_tiles(R), sms, splits, first);
  const auto W = static_cast<int>(splits.size());
  // NaN until written: a row a block forgets shows up in the merge.
  std::vector<float> part_m(static_cast<size_t>(W) * R, NAN), part_l(part_m.size(), NAN);
  std::vector<float> part_o(part_m.size() * D, NAN);
  for (int w = 0; w < W; ++w) {
    const int s = splits[w].segment;
    const Split sp = effective_split(splits[w], w, first.data(), p.len[s]);
    for (int t = 0; t < pf::row_tiles(R); ++t)
      emulate_block<T>(p, s, sp, t, part_m.data() + static_cast<int64_t>(w) * R,
                       part_l.data() + static_cast<int64_t>(w) * R,
                       part_o.data() + static_cast<int64_t>(w) * R * D, count);
  }
  // The merge kernel: one thread per (segment, packed row, d).
  std::vector<float> out(p.q.size(), NAN);
  if (lse) lse->assign(static_cast<size_t>(p.S()) * R, NAN);
  for (int s = 0; s < p.S(); ++s) count.merged_segments += first[s + 1] - first[s] > 1 ? 1 : 0;
  for (int s = 0; s < p.S(); ++s)
    for (int prow = 0; prow < R; ++prow) {
      for (int d = 0; d < D; ++d) {
        const kvcache_ext::attention::MergeState<1> st = pf::merge_element(
            part_m.data(), part_l.data(), part_o.data(), first[s], first[s + 1], R, prow, D, d);
        if (lse && d == 0) (*lse)[static_cast<size_t>(s) * R + prow] = pf::row_lse(st.m, st.l);
        out[pf::q_row(s, prow, p.G, p.n) * D + d] = st.out(0);
      }
    }
  return out;
}

// P is rounded to T before P V (as on tensor cores): relative 2^-8 (bf16) or 2^-11 (fp16)
// per weight, on outputs of size ~1 (on int8 pages, of the rows' magnitude, up to 8).
template <typename T>
double output_tol(bool q8) {
  return (std::is_same_v<T, c10::BFloat16> ? 1e-2 : 2e-3) * (q8 ? 8 : 1);
}

template <typename T>
void expect_matches_reference(std::mt19937& rng, int B, int H, int G, int n, int D, int shift,
                              bool causal, bool shuffled, int64_t sms, int max_len, Counters& count, bool q8) {
  const Problem p = make_problem<T>(rng, B, H, G, n, D, shift, causal, shuffled, max_len, false, q8);
  const std::vector<double> want = reference<T>(p);
  const std::vector<float> got = emulate<T>(p, sms, count);
  const double tol = output_tol<T>(q8);
  double worst = 0.0;
  int64_t worst_at = -1;
  for (size_t e = 0; e < want.size(); ++e) {
    const double err = std::abs(double(got[e]) - want[e]);
    if (!(err <= worst)) {  // NaN counts as worst
      worst = std::isnan(err) ? INFINITY : err;
      worst_at = static_cast<int64_t>(e);
    }
  }
  EXPECT_LE(worst, tol) << "B " << B << " H " << H << " G " << G << " n " << n << " D " << D
                        << " page " << (1 << shift) << " causal " << causal << " shuffled " << shuffled
                        << " int8 " << q8 << ": worst at " << worst_at;
}

// ---------------------------------------------------------------------------------------
// The statistics pass (prefill_stats), emulated, against float64 statistics

// Statistics in slot layout, as the op hands them to the kernel (zero-filled), with the
// number of stores each slot received (the pass must store each live slot exactly once).
struct SlotStats {
  std::vector<double> mass, last, sum_sq;  // [capacity], [capacity, G], [capacity]
  std::vector<int32_t> count;              // [capacity]
  std::vector<int> stores, last_stores;    // [capacity], [capacity, G]
  SlotStats(int64_t capacity, int G)
      : mass(capacity, 0.0), last(capacity * G, 0.0), sum_sq(capacity, 0.0), count(capacity, 0),
        stores(capacity, 0), last_stores(capacity * G, 0) {}
};

int64_t capacity_of(const Problem& p) { return static_cast<int64_t>(p.pages.size()) << p.shift; }

// The definitions of attention_kernels.h (kvcache_ext.reference): p of every (g, i, token),
// masked slots 0, a row that sees nothing all 0.
template <typename T>
SlotStats reference_stats(const Problem& p) {
  const store::PagedView v = p.view();
  SlotStats st(capacity_of(p), p.G);
  for (int s = 0; s < p.S(); ++s) {
    const int b = s / p.H, L = p.len[s];
    std::vector<int32_t> pos(L);
    for (int l = 0; l < L; ++l) std::memcpy(&pos[l], v.token(store::kPos, s, l), 4);
    std::vector<double> group(static_cast<size_t>(p.n) * L, 0.0);  // [i, l]: sum over g of p
    for (int g = 0; g < p.G; ++g)
      for (int i = 0; i < p.n; ++i) {
        const int64_t row = (static_cast<int64_t>(s) * p.G + g) * p.n + i;
        std::vector<double> logit(L, -INFINITY);
        double m = -INFINITY;
        for (int l = 0; l < L; ++l) {
          if (!pf::visible(pos[l], p.query_pos(b, i))) continue;
          double dot = 0.0;
          for (int d = 0; d < p.D; ++d) dot += double(from_bits<T>(p.q[row * p.D + d])) * p.value(store::kK, s, l, d);
          logit[l] = dot * p.scale;
          m = std::max(m, logit[l]);
        }
        double sum = 0.0;
        for (int l = 0; l < L; ++l) sum += m == -INFINITY || logit[l] == -INFINITY ? 0.0 : std::exp(logit[l] - m);
        for (int l = 0; l < L; ++l) {
          const double prob = sum > 0.0 && logit[l] != -INFINITY ? std::exp(logit[l] - m) / sum : 0.0;
          const int64_t slot = v.slot(s, l);
          st.mass[slot] += prob;
          group[static_cast<size_t>(i) * L + l] += prob;
          if (i == p.n - 1) st.last[slot * p.G + g] = prob;
        }
      }
    for (int l = 0; l < L; ++l) {
      const int64_t slot = v.slot(s, l);
      for (int i = 0; i < p.n; ++i) {
        const double mean = group[static_cast<size_t>(i) * L + l] / p.G;
        st.sum_sq[slot] += mean * mean;
        st.count[slot] += pf::visible(pos[l], p.query_pos(b, i)) ? 1 : 0;
      }
    }
  }
  return st;
}

struct StatsCounters {
  int tiles = 0, skipped_warp_tiles = 0, strided_tiles = 0;  // strided: a block's second tile or later
  std::set<int> padded;  // the Gp the pass ran with
};

// A mutation the test must catch: the query grouping of sum_sq one step too narrow (the two
// halves of a query's heads squared apart).
enum class StatsMutation { kNone, kNarrowGroups };

// Block (w, first_tile) of prefill_stats, lane by lane; lse: [S, R] from the merge.
template <typename T>
void emulate_stats_block(const Problem& p, int s, Split split, int first_tile, int block_tiles,
                         const std::vector<float>& lse, SlotStats& out, StatsCounters& count,
                         StatsMutation mutation) {
  const int D = p.D, G = p.G, n = p.n, b = s / p.H;
  const store::PagedView v = p.view();
  const float scale_log2 = p.scale * 1.4426950408889634f;
  const int lp = pf::padded_groups_log2(G), Gp = 1 << lp;
  const int gl = mutation == StatsMutation::kNarrowGroups ? pf::group_lanes(std::max(1, Gp / 2)) : pf::group_lanes(Gp);
  const int gn = mutation == StatsMutation::kNarrowGroups ? pf::group_nblocks(std::max(1, Gp / 2)) : pf::group_nblocks(Gp);
  const int tiles_m = pf::stats_tiles(n, lp), last_tile = pf::last_query_tile(n, lp);
  const float inv_groups = 1.f / static_cast<float>(G);
  count.padded.insert(Gp);
  const int ksteps = D / 16;

  bool first = true;
  for (int t0 = split.begin + first_tile * pf::kTileN; t0 < split.end; t0 += block_tiles * pf::kTileN) {
    const int tile_len = std::min(pf::kTileN, split.end - t0);
    ++count.tiles;
    count.strided_tiles += first ? 0 : 1;
    first = false;
    const StagedPages pages(p, s, t0, tile_len);
    Smem k_smem(pf::kTileN * D * 2);
    std::vector<int32_t> pos(pf::kTileN, 0);
    const TileScales scales = tile_scales(p, pages, tile_len);
    if (p.q8) copy_and_widen<T>(pages, store::kK, D, tile_len, k_smem);
    for (int idx = 0; !p.q8 && idx < pf::kTileN * D / pf::kChunkElems; ++idx) {
      const pf::RowCol at = pf::copy_chunk(idx, D);
      const int off = pf::smem_offset(at.row, at.col, D);
      if (at.row < tile_len) std::memcpy(k_smem.data() + off, pages.row(store::kK, at.row) + at.col * 2, 16);
      else std::memset(k_smem.data() + off, 0, 16);
    }
    for (int j = 0; j < tile_len; ++j)
      if (p.causal) std::memcpy(&pos[j], pages.row(store::kPos, j), 4);

    // Per warp, per lane: K as A fragments, the lane's two tokens, the warp's least position.
    std::vector<std::vector<std::vector<AFrag>>> kf(pf::kWarps, std::vector<std::vector<AFrag>>(ksteps, std::vector<AFrag>(32)));
    for (int w = 0; w < pf::kWarps; ++w)
      for (int kk = 0; kk < ksteps; ++kk) {
        const auto regs = ldmatrix_x4(k_smem, D, false, [&](int l) { return pf::ldmatrix_q(l, 16 * w, 16 * kk); });
        for (int lane = 0; lane < 32; ++lane)
          for (int j = 0; j < 4; ++j)
            for (int e = 0; e < 2; ++e) kf[w][kk][lane][j][e] = from_bits<T>(regs[lane][j][e]);
      }
    std::vector<int32_t> warp_min_pos(pf::kWarps, INT32_MAX);
    for (int w = 0; w < pf::kWarps; ++w)
      for (int j = 16 * w; j < 16 * w + 16; ++j)
        if (p.causal && j < tile_len) warp_min_pos[w] = std::min(warp_min_pos[w], pos[j]);
    auto token_of = [&](int w, int lane, int h) { return 16 * w + lane / 4 + 8 * h; };
    std::vector<std::vector<std::array<float, 2>>> mass(pf::kWarps, std::vector<std::array<float, 2>>(32, {0.f, 0.f}));
    auto sum_sq = mass;
    std::vector<std::vector<std::array<int32_t, 2>>> seen(pf::kWarps, std::vector<std::array<int32_t, 2>>(32, {0, 0}));

    for (int mt = 0; mt < tiles_m; ++mt) {
      Smem q_smem(pf::kTileM * D * 2);
      std::vector<float> row_lse(pf::kTileM);
      std::vector<int32_t> row_qpos(pf::kTileM);
      for (int idx = 0; idx < pf::kTileM * D / pf::kChunkElems; ++idx) {
        const pf::RowCol at = pf::copy_chunk(idx, D);
        const pf::StatsRow row = pf::stats_row(mt * pf::kTileM + at.row, lp, G, n);
        const int off = pf::smem_offset(at.row, at.col, D);
        if (row.live) std::memcpy(q_smem.data() + off, p.q.data() + pf::q_row(s, pf::packed_row(row.g, row.i, G), G, n) * D + at.col, 16);
        else std::memset(q_smem.data() + off, 0, 16);
      }
      for (int r = 0; r < pf::kTileM; ++r) {
        const pf::StatsRow row = pf::stats_row(mt * pf::kTileM + r, lp, G, n);
        row_lse[r] = row.live ? lse[static_cast<size_t>(s) * p.rows() + pf::packed_row(row.g, row.i, G)] : INFINITY;
        row_qpos[r] = !row.live ? INT32_MIN : p.query_pos(b, row.i);
      }
      const int32_t max_query_pos = *std::max_element(row_qpos.begin(), row_qpos.end());
      for (int w = 0; w < pf::kWarps; ++w) {
        if (p.causal && !pf::tile_needed(warp_min_pos[w], max_query_pos)) {
          ++count.skipped_warp_tiles;
          continue;
        }
        // S^T = K Q^T: n-blocks of 8 query rows.
        std::vector<std::vector<CFrag>> sc(pf::kTileM / 8, std::vector<CFrag>(32, CFrag{}));
        for (int k2 = 0; k2 < D / 32; ++k2)
          for (int nb = 0; nb < pf::kTileM / 8; ++nb) {
            const auto regs = ldmatrix_x4(q_smem, D, false, [&](int lane) { return pf::ldmatrix_k(lane, 8 * nb, 32 * k2); });
            for (int half = 0; half < 2; ++half) mma(sc[nb], kf[w][2 * k2 + half], b_fragments<T>(regs, half));
          }
        for (int lane = 0; lane < 32; ++lane)
          for (int nb = 0; nb < pf::kTileM / 8; ++nb)
            for (int c = 0; c < 4; ++c) {
              const int h = c / 2, j = token_of(w, lane, h);
              const int col = 8 * nb + pf::mma_c(lane, c).col;
              const pf::StatsRow row = pf::stats_row(mt * pf::kTileM + col, lp, G, n);
              const bool vis = j < tile_len && row.live && (!p.causal || pf::visible(pos[j], row_qpos[col]));
              const float factor = pf::logit_factor(scale_log2, scales.k[j]);
              const float prob = vis ? pf::stats_weight(sc[nb][lane][c] * factor, row_lse[col]) : 0.f;
              sc[nb][lane][c] = prob;
              mass[w][lane][h] += prob;
              seen[w][lane][h] += vis && row.g == 0 ? 1 : 0;
              if (mt == last_tile && j < tile_len && row.live && row.i == n - 1) {
                const int64_t at = v.slot(s, t0 + j) * G + row.g;
                out.last[at] = prob;
                ++out.last_stores[at];
              }
            }
        for (int h = 0; h < 2; ++h) {
          if (Gp == 1) {
            for (int lane = 0; lane < 32; ++lane)
              for (int nb = 0; nb < pf::kTileM / 8; ++nb)
                sum_sq[w][lane][h] += sc[nb][lane][2 * h] * sc[nb][lane][2 * h] + sc[nb][lane][2 * h + 1] * sc[nb][lane][2 * h + 1];
            continue;
          }
          std::array<float, 32> part{};
          for (int nb = 0; nb < pf::kTileM / 8; ++nb) {
            for (int lane = 0; lane < 32; ++lane) part[lane] += sc[nb][lane][2 * h] + sc[nb][lane][2 * h + 1];
            if (((nb + 1) & (gn - 1)) != 0) continue;  // the kernel's mask
            for (int off = 1; off < gl; off *= 2) {  // shfl_xor 1 (gl >= 2), 2 (gl >= 4)
              const std::array<float, 32> before = part;
              for (int lane = 0; lane < 32; ++lane) part[lane] = before[lane] + before[lane ^ off];
            }
            for (int lane = 0; lane < 32; ++lane) {
              const float mean = part[lane] * inv_groups;
              if ((lane & (gl - 1)) == 0) sum_sq[w][lane][h] += mean * mean;
            }
            part.fill(0.f);
          }
        }
      }
    }
    // The quad's sums (shfl_xor 1, 2), stored by its first lane.
    for (int w = 0; w < pf::kWarps; ++w)
      for (int lane = 0; lane < 32; lane += 4)
        for (int h = 0; h < 2; ++h) {
          const int j = token_of(w, lane, h);
          if (j >= tile_len) continue;
          float m = 0.f, sq = 0.f;
          int32_t c = 0;
          for (int q = lane; q < lane + 4; ++q) {
            m += mass[w][q][h];
            sq += sum_sq[w][q][h];
            c += seen[w][q][h];
          }
          const int64_t slot = v.slot(s, t0 + j);
          out.mass[slot] = m;
          out.sum_sq[slot] = sq;
          out.count[slot] = c;
          ++out.stores[slot];
        }
  }
}

// The forward pass (for the lse), then every block of the statistics grid: W splits times
// block_tiles = the forward's M tiles.
template <typename T>
SlotStats emulate_stats(const Problem& p, int64_t sms, StatsCounters& count, StatsMutation mutation) {
  Counters forward;
  std::vector<float> lse;
  emulate<T>(p, sms, forward, &lse);
  std::vector<Split> splits;
  std::vector<int32_t> first;
  const int block_tiles = pf::row_tiles(p.rows());
  plan_splits(p.len, block_tiles, sms, splits, first);
  SlotStats out(capacity_of(p), p.G);
  for (int w = 0; w < static_cast<int>(splits.size()); ++w) {
    const int s = splits[w].segment;
    const Split sp = effective_split(splits[w], w, first.data(), p.len[s]);
    for (int k = 0; k < block_tiles; ++k) emulate_stats_block<T>(p, s, sp, k, block_tiles, lse, out, count, mutation);
  }
  return out;
}

// Worst error of the four statistics over the live slots (relative to max(1, |want|)), and
// whether every live slot was stored exactly once and no dead slot at all.
struct StatsError {
  double mass = 0, last = 0, sum_sq = 0;
  int64_t count_mismatches = 0, bad_stores = 0, live_slots = 0;
};

template <typename T>
StatsError stats_error(const Problem& p, const SlotStats& got, const SlotStats& want) {
  StatsError e;
  const store::PagedView v = p.view();
  std::vector<bool> live(got.mass.size(), false);
  for (int s = 0; s < p.S(); ++s)
    for (int l = 0; l < p.len[s]; ++l) live[v.slot(s, l)] = true;
  auto err = [](double g, double w) {
    const double d = std::abs(g - w) / std::max(1.0, std::abs(w));
    return std::isnan(d) ? INFINITY : d;
  };
  for (size_t slot = 0; slot < live.size(); ++slot) {
    if (!live[slot]) {
      e.bad_stores += got.stores[slot] != 0 ? 1 : 0;
      for (int g = 0; g < p.G; ++g) e.bad_stores += got.last_stores[slot * p.G + g] != 0 ? 1 : 0;
      continue;
    }
    ++e.live_slots;
    e.bad_stores += got.stores[slot] != 1 ? 1 : 0;
    e.mass = std::max(e.mass, err(got.mass[slot], want.mass[slot]));
    e.sum_sq = std::max(e.sum_sq, err(got.sum_sq[slot], want.sum_sq[slot]));
    e.count_mismatches += got.count[slot] != want.count[slot] ? 1 : 0;
    for (int g = 0; g < p.G; ++g) {
      e.bad_stores += got.last_stores[slot * p.G + g] > 1 ? 1 : 0;  // 0: its tile was skipped (p = 0)
      e.last = std::max(e.last, err(got.last[slot * p.G + g], want.last[slot * p.G + g]));
    }
  }
  return e;
}

// fp32 probabilities of exact bf16 / fp16 products against float64: the logits differ by fp32
// rounding only (the mma sums products exactly representable in fp32). Measured worst about
// 2e-7 (relative to max(1, |want|)); the mutation gives about 0.45.
constexpr double kStatsTol = 1e-5;

TEST(PrefillTiles, SwizzleIsABijectionOfEachRow) {
  for (int D : {64, 128}) {
    for (int row = 0; row < pf::kTileN; ++row) {
      std::set<int> offsets;
      for (int col = 0; col < D; col += pf::kChunkElems) {
        const int off = pf::smem_offset(row, col, D);
        EXPECT_GE(off, row * D * 2);
        EXPECT_LT(off, (row + 1) * D * 2);
        EXPECT_EQ(off % 16, 0);
        offsets.insert(off);
      }
      EXPECT_EQ(offsets.size(), static_cast<size_t>(D / pf::kChunkElems)) << "D " << D << " row " << row;
    }
  }
}

TEST(PrefillTiles, LdmatrixAndCopyPhasesHaveNoBankConflict) {
  for (int D : {64, 128}) {
    for (int w = 0; w < pf::kWarps; ++w)
      for (int k0 = 0; k0 < D; k0 += 16)
        expect_phases_conflict_free(D, [&](int l) { return pf::ldmatrix_q(l, 16 * w, k0); }, "Q");
    for (int n0 = 0; n0 < pf::kTileN; n0 += 8)
      for (int k0 = 0; k0 < D; k0 += 32)
        expect_phases_conflict_free(D, [&](int l) { return pf::ldmatrix_k(l, n0, k0); }, "K");
    for (int k0 = 0; k0 < pf::kTileN; k0 += 16)
      for (int n0 = 0; n0 < D; n0 += 16)
        expect_phases_conflict_free(D, [&](int l) { return pf::ldmatrix_v(l, k0, n0); }, "V");
    for (int it = 0; it < pf::kTileN * D / pf::kChunkElems / pf::kThreads; ++it)
      for (int warp = 0; warp < pf::kWarps; ++warp)
        expect_phases_conflict_free(
            D, [&](int l) { return pf::copy_chunk(it * pf::kThreads + 32 * warp + l, D); }, "cp.async");
  }
  // The unswizzled layout would conflict (8 rows of 128 or 256 bytes on the same banks): the
  // check above can fail.
  std::set<int> banks;
  for (int r = 0; r < 8; ++r) banks.insert((r * 64 * 2 / 4) % 32);
  EXPECT_EQ(banks.size(), 1u);
}

TEST(PrefillTiles, FragmentMapsCoverEachOperandOnce) {
  std::set<std::pair<int, int>> a, b, c;
  for (int lane = 0; lane < 32; ++lane) {
    for (int e = 0; e < 2; ++e) {
      for (int reg = 0; reg < 4; ++reg) a.insert({pf::mma_a(lane, reg, e).row, pf::mma_a(lane, reg, e).col});
      for (int reg = 0; reg < 2; ++reg) b.insert({pf::mma_b(lane, reg, e).row, pf::mma_b(lane, reg, e).col});
    }
    for (int k = 0; k < 4; ++k) c.insert({pf::mma_c(lane, k).row, pf::mma_c(lane, k).col});
  }
  EXPECT_EQ(a.size(), 256u);
  EXPECT_EQ(b.size(), 128u);
  EXPECT_EQ(c.size(), 128u);
}

TEST(PrefillTiles, PackedRowsRoundTrip) {
  for (int G : {1, 3, 4, 8})
    for (int n : {1, 5, 17})
      for (int i = 0; i < n; ++i)
        for (int g = 0; g < G; ++g) {
          const pf::RowOf r = pf::unpack_row(pf::packed_row(g, i, G), G);
          EXPECT_EQ(r.g, g);
          EXPECT_EQ(r.i, i);
        }
}

TEST(PrefillTiles, SoftmaxOfNothingVisibleIsZero) {
  const pf::SoftmaxStep step = pf::softmax_step(pf::neg_inf(), pf::neg_inf());
  EXPECT_EQ(step.alpha, 1.f);
  EXPECT_EQ(pf::softmax_weight(pf::neg_inf(), step.m_new), 0.f);
  // Splits that saw nothing merge into a zero output, not NaN.
  const float m[2] = {pf::neg_inf(), pf::neg_inf()}, l[2] = {0.f, 0.f}, o[2] = {0.f, 0.f};
  const kvcache_ext::attention::MergeState<1> st = pf::merge_element(m, l, o, 0, 2, 1, 0, 1, 0);
  EXPECT_EQ(st.out(0), 0.f);
  EXPECT_EQ(st.inv_l(), 0.f);
  EXPECT_EQ(pf::row_lse(st.m, st.l), INFINITY);
  EXPECT_EQ(pf::softmax_step(pf::neg_inf(), 3.f).alpha, 0.f);
}

template <typename T>
void run_emulation_cases(uint32_t seed, bool q8) {
  std::mt19937 rng(seed);
  Counters count;
  struct Case {
    int B, H, G, n, D, shift;
    bool causal, shuffled;
    int64_t sms;
    int max_len;  // of the long segments
  };
  const Case cases[] = {
      {2, 2, 4, 16, 64, 4, true, false, 1, 400},    // GQA, n * G = 64: one M tile
      {2, 2, 4, 37, 128, 6, true, false, 1, 400},   // n not a multiple of anything, 3 M tiles
      {1, 3, 1, 70, 64, 0, true, false, 2, 400},    // pages of one token, G = 1, 2 M tiles
      {2, 1, 3, 5, 64, 2, false, false, 1, 400},    // no q_pos, G = 3, partial M tile
      {1, 2, 2, 40, 128, 5, true, true, 1, 400},    // positions out of token order
      {3, 2, 4, 1, 64, 3, true, false, 4, 400},     // decode-sized: one query, a partial tile
      {1, 2, 4, 24, 128, 4, true, false, 1, 1500},  // long segments: several splits each
  };
  for (const Case& c : cases)
    expect_matches_reference<T>(rng, c.B, c.H, c.G, c.n, c.D, c.shift, c.causal, c.shuffled, c.sms,
                                c.max_len, count, q8);
  EXPECT_GT(count.tiles, 0);
  EXPECT_GT(count.merged_segments, 0) << "no segment had several splits: the merge is untested";
  EXPECT_GT(count.skipped, 0) << "no KV tile was skipped by the causal rule: the rule is untested";
}

TEST(PrefillTiles, EmulatedKernelMatchesFloat64ReferenceBf16) { run_emulation_cases<c10::BFloat16>(43, false); }
TEST(PrefillTiles, EmulatedKernelMatchesFloat64ReferenceFp16) { run_emulation_cases<c10::Half>(44, false); }
TEST(PrefillTiles, EmulatedKernelOnInt8PagesMatchesFloat64ReferenceBf16) { run_emulation_cases<c10::BFloat16>(53, true); }
TEST(PrefillTiles, EmulatedKernelOnInt8PagesMatchesFloat64ReferenceFp16) { run_emulation_cases<c10::Half>(54, true); }

template <typename T>
void run_stats_cases(uint32_t seed, bool q8) {
  std::mt19937 rng(seed);
  StatsCounters count;
  int64_t live_slots = 0;
  struct Case {
    int B, H, G, n, D, shift;
    bool causal, shuffled;
    int64_t sms;
    int max_len;
  };
  const Case cases[] = {
      {1, 4, 1, 70, 64, 0, true, false, 2, 400},     // G = 1, pages of one token, 2 M tiles
      {2, 3, 2, 40, 128, 4, true, true, 1, 400},     // G = 2, positions out of token order
      {2, 3, 4, 37, 128, 5, true, false, 1, 400},    // G = 4, 3 M tiles, a partial one
      {2, 3, 4, 16, 64, 4, false, false, 1, 400},    // no q_pos: count = n, no skip
      {3, 2, 8, 5, 64, 2, true, false, 4, 400},      // G = 8, n small: a partial M tile
      {2, 3, 3, 23, 64, 4, true, false, 1, 300},     // G = 3 padded to 4 rows a query
      {1, 4, 12, 9, 64, 4, true, false, 1, 300},     // G = 12 padded to 16: a query over 2 n-blocks
      {1, 4, 4, 24, 128, 4, true, false, 1, 1500},   // long segments: splits of many KV tiles
  };
  for (const Case& c : cases) {
    const Problem p = make_problem<T>(rng, c.B, c.H, c.G, c.n, c.D, c.shift, c.causal, c.shuffled, c.max_len,
                                      /*edge_segments=*/true, q8);
    const SlotStats want = reference_stats<T>(p);
    const StatsError e = stats_error<T>(p, emulate_stats<T>(p, c.sms, count, StatsMutation::kNone), want);
    const std::string what = "B " + std::to_string(c.B) + " H " + std::to_string(c.H) + " G " + std::to_string(c.G) +
                             " n " + std::to_string(c.n) + " D " + std::to_string(c.D) + " page " +
                             std::to_string(1 << c.shift) + " causal " + std::to_string(c.causal) + " int8 " +
                             std::to_string(q8);
    live_slots += e.live_slots;
    EXPECT_LE(e.mass, kStatsTol) << what;
    EXPECT_LE(e.last, kStatsTol) << what;
    EXPECT_LE(e.sum_sq, kStatsTol) << what;
    EXPECT_EQ(e.count_mismatches, 0) << what;
    EXPECT_EQ(e.bad_stores, 0) << what << ": a live slot not stored exactly once, or a dead one stored";
    // The test can fail: sum_sq with a query's heads split in two groups (Gp >= 4).
    if (c.G >= 3) {
      const StatsError bad = stats_error<T>(p, emulate_stats<T>(p, c.sms, count, StatsMutation::kNarrowGroups), want);
      EXPECT_GT(bad.sum_sq, 10 * kStatsTol) << what << ": the wrong grouping went unnoticed";
      EXPECT_LE(bad.mass, kStatsTol) << what;
    }
  }
  EXPECT_GT(live_slots, 2000) << "too few live slots to say much";
  EXPECT_GT(count.tiles, 100);
  EXPECT_GT(count.skipped_warp_tiles, 0) << "the causal skip of the statistics pass is untested";
  EXPECT_GT(count.strided_tiles, 0) << "no block walked several KV tiles of its split";
  EXPECT_EQ(count.padded, (std::set<int>{1, 2, 4, 8, 16}));
}

TEST(PrefillTiles, EmulatedStatisticsMatchFloat64ReferenceBf16) { run_stats_cases<c10::BFloat16>(45, false); }
TEST(PrefillTiles, EmulatedStatisticsMatchFloat64ReferenceFp16) { run_stats_cases<c10::Half>(46, false); }
TEST(PrefillTiles, EmulatedStatisticsOnInt8PagesMatchFloat64ReferenceBf16) { run_stats_cases<c10::BFloat16>(55, true); }
TEST(PrefillTiles, EmulatedStatisticsOnInt8PagesMatchFloat64ReferenceFp16) { run_stats_cases<c10::Half>(56, true); }

TEST(PrefillTiles, TilePagesListEachPageOfATileOnce) {
  for (int shift = 0; shift <= 7; ++shift)
    for (int64_t t0 : {0, 1, 63, 64, 100, 127, 128, 1000})
      for (int len = 1; len <= pf::kTileN; ++len) {
        const pf::TilePages tp = pf::tile_pages(t0, len, shift);
        const int P = 1 << shift;
        EXPECT_LE(tp.count, (pf::kTileN - 1 + P - 1) / P + 1);  // ceil((kTileN - 1) / P) + 1: kTileN at P = 1
        std::set<int> used;
        for (int r = 0; r < len; ++r) {
          const int c = pf::tile_page_of(t0, r, tp.first, shift);
          ASSERT_GE(c, 0);
          ASSERT_LT(c, tp.count);
          EXPECT_EQ(tp.first + c, (t0 + r) >> shift);
          used.insert(c);
        }
        EXPECT_EQ(static_cast<int>(used.size()), tp.count) << "a staged page no row reads";
      }
  EXPECT_EQ(pf::tile_pages(5, 0, 4).count, 0);
}

TEST(PrefillTiles, StatsRowsPadEachQueryToAPowerOfTwo) {
  for (int G : {1, 2, 3, 4, 5, 7, 8, 12, 16, 33, 64}) {
    const int lp = pf::padded_groups_log2(G), Gp = 1 << lp;
    EXPECT_GE(Gp, G);
    EXPECT_LT(Gp, 2 * G);
    EXPECT_EQ(pf::kTileM % Gp, 0) << "a query's rows must not straddle M tiles";
    // The lanes and n-blocks of a group cover exactly Gp columns of the C fragment (two per
    // lane and n-block; Gp = 1 squares each column alone).
    if (Gp >= 2) {
      EXPECT_EQ(2 * pf::group_lanes(Gp) * pf::group_nblocks(Gp), Gp);
    }
    const int n = 11;
    int live = 0;
    for (int row = 0; row < pf::stats_tiles(n, lp) * pf::kTileM; ++row) {
      const pf::StatsRow r = pf::stats_row(row, lp, G, n);
      live += r.live ? 1 : 0;
      if (r.live) {
        EXPECT_EQ(row, r.i * Gp + r.g);
      }
    }
    EXPECT_EQ(live, G * n);
    EXPECT_EQ(pf::last_query_tile(n, lp), ((n - 1) * Gp) / pf::kTileM);
  }
}

// ---------------------------------------------------------------------------------------
// The tensor-core decode kernel (decode_tc_cuda.cu, decode_tiles.h), emulated: one block per
// split, the segment's R <= 16 rows (scalar order r = g n + i) as one M tile, warp w over
// tokens [16 w, 16 w + 16) of each KV tile with a state of its own, the warps folded in warp
// order at the end. Writes the split's states into part_m, part_l, part_o ([R], [R, D]).

// With statistics (logits non-null: [R, capacity], writes counted in `writes`) the block also
// writes every row's base-2 logit of each token of its split, at the token's slot, and skips no
// KV tile.
template <typename T>
void emulate_decode_block(const Problem& p, int s, Split split, float* part_m, float* part_l, float* part_o,
                          Counters& count, float* logits = nullptr, int* writes = nullptr) {
  const int D = p.D, R = p.rows(), b = s / p.H;
  const float scale_log2 = p.scale * 1.4426950408889634f;
  EXPECT_LE(R, dt::kRows);

  Smem q_smem(dt::kRows * D * 2, 0);
  std::vector<int32_t> row_pos(dt::kRows, INT32_MAX);
  int32_t max_query_pos = INT32_MIN;
  for (int idx = 0; idx < dt::kRows * D / pf::kChunkElems; ++idx) {
    const pf::RowCol at = pf::copy_chunk(idx, D);
    if (at.row >= R) continue;
    const uint16_t* src = p.q.data() + dt::q_row(s, at.row, p.G, p.n, p.n, 0) * D + at.col;
    std::memcpy(q_smem.data() + pf::smem_offset(at.row, at.col, D), src, 16);
  }
  for (int r = 0; r < R; ++r) {
    row_pos[r] = p.query_pos(b, dt::query_of(r, p.n, 0));
    max_query_pos = std::max(max_query_pos, row_pos[r]);
  }
  const std::vector<std::vector<AFrag>> qf = q_fragments<T>(q_smem, D, 0);  // the same in every warp
  std::vector<WarpState> st(dt::kWarps, WarpState(D));

  Smem k_smem(pf::kTileN * D * 2), v_smem(pf::kTileN * D * 2);
  std::vector<int32_t> pos(pf::kTileN);
  TileScales scales;
  for (int t0 = split.begin; t0 < split.end; t0 += pf::kTileN) {
    const int tile_len = std::min(pf::kTileN, split.end - t0);
    ++count.tiles;
    const int32_t min_pos = copy_kv_tile<T>(p, s, t0, tile_len, k_smem, v_smem, pos, &scales);
    if (p.causal && !logits && !pf::tile_needed(min_pos, max_query_pos)) {
      ++count.skipped;
      continue;
    }
    for (int w = 0; w < dt::kWarps; ++w) {
      const int first = dt::warp_first_token(w);
      if (first >= tile_len) continue;
      const auto sc = warp_tile_step<T>(st[w], qf, k_smem, v_smem, D, first, 2, scale_log2, scales, [&](int row, int j) {
        return j < tile_len && (!p.causal || pf::visible(pos[j], row_pos[row]));
      });
      if (!logits) continue;
      for (int lane = 0; lane < 32; ++lane)  // the kernel's slot: page id from the table
        for (int nb = 0; nb < 2; ++nb)
          for (int c = 0; c < 4; ++c) {
            const pf::RowCol rc = pf::mma_c(lane, c);
            const int j = first + 8 * nb + rc.col;
            if (j >= tile_len || rc.row >= R) continue;
            const int64_t t = t0 + j;
            const int64_t slot = (static_cast<int64_t>(p.table[s * p.width + (t >> p.shift)]) << p.shift) |
                                 (t & ((int64_t{1} << p.shift) - 1));
            logits[rc.row * capacity_of(p) + slot] = sc[nb][lane][c];
            ++writes[rc.row * capacity_of(p) + slot];
          }
    }
  }
  // The warps' states through "shared memory" ([kWarps, kRows(, D)], l summed over the quad),
  // then folded in warp order.
  std::vector<float> warp_m(dt::kWarps * dt::kRows, NAN), warp_l(warp_m.size(), NAN);
  std::vector<float> warp_o(warp_m.size() * D, NAN);
  for (int w = 0; w < dt::kWarps; ++w)
    for (int lane = 0; lane < 32; ++lane)
      for (int h = 0; h < 2; ++h) {
        const int wr = w * dt::kRows + lane / 4 + 8 * h;
        if (lane % 4 == 0) {
          warp_m[wr] = st[w].m[lane][h];
          warp_l[wr] = st[w].quad_l(lane, h);
        }
        for (int nb = 0; nb < D / 8; ++nb)
          for (int c = 2 * h; c < 2 * h + 2; ++c) warp_o[static_cast<int64_t>(wr) * D + 8 * nb + pf::mma_c(lane, c).col] = st[w].o[nb][lane][c];
      }
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < D; ++d) {
      const kvcache_ext::attention::MergeState<1> merged = dt::merge_warps(warp_m.data(), warp_l.data(), warp_o.data(), r, D, d);
      part_o[static_cast<int64_t>(r) * D + d] = merged.o[0];
      if (d == 0) {
        part_m[r] = merged.m;
        part_l[r] = merged.l;
      }
    }
}

// The decode call: the plan of one row tile (attention_cuda.cu's make_plan for this kernel),
// every split's block, then the splits folded in order per (segment, row), as merge_segments.
template <typename T>
std::vector<float> emulate_decode(const Problem& p, int64_t sms, Counters& count, float* logits = nullptr,
                                  int* writes = nullptr) {
  std::vector<Split> splits;
  std::vector<int32_t> first;
  const int R = p.rows(), D = p.D;
  plan_splits(p.len, 1, sms, splits, first);
  const auto W = static_cast<int>(splits.size());
  std::vector<float> part_m(static_cast<size_t>(W) * R, NAN), part_l(part_m.size(), NAN);
  std::vector<float> part_o(part_m.size() * D, NAN);
  for (int w = 0; w < W; ++w) {
    const int s = splits[w].segment;
    emulate_decode_block<T>(p, s, effective_split(splits[w], w, first.data(), p.len[s]),
                            part_m.data() + static_cast<int64_t>(w) * R, part_l.data() + static_cast<int64_t>(w) * R,
                            part_o.data() + static_cast<int64_t>(w) * R * D, count, logits, writes);
  }
  std::vector<float> out(p.q.size(), NAN);
  for (int s = 0; s < p.S(); ++s) {
    count.merged_segments += first[s + 1] - first[s] > 1 ? 1 : 0;
    for (int r = 0; r < R; ++r)
      for (int d = 0; d < D; ++d)
        out[dt::q_row(s, r, p.G, p.n, p.n, 0) * D + d] =
            pf::merge_element(part_m.data(), part_l.data(), part_o.data(), first[s], first[s + 1], R, r, D, d).out(0);
  }
  return out;
}

TEST(DecodeTiles, RowsRoundTripAndWarpsCoverATile) {
  for (int G : {1, 2, 4, 8, 16})
    for (int n = 1; G * n <= dt::kRows; ++n) {
      std::set<int64_t> seen;
      for (int r = 0; r < G * n; ++r) {
        const int64_t row = dt::q_row(3, r, G, n, n, 0);
        EXPECT_EQ(row, (3 * G + r / n) * n + dt::query_of(r, n, 0));  // attention_kernels.h's r = g n + i
        // A pass over queries [i0, i0 + n) of n_total: the same head, query i0 + i.
        EXPECT_EQ(dt::q_row(3, r, G, n, n + 5, 2), (3 * G + r / n) * (n + 5) + 2 + r % n);
        EXPECT_EQ(dt::query_of(r, n, 2), 2 + r % n);
        EXPECT_GE(row, int64_t{3} * G * n);
        EXPECT_LT(row, int64_t{4} * G * n);
        seen.insert(row);
      }
      EXPECT_EQ(static_cast<int>(seen.size()), G * n);
    }
  std::set<int> tokens;
  for (int w = 0; w < dt::kWarps; ++w)
    for (int j = 0; j < dt::kWarpTokens; ++j) tokens.insert(dt::warp_first_token(w) + j);
  EXPECT_EQ(static_cast<int>(tokens.size()), pf::kTileN);
  EXPECT_EQ(*tokens.rbegin(), pf::kTileN - 1);
}

TEST(DecodeTiles, WarpMergeOfEmptyWarpsIsEmpty) {
  // Warps that saw no visible token (m = -inf, l = 0) change nothing; all empty: a zero row.
  std::vector<float> m(dt::kWarps * dt::kRows, -INFINITY), l(m.size(), 0.f), o(m.size() * 8, 0.f);
  EXPECT_EQ(dt::merge_warps(m.data(), l.data(), o.data(), 3, 8, 5).out(0), 0.f);
  m[2 * dt::kRows + 3] = 1.f;
  l[2 * dt::kRows + 3] = 2.f;
  o[(2 * dt::kRows + 3) * 8 + 5] = 6.f;
  const auto st = dt::merge_warps(m.data(), l.data(), o.data(), 3, 8, 5);
  EXPECT_EQ(st.m, 1.f);
  EXPECT_FLOAT_EQ(st.out(0), 3.f);
}

template <typename T>
void run_decode_cases(uint32_t seed, bool q8) {
  std::mt19937 rng(seed);
  Counters count;
  struct Case {
    int B, H, G, n, D, shift;
    bool causal, shuffled;
    int64_t sms;
    int max_len;
  };
  const Case cases[] = {
      {3, 2, 4, 1, 128, 4, true, false, 1, 400},    // GQA decode, batch 3, pages of 16
      {2, 3, 1, 1, 64, 0, true, false, 2, 300},     // G = 1: 15 dead rows, pages of one token
      {2, 2, 8, 2, 64, 5, true, true, 1, 500},      // 16 rows (G 8 x n 2), positions out of order
      {1, 2, 3, 5, 128, 3, false, false, 1, 400},   // no q_pos, G = 3, n = 5
      {2, 1, 4, 3, 64, 2, true, false, 1, 200},     // a causal step of 3 queries (some tiles skipped)
      {1, 1, 4, 1, 128, 6, true, false, 8, 3000},   // batch 1, one KV head: many splits
  };
  for (const Case& c : cases) {
    const Problem p = make_problem<T>(rng, c.B, c.H, c.G, c.n, c.D, c.shift, c.causal, c.shuffled, c.max_len,
                                      /*edge_segments=*/true, q8);
    const std::vector<double> want = reference<T>(p);
    const std::vector<float> got = emulate_decode<T>(p, c.sms, count);
    const double tol = output_tol<T>(q8);
    double worst = 0.0;
    for (size_t e = 0; e < want.size(); ++e) {
      const double err = std::abs(double(got[e]) - want[e]);
      worst = std::isnan(err) ? INFINITY : std::max(worst, err);
    }
    EXPECT_LE(worst, tol) << "B " << c.B << " H " << c.H << " G " << c.G << " n " << c.n << " D " << c.D
                          << " int8 " << q8;
  }
  EXPECT_GT(count.tiles, 0);
  EXPECT_GT(count.merged_segments, 0) << "no segment had several splits: the merge is untested";
  EXPECT_GT(count.skipped, 0) << "no KV tile was skipped by the causal rule: the rule is untested";
}

// With statistics: every (row, live slot) gets its logit once, the reference's q.k * scale in
// base 2 (-inf where the row does not see the token; k dequantized on int8 pages), and the
// output is the same.
template <typename T>
void run_decode_logits_cases(uint32_t seed, bool q8) {
  std::mt19937 rng(seed);
  Counters count;
  for (const auto& [G, n, causal, shift] : {std::tuple{4, 1, true, 4}, std::tuple{8, 2, true, 0}, std::tuple{3, 5, false, 6},
                                          std::tuple{1, 1, true, 2}}) {
    const Problem p = make_problem<T>(rng, 2, 3, G, n, 64, shift, causal, /*shuffled_positions=*/true, 700,
                                      /*edge_segments=*/true, q8);
    const int64_t capacity = capacity_of(p);
    const int R = p.rows();
    std::vector<float> logits(static_cast<size_t>(R) * capacity, NAN);
    std::vector<int> writes(logits.size(), 0);
    const std::vector<float> with = emulate_decode<T>(p, 2, count, logits.data(), writes.data());
    const std::vector<float> without = emulate_decode<T>(p, 2, count);
    EXPECT_EQ(with, without) << "statistics changed the output";
    const store::PagedView v = p.view();
    int64_t live_writes = 0;
    for (int s = 0; s < p.S(); ++s)
      for (int l = 0; l < p.len[s]; ++l) {
        const int64_t slot = v.slot(s, l);
        int32_t pos;
        std::memcpy(&pos, v.token(store::kPos, s, l), 4);
        for (int r = 0; r < R; ++r) {
          const int64_t at = r * capacity + slot;
          ASSERT_EQ(writes[at], 1) << "segment " << s << " token " << l << " row " << r;
          ++live_writes;
          const int64_t qrow = dt::q_row(s, r, G, n, n, 0);
          if (!pf::visible(pos, p.query_pos(s / p.H, dt::query_of(r, n, 0)))) {
            EXPECT_EQ(logits[at], -INFINITY);
            continue;
          }
          double dot = 0.0;
          for (int d = 0; d < p.D; ++d) dot += double(from_bits<T>(p.q[qrow * p.D + d])) * p.value(store::kK, s, l, d);
          const double want = dot * p.scale * 1.4426950408889634;
          EXPECT_NEAR(logits[at], want, 1e-4 * (q8 ? std::max(1.0, std::abs(want)) : 1.0));  // int8: rows up to 8
        }
      }
    int64_t all_writes = 0;
    for (int w : writes) all_writes += w;
    EXPECT_EQ(all_writes, live_writes) << "a write to a slot no live token holds";
  }
}

TEST(DecodeTiles, EmulatedKernelMatchesFloat64ReferenceBf16) { run_decode_cases<c10::BFloat16>(47, false); }
TEST(DecodeTiles, LogitsForStatisticsCoverEveryLiveSlotOnceBf16) { run_decode_logits_cases<c10::BFloat16>(49, false); }
TEST(DecodeTiles, LogitsForStatisticsCoverEveryLiveSlotOnceFp16) { run_decode_logits_cases<c10::Half>(50, false); }
TEST(DecodeTiles, EmulatedKernelMatchesFloat64ReferenceFp16) { run_decode_cases<c10::Half>(48, false); }
TEST(DecodeTiles, EmulatedKernelOnInt8PagesMatchesFloat64ReferenceBf16) { run_decode_cases<c10::BFloat16>(57, true); }
TEST(DecodeTiles, EmulatedKernelOnInt8PagesMatchesFloat64ReferenceFp16) { run_decode_cases<c10::Half>(58, true); }
TEST(DecodeTiles, LogitsOnInt8PagesCoverEveryLiveSlotOnceBf16) { run_decode_logits_cases<c10::BFloat16>(59, true); }

}  // namespace
