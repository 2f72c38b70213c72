// What the CUDA half of the extension was compiled for, read from nvcc's own macros.
#include <cuda_runtime_api.h>

#include <string>
#include <vector>

namespace kvcache_ext {

std::vector<int> cuda_compiled_archs() { return {__CUDA_ARCH_LIST__}; }

std::string cuda_compiled_version() {
  return std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
}

}  // namespace kvcache_ext
