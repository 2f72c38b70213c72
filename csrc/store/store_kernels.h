// Kernels of the ragged KV store, one CPU and one CUDA implementation of each.
// They trust their inputs: RaggedKVStore (ragged_store.cpp) checks everything first.
//
// Slot layout: segment s owns the slots [start[s], start[s] + cap[s]) of every per-slot
// buffer; its first len[s] slots are live. K and V rows are moved as raw bytes, so
// these kernels need no dtype dispatch.
#pragma once
#include <ATen/ATen.h>

namespace kvcache_ext::store {

struct SlotBuffers {
  at::Tensor k;       // [capacity, D], model dtype
  at::Tensor v;       // [capacity, D], model dtype
  at::Tensor pos;     // [capacity] int32, absolute token position
  at::Tensor scores;  // [capacity, C] float32, score channels owned by a policy
};

// Copies the first len[s] slots of every segment from src (at src_start[s]) to dst
// (at dst_start[s]). src and dst are different buffers. max_len = max(len).
void relocate_cpu(const SlotBuffers& src, const SlotBuffers& dst, const at::Tensor& src_start,
                  const at::Tensor& dst_start, const at::Tensor& len, int64_t max_len);

// Writes token t of segment s (new_k/new_v [S, n, D], new_pos [B, n] with
// S = B * heads) to slot start[s] + len[s] + rank[s, t] and zeroes its scores.
// rank [S, n] int32 with -1 for tokens not stored; an undefined rank means rank = t.
// len is not updated here.
void append_cpu(const SlotBuffers& buf, const at::Tensor& start, const at::Tensor& len,
                const at::Tensor& new_k, const at::Tensor& new_v, const at::Tensor& new_pos,
                const at::Tensor& rank);

// Overwrites slot start[s] + slot[s] with token s of new_k/new_v [S, D] and
// new_pos [B] (S = B * heads), and zeroes its scores.
void replace_cpu(const SlotBuffers& buf, const at::Tensor& start, const at::Tensor& slot,
                 const at::Tensor& new_k, const at::Tensor& new_v, const at::Tensor& new_pos);

// Stable in-place removal of every live slot whose keep flag ([capacity] bool) is
// false. Writes the new lengths into len.
void compact_cpu(const SlotBuffers& buf, const at::Tensor& start, const at::Tensor& len,
                 const at::Tensor& keep);

#ifdef KVCACHE_EXT_WITH_CUDA
void relocate_cuda(const SlotBuffers& src, const SlotBuffers& dst, const at::Tensor& src_start,
                   const at::Tensor& dst_start, const at::Tensor& len, int64_t max_len);
void append_cuda(const SlotBuffers& buf, const at::Tensor& start, const at::Tensor& len,
                 const at::Tensor& new_k, const at::Tensor& new_v, const at::Tensor& new_pos,
                 const at::Tensor& rank);
void replace_cuda(const SlotBuffers& buf, const at::Tensor& start, const at::Tensor& slot,
                  const at::Tensor& new_k, const at::Tensor& new_v, const at::Tensor& new_pos);
void compact_cuda(const SlotBuffers& buf, const at::Tensor& start, const at::Tensor& len,
                  const at::Tensor& keep);
#endif

}  // namespace kvcache_ext::store
