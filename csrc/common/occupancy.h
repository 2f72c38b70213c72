// Blocks of a CUDA kernel an SM holds at once, asked of the runtime once per (device, kernel,
// block size, dynamic shared memory) and then remembered: the plans and launch configurations
// that need it run for every layer at every step, and each query costs microseconds of host
// time. The runtime answers for the current device, which callers pass as `device`.
#pragma once
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <tuple>

namespace kvcache_ext {

inline int resident_blocks_per_sm(const void* kernel, int device, int threads, size_t dynamic_smem = 0) {
  static std::mutex lock;
  static std::map<std::tuple<const void*, int, int, size_t>, int> known;
  const std::lock_guard<std::mutex> guard(lock);
  const auto key = std::make_tuple(kernel, device, threads, dynamic_smem);
  auto it = known.find(key);
  if (it == known.end()) {
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, dynamic_smem));
    it = known.emplace(key, per_sm).first;
  }
  return it->second;
}

template <typename... Args>
int resident_blocks_per_sm(void (*kernel)(Args...), int device, int threads, size_t dynamic_smem = 0) {
  return resident_blocks_per_sm(reinterpret_cast<const void*>(kernel), device, threads, dynamic_smem);
}

}  // namespace kvcache_ext
