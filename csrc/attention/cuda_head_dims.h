// The head_dim sizes the CUDA attention kernel is instantiated for, in one place: the kernel's
// dispatch (attention_cuda.cu), its refusal message, the gtest twins and Python's
// kvcache_ext.kernels.attention.CUDA_HEAD_DIMS (through the binding) all read this list. The CPU
// kernels take any head_dim. Plain C++, so that a build without CUDA still has the list.
#pragma once

#include <cstdint>
#include <string>

namespace kvcache_ext::attention {

template <int... Sizes>
struct HeadDims {
  static constexpr int64_t count = sizeof...(Sizes);
  static constexpr int64_t values[count] = {Sizes...};
};

// One instantiation each: a size added here is compiled into the kernel.
using CudaHeadDims = HeadDims<64, 80, 96, 112, 128, 192, 256>;

inline bool is_cuda_head_dim(int64_t head_dim) {
  for (const int64_t size : CudaHeadDims::values)
    if (size == head_dim) return true;
  return false;
}

// "64, 80, ... and 256": the words of the refusal, the same in C++ and in Python.
inline std::string cuda_head_dims_text() {
  std::string text;
  for (int64_t i = 0; i < CudaHeadDims::count; ++i) {
    if (i > 0) text += i + 1 == CudaHeadDims::count ? " and " : ", ";
    text += std::to_string(CudaHeadDims::values[i]);
  }
  return text;
}

}  // namespace kvcache_ext::attention
