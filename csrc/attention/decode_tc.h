// The tensor-core decode kernel (decode_tc_cuda.cu; its tiling in decode_tiles.h): the attend
// step of ragged_attention_cuda (attention_cuda.cu) for calls of few query rows per KV head,
// when switched on. It writes each split's state where attend_split would, and the scalar
// path's merge combines them. Only with CUDA.
#pragma once
#ifdef KVCACHE_EXT_WITH_CUDA

#include <cuda_runtime.h>

#include <cstdint>

#include "attention/split_args.h"

namespace kvcache_ext::attention {

// Opt-in until a GPU has measured it against the scalar kernel (docs/kernels.md): unset or "0"
// off, "1" on; any other value raises a ValueError naming it. Read from the environment on
// every call that could take the kernel (a getenv: well under a microsecond), so that the
// benchmarks time both kernels in one process.
constexpr const char* kDecodeTcSwitch = "KVCACHE_EXT_TC_DECODE";
bool decode_tc_enabled();

// At most this many query rows per KV head (G * n: one mma M tile).
constexpr int64_t kDecodeTcMaxRows = 16;

// T is at::Half or at::BFloat16 (q, the output, and 16-bit pages), D 64 or 128, Q8 int8 pages
// (the instantiations decode_tc_cuda.cu makes).
template <typename T, int D, bool Q8>
void launch_decode_tc(const SplitArgs& a, int64_t splits, cudaStream_t stream);

// Blocks of the kernel (bf16, head_dim 128) an SM holds: the plan's waves.
int decode_tc_blocks_per_sm(int device);

}  // namespace kvcache_ext::attention

#endif  // KVCACHE_EXT_WITH_CUDA
