// CPU kernels of the ragged store: parallel over segments, rows moved with memcpy/memmove.
#include <ATen/Parallel.h>

#include <cstring>

#include "store/store_kernels.h"

namespace kvcache_ext::store {

namespace {

// Raw views of the four per-slot buffers: row r of each starts at base + r * row_bytes.
struct RowBuffers {
  char* base[4];
  int64_t row_bytes[4];

  explicit RowBuffers(const SlotBuffers& b) {
    const at::Tensor* ts[4] = {&b.k, &b.v, &b.pos, &b.scores};
    for (int i = 0; i < 4; ++i) {
      base[i] = static_cast<char*>(ts[i]->data_ptr());
      row_bytes[i] = ts[i]->numel() == 0 ? 0 : ts[i]->nbytes() / ts[i]->size(0);
    }
  }
  char* row(int buffer, int64_t r) const { return base[buffer] + r * row_bytes[buffer]; }
};

constexpr int kK = 0, kV = 1, kPos = 2, kScores = 3;

// Segments are independent; a grain of 1 lets one long segment not serialize the rest.
template <typename F>
void for_each_segment(int64_t num_segments, const F& f) {
  at::parallel_for(0, num_segments, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) f(s);
  });
}

void write_token(const RowBuffers& dst, int64_t slot, const char* k, const char* v,
                 int32_t pos) {
  std::memcpy(dst.row(kK, slot), k, dst.row_bytes[kK]);
  std::memcpy(dst.row(kV, slot), v, dst.row_bytes[kV]);
  std::memcpy(dst.row(kPos, slot), &pos, sizeof(int32_t));
  std::memset(dst.row(kScores, slot), 0, dst.row_bytes[kScores]);
}

}  // namespace

void relocate_cpu(const SlotBuffers& src, const SlotBuffers& dst, const at::Tensor& src_start,
                  const at::Tensor& dst_start, const at::Tensor& len, int64_t /*max_len*/) {
  const RowBuffers from(src), to(dst);
  const int64_t* src_start_p = src_start.data_ptr<int64_t>();
  const int64_t* dst_start_p = dst_start.data_ptr<int64_t>();
  const int32_t* len_p = len.data_ptr<int32_t>();
  for_each_segment(len.numel(), [&](int64_t s) {
    for (int b = 0; b < 4; ++b) {
      std::memcpy(to.row(b, dst_start_p[s]), from.row(b, src_start_p[s]),
                  len_p[s] * from.row_bytes[b]);
    }
  });
}

void append_cpu(const SlotBuffers& buf, const at::Tensor& start, const at::Tensor& len,
                const at::Tensor& new_k, const at::Tensor& new_v, const at::Tensor& new_pos,
                const at::Tensor& rank) {
  const RowBuffers to(buf);
  const int64_t S = new_k.size(0), n = new_k.size(1), heads = S / new_pos.size(0);
  const int64_t row_bytes = new_k.size(-1) * new_k.element_size();
  const char* k = static_cast<const char*>(new_k.data_ptr());
  const char* v = static_cast<const char*>(new_v.data_ptr());
  const int32_t* pos = new_pos.data_ptr<int32_t>();
  const int32_t* rank_p = rank.defined() ? rank.data_ptr<int32_t>() : nullptr;
  const int64_t* start_p = start.data_ptr<int64_t>();
  const int32_t* len_p = len.data_ptr<int32_t>();
  for_each_segment(S, [&](int64_t s) {
    const int64_t end = start_p[s] + len_p[s];
    for (int64_t t = 0; t < n; ++t) {
      const int64_t r = rank_p ? rank_p[s * n + t] : t;
      if (r < 0) continue;
      write_token(to, end + r, k + (s * n + t) * row_bytes, v + (s * n + t) * row_bytes,
                  pos[(s / heads) * n + t]);
    }
  });
}

void replace_cpu(const SlotBuffers& buf, const at::Tensor& start, const at::Tensor& slot,
                 const at::Tensor& new_k, const at::Tensor& new_v, const at::Tensor& new_pos) {
  const RowBuffers to(buf);
  const int64_t S = new_k.size(0), heads = S / new_pos.size(0);
  const int64_t row_bytes = new_k.size(-1) * new_k.element_size();
  const char* k = static_cast<const char*>(new_k.data_ptr());
  const char* v = static_cast<const char*>(new_v.data_ptr());
  const int32_t* pos = new_pos.data_ptr<int32_t>();
  const int64_t* start_p = start.data_ptr<int64_t>();
  const int64_t* slot_p = slot.data_ptr<int64_t>();
  for_each_segment(S, [&](int64_t s) {
    write_token(to, start_p[s] + slot_p[s], k + s * row_bytes, v + s * row_bytes,
                pos[s / heads]);
  });
}

void compact_cpu(const SlotBuffers& buf, const at::Tensor& start, const at::Tensor& len,
                 const at::Tensor& keep) {
  const RowBuffers rows(buf);
  const int64_t* start_p = start.data_ptr<int64_t>();
  int32_t* len_p = len.data_ptr<int32_t>();
  const bool* keep_p = keep.data_ptr<bool>();
  for_each_segment(len.numel(), [&](int64_t s) {
    const int64_t first = start_p[s];
    int64_t kept = 0;
    // Runs of kept slots move as one block; dst <= src, so a forward memmove is safe.
    for (int64_t i = 0; i < len_p[s];) {
      if (!keep_p[first + i]) {
        ++i;
        continue;
      }
      int64_t run = 1;
      while (i + run < len_p[s] && keep_p[first + i + run]) ++run;
      if (kept != i) {
        for (int b = 0; b < 4; ++b) {
          std::memmove(rows.row(b, first + kept), rows.row(b, first + i), run * rows.row_bytes[b]);
        }
      }
      kept += run;
      i += run;
    }
    len_p[s] = static_cast<int32_t>(kept);
  });
}

}  // namespace kvcache_ext::store
