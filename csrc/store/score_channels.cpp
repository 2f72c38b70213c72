#include "store/score_channels.h"

namespace kvcache_ext::store {

at::Tensor slab_part(const at::Tensor& slab, const PageRecord& record, int part, int64_t page_size,
                     at::ScalarType kv_dtype) {
  const int64_t pages = slab.size(0);
  const at::ScalarType dtype = part == kPos      ? at::kInt
                              : part == kScores ? at::kFloat
                              : part == kScale  ? at::kHalf
                                                : kv_dtype;
  const int64_t width = record.row_bytes[part] / static_cast<int64_t>(c10::elementSize(dtype));
  // The part's bytes of every page: [pages, P * row bytes] with the record as row stride.
  const at::Tensor bytes = slab.narrow(1, record.offset[part], page_size * record.row_bytes[part]);
  const at::Tensor typed = width == 0 ? at::empty({pages, 0}, slab.options().dtype(dtype)) : bytes.view(dtype);
  return part == kPos ? typed.view({pages, page_size}) : typed.view({pages, page_size, width});
}

void add_to_scores(at::TensorList slabs, const PageRecord& record, int64_t page_size, int64_t channel,
                   const at::Tensor& values) {
  int64_t first_slot = 0;
  for (const at::Tensor& slab : slabs) {
    at::Tensor dst = slab_part(slab, record, kScores, page_size, at::kFloat).select(2, channel);  // [pages, P]
    dst.add_(values.narrow(0, first_slot, dst.numel()).view(dst.sizes()));
    first_slot += dst.numel();
  }
}

}  // namespace kvcache_ext::store
