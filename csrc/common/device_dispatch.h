// Picks the CPU or the CUDA implementation of a kernel `name` (name##_cpu / name##_cuda).
#pragma once
#include <c10/util/Exception.h>

#ifdef KVCACHE_EXT_WITH_CUDA
#define KVCACHE_DEVICE_DISPATCH(device, name, ...) \
  ((device).is_cuda() ? name##_cuda(__VA_ARGS__) : name##_cpu(__VA_ARGS__))
#else
#define KVCACHE_DEVICE_DISPATCH(device, name, ...) name##_cpu(__VA_ARGS__)
#endif

namespace kvcache_ext {

inline void check_device_supported(const c10::Device& device) {
#ifdef KVCACHE_EXT_WITH_CUDA
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda(),
                    "kvcache_ext supports CPU and CUDA tensors, got ", device);
#else
  TORCH_CHECK_VALUE(device.is_cpu(), "kvcache_ext was built without CUDA kernels; got a tensor on ",
                    device, ". Reinstall with a CUDA build of torch and nvcc available.");
#endif
}

}  // namespace kvcache_ext
