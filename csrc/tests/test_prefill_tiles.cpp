// The tensor-core prefill kernel's device-independent logic (attention/prefill_tiles.h), on the
// host: an emulation of the kernel's tile loop (prefill_cuda.cu) that goes through the same
// maps (packed rows, swizzled shared tiles, ldmatrix addresses and results, mma fragments,
// masking, online softmax, split merge), with mma emulated in fp32 by rebuilding the 16 x 16
// and 16 x 8 operands from the 32 lanes' fragments, must match a float64 attention on random
// ragged paged inputs; the swizzle must be a bijection without bank conflicts for every
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
#include <type_traits>
#include <vector>

#include "attention/attention_plan.h"
#include "attention/prefill_tiles.h"
#include "store/paged_layout.h"
#include "tests/test_util.h"

namespace {

namespace pf = kvcache_ext::attention::prefill;
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
};

template <typename T>
Problem make_problem(std::mt19937& rng, int B, int H, int G, int n, int D, int shift, bool causal,
                     bool shuffled_positions, int max_len) {
  Problem p{B, H, G, n, D, shift, 1.f / std::sqrt(static_cast<float>(D)), causal};
  const int S = B * H;
  const int P = 1 << shift;
  p.len.resize(S);
  for (int s = 0; s < S; ++s) {
    const int kind = static_cast<int>(kvtest::uniform_int(rng, 0, 5));  // empty, one, short, long
    p.len[s] = kind == 0 ? 0 : kind == 1 ? 1 : kind == 2 ? static_cast<int>(kvtest::uniform_int(rng, 2, 70))
                                                       : static_cast<int>(kvtest::uniform_int(rng, 2, max_len));
  }
  int32_t longest = 1;
  for (int32_t l : p.len) longest = std::max(longest, l);
  p.width = (longest + P - 1) / P;
  p.record = store::page_record(P, D, 2, 0);
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
      auto* k = reinterpret_cast<uint16_t*>(const_cast<char*>(v.token(store::kK, s, l)));
      auto* vv = reinterpret_cast<uint16_t*>(const_cast<char*>(v.token(store::kV, s, l)));
      for (int d = 0; d < D; ++d) {
        k[d] = to_bits<T>(normal(rng));
        vv[d] = to_bits<T>(normal(rng));
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
          const auto* k = reinterpret_cast<const uint16_t*>(v.token(store::kK, s, l));
          double dot = 0.0;
          for (int d = 0; d < p.D; ++d) dot += double(from_bits<T>(p.q[row * p.D + d])) * from_bits<T>(k[d]);
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
          const auto* vv = reinterpret_cast<const uint16_t*>(v.token(store::kV, s, l));
          for (int d = 0; d < p.D; ++d) o[d] += w * from_bits<T>(vv[d]);
        }
        for (int d = 0; d < p.D; ++d) out[row * p.D + d] = o[d] / sum;
      }
  }
  return out;
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
  const store::PagedView v = p.view();
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

  const int ksteps = D / 16;
  // Per warp, per lane: Q fragments, O accumulators, m and partial l of rows grp and grp + 8.
  std::vector<std::vector<std::vector<AFrag>>> qf(pf::kWarps, std::vector<std::vector<AFrag>>(ksteps, std::vector<AFrag>(32)));
  for (int w = 0; w < pf::kWarps; ++w)
    for (int kk = 0; kk < ksteps; ++kk) {
      const auto regs = ldmatrix_x4(q_smem, D, false, [&](int l) { return pf::ldmatrix_q(l, 16 * w, 16 * kk); });
      for (int lane = 0; lane < 32; ++lane)
        for (int j = 0; j < 4; ++j)
          for (int e = 0; e < 2; ++e) qf[w][kk][lane][j][e] = from_bits<T>(regs[lane][j][e]);
    }
  std::vector<std::vector<std::vector<CFrag>>> o(pf::kWarps, std::vector<std::vector<CFrag>>(D / 8, std::vector<CFrag>(32, CFrag{})));
  std::vector<std::vector<std::array<float, 2>>> m(pf::kWarps, std::vector<std::array<float, 2>>(32, {pf::neg_inf(), pf::neg_inf()}));
  std::vector<std::vector<std::array<float, 2>>> l(pf::kWarps, std::vector<std::array<float, 2>>(32, {0.f, 0.f}));

  Smem k_smem(pf::kTileN * D * 2), v_smem(pf::kTileN * D * 2);
  std::vector<int32_t> pos(pf::kTileN);
  for (int t0 = split.begin; t0 < split.end; t0 += pf::kTileN) {
    const int tile_len = std::min(pf::kTileN, split.end - t0);
    ++count.tiles;
    // cp.async: live rows copied, rows past the split zero-filled.
    for (int idx = 0; idx < pf::kTileN * D / pf::kChunkElems; ++idx) {
      const pf::RowCol at = pf::copy_chunk(idx, D);
      const int off = pf::smem_offset(at.row, at.col, D);
      if (at.row < tile_len) {
        std::memcpy(k_smem.data() + off, v.token(store::kK, s, t0 + at.row) + at.col * 2, 16);
        std::memcpy(v_smem.data() + off, v.token(store::kV, s, t0 + at.row) + at.col * 2, 16);
      } else {
        std::memset(k_smem.data() + off, 0, 16);
        std::memset(v_smem.data() + off, 0, 16);
      }
    }
    int32_t min_pos = INT32_MAX;
    for (int j = 0; j < pf::kTileN; ++j) {
      if (j < tile_len) std::memcpy(&pos[j], v.token(store::kPos, s, t0 + j), 4);
      if (j < tile_len) min_pos = std::min(min_pos, pos[j]);
    }
    if (p.causal && !pf::tile_needed(min_pos, max_query_pos)) {
      ++count.skipped;
      continue;
    }
    for (int w = 0; w < pf::kWarps; ++w) {
      // S = Q K^T, 8 n-blocks of 8 tokens.
      std::vector<std::vector<CFrag>> sc(pf::kTileN / 8, std::vector<CFrag>(32, CFrag{}));
      for (int k2 = 0; k2 < D / 32; ++k2)
        for (int nb = 0; nb < pf::kTileN / 8; ++nb) {
          const auto regs = ldmatrix_x4(k_smem, D, false, [&](int lane) { return pf::ldmatrix_k(lane, 8 * nb, 32 * k2); });
          for (int half = 0; half < 2; ++half) {
            std::vector<BFrag> bf(32);
            for (int lane = 0; lane < 32; ++lane)
              for (int r = 0; r < 2; ++r)
                for (int e = 0; e < 2; ++e) bf[lane][r][e] = from_bits<T>(regs[lane][2 * half + r][e]);
            mma(sc[nb], qf[w][2 * k2 + half], bf);
          }
        }
      // Mask, online softmax per row (a lane's two rows; a quad shares a row).
      std::vector<std::array<float, 2>> tile_max(32, {pf::neg_inf(), pf::neg_inf()});
      for (int lane = 0; lane < 32; ++lane)
        for (int nb = 0; nb < pf::kTileN / 8; ++nb)
          for (int c = 0; c < 4; ++c) {
            const pf::RowCol rc = pf::mma_c(lane, c);
            const int row = 16 * w + rc.row, j = 8 * nb + rc.col;
            float& x = sc[nb][lane][c];
            const bool live = j < tile_len && (!p.causal || pf::visible(pos[j], row_pos[row]));
            x = live ? x * scale_log2 : pf::neg_inf();
            tile_max[lane][c / 2] = std::max(tile_max[lane][c / 2], x);
          }
      for (int lane = 0; lane < 32; ++lane)  // shfl_xor 1, 2 within the quad
        for (int h = 0; h < 2; ++h)
          for (int q = lane & ~3; q < (lane & ~3) + 4; ++q) tile_max[lane][h] = std::max(tile_max[lane][h], tile_max[q][h]);
      std::vector<AFrag> pfrag_all[pf::kTileN / 16];
      for (auto& pa : pfrag_all) pa.assign(32, AFrag{});
      for (int lane = 0; lane < 32; ++lane) {
        pf::SoftmaxStep step[2];
        for (int h = 0; h < 2; ++h) {
          step[h] = pf::softmax_step(m[w][lane][h], tile_max[lane][h]);
          m[w][lane][h] = step[h].m_new;
          l[w][lane][h] *= step[h].alpha;
        }
        for (int nb = 0; nb < D / 8; ++nb)
          for (int c = 0; c < 4; ++c) o[w][nb][lane][c] *= step[c / 2].alpha;
        for (int nb = 0; nb < pf::kTileN / 8; ++nb)
          for (int c = 0; c < 4; ++c) {
            const float prob = pf::softmax_weight(sc[nb][lane][c], step[c / 2].m_new);
            l[w][lane][c / 2] += prob;  // fp32, before the rounding of P (as the kernel)
            // C of n-blocks 2j, 2j + 1 is A of k-step j: c0 c1 -> a0 / a2, c2 c3 -> a1 / a3.
            pfrag_all[nb / 2][lane][(c / 2) + 2 * (nb % 2)][c % 2] = from_bits<T>(to_bits<T>(prob));
          }
      }
      // O += P V.
      for (int j = 0; j < pf::kTileN / 16; ++j)
        for (int n2 = 0; n2 < D / 16; ++n2) {
          const auto regs = ldmatrix_x4(v_smem, D, true, [&](int lane) { return pf::ldmatrix_v(lane, 16 * j, 16 * n2); });
          for (int half = 0; half < 2; ++half) {
            std::vector<BFrag> bf(32);
            for (int lane = 0; lane < 32; ++lane)
              for (int r = 0; r < 2; ++r)
                for (int e = 0; e < 2; ++e) bf[lane][r][e] = from_bits<T>(regs[lane][2 * half + r][e]);
            mma(o[w][2 * n2 + half], pfrag_all[j], bf);
          }
        }
    }
  }
  // Split states of the block's rows: l summed over the quad (shfl_xor 1, 2).
  for (int w = 0; w < pf::kWarps; ++w)
    for (int lane = 0; lane < 32; ++lane)
      for (int h = 0; h < 2; ++h) {
        const int prow = tile * pf::kTileM + 16 * w + lane / 4 + 8 * h;
        if (prow >= R) continue;
        float lsum = 0.f;
        for (int q = lane & ~3; q < (lane & ~3) + 4; ++q) lsum += l[w][q][h];
        if (lane % 4 == 0) {
          part_m[prow] = m[w][lane][h];
          part_l[prow] = lsum;
        }
        for (int nb = 0; nb < D / 8; ++nb)
          for (int c = 2 * h; c < 2 * h + 2; ++c) part_o[static_cast<int64_t>(prow) * D + 8 * nb + pf::mma_c(lane, c).col] = o[w][nb][lane][c];
      }
}

// The whole kernel: every (split, M tile) block, then the merge. Returns out [B, Hq, n, D].
template <typename T>
std::vector<float> emulate(const Problem& p, int64_t sms, Counters& count) {
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
  for (int s = 0; s < p.S(); ++s) count.merged_segments += first[s + 1] - first[s] > 1 ? 1 : 0;
  for (int s = 0; s < p.S(); ++s)
    for (int prow = 0; prow < R; ++prow) {
      pf::MergeState st;
      for (int w = first[s]; w < first[s + 1]; ++w) st.m = std::max(st.m, part_m[static_cast<int64_t>(w) * R + prow]);
      for (int w = first[s]; w < first[s + 1]; ++w) {
        const int64_t pr = static_cast<int64_t>(w) * R + prow;
        st.l += part_l[pr] * pf::merge_scale(part_m[pr], st.m);
      }
      const float inv_l = pf::inverse_sum(st.l);
      for (int d = 0; d < D; ++d) {
        float sum = 0.f;
        if (inv_l > 0.f) {
          for (int w = first[s]; w < first[s + 1]; ++w) {
            const int64_t pr = static_cast<int64_t>(w) * R + prow;
            sum += part_o[pr * D + d] * pf::merge_scale(part_m[pr], st.m);
          }
        }
        out[pf::q_row(s, prow, p.G, p.n) * D + d] = sum * inv_l;
      }
    }
  return out;
}

template <typename T>
void expect_matches_reference(std::mt19937& rng, int B, int H, int G, int n, int D, int shift,
                              bool causal, bool shuffled, int64_t sms, int max_len, Counters& count) {
  const Problem p = make_problem<T>(rng, B, H, G, n, D, shift, causal, shuffled, max_len);
  const std::vector<double> want = reference<T>(p);
  const std::vector<float> got = emulate<T>(p, sms, count);
  // P is rounded to T before P V (as on tensor cores): relative 2^-8 (bf16) or 2^-11 (fp16)
  // per weight, on outputs of size ~1.
  // (Measured worst: about 2e-3 in bf16, 3e-4 in fp16.)
  const double tol = std::is_same_v<T, c10::BFloat16> ? 1e-2 : 2e-3;
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
                        << ": worst at " << worst_at;
}

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
  EXPECT_EQ(pf::merge_scale(pf::neg_inf(), pf::neg_inf()), 0.f);
  EXPECT_EQ(pf::inverse_sum(0.f), 0.f);
  EXPECT_EQ(pf::softmax_step(pf::neg_inf(), 3.f).alpha, 0.f);
}

template <typename T>
void run_emulation_cases(uint32_t seed) {
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
                                c.max_len, count);
  EXPECT_GT(count.tiles, 0);
  EXPECT_GT(count.merged_segments, 0) << "no segment had several splits: the merge is untested";
  EXPECT_GT(count.skipped, 0) << "no KV tile was skipped by the causal rule: the rule is untested";
}

TEST(PrefillTiles, EmulatedKernelMatchesFloat64ReferenceBf16) { run_emulation_cases<c10::BFloat16>(43); }
TEST(PrefillTiles, EmulatedKernelMatchesFloat64ReferenceFp16) { run_emulation_cases<c10::Half>(44); }

}  // namespace
