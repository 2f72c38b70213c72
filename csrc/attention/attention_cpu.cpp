// CPU attention over the ragged store, split as flash-decoding splits it.
//
// A work unit is one segment, one chunk of its tokens and one block of its queries (all G
// heads of each). A unit computes its logits, softmaxes them against its own maximum, and
// leaves that maximum, the sum of its exponentials and its unnormalised output; a merge then
// rescales the chunks of each (segment, query block) to their common maximum and writes the
// output. Two shapes of unit:
// - tile units (fewer than kGemmRows rows: decode) take chunks of kChunk tokens, so a batch-1
//   decode with a few long segments still fills every core, and run the tile loops of
//   attention_cpu_tiles.h: every row against one pass over the chunk's K and V;
// - matrix units (block prefill) take a whole segment and at most kGemmMaxRows rows, whose
//   logits and output are two BLAS products over the segment's K and V widened to float.
// Statistics need the final probabilities. A tile unit keeps its exponentials, the merge
// leaves each unit's factor to the final softmax, and the chunk's slots then get their
// statistics written once (by the thread that ran the whole segment, or in a last pass). A
// matrix unit sees its whole segment, so it writes its own; the query blocks of one segment
// then run on one thread, as they add into the same slots. Slots without a live token get
// zeros, so the statistics need no zero-fill first.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention/attention_cpu_tiles.h"
#include "attention/attention_kernels.h"

namespace kvcache_ext::attention {

namespace {

constexpr int64_t kChunk = 512;        // tokens per tile unit
constexpr int64_t kTileMaxRows = 256;  // query rows (G per query) of a tile unit
// From this many rows on, units are matrix units (see the top of the file).
constexpr int64_t kGemmRows = 16;
// Rows of a matrix unit: its logits [rows, segment length] stay in a thread's buffer.
constexpr int64_t kGemmMaxRows = 128;
// Below this many multiply-adds in all, the call runs on the calling thread: waking the
// pool costs more than it saves (a decode step of a small model's layer).
constexpr int64_t kSerialWork = int64_t{1} << 18;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The split of a call into units. Unit u = chunk * blocks + block, chunks numbered segment
// by segment.
struct Plan {
  int64_t heads, groups, n, D;
  bool gemm;          // matrix units: one chunk per (non-empty) segment
  int64_t per_block;  // queries per block
  int64_t blocks;     // query blocks per segment
  int64_t rows_max;   // rows of the tallest block: groups * per_block
  std::vector<int64_t> chunk_segment;  // segment of each chunk
  std::vector<int64_t> chunk_first;    // [S + 1] first chunk of each segment

  int64_t chunks() const { return static_cast<int64_t>(chunk_segment.size()); }
  int64_t units() const { return chunks() * blocks; }
  int64_t block_queries(int64_t block) const {
    return std::min(n, (block + 1) * per_block) - block * per_block;
  }
};

// Tokens [first, first + count) of segment s that chunk c covers.
struct ChunkRange {
  int64_t s, first, count;
};

ChunkRange chunk_range(const Problem& p, const Plan& plan, int64_t c) {
  const int64_t s = plan.chunk_segment[c];
  const int64_t len = (*p.len_host)[s];
  if (plan.gemm) return {s, 0, len};
  const int64_t first = (c - plan.chunk_first[s]) * kChunk;
  return {s, first, std::min(kChunk, len - first)};
}

Plan make_plan(const Problem& p, int64_t n, int64_t D) {
  Plan plan;
  plan.heads = p.segments / p.q.size(0);
  plan.groups = p.groups;
  plan.n = n;
  plan.D = D;
  plan.gemm = p.groups * n >= kGemmRows;
  const int64_t max_rows = plan.gemm ? kGemmMaxRows : kTileMaxRows;
  plan.per_block = std::min(n, std::max<int64_t>(1, max_rows / p.groups));
  plan.blocks = (n + plan.per_block - 1) / plan.per_block;
  plan.rows_max = p.groups * plan.per_block;
  plan.chunk_first.assign(p.segments + 1, 0);
  for (int64_t s = 0; s < p.segments; ++s) {
    const int64_t len = (*p.len_host)[s];
    const int64_t chunks = plan.gemm ? (len > 0 ? 1 : 0) : (len + kChunk - 1) / kChunk;
    plan.chunk_first[s + 1] = plan.chunk_first[s] + chunks;
    plan.chunk_segment.insert(plan.chunk_segment.end(), chunks, s);
  }
  return plan;
}

// Per-unit results. m: the unit's maximum logit per row, replaced by the merge with the
// factor taking the unit's exponentials to final probabilities. sum: its sum of
// exponentials. acc: sum of exponential * v. probs: the exponentials (statistics only).
struct Workspace {
  float* m;
  float* sum;
  float* acc;
  float* probs;  // nullptr without statistics
};

// Calls f(l, run, rows, next) for the runs of tokens [l0, l1) of segment s that share a page:
// rows points to part b's row of token l, next to that of the following run (nullptr for
// the last), which the tile loops prefetch.
template <typename T, typename F>
void for_each_page_run(const store::PagedView& view, int part, int64_t s, int64_t l0, int64_t l1,
                       const F& f) {
  const int64_t P = view.page_size();
  const T* rows = l0 < l1 ? reinterpret_cast<const T*>(view.token(part, s, l0)) : nullptr;
  for (int64_t l = l0; l < l1;) {
    const int64_t run = std::min(P - (l & (P - 1)), l1 - l);
    const T* next = l + run < l1 ? reinterpret_cast<const T*>(view.token(part, s, l + run)) : nullptr;
    f(l, run, rows, next);
    rows = next;
    l += run;
  }
}

template <typename F>
void run_parallel(int64_t count, bool parallel, const F& f) {
  if (!parallel) {
    for (int64_t i = 0; i < count; ++i) f(i);
    return;
  }
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) f(i);
  });
}

// Zeros the statistics of every slot that holds no live token: the rows of a segment's
// pages past its length and the pages no segment uses. add_statistics writes the live ones,
// so the statistics arrive uninitialised (attention_kernels.h) and no slot is written twice.
void zero_dead_slots(const Problem& p, Result& r) {
  const store::PagedView& view = p.view;
  const int64_t P = view.page_size(), pages = p.capacity / P;
  if (pages == 0) return;
  std::vector<int64_t> live(pages, 0);  // live rows at the start of each page
  for (int64_t s = 0; s < p.segments; ++s) {
    const int64_t len = (*p.len_host)[s];
    for (int64_t j = 0; j * P < len; ++j) {
      live[view.table[s * view.width + j]] = std::min(P, len - j * P);
    }
  }
  auto zero = [&](int64_t begin, int64_t end) {  // slots [begin, end)
    for (at::Tensor* t : {&r.mass, &r.last, &r.sum_sq, &r.count}) {
      if (!t->defined()) continue;
      const int64_t per_slot = t->numel() / p.capacity * t->element_size();
      std::memset(static_cast<char*>(t->data_ptr()) + begin * per_slot, 0, (end - begin) * per_slot);
    }
  };
  std::vector<std::pair<int64_t, int64_t>> dead;  // ranges of dead slots, in order
  for (int64_t page = 0; page < pages; ++page) {
    const int64_t first_dead = page * P + live[page], page_end = (page + 1) * P;
    if (first_dead == page_end) continue;
    if (!dead.empty() && dead.back().second == first_dead) {
      dead.back().second = page_end;
    } else {
      dead.emplace_back(first_dead, page_end);
    }
  }
  // A store that kept the pages its evictions freed has several times more dead slots than
  // live ones: zero them on every core, a stretch of slots each.
  at::parallel_for(0, p.capacity, int64_t{1} << 16, [&](int64_t lo, int64_t hi) {
    auto range = std::lower_bound(dead.begin(), dead.end(), lo,
                                  [](const auto& d, int64_t slot) { return d.second <= slot; });
    for (; range != dead.end() && range->first < hi; ++range) {
      zero(std::max(range->first, lo), std::min(range->second, hi));
    }
  });
}

// last[t, g] = row(g)[l + t] * factor(g) for the tokens t < run: the G rows of the last
// query interleaved into the [slots, G] layout. With G fixed at compile time the compiler
// turns a token's G products into one vector store (a loop over g per token does not).
template <int kG, typename Row, typename Factor>
void interleave_last(float* out, const Row& row, const Factor& factor, int64_t l, int64_t run) {
  float f[kG];
  const float* x[kG];
  for (int g = 0; g < kG; ++g) {
    f[g] = factor(g);
    x[g] = row(g) + l;
  }
  for (int64_t t = 0; t < run; ++t)
    for (int g = 0; g < kG; ++g) out[t * kG + g] = x[g][t] * f[g];
}

// Writes (assign) or adds the final probabilities of query blocks [block_begin, block_end)
// over the tokens [l0, l0 + cl) of segment s into the statistics of their slots.
// probs(block) gives the block's exponentials ([rows, cl]) and factors ([rows]) to final
// probabilities. The caller owns these slots: nothing else writes them meanwhile. Column
// buffers keep the loops over tokens contiguous.
template <typename F>
void add_statistics(const Problem& p, const Plan& plan, Result& r, int64_t s, int64_t l0,
                    int64_t cl, int64_t block_begin, int64_t block_end, bool assign,
                    const F& probs) {
  const int64_t G = plan.groups, n = plan.n;
  const store::PagedView& view = p.view;
  float* mass_out = r.mass.defined() ? r.mass.data_ptr<float>() : nullptr;
  float* last_out = r.last.defined() ? r.last.data_ptr<float>() : nullptr;
  float* sum_sq_out = r.sum_sq.defined() ? r.sum_sq.data_ptr<float>() : nullptr;
  int32_t* count_out = r.count.defined() ? r.count.data_ptr<int32_t>() : nullptr;
  const int32_t* q_pos = p.q_pos.defined() ? p.q_pos.data_ptr<int32_t>() + (s / plan.heads) * n
                                           : nullptr;
  // Columns over the chunk's tokens, accumulated over its queries.
  thread_local std::vector<float> mass, sum_sq, group;
  thread_local std::vector<int32_t> count, pos;
  mass.assign(cl, 0.f);
  sum_sq.assign(cl, 0.f);
  group.resize(cl);
  count.assign(cl, 0);
  if (count_out && q_pos) {
    pos.resize(cl);
    for_each_page_run<int32_t>(view, store::kPos, s, l0, l0 + cl,
                               [&](int64_t l, int64_t run, const int32_t* pp, const int32_t*) {
                                 std::copy(pp, pp + run, pos.data() + (l - l0));
                               });
  }
  const float inv_g = 1.f / static_cast<float>(G);
  for (int64_t block = block_begin; block < block_end; ++block) {
    const int64_t i0 = block * plan.per_block, ib = plan.block_queries(block);
    const auto [x_block, factor] = probs(block);
    for (int64_t i = i0; i < i0 + ib; ++i) {
      // Row j = g * ib + (i - i0) holds query i of head g.
      auto row = [&](int64_t g) { return x_block + (g * ib + (i - i0)) * cl; };
      auto row_factor = [&](int64_t g) { return factor[g * ib + (i - i0)]; };
      if (mass_out || sum_sq_out) {
        const float* x = row(0);
        const float f = row_factor(0);
        for (int64_t l = 0; l < cl; ++l) group[l] = x[l] * f;
        for (int64_t g = 1; g < G; ++g) {
          const float* xg = row(g);
          const float fg = row_factor(g);
          for (int64_t l = 0; l < cl; ++l) group[l] += xg[l] * fg;
        }
        for (int64_t l = 0; l < cl; ++l) {
          mass[l] += group[l];
          const float mean = group[l] * inv_g;
          sum_sq[l] += mean * mean;
        }
      }
      if (last_out && i == n - 1) {  // written once: only one block holds the last query
        for_each_page_run<int32_t>(view, store::kPos, s, l0, l0 + cl,
                                   [&](int64_t l, int64_t run, const int32_t*, const int32_t*) {
                                     float* out = last_out + view.slot(s, l) * G;
                                     if (G == 4) {  // the common case
                                       interleave_last<4>(out, row, row_factor, l - l0, run);
                                       return;
                                     }
                                     for (int64_t g = 0; g < G; ++g) {
                                       const float* x = row(g) + (l - l0);
                                       const float f = row_factor(g);
                                       for (int64_t t = 0; t < run; ++t) out[t * G + g] = x[t] * f;
                                     }
                                   });
      }
      if (count_out && q_pos) {
        for (int64_t l = 0; l < cl; ++l) count[l] += pos[l] <= q_pos[i] ? 1 : 0;
      }
    }
  }
  if (count_out && !q_pos) {  // every query sees every live slot
    int32_t queries = 0;
    for (int64_t block = block_begin; block < block_end; ++block) {
      queries += static_cast<int32_t>(plan.block_queries(block));
    }
    std::fill(count.begin(), count.end(), queries);
  }
  // Consecutive tokens of a page have consecutive slots: write a page run at a time.
  for_each_page_run<int32_t>(view, store::kPos, s, l0, l0 + cl,
                             [&](int64_t l, int64_t run, const int32_t*, const int32_t*) {
                               const int64_t first = view.slot(s, l);
                               auto put = [&](auto* out, const auto& column) {
                                 if (out == nullptr) return;
                                 const auto* in = column.data() + (l - l0);
                                 if (assign) {
                                   std::copy(in, in + run, out + first);
                                 } else {
                                   for (int64_t t = 0; t < run; ++t) out[first + t] += in[t];
                                 }
                               };
                               put(mass_out, mass);
                               put(sum_sq_out, sum_sq);
                               put(count_out, count);
                             });
}

// Unit u: the queries of its block against the tokens of its chunk. Leaves the unit's
// maximum, sum and unnormalised output in the workspace; a tile unit leaves its exponentials
// in ws.probs when statistics are asked for, a matrix unit adds its statistics itself.
// T: the queries' element type; E: the pages' (T, or int8_t for int8 pages: the loops run
// over the steps, and each token's K scale multiplies its logits, its V scale its weights).
template <typename T, typename E>
void attend_unit(const Problem& p, const Plan& plan, const Workspace& ws, Result& r, int64_t u) {
  constexpr bool kQuantized = std::is_same_v<E, int8_t>;
  const Tiles<E>& tiles = attention::tiles<E>();
  const int64_t block = u % plan.blocks;
  const auto [s, l0, cl] = chunk_range(p, plan, u / plan.blocks);
  const int64_t G = plan.groups, n = plan.n, D = plan.D;
  const int64_t i0 = block * plan.per_block, ib = plan.block_queries(block), rows = G * ib;
  const store::PagedView& view = p.view;

  // The block's queries as scaled floats, row j = g * ib + (i - i0).
  thread_local std::vector<float> qf, logits_buf, kv_f, k_scale, v_scale, weights;
  thread_local std::vector<int32_t> pos;
  qf.resize(rows * D);
  const T* q = p.q.data_ptr<T>() + s * G * n * D;
  for (int64_t g = 0; g < G; ++g) {
    attention::tiles<T>().widen(q + (g * n + i0) * D, qf.data() + g * ib * D, ib * D);
  }
  for (float& x : qf) x *= p.scale;
  if constexpr (kQuantized) {  // the chunk's scales as floats: widened as pairs (K, V), then split
    k_scale.resize(cl);
    v_scale.resize(cl);
    weights.resize(2 * cl);
    for_each_page_run<c10::Half>(view, store::kScale, s, l0, l0 + cl,
                                 [&](int64_t l, int64_t run, const c10::Half* sc, const c10::Half*) {
                                   attention::tiles<c10::Half>().widen(sc, weights.data() + 2 * (l - l0), 2 * run);
                                 });
    for (int64_t t = 0; t < cl; ++t) {
      k_scale[t] = weights[2 * t];
      v_scale[t] = weights[2 * t + 1];
    }
  }

  const bool keep_probs = ws.probs != nullptr && !plan.gemm;
  float* logits = keep_probs ? ws.probs + u * plan.rows_max * kChunk
                             : (logits_buf.resize(rows * cl), logits_buf.data());
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  auto widen_part = [&](int part) {  // the chunk's K or V rows as floats [cl, D]
    kv_f.resize(cl * D);
    for_each_page_run<E>(view, part, s, l0, l0 + cl,
                         [&](int64_t l, int64_t run, const E* rows_p, const E*) {
                           tiles.widen(rows_p, kv_f.data() + (l - l0) * D, run * D);
                         });
    if constexpr (kQuantized) {
      const std::vector<float>& scale = part == store::kK ? k_scale : v_scale;
      for (int64_t l = 0; l < cl; ++l)
        for (int64_t d = 0; d < D; ++d) kv_f[l * D + d] *= scale[l];
    }
    return at::from_blob(kv_f.data(), {cl, D}, f32);
  };
  if (plan.gemm) {
    at::Tensor out = at::from_blob(logits, {rows, cl}, f32);
    at::mm_out(out, at::from_blob(qf.data(), {rows, D}, f32), widen_part(store::kK).t());
  } else {
    for_each_page_run<E>(view, store::kK, s, l0, l0 + cl, [&](int64_t l, int64_t run, const E* k, const E* next) {
      tiles.logits(k, run, D, qf.data(), rows, logits + (l - l0), cl, next);
    });
    if constexpr (kQuantized) {
      for (int64_t j = 0; j < rows; ++j)
        for (int64_t l = 0; l < cl; ++l) logits[j * cl + l] *= k_scale[l];
    }
  }
  if (p.q_pos.defined()) {  // causal by position: a slot in a query's future is masked
    pos.resize(cl);
    for_each_page_run<int32_t>(view, store::kPos, s, l0, l0 + cl,
                               [&](int64_t l, int64_t run, const int32_t* pp, const int32_t*) {
                                 std::copy(pp, pp + run, pos.data() + (l - l0));
                               });
    const int32_t* q_pos = p.q_pos.data_ptr<int32_t>() + (s / plan.heads) * n;
    for (int64_t j = 0; j < rows; ++j) {
      const int32_t limit = q_pos[i0 + j % ib];
      float* x = logits + j * cl;
      for (int64_t l = 0; l < cl; ++l) x[l] = pos[l] <= limit ? x[l] : kNegInf;
    }
  }
  float* m = ws.m + u * plan.rows_max;
  float* sum = ws.sum + u * plan.rows_max;
  for (int64_t j = 0; j < rows; ++j) {
    float* x = logits + j * cl;
    m[j] = tiles.max(x, cl);
    if (m[j] == kNegInf) {  // the row sees none of these tokens
      std::fill(x, x + cl, 0.f);
      sum[j] = 0.f;
    } else {
      sum[j] = tiles.exp_sum(x, cl, m[j]);
    }
  }
  float* acc = ws.acc + u * plan.rows_max * D;
  if (plan.gemm) {
    at::Tensor out = at::from_blob(acc, {rows, D}, f32);
    at::mm_out(out, at::from_blob(logits, {rows, cl}, f32), widen_part(store::kV));
  } else {
    std::fill(acc, acc + rows * D, 0.f);
    // The weights of the V rows: the exponentials, times each token's V scale on int8 pages
    // (a copy: the exponentials stay as they are for the statistics).
    const float* w = logits;
    if constexpr (kQuantized) {
      weights.resize(rows * cl);
      for (int64_t j = 0; j < rows; ++j)
        for (int64_t l = 0; l < cl; ++l) weights[j * cl + l] = logits[j * cl + l] * v_scale[l];
      w = weights.data();
    }
    for_each_page_run<E>(view, store::kV, s, l0, l0 + cl, [&](int64_t l, int64_t run, const E* v, const E* next) {
      tiles.values(v, run, D, w + (l - l0), cl, rows, acc, next);
    });
  }
  if (plan.gemm && ws.probs != nullptr) {  // the unit is its segment's only chunk: final now
    thread_local std::vector<float> factor;
    factor.resize(rows);
    for (int64_t j = 0; j < rows; ++j) factor[j] = sum[j] > 0.f ? 1.f / sum[j] : 0.f;
    add_statistics(p, plan, r, s, l0, cl, block, block + 1, /*assign=*/block == 0,
                   [&](int64_t) { return std::pair<const float*, const float*>(logits, factor.data()); });
  }
}

// Merges the chunks of (segment s, query block) into the output; leaves in ws.m each unit's
// factor to the final probabilities (0 where a row saw nothing).
template <typename T>
void merge_block(const Plan& plan, const Workspace& ws, T* out_all, int64_t w) {
  const int64_t s = w / plan.blocks, block = w % plan.blocks;
  const int64_t G = plan.groups, n = plan.n, D = plan.D;
  const int64_t i0 = block * plan.per_block, ib = plan.block_queries(block);
  const int64_t first = plan.chunk_first[s], last = plan.chunk_first[s + 1];
  thread_local std::vector<float> row;
  row.resize(D);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = i0; i < i0 + ib; ++i) {
      const int64_t j = g * ib + (i - i0);
      auto at = [&](int64_t c) { return (c * plan.blocks + block) * plan.rows_max + j; };
      float top = kNegInf;
      for (int64_t c = first; c < last; ++c) top = std::max(top, ws.m[at(c)]);
      float total = 0.f;
      for (int64_t c = first; c < last && top != kNegInf; ++c) {
        total += ws.sum[at(c)] * std::exp(ws.m[at(c)] - top);
      }
      std::fill(row.begin(), row.end(), 0.f);
      for (int64_t c = first; c < last; ++c) {
        const float factor = top == kNegInf ? 0.f : std::exp(ws.m[at(c)] - top) / total;
        ws.m[at(c)] = factor;
        if (factor == 0.f) continue;
        const float* acc = ws.acc + at(c) * D;
        for (int64_t d = 0; d < D; ++d) row[d] += factor * acc[d];
      }
      T* o = out_all + (s * G * n + g * n + i) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(row[d]);
    }
}

template <typename T, typename E>
void attend_all(const Problem& p, Result& r) {
  const int64_t n = p.q.size(2), D = p.q.size(3);
  const Plan plan = make_plan(p, n, D);
  const bool stats = r.mass.defined() || r.last.defined() || r.sum_sq.defined() || r.count.defined();
  int64_t tokens = 0;
  for (int64_t s = 0; s < p.segments; ++s) tokens += (*p.len_host)[s];
  const bool parallel = tokens * plan.groups * n * D >= kSerialWork;

  const int64_t U = plan.units(), R = plan.rows_max;
  const auto f32 = p.q.options().dtype(at::kFloat);
  at::Tensor parts = at::empty({U * R * (2 + D)}, f32);
  at::Tensor probs;
  if (stats && !plan.gemm) probs = at::empty({U * R * kChunk}, f32);
  float* base = parts.data_ptr<float>();
  // A matrix unit keeps no exponentials; probs is then only a flag that statistics are on.
  float* probs_p = !stats ? nullptr : plan.gemm ? base : probs.data_ptr<float>();
  const Workspace ws{base, base + U * R, base + 2 * U * R, probs_p};
  if (stats) zero_dead_slots(p, r);
  T* out = r.out.data_ptr<T>();

  // Segment s's units are [unit_begin(s), unit_begin(s + 1)).
  auto unit_begin = [&](int64_t s) { return plan.chunk_first[s] * plan.blocks; };
  auto chunk_statistics = [&](int64_t c) {
    const auto [s, l0, cl] = chunk_range(p, plan, c);
    add_statistics(p, plan, r, s, l0, cl, 0, plan.blocks, /*assign=*/true, [&](int64_t block) {
      const int64_t u = c * plan.blocks + block;
      return std::pair<const float*, const float*>(ws.probs + u * R * kChunk, ws.m + u * R);
    });
  };
  auto finish_segment = [&](int64_t s) {  // merge, then a tile unit's statistics
    for (int64_t b = 0; b < plan.blocks; ++b) merge_block<T>(plan, ws, out, s * plan.blocks + b);
    if (!stats || plan.gemm) return;
    for (int64_t c = plan.chunk_first[s]; c < plan.chunk_first[s + 1]; ++c) chunk_statistics(c);
  };
  // A thread that ran every unit of a segment finishes the segment right after its last
  // unit, so that its exponentials are read back soon after they were written; segments
  // split between threads wait for the passes below. (On the 2-core test machine this
  // measured within noise of finishing every segment in separate passes.)
  std::vector<uint8_t> finished(p.segments, 0);
  // With statistics a matrix unit adds into its segment's slots: a segment's blocks then
  // run on one thread, as one task.
  const int64_t per_task = stats && plan.gemm ? plan.blocks : 1;
  auto run_tasks = [&](int64_t task_begin, int64_t task_end) {
    const int64_t first = task_begin * per_task;
    for (int64_t u = first; u < task_end * per_task; ++u) {
      attend_unit<T, E>(p, plan, ws, r, u);
      const int64_t s = plan.chunk_segment[u / plan.blocks];
      if (u + 1 == unit_begin(s + 1) && unit_begin(s) >= first) {
        finish_segment(s);
        finished[s] = 1;
      }
    }
  };
  if (parallel) {
    at::parallel_for(0, U / per_task, 1, run_tasks);
  } else {
    run_tasks(0, U / per_task);
  }
  std::vector<int64_t> left;  // split between threads, or empty
  for (int64_t s = 0; s < p.segments; ++s) {
    if (!finished[s]) left.push_back(s);
  }
  run_parallel(static_cast<int64_t>(left.size()) * plan.blocks, parallel, [&](int64_t w) {
    merge_block<T>(plan, ws, out, left[w / plan.blocks] * plan.blocks + w % plan.blocks);
  });
  if (stats && !plan.gemm) {
    std::vector<int64_t> chunks;
    for (const int64_t s : left) {
      for (int64_t c = plan.chunk_first[s]; c < plan.chunk_first[s + 1]; ++c) chunks.push_back(c);
    }
    run_parallel(static_cast<int64_t>(chunks.size()), parallel,
                 [&](int64_t i) { chunk_statistics(chunks[i]); });
  }
}

}  // namespace

void ragged_attention_cpu(const Problem& p, Result& r) {
  // q is float32, float16 or bfloat16; the pages hold the same, or int8 (the op checks).
  const bool int8_pages = p.view.record.quantized();
  switch (p.q.scalar_type()) {
    case at::kFloat: return int8_pages ? attend_all<float, int8_t>(p, r) : attend_all<float, float>(p, r);
    case at::kHalf:
      return int8_pages ? attend_all<c10::Half, int8_t>(p, r) : attend_all<c10::Half, c10::Half>(p, r);
    case at::kBFloat16:
      return int8_pages ? attend_all<c10::BFloat16, int8_t>(p, r)
                        : attend_all<c10::BFloat16, c10::BFloat16>(p, r);
    default: TORCH_CHECK(false, "ragged_attention_cpu: unsupported dtype ", p.q.scalar_type());
  }
}

}  // namespace kvcache_ext::attention
