// The order in which slots are kept, as one 64-bit key (larger = kept first), shared by
// the CPU and CUDA selection so that both choose the same slots:
//   higher score first; NaN is lower than every number (evicted first);
//   equal scores: lower position first; -0.0 equals +0.0.
// Key 0 is below every live slot's key: the CUDA kernels give it to slack slots.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVCACHE_SELECTION_KEY_FN __host__ __device__ __forceinline__
#else
#define KVCACHE_SELECTION_KEY_FN inline
#endif

namespace kvcache_ext::select {

KVCACHE_SELECTION_KEY_FN uint64_t selection_key(float score, int32_t pos) {
  uint32_t ordered;
  if (score != score) {
    ordered = 1u;  // NaN: above slack (0), below -inf (0x007fffff)
  } else {
    if (score == 0.0f) score = 0.0f;  // -0.0 -> +0.0
    uint32_t bits;
#if defined(__CUDA_ARCH__)
    bits = __float_as_uint(score);
#else
    std::memcpy(&bits, &score, sizeof(bits));
#endif
    // Flip so that unsigned order matches float order.
    ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  }
  return (static_cast<uint64_t>(ordered) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(pos));
}

}  // namespace kvcache_ext::select

// Local to this header: store/paged_layout.h defines KVCACHE_HOST_DEVICE for its own use.
#undef KVCACHE_SELECTION_KEY_FN
