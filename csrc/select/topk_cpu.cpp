// CPU selection, in parallel over segments (or groups): every candidate gets its 64-bit
// selection key (radix_select.h: score key, then position key), the threshold of the k
// best is found by the shared radix selection on the keys alone, and one pass in candidate
// order keeps the keys above it and the first of the keys equal to it. Candidate order is
// segment by segment, token by token, so equal keys (equal score and position) go to the
// earlier candidate, as the CUDA kernel's ordered tie pass does (topk_cuda.cu).
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <functional>
#include <memory>
#include <numeric>
#include <vector>

#include "select/radix_select.h"
#include "select/slot_rule.h"
#include "select/topk.h"
#include "store/paged_layout.h"

namespace kvcache_ext::select {

namespace {

// An uninitialised array that only grows: filled by index, so the loop that writes the
// candidates has no capacity check per element and nothing is zeroed first.
template <typename T>
struct GrowOnly {
  std::unique_ptr<T[]> data;
  int64_t capacity = 0;

  T* at_least(int64_t n) {
    if (n > capacity) {
      data.reset(new T[n]);
      capacity = n;
    }
    return data.get();
  }
};

// The candidates of one segment or group, reused across the groups a thread handles:
// key[i] and slot[i] for i < size.
struct Candidates {
  GrowOnly<uint64_t> keys_, scratch_;
  GrowOnly<int64_t> slots_;
  uint64_t* key = nullptr;
  int64_t* slot = nullptr;
  uint64_t* scratch = nullptr;  // the radix selection's keys still in play
  int64_t size = 0;

  // Room for `count` candidates; empties the set.
  void clear(int64_t count) {
    key = keys_.at_least(count);
    slot = slots_.at_least(count);
    scratch = scratch_.at_least(count);
    size = 0;
  }
};

// The threshold of the k best candidates (0 < k < size): every key above it is kept, and
// of the keys equal to it (when it is not settled) the first `rank` in candidate order.
//
// The radix selection of radix_select.h, kDigitBits bits of the key at a time from the
// top: a histogram of the digits of the keys in play, descend_serial to the bucket that
// holds the k-th key, and only that bucket's keys (copied to scratch) stay in play. Scores
// of different magnitudes differ in their top bits, so two passes usually leave a few keys;
// once at most kSmall are left a partial sort finishes. (nth_element on all the keys, its
// data-dependent branches mispredicted, was slower than torch.topk.)
Threshold threshold(Candidates& c, int64_t k) {
  constexpr int kDigitBits = 11;
  constexpr int64_t kSmall = 64;
  std::array<int64_t, size_t{1} << kDigitBits> hist;
  const uint64_t* keys = c.key;  // the candidates in play
  int64_t n = c.size;
  Threshold t(k, n);
  while (n > kSmall && t.open()) {
    const int shift = t.shift(kDigitBits);
    const uint64_t mask = (uint64_t{1} << t.width(kDigitBits)) - 1;
    std::fill_n(hist.begin(), mask + 1, 0);
    for (int64_t i = 0; i < n; ++i) ++hist[(keys[i] >> shift) & mask];
    descend_serial(t, hist.data(), kDigitBits);
    const uint64_t bucket = (t.prefix >> shift) & mask;
    if (t.open() && hist[bucket] < n) {  // keep that bucket's keys (in place once in scratch)
      int64_t m = 0;
      for (int64_t i = 0; i < n; ++i) {
        if (((keys[i] >> shift) & mask) == bucket) c.scratch[m++] = keys[i];
      }
      keys = c.scratch;
      n = m;
    }
  }
  if (!t.open()) return t;  // settled, or every bit decided: the keys in play are equal
  uint64_t* small = c.scratch;
  if (keys != small) std::copy(keys, keys + n, small);
  std::nth_element(small, small + (t.rank - 1), small + n, std::greater<uint64_t>());
  const uint64_t key = small[t.rank - 1];
  int64_t above = 0;
  for (int64_t i = 0; i < t.rank - 1; ++i) above += small[i] > key;
  t.decide_all(key, t.rank - above);
  return t;
}

// Keeps the k best candidates of c; ends[j] (null: one segment, all of c) is the end of
// segment j's candidates, and counts[j] receives its kept number.
void keep_best(Candidates& c, int64_t k, bool* keep, const int64_t* ends, int64_t segments,
               int32_t* counts) {
  const int64_t n = c.size;
  if (k == 0) {
    if (counts) std::fill(counts, counts + segments, 0);
    return;
  }
  const Threshold t = k < n ? threshold(c, k) : Threshold(n, n);  // k >= n: keep all
  int64_t ties = t.rank;  // keys equal to an unsettled threshold still to keep
  int64_t i = 0;
  for (int64_t j = 0; j < segments; ++j) {
    const int64_t end = ends ? ends[j] : n;
    int32_t kept = 0;
    for (; i < end; ++i) {
      const Verdict v = t.verdict(c.key[i]);
      const bool take = v == Verdict::kKeep || (v == Verdict::kTie && ties > 0);
      ties -= v == Verdict::kTie && take;
      if (take) {
        keep[c.slot[i]] = true;
        ++kept;
      }
    }
    if (counts) counts[j] = kept;
  }
}

// Appends `count` candidates: slots first .. first + count - 1, whose scores are
// score[0], score[stride], ... and positions pos[0 .. count - 1].
void add_run(Candidates& c, const float* score, int64_t stride, const int32_t* pos, int64_t first,
             int64_t count) {
  uint64_t* key = c.key + c.size;
  int64_t* slot = c.slot + c.size;
  for (int64_t r = 0; r < count; ++r) {
    key[r] = selection_key(score[r * stride], pos[r]);
    slot[r] = first + r;
  }
  c.size += count;
}

// add_run under a slot rule: each candidate's score is rule.score of its record (channel 0
// at score[r * stride], the position pos[r]) in segment `segment`.
void add_run(Candidates& c, const SlotRule& rule, int64_t segment, const float* score,
             int64_t stride, const int32_t* pos, int64_t first, int64_t count) {
  uint64_t* key = c.key + c.size;
  int64_t* slot = c.slot + c.size;
  for (int64_t r = 0; r < count; ++r) {
    key[r] = selection_key(rule.score(score + r * stride, pos[r], segment), pos[r]);
    slot[r] = first + r;
  }
  c.size += count;
}

// The slot-layout inputs of segmented_topk_cpu and grouped_topk_cpu, as the kernels read them.
struct SlotLayout {
  const float* scores;
  const int32_t* pos;
  const int64_t* start;
  const int32_t* len;
  const int32_t* k;
  bool* keep;
  SlotLayout(const at::Tensor& scores_t, const at::Tensor& pos_t, const at::Tensor& start_t,
             const at::Tensor& len_t, const at::Tensor& k_t, const at::Tensor& keep_t)
      : scores(scores_t.data_ptr<float>()), pos(pos_t.data_ptr<int32_t>()),
        start(start_t.data_ptr<int64_t>()), len(len_t.data_ptr<int32_t>()),
        k(k_t.data_ptr<int32_t>()), keep(keep_t.data_ptr<bool>()) {}
};

}  // namespace

void segmented_topk_cpu(const at::Tensor& scores, const at::Tensor& pos, const at::Tensor& start,
                        const at::Tensor& len, const at::Tensor& k, const at::Tensor& keep) {
  const SlotLayout in(scores, pos, start, len, k, keep);
  at::parallel_for(0, start.size(0), 1, [&](int64_t begin, int64_t end) {
    Candidates cand;
    for (int64_t s = begin; s < end; ++s) {
      if (in.k[s] >= in.len[s]) {  // everything is kept: no keys needed
        std::fill_n(in.keep + in.start[s], in.len[s], true);
        continue;
      }
      cand.clear(in.len[s]);
      add_run(cand, in.scores + in.start[s], 1, in.pos + in.start[s], in.start[s], in.len[s]);
      keep_best(cand, in.k[s], in.keep, nullptr, 1, nullptr);
    }
  });
}

void grouped_topk_cpu(const at::Tensor& scores, const at::Tensor& pos, const at::Tensor& start,
                      const at::Tensor& len, int64_t group_size, const at::Tensor& k,
                      const at::Tensor& keep, const at::Tensor& counts) {
  const SlotLayout in(scores, pos, start, len, k, keep);
  int32_t* counts_p = counts.data_ptr<int32_t>();
  at::parallel_for(0, k.size(0), 1, [&](int64_t begin, int64_t end) {
    Candidates cand;
    std::vector<int64_t> ends(group_size);
    for (int64_t g = begin; g < end; ++g) {
      cand.clear(std::accumulate(in.len + g * group_size, in.len + (g + 1) * group_size, int64_t{0}));
      for (int64_t j = 0; j < group_size; ++j) {
        const int64_t s = g * group_size + j;
        add_run(cand, in.scores + in.start[s], 1, in.pos + in.start[s], in.start[s], in.len[s]);
        ends[j] = cand.size;
      }
      keep_best(cand, in.k[g], in.keep, ends.data(), group_size, counts_p + g * group_size);
    }
  });
}

constexpr int64_t kPrefetchPages = 8;  // how far ahead a segment's pages are prefetched

void paged_topk_cpu(const store::PagedView& view, const at::Tensor& len, const at::Tensor& scores,
                    int64_t group_size, const at::Tensor& k, const at::Tensor& keep,
                    const at::Tensor& counts, const SlotRule* rule) {
  using store::kPos;
  using store::kScores;
  const int32_t* len_p = len.data_ptr<int32_t>();
  const int32_t* k_p = k.data_ptr<int32_t>();
  bool* keep_p = keep.data_ptr<bool>();
  int32_t* counts_p = counts.data_ptr<int32_t>();
  // Where token i of segment s (slot `slot`) finds its score: channel 0 in its page, the
  // slot-layout tensor at its slot, or the padded tensor at [s, i].
  const float* given = scores.defined() ? scores.data_ptr<float>() : nullptr;
  const int64_t padded_len = scores.defined() && scores.dim() == 3 ? scores.size(2) : -1;
  const int64_t channels = view.record.row_bytes[kScores] / 4;
  const int64_t P = view.page_size();
  at::parallel_for(0, k.size(0), 1, [&](int64_t begin, int64_t end) {
    Candidates cand;
    std::vector<int64_t> ends(group_size);
    for (int64_t g = begin; g < end; ++g) {
      cand.clear(std::accumulate(len_p + g * group_size, len_p + (g + 1) * group_size, int64_t{0}));
      for (int64_t j = 0; j < group_size; ++j) {
        const int64_t s = g * group_size + j, n = len_p[s];
        const auto score_of = [&](int64_t i, int64_t slot) {
          return given == nullptr ? reinterpret_cast<const float*>(view.row(kScores, slot))
                 : padded_len < 0 ? given + slot
                                  : given + s * padded_len + i;
        };
        // A page's rows at a time: consecutive tokens, consecutive slots and rows.
        for (int64_t i = 0; i < n;) {
          const int64_t slot = view.slot(s, i), run = std::min(P - (i & (P - 1)), n - i);
          // A page's positions and scores are a few cache lines in a record of K and V
          // kilobytes long: the hardware prefetcher does not follow page to page, and
          // without this every page waits on a miss, which dominated the op's time.
          const int64_t ahead = (i & ~(P - 1)) + kPrefetchPages * P;
          if (ahead < n) {
            const int64_t far = view.slot(s, ahead);
            __builtin_prefetch(view.row(kPos, far));
            __builtin_prefetch(score_of(ahead, far));
          }
          const auto* positions = reinterpret_cast<const int32_t*>(view.row(kPos, slot));
          if (rule != nullptr) {
            add_run(cand, *rule, s, score_of(i, slot), channels, positions, slot, run);
          } else {
            add_run(cand, score_of(i, slot), given == nullptr ? channels : 1, positions, slot, run);
          }
          i += run;
        }
        ends[j] = cand.size;
      }
      keep_best(cand, k_p[g], keep_p, ends.data(), group_size, counts_p + g * group_size);
    }
  });
}

}  // namespace kvcache_ext::select
