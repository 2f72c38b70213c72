// CUDA selection: a radix selection per group (a segment, or an Ada-KV group of segments),
// reading every candidate where it lies, with the digit and threshold logic of
// radix_select.h, so that the result is topk_cpu.cpp's, bit for bit:
//   - candidate c of group g is token i of segment s in candidate order (the group's
//     segments one after another, tokens in order), as the CPU's Candidates are filled;
//   - its key is selection_key(score, pos): 32-bit score key, then 32-bit position key;
//   - 8-bit digits from the top (8 passes at most): each pass histograms the digit of the
//     keys still in play in shared memory, the bucket holding the rank-th key is found by a
//     block scan, and Threshold::descend decides it (the CPU: descend_serial);
//   - keys equal to an unsettled threshold are kept in candidate order (the CPU keeps the
//     first `rank` of them in its keep_best loop): an ordered block scan per tile, after the
//     counts of the team's earlier CTAs.
//
// Launch shape: one CTA of kThreads per group when there are at least as many groups as
// SMs (every SM has work, and the CTA does every pass with __syncthreads only). With fewer
// groups (batch 1 with few KV heads, Ada-KV with few batch rows) a team of `splits` CTAs
// shares a group, each a contiguous chunk of its candidates: the CTAs add their shared
// histograms into the group's global one and meet at a grid barrier (cooperative launch,
// so every CTA is resident) before each decision. No host sync: the sizes of the launch
// come from shapes only, the lengths and budgets are read on the device.
//
// k: clamped to [0, candidates] on the device: a negative budget keeps nothing and one at or
// beyond the group's live tokens keeps them all (the ops clamp before, too).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cooperative_groups.h>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <limits>

#include "common/occupancy.h"
#include "select/slot_rule.h"
#include "select/radix_select.h"
#include "select/topk.h"
#include "store/paged_layout.h"

namespace kvcache_ext::select {

namespace {

constexpr int kThreads = 256;
constexpr int kDigitBits = 8;
constexpr int kBuckets = 1 << kDigitBits;  // one per thread in the bucket scan
constexpr int kPasses = 64 / kDigitBits;
// The score keys of a CTA's first kCached candidates stay in shared memory after the first
// pass: the later passes (and the marking) read them there instead of going through the
// page table again (two dependent loads before each score). Teams are sized so that a
// chunk fits when the GPU has room for enough CTAs.
constexpr int64_t kCached = 16 * kThreads;  // 16 KiB
// A team's CTA gets at least one candidate per thread: fewer, and the barriers cost more
// than the histogram work they split.
constexpr int64_t kMinChunk = kThreads;
static_assert(kBuckets == kThreads, "the bucket scan gives each thread one bucket");
static_assert(kThreads % 32 == 0, "whole warps: the histogram's __match_any_sync names all 32 lanes");
constexpr uint32_t kNoDigit = 0xFFFFFFFFu;  // a lane with no key in play this tile

// The candidates of the segmented_topk / grouped_topk ops: segment s's tokens are the slots
// start[s] .. start[s] + len[s] - 1 of [capacity] scores and positions.
struct SlotSource {
  const float* scores;
  const int32_t* pos;
  const int64_t* start;
  __device__ int64_t slot(int64_t s, int64_t i) const { return start[s] + i; }
  __device__ float score(int64_t, int64_t, int64_t slot) const { return __ldg(scores + slot); }
  __device__ int32_t position(int64_t slot) const { return __ldg(pos + slot); }
};

// The candidates of the store_topk op, through the store's pages (as paged_topk_cpu reads
// them): positions from the pages; scores from channel 0 of the pages (given == nullptr),
// a [capacity] slot-layout tensor (padded_len < 0) or a [S, padded_len] padded one.
struct PagedSource {
  store::PagedView view;
  const float* given;
  int64_t padded_len;
  SlotRule rule;      // with has_rule (given == nullptr): the score is rule.score of the record
  bool has_rule;
  __device__ int64_t slot(int64_t s, int64_t i) const { return view.slot(s, i); }
  // Explicitly global, read-only loads (scores and positions do not change during the
  // kernel): the compiler may then overlap them with the shared-memory atomics of the
  // histogram, which a generic pointer (one that could point to shared memory) forbids.
  __device__ float score(int64_t s, int64_t i, int64_t slot) const {
    if (has_rule) {  // as paged_topk_cpu's add_run under a rule (slot_rule.h)
      return rule.score(reinterpret_cast<const float*>(view.row(store::kScores, slot)), position(slot), s);
    }
    if (given == nullptr) return __ldg(reinterpret_cast<const float*>(view.row(store::kScores, slot)));
    if (padded_len < 0) return __ldg(given + slot);
    // The CPU op checks L >= every length (a host read); here a token past the padded
    // width has no score and is read as NaN (evicted first) instead of out of bounds.
    return i < padded_len ? __ldg(given + s * padded_len + i) : std::numeric_limits<float>::quiet_NaN();
  }
  __device__ int32_t position(int64_t slot) const {
    return __ldg(reinterpret_cast<const int32_t*>(view.row(store::kPos, slot)));
  }
};

struct Problem {
  const int32_t* len;      // [S]
  const int32_t* k;        // [groups]
  int64_t group_size;
  int64_t splits;          // CTAs per group (1: no team)
  bool* keep;              // [capacity], zeroed: only kept slots are written
  int32_t* counts;         // [S], zeroed, or null
  unsigned int* team_hist; // teams: [groups, kPasses, kBuckets], zeroed
  int64_t* team_equal;     // teams: [groups, splits] keys equal to the threshold per CTA
};

// The key of candidate (s, i), the `local`-th of the CTA's chunk. Its score key comes from
// the cache when it holds it (filled by the first pass: fill_cache). The position (and the
// slot, through the page table) is read only when the threshold has decided into the
// position bits and the score part matches, otherwise those bits cannot change a decision:
// passes over the score bits read no position.
template <typename Source>
__device__ uint64_t key_of(const Source& src, const Threshold& t, int64_t s, int64_t i,
                           int64_t local, uint32_t* cache, bool fill_cache) {
  uint32_t score_k;
  if (local < kCached && !fill_cache) {
    score_k = cache[local];
  } else {
    score_k = score_key(src.score(s, i, src.slot(s, i)));
    if (local < kCached) cache[local] = score_k;  // read back by this same thread only
  }
  const bool need_pos = t.decided >= 32 && score_k == static_cast<uint32_t>(t.prefix >> 32);
  return selection_key(score_k, need_pos ? pos_key(src.position(src.slot(s, i))) : 0u);
}

// Calls f(s, i, local, valid) for the candidates [c0, c1) of group g (local: the index in
// the chunk, c - c0), one tile of kThreads consecutive tokens of one segment at a time
// (thread x gets token base + x); every thread of the CTA makes the same calls, so f may
// use block collectives. done(s) after each segment's part.
template <typename F, typename Done>
__device__ void for_each_tile(const Problem& p, int64_t g, int64_t c0, int64_t c1, F&& f,
                              Done&& done) {
  int64_t offset = 0;  // candidates of the group's earlier segments
  for (int64_t s = g * p.group_size; s < (g + 1) * p.group_size && offset < c1; ++s) {
    const int64_t n = max(p.len[s], 0);
    const int64_t lo = max(c0, offset) - offset, hi = min(c1, offset + n) - offset;
    if (lo < hi) {
      for (int64_t base = lo; base < hi; base += kThreads) {
        const int64_t i = base + threadIdx.x;
        f(s, i, offset + i - c0, i < hi);
      }
      done(s);
    }
    offset += n;
  }
}

template <typename Source, bool kTeam>
__global__ void __launch_bounds__(kThreads) topk_kernel(Source src, Problem p) {
  using BlockScan = cub::BlockScan<unsigned int, kThreads>;
  __shared__ typename BlockScan::TempStorage scan;
  __shared__ unsigned int hist[kBuckets];
  __shared__ unsigned int chosen[3];  // bucket, keys above it, keys in it
  __shared__ unsigned int chosen_local;  // this CTA's keys in the chosen bucket
  __shared__ uint32_t cache[kCached];     // score keys of the chunk's first kCached candidates

  const int64_t g = kTeam ? blockIdx.x / p.splits : blockIdx.x;
  const int64_t split = kTeam ? blockIdx.x % p.splits : 0;
  int64_t n = 0;  // the group's candidates
  for (int64_t s = g * p.group_size; s < (g + 1) * p.group_size; ++s) n += max(p.len[s], 0);
  const int64_t k = min(max(static_cast<int64_t>(p.k[g]), int64_t{0}), n);
  const int64_t chunk = (n + p.splits - 1) / p.splits;
  const int64_t c0 = min(n, split * chunk), c1 = min(n, c0 + chunk);
  // Every thread holds the same threshold and takes the same branches on it.
  Threshold t(k, n);
  const auto nothing = [](int64_t) {};

  // CPU twin: threshold() in topk_cpu.cpp. The CPU copies the keys in play into scratch after
  // each digit and stops at 64 keys for a partial sort; here every pass re-tests in_play on
  // every candidate (the cached keys make that a shared-memory read) and runs the digits to
  // the end: the same Threshold either way, since both take the bucket that holds the rank.
  for (int pass = 0; pass < kPasses; ++pass) {
    const bool open = t.open();  // the same in every CTA of a team
    if (!kTeam && !open) break;
    if (open) {
      hist[threadIdx.x] = 0;
      __syncthreads();
      for_each_tile(p, g, c0, c1, [&](int64_t s, int64_t i, int64_t local, bool valid) {
        uint32_t digit = kNoDigit;
        if (valid) {
          const uint64_t key = key_of(src, t, s, i, local, cache, /*fill_cache=*/pass == 0);
          if (t.in_play(key)) digit = t.digit(key, kDigitBits);
        }
        // One shared atomic per distinct digit of a warp: equal scores (all zero, say) would
        // otherwise serialise 256 atomics on one bin per tile. Every lane gets here (the
        // tiles are uniform over the CTA and kThreads is a whole number of warps).
        const unsigned int peers = __match_any_sync(0xffffffffu, digit);
        if (digit != kNoDigit && static_cast<int>(threadIdx.x % 32) == __ffs(peers) - 1) {
          atomicAdd(&hist[digit], static_cast<unsigned int>(__popc(peers)));
        }
      }, nothing);
      __syncthreads();
    }
    unsigned int local = 0;  // this CTA's count in bucket threadIdx.x
    if constexpr (kTeam) {
      unsigned int* team = p.team_hist + (g * kPasses + pass) * kBuckets;
      if (open) {
        local = hist[threadIdx.x];
        if (local) atomicAdd(team + threadIdx.x, local);
      }
      // Every CTA of the grid, open or not, meets here kPasses + 1 times in all.
      cooperative_groups::this_grid().sync();
      // The barrier orders the other CTAs' atomics before this read; __ldcg reads L2 (the
      // coherent level), never a line this SM's L1 may hold.
      if (open) hist[threadIdx.x] = __ldcg(team + threadIdx.x);
      __syncthreads();
    } else {
      local = hist[threadIdx.x];
    }
    if (!open) continue;
    // Thread x takes bucket kBuckets - 1 - x: the exclusive scan gives the keys above it.
    const unsigned int bucket = kBuckets - 1 - threadIdx.x;
    const unsigned int count = hist[bucket];
    unsigned int above;
    BlockScan(scan).ExclusiveSum(count, above);
    if (t.holds_rank(above, count)) {  // exactly one thread
      chosen[0] = bucket;
      chosen[1] = above;
      chosen[2] = count;
    }
    __syncthreads();
    t.descend(chosen[0], chosen[1], chosen[2], kDigitBits);
    // The team's tie pass needs this CTA's own count of the chosen bucket (the last pass's:
    // the keys equal to the whole threshold); `local` is bucket threadIdx.x's.
    if (threadIdx.x == chosen[0]) chosen_local = local;
    __syncthreads();  // hist, chosen and the scan storage are reused
  }

  // Keys equal to the whole threshold that come before this CTA's chunk in candidate order.
  const bool ordered_ties = t.rank > 0 && !t.settled;
  int64_t equal_before = 0;
  if constexpr (kTeam) {
    if (threadIdx.x == 0) p.team_equal[g * p.splits + split] = ordered_ties ? chosen_local : 0;
    cooperative_groups::this_grid().sync();
    if (ordered_ties) {
      for (int64_t j = 0; j < split; ++j) equal_before += __ldcg(p.team_equal + g * p.splits + j);
    }
  }
  if (t.rank <= 0) return;  // keeps nothing; counts stay 0

  // CPU twin: keep_best. Tiles go in candidate order and the scan ranks a tile's ties in
  // thread (= token) order, so the first t.rank ties of the group are kept, as on the CPU.
  int32_t kept = 0;  // thread 0: kept in the current segment's part
  // k >= live tokens: settled before any pass, every candidate kept without reading a score
  // (the cache was never filled).
  const bool keep_all = k == n;
  for_each_tile(p, g, c0, c1, [&](int64_t s, int64_t i, int64_t local, bool valid) {
    Verdict v = Verdict::kDrop;
    if (valid) v = keep_all ? Verdict::kKeep : t.verdict(key_of(src, t, s, i, local, cache, false));
    bool take = v == Verdict::kKeep;
    if (ordered_ties) {  // uniform: the whole CTA scans
      const unsigned int tie = v == Verdict::kTie;
      unsigned int tie_rank, tile_ties;
      BlockScan(scan).ExclusiveSum(tie, tie_rank, tile_ties);
      take = take || (tie && equal_before + tie_rank < t.rank);
      equal_before += tile_ties;
      __syncthreads();  // the scan storage is reused by the next tile
    }
    if (take) p.keep[src.slot(s, i)] = true;
    const int n_kept = __syncthreads_count(take);
    if (threadIdx.x == 0) kept += n_kept;
  }, [&](int64_t s) {
    if (threadIdx.x == 0 && p.counts != nullptr && kept > 0) atomicAdd(p.counts + s, kept);
    kept = 0;
  });
}

// CTAs of the team kernel an SM holds at once (common/occupancy.h: asked once per device and
// Source, not on every selection of every layer's eviction).
template <typename Source>
int team_blocks_per_sm(int device) {
  return resident_blocks_per_sm(topk_kernel<Source, true>, device, kThreads);
}

template <typename Source>
void launch(const Source& src, Problem p, int64_t groups, int64_t max_candidates,
            const at::TensorOptions& on_device) {
  if (groups == 0) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const int64_t sms = props->multiProcessorCount;
  int64_t splits = 1;
  if (groups < sms && props->cooperativeLaunch) {
    const int per_sm = team_blocks_per_sm<Source>(at::cuda::current_device());
    const int64_t resident = static_cast<int64_t>(per_sm) * sms;  // a cooperative grid's limit
    // Enough CTAs for four per SM (the first pass waits on two dependent loads per score
    // through the page table: more warps hide more of that latency), and enough that the
    // longest possible group's chunks fit the key cache; never more than the resident CTAs
    // (a cooperative grid must all be resident), nor more than the longest possible group
    // has candidates for.
    const int64_t fill = (4 * sms + groups - 1) / groups;
    const int64_t fit = (max_candidates + kCached - 1) / kCached;
    splits = std::min({std::max(fill, fit), resident / groups,
                       (max_candidates + kMinChunk - 1) / kMinChunk});
    splits = std::max<int64_t>(splits, 1);
  }
  if (splits == 1) {
    TORCH_CHECK_VALUE(groups <= INT_MAX, "top-k supports fewer than 2^31 groups");
    topk_kernel<Source, false><<<static_cast<unsigned int>(groups), kThreads, 0, stream>>>(src, p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const at::Tensor team_hist = at::zeros({groups * kPasses * kBuckets}, on_device.dtype(at::kInt));
  const at::Tensor team_equal = at::empty({groups * splits}, on_device.dtype(at::kLong));
  p.splits = splits;
  p.team_hist = reinterpret_cast<unsigned int*>(team_hist.data_ptr<int32_t>());
  p.team_equal = team_equal.data_ptr<int64_t>();
  void* args[] = {const_cast<Source*>(&src), &p};
  C10_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(topk_kernel<Source, true>),
                                             dim3(static_cast<unsigned int>(groups * splits)),
                                             dim3(kThreads), args, 0, stream));
}

Problem problem(const at::Tensor& len, const at::Tensor& k, int64_t group_size,
                const at::Tensor& keep, const at::Tensor* counts) {
  Problem p{};
  p.len = len.data_ptr<int32_t>();
  p.k = k.data_ptr<int32_t>();
  p.group_size = group_size;
  p.splits = 1;
  p.keep = keep.data_ptr<bool>();
  p.counts = counts ? counts->data_ptr<int32_t>() : nullptr;
  return p;
}

void slot_topk(const at::Tensor& scores, const at::Tensor& pos, const at::Tensor& start,
               const at::Tensor& len, int64_t group_size, const at::Tensor& k,
               const at::Tensor& keep, const at::Tensor* counts) {
  const int64_t capacity = scores.size(0), groups = start.size(0) / group_size;
  if (capacity == 0 || groups == 0) return;
  const c10::cuda::CUDAGuard guard(scores.device());
  const SlotSource src{scores.data_ptr<float>(), pos.data_ptr<int32_t>(), start.data_ptr<int64_t>()};
  // A group's segments lie inside the buffers: it has at most `capacity` candidates.
  launch(src, problem(len, k, group_size, keep, counts), groups, capacity, scores.options());
}

}  // namespace

// keep (and counts) arrive zeroed (ops.cpp); like the CPU kernel, only kept slots are written.
void segmented_topk_cuda(const at::Tensor& scores, const at::Tensor& pos, const at::Tensor& start,
                         const at::Tensor& len, const at::Tensor& k, const at::Tensor& keep) {
  slot_topk(scores, pos, start, len, /*group_size=*/1, k, keep, /*counts=*/nullptr);
}

void grouped_topk_cuda(const at::Tensor& scores, const at::Tensor& pos, const at::Tensor& start,
                       const at::Tensor& len, int64_t group_size, const at::Tensor& k,
                       const at::Tensor& keep, const at::Tensor& counts) {
  slot_topk(scores, pos, start, len, group_size, k, keep, &counts);
}

void paged_topk_cuda(const store::PagedView& view, const at::Tensor& len, const at::Tensor& scores,
                     int64_t group_size, const at::Tensor& k, const at::Tensor& keep,
                     const at::Tensor& counts, const SlotRule* rule) {
  const int64_t groups = k.size(0);
  if (groups == 0 || keep.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(len.device());
  PagedSource src{view, nullptr, -1, rule != nullptr ? *rule : SlotRule{}, rule != nullptr};
  if (scores.defined()) {
    src.given = scores.data_ptr<float>();
    src.padded_len = scores.dim() == 3 ? scores.size(2) : -1;
  }
  // A segment holds at most its page-table row: width pages.
  const int64_t max_candidates = group_size * (view.width << view.shift);
  launch(src, problem(len, k, group_size, keep, &counts), groups, max_candidates, len.options());
}

}  // namespace kvcache_ext::select
