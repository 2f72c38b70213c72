// RaggedKVStore: the KV cache of one attention layer, stored as one ragged segment
// per (batch item, KV head). See DESIGN.md "Ragged store" and README "Store API".
#pragma once
#include <ATen/ATen.h>

#include <vector>

#include "store/store_kernels.h"

namespace kvcache_ext {

class RaggedKVStore {
 public:
  // `like` only carries the dtype and device of K and V.
  RaggedKVStore(int64_t batch, int64_t heads, int64_t head_dim, int64_t score_channels,
                const at::Tensor& like, double growth);

  // Appends n tokens to every segment: k, v [B, H, n, D]; pos [B, n] or [n]. With
  // valid ([B, n] or [B, H, n] bool), only the valid tokens are stored, in order.
  void append(const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos,
              const c10::optional<at::Tensor>& valid);
  // Overwrites slot[b, h] (an index in [0, len)) of every segment with the token
  // k, v [B, H, 1, D] at position pos [B]. check_bounds costs one host sync on CUDA.
  void replace(const at::Tensor& slot, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& pos, bool check_bounds);
  // Keeps the live slots whose flag in keep ([capacity] bool) is set, in order.
  void compact(const at::Tensor& keep);
  // Makes room for `extra` more tokens in every segment without regrowing.
  void reserve(int64_t extra);
  // Gives back every slot beyond the live ones (cap = len).
  void shrink_to_fit();

  const at::Tensor& k() const { return buf_.k; }
  const at::Tensor& v() const { return buf_.v; }
  const at::Tensor& pos() const { return buf_.pos; }
  const at::Tensor& scores() const { return buf_.scores; }
  const at::Tensor& start() const { return start_; }
  const at::Tensor& len() const { return len_; }
  const at::Tensor& cap() const { return cap_; }
  const std::vector<int32_t>& len_host() const { return len_h_; }
  const std::vector<int32_t>& cap_host() const { return cap_h_; }
  int64_t capacity() const { return buf_.k.size(0); }
  int64_t num_tokens() const;  // live slots, summed over segments
  int64_t nbytes() const;      // bytes held by every buffer of the store
  int64_t batch() const { return batch_; }
  int64_t heads() const { return heads_; }
  int64_t head_dim() const { return head_dim_; }
  int64_t score_channels() const { return score_channels_; }
  int64_t num_segments() const { return batch_ * heads_; }
  double growth() const { return growth_; }

 private:
  void check_tokens(const at::Tensor& t, int64_t n, const char* name) const;
  // Grows segments (never shrinks them) so that segment s can take incoming[s] more tokens.
  void ensure_room(const std::vector<int64_t>& incoming);
  // Moves every live slot into fresh buffers whose segment capacities are new_cap.
  void relayout(const std::vector<int32_t>& new_cap);

  int64_t batch_, heads_, head_dim_, score_channels_;
  double growth_;
  at::TensorOptions kv_options_;
  store::SlotBuffers buf_;
  at::Tensor start_, len_, cap_;   // on the store's device: int64, int32, int32 [S]
  std::vector<int64_t> start_h_;   // host mirrors: growth decisions need no device sync
  std::vector<int32_t> len_h_, cap_h_;
};

}  // namespace kvcache_ext
