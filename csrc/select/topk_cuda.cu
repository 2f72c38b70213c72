// CUDA selection: a segmented radix sort (CUB) of 64-bit selection keys, then the first k
// of every sorted range are kept. Same result as topk_cpu.cpp, bit for bit:
//   - the keys are selection_key(score, pos), shared with the CPU;
//   - the radix sort is stable and the values (slot indices) enter in ascending order, so
//     equal keys keep the lower slot first, the CPU's tie-break.
//
// The segmented selection is the grouped one with groups of one segment, so both run
// through select_top_k below. Everything stays on the device: no host sync.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cub/device/device_segmented_radix_sort.cuh>

#include <climits>
#include <cstdint>

#include "select/selection_key.h"
#include "select/topk.h"

namespace kvcache_ext::select {

namespace {

constexpr int kThreads = 256;

unsigned int blocks_for(int64_t items) {
  return static_cast<unsigned int>((items + kThreads - 1) / kThreads);
}

// Largest j in [0, n) with a[j] <= x, or -1 if there is none. a is non-decreasing
// (segments lie in order; an empty segment may share its start with the next one).
template <typename T>
__device__ int64_t last_at_or_before(const T* a, int64_t n, int64_t x) {
  int64_t lo = 0, hi = n;  // answer + 1 lies in [lo, hi]
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (static_cast<int64_t>(a[mid]) <= x) lo = mid + 1; else hi = mid;
  }
  return lo - 1;
}

// Sort range of every group: from the first slot of its first segment to the end of the
// live slots of its last segment. Slots of the store fit in int32 (checked by the caller).
__global__ void group_ranges_kernel(const int64_t* start, const int32_t* len, int64_t group_size,
                                    int64_t groups, int32_t* begin, int32_t* end) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  const int64_t last = (g + 1) * group_size - 1;
  begin[g] = static_cast<int32_t>(start[g * group_size]);
  end[g] = static_cast<int32_t>(start[last] + len[last]);
}

// keys[j] = selection_key of slot j if it is live, else 0: slack slots inside a group's
// range then sort after every live slot (a live key is at least 1 << 32, see
// selection_key.h). values[j] = j. Slot j can only be live in the last segment that
// starts at or before it.
__global__ void fill_keys_kernel(const float* scores, const int32_t* pos, const int64_t* start,
                                 const int32_t* len, int64_t segments, int64_t capacity,
                                 uint64_t* keys, int32_t* values) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= capacity) return;
  const int64_t s = last_at_or_before(start, segments, j);
  const bool live = s >= 0 && j < start[s] + len[s];
  keys[j] = live ? selection_key(scores[j], pos[j]) : uint64_t{0};
  values[j] = static_cast<int32_t>(j);
}

// Sorted position i of group g (in [begin[g], end[g])) is kept when its rank in the group
// is below k[g] and it is a live slot (key != 0): the first min(k[g], live) entries.
// counts, when given (zeroed), receives the number kept per segment; the segment of a
// kept slot is found among its group's segments by binary search.
__global__ void __launch_bounds__(kThreads)
    mark_kept_kernel(const uint64_t* keys, const int32_t* values, const int32_t* begin,
                     const int32_t* end, const int32_t* k, int64_t groups, int64_t capacity,
                     const int64_t* start, int64_t group_size, bool* keep, int32_t* counts) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t segment = -1;  // segment of the slot kept by this thread, -1: none
  if (i < capacity) {
    // Positions outside every group's range hold no sorted data (CUB leaves them as is).
    const int64_t g = last_at_or_before(begin, groups, i);
    if (g >= 0 && i < end[g] && i - begin[g] < k[g] && keys[i] != 0) {
      const int32_t slot = values[i];
      keep[slot] = true;
      if (counts) {
        segment = g * group_size + last_at_or_before(start + g * group_size, group_size, slot);
      }
    }
  }
  if (counts) {
    // Lanes keeping a slot of the same segment add up in one atomic. Every lane of the
    // warp gets here (no early exit above, and the block is a whole number of warps).
    const unsigned int peers = __match_any_sync(0xffffffffu, static_cast<unsigned long long>(segment));
    const int lane = static_cast<int>(threadIdx.x % 32);
    if (segment >= 0 && lane == __ffs(peers) - 1) atomicAdd(counts + segment, __popc(peers));
  }
}

// Keeps, in every group g of group_size consecutive segments, the k[g] best live slots.
void select_top_k(const at::Tensor& scores, const at::Tensor& pos, const at::Tensor& start,
                  const at::Tensor& len, int64_t group_size, const at::Tensor& k,
                  const at::Tensor& keep, const at::Tensor* counts) {
  const int64_t capacity = scores.size(0), segments = start.size(0);
  const int64_t groups = segments / group_size;
  if (capacity == 0 || groups == 0) return;
  TORCH_CHECK_VALUE(capacity < INT_MAX && groups < INT_MAX,
                    "selection supports fewer than 2^31 slots and segments");
  const c10::cuda::CUDAGuard guard(scores.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto on_device = scores.options();

  // Group ranges for CUB, built on the device: begin = ranges[0, G), end = ranges[G, 2G).
  const at::Tensor ranges = at::empty({2 * groups}, on_device.dtype(at::kInt));
  int32_t* begin = ranges.data_ptr<int32_t>();
  int32_t* end = begin + groups;
  group_ranges_kernel<<<blocks_for(groups), kThreads, 0, stream>>>(
      start.data_ptr<int64_t>(), len.data_ptr<int32_t>(), group_size, groups, begin, end);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  // Two key and two value buffers over the whole capacity: CUB's double-buffer interface
  // sorts in them with only a small temporary storage besides.
  const at::Tensor key_buffers = at::empty({2 * capacity}, on_device.dtype(at::kLong));
  const at::Tensor value_buffers = at::empty({2 * capacity}, on_device.dtype(at::kInt));
  uint64_t* keys = reinterpret_cast<uint64_t*>(key_buffers.data_ptr<int64_t>());
  int32_t* values = value_buffers.data_ptr<int32_t>();
  fill_keys_kernel<<<blocks_for(capacity), kThreads, 0, stream>>>(
      scores.data_ptr<float>(), pos.data_ptr<int32_t>(), start.data_ptr<int64_t>(),
      len.data_ptr<int32_t>(), segments, capacity, keys, values);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  cub::DoubleBuffer<uint64_t> sorted_keys(keys, keys + capacity);
  cub::DoubleBuffer<int32_t> sorted_values(values, values + capacity);
  const int num_items = static_cast<int>(capacity), num_groups = static_cast<int>(groups);
  size_t temp_bytes = 0;
  C10_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
      nullptr, temp_bytes, sorted_keys, sorted_values, num_items, num_groups, begin, end, 0,
      64, stream));
  const at::Tensor temp =
      at::empty({static_cast<int64_t>(temp_bytes)}, on_device.dtype(at::kByte));
  // The sort picks (on the host, from the number of passes) which buffer of each pair
  // holds the result, and records it in the DoubleBuffer selectors.
  C10_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
      temp.data_ptr(), temp_bytes, sorted_keys, sorted_values, num_items, num_groups, begin, end,
      0, 64, stream));

  int32_t* counts_p = nullptr;
  if (counts != nullptr) {
    counts->zero_();  // the kernel adds to it
    counts_p = counts->data_ptr<int32_t>();
  }
  mark_kept_kernel<<<blocks_for(capacity), kThreads, 0, stream>>>(
      sorted_keys.Current(), sorted_values.Current(), begin, end, k.data_ptr<int32_t>(), groups,
      capacity, start.data_ptr<int64_t>(), group_size, keep.data_ptr<bool>(), counts_p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// keep arrives zeroed (topk.cpp); like the CPU kernel, only kept slots are written.
void segmented_topk_cuda(const at::Tensor& scores, const at::Tensor& pos, const at::Tensor& start,
                         const at::Tensor& len, const at::Tensor& k, const at::Tensor& keep) {
  select_top_k(scores, pos, start, len, /*group_size=*/1, k, keep, /*counts=*/nullptr);
}

void grouped_topk_cuda(const at::Tensor& scores, const at::Tensor& pos, const at::Tensor& start,
                       const at::Tensor& len, int64_t group_size, const at::Tensor& k,
                       const at::Tensor& keep, const at::Tensor& counts) {
  select_top_k(scores, pos, start, len, group_size, k, keep, &counts);
}

}  // namespace kvcache_ext::select
