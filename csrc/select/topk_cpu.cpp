// CPU selection: a partial sort (nth_element) of each segment or group, in parallel.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "select/selection_key.h"
#include "select/topk.h"

namespace kvcache_ext::select {

namespace {

struct Ranked {
  uint64_t key;
  int64_t slot;
};

// Marks the k best of the ranked candidates; ties of equal keys go to the lower slot,
// as CUB's stable radix sort does.
void keep_best(std::vector<Ranked>& cand, int64_t k, bool* keep) {
  if (k < static_cast<int64_t>(cand.size())) {
    std::nth_element(cand.begin(), cand.begin() + k, cand.end(),
                     [](const Ranked& a, const Ranked& b) {
                       return a.key != b.key ? a.key > b.key : a.slot < b.slot;
                     });
    cand.resize(k);
  }
  for (const Ranked& c : cand) keep[c.slot] = true;
}

void add_live_slots(std::vector<Ranked>& cand, const float* scores, const int32_t* pos,
                    int64_t first, int32_t len) {
  for (int64_t j = first; j < first + len; ++j) cand.push_back({selection_key(scores[j], pos[j]), j});
}

}  // namespace

void segmented_topk_cpu(const at::Tensor& scores, const at::Tensor& pos, const at::Tensor& start,
                        const at::Tensor& len, const at::Tensor& k, const at::Tensor& keep) {
  const float* scores_p = scores.data_ptr<float>();
  const int32_t* pos_p = pos.data_ptr<int32_t>();
  const int64_t* start_p = start.data_ptr<int64_t>();
  const int32_t* len_p = len.data_ptr<int32_t>();
  const int32_t* k_p = k.data_ptr<int32_t>();
  bool* keep_p = keep.data_ptr<bool>();
  at::parallel_for(0, start.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<Ranked> cand;
    for (int64_t s = begin; s < end; ++s) {
      cand.clear();
      add_live_slots(cand, scores_p, pos_p, start_p[s], len_p[s]);
      keep_best(cand, k_p[s], keep_p);
    }
  });
}

void grouped_topk_cpu(const at::Tensor& scores, const at::Tensor& pos, const at::Tensor& start,
                      const at::Tensor& len, int64_t group_size, const at::Tensor& k,
                      const at::Tensor& keep, const at::Tensor& counts) {
  const float* scores_p = scores.data_ptr<float>();
  const int32_t* pos_p = pos.data_ptr<int32_t>();
  const int64_t* start_p = start.data_ptr<int64_t>();
  const int32_t* len_p = len.data_ptr<int32_t>();
  const int32_t* k_p = k.data_ptr<int32_t>();
  bool* keep_p = keep.data_ptr<bool>();
  int32_t* counts_p = counts.data_ptr<int32_t>();
  at::parallel_for(0, k.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<Ranked> cand;
    for (int64_t g = begin; g < end; ++g) {
      cand.clear();
      const int64_t first = g * group_size, last = first + group_size;
      for (int64_t s = first; s < last; ++s) add_live_slots(cand, scores_p, pos_p, start_p[s], len_p[s]);
      keep_best(cand, k_p[g], keep_p);
      for (int64_t s = first; s < last; ++s) {
        counts_p[s] = static_cast<int32_t>(
            std::count(keep_p + start_p[s], keep_p + start_p[s] + len_p[s], true));
      }
    }
  });
}

}  // namespace kvcache_ext::select
