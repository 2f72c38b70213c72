// CUDA selection: a segmented radix sort (CUB) of 64-bit selection keys, then the first k
// of every sorted range are kept. Same result as topk_cpu.cpp, bit for bit:
//   - the keys are selection_key(score, pos), shared with the CPU;
//   - the radix sort is stable and the values (slot indices) enter in ascending order, so
//     equal keys keep the lower slot first, the CPU's tie-break.
//
// The segmented selection is the grouped one with groups of one segment, so both run
// through select_top_k below. Everything stays on the device: no host sync.
//
// Two ways to sort, chosen from the number of groups (known on the host):
//   - many groups (at least one per SM): CUB's segmented sort, one block per group;
//   - fewer groups than SMs (batch 1 or a few, where one block per group would leave most
//     of the GPU idle on a long group): two device-wide sorts over every slot, which use the
//     whole GPU. First by key, descending; then, stably, by group (dead slots form a last,
//     extra group). Stability keeps each group's slots in key order, so group g ends up in
//     [off_g, off_g + live_g), off_g the live slots of the groups before it, best first.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cub/device/device_radix_sort.cuh>
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

// group_of[i]: the group of sorted slot values[i] (segment / group_size), or `groups` for
// a dead slot (key 0), which sorts it after every live one in the second, stable sort.
__global__ void group_of_sorted_kernel(const uint64_t* keys, const int32_t* values,
                                       const int64_t* start, int64_t segments, int64_t group_size,
                                       int64_t groups, int64_t capacity, uint32_t* group_of) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= capacity) return;
  group_of[i] = keys[i] == 0 ? static_cast<uint32_t>(groups)
                             : static_cast<uint32_t>(last_at_or_before(start, segments, values[i]) / group_size);
}

// Ranges of the groups after the two device-wide sorts: live slots of the groups in order,
// begin[g] = the live slots of groups < g. One thread: there are fewer groups than SMs.
__global__ void packed_group_ranges_kernel(const int32_t* len, int64_t group_size, int64_t groups,
                                           int32_t* begin, int32_t* end) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  int64_t at = 0;
  for (int64_t g = 0; g < groups; ++g) {
    begin[g] = static_cast<int32_t>(at);
    for (int64_t s = g * group_size; s < (g + 1) * group_size; ++s) at += len[s];
    end[g] = static_cast<int32_t>(at);
  }
}

// Sorted position i of group g (in [begin[g], end[g])) is kept when its rank in the group
// is below k[g] and it is a live slot (key != 0; keys == nullptr: every position in a
// range is live): the first min(k[g], live) entries.
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
    if (g >= 0 && i < end[g] && i - begin[g] < k[g] && (keys == nullptr || keys[i] != 0)) {
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

// Temporary storage for a CUB call from the caching allocator on the current stream: the
// first call (null storage) asks for the size, the second sorts.
template <typename Sort>
void run_cub(const Sort& sort, const at::TensorOptions& on_device) {
  size_t temp_bytes = 0;
  C10_CUDA_CHECK(sort(nullptr, temp_bytes));
  const at::Tensor temp = at::empty({static_cast<int64_t>(temp_bytes)}, on_device.dtype(at::kByte));
  C10_CUDA_CHECK(sort(temp.data_ptr(), temp_bytes));
}

int bits_for(int64_t values) {  // bits that hold 0 .. values - 1
  int bits = 1;
  while ((int64_t{1} << bits) < values) ++bits;
  return bits;
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
  const bool few_groups = groups < at::cuda::getCurrentDeviceProperties()->multiProcessorCount;

  // Group ranges for CUB's segmented sort, built on the device: begin = ranges[0, G),
  // end = ranges[G, 2G). The device-wide path writes its own ranges here after sorting.
  const at::Tensor ranges = at::empty({2 * groups}, on_device.dtype(at::kInt));
  int32_t* begin = ranges.data_ptr<int32_t>();
  int32_t* end = begin + groups;
  if (!few_groups) {
    group_ranges_kernel<<<blocks_for(groups), kThreads, 0, stream>>>(
        start.data_ptr<int64_t>(), len.data_ptr<int32_t>(), group_size, groups, begin, end);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

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
  // Each sort picks (on the host, from the number of passes) which buffer of a pair holds
  // its result, and records it in the DoubleBuffer selectors.
  const uint64_t* final_keys = nullptr;  // null: every position of a group's range is live
  if (few_groups) {
    run_cub([&](void* temp, size_t& bytes) {
      return cub::DeviceRadixSort::SortPairsDescending(temp, bytes, sorted_keys, sorted_values,
                                                       num_items, 0, 64, stream);
    }, on_device);
    const at::Tensor group_buffers = at::empty({2 * capacity}, on_device.dtype(at::kInt));
    uint32_t* group_of = reinterpret_cast<uint32_t*>(group_buffers.data_ptr<int32_t>());
    group_of_sorted_kernel<<<blocks_for(capacity), kThreads, 0, stream>>>(
        sorted_keys.Current(), sorted_values.Current(), start.data_ptr<int64_t>(), segments,
        group_size, groups, capacity, group_of);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (groups > 1) {  // one group: the key order is already the group's order
      cub::DoubleBuffer<uint32_t> sorted_groups(group_of, group_of + capacity);
      const int bits = bits_for(groups + 1);   // groups and the dead slots' `groups`
      run_cub([&](void* temp, size_t& bytes) {
        return cub::DeviceRadixSort::SortPairs(temp, bytes, sorted_groups, sorted_values,
                                               num_items, 0, bits, stream);
      }, on_device);
    }
    packed_group_ranges_kernel<<<1, 1, 0, stream>>>(len.data_ptr<int32_t>(), group_size, groups,
                                                     begin, end);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    run_cub([&](void* temp, size_t& bytes) {
      return cub::DeviceSegmentedRadixSort::SortPairsDescending(
          temp, bytes, sorted_keys, sorted_values, num_items, num_groups, begin, end, 0, 64, stream);
    }, on_device);
    final_keys = sorted_keys.Current();
  }

  int32_t* counts_p = nullptr;
  if (counts != nullptr) {
    counts->zero_();  // the kernel adds to it
    counts_p = counts->data_ptr<int32_t>();
  }
  mark_kept_kernel<<<blocks_for(capacity), kThreads, 0, stream>>>(
      final_keys, sorted_values.Current(), begin, end, k.data_ptr<int32_t>(), groups,
      capacity, start.data_ptr<int64_t>(), group_size, keep.data_ptr<bool>(), counts_p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// keep arrives zeroed (ops.cpp); like the CPU kernel, only kept slots are written.
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
