// The one Python module, kvcache_ext._C, for what is not an op: the host page allocator
// (store/page_allocator.h), the eager decode step over the allocator (ops::decode_step: the
// store_decode_step op's function with the allocator's host steps), the page layout's sizes,
// the CPU attention's ISA switch and build information. Every kernel is reached through the
// functions of its torch op (ops.h, registered in ops.cpp).
#include <torch/extension.h>
#include <torch/version.h>

#include "attention/attention_cpu_tiles.h"
#include "attention/cuda_head_dims.h"
#include "ops.h"
#include "store/page_allocator.h"

namespace kvcache_ext {
#ifdef KVCACHE_EXT_WITH_CUDA
std::vector<int> cuda_compiled_archs();
std::string cuda_compiled_version();
#endif

namespace {

py::dict build_info() {
  py::dict info;
  info["torch_version"] = std::to_string(TORCH_VERSION_MAJOR) + "." +
                          std::to_string(TORCH_VERSION_MINOR) + "." +
                          std::to_string(TORCH_VERSION_PATCH);
#ifdef KVCACHE_EXT_WITH_CUDA
  info["cuda"] = true;
  info["cuda_version"] = cuda_compiled_version();
  info["cuda_archs"] = cuda_compiled_archs();  // e.g. [800, 900]
#ifdef KVCACHE_EXT_WITH_PTX
  info["ptx"] = true;
#else
  info["ptx"] = false;
#endif
#else
  info["cuda"] = false;
  info["cuda_version"] = py::none();
  info["cuda_archs"] = std::vector<int>{};
  info["ptx"] = false;
#endif
  return info;
}

}  // namespace
}  // namespace kvcache_ext

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using kvcache_ext::PageAllocator;
  m.doc() = "kvcache_ext: the host page allocator of the ragged store, and build information "
            "(the kernels are the torch ops torch.ops.kvcache_ext.*)";
  py::class_<PageAllocator>(m, "PageAllocator")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, const at::Tensor&, int64_t,
                    c10::optional<at::ScalarType>>(),
           py::arg("batch"), py::arg("heads"), py::arg("head_dim"), py::arg("score_channels"),
           py::arg("like"), py::arg("page_size"), py::arg("kv_dtype") = py::none())
      // The host halves of append and compact around their ops, and the state the Python store
      // passes to the ops.
      .def("prepare_append", &PageAllocator::prepare_append, py::arg("k"), py::arg("v"),
           py::arg("pos"), py::arg("valid") = py::none())
      .def("finish_compact", &PageAllocator::finish_compact, py::arg("known") = py::none())
      .def("cancel_append", &PageAllocator::cancel_append, py::arg("lengths"))
      .def("slot_rows", &PageAllocator::slot_rows)
      .def("state", [](const PageAllocator& a) {
        return py::make_tuple(a.pool(), a.page_table_device(), a.len_device());
      })
      .def("attention_plan", &PageAllocator::attention_plan, py::arg("rows"))
      .def("attention_plan_of_pages", &PageAllocator::attention_plan_of_pages, py::arg("rows"))
      .def("note_appended", &PageAllocator::note_appended, py::arg("n"))
      .def("has_room", &PageAllocator::has_room, py::arg("n"))
      .def("note_kept_in_pages", &PageAllocator::note_kept_in_pages, py::arg("budget"))
      .def("reserve", &PageAllocator::reserve, py::arg("extra"))
      .def("repack", &PageAllocator::repack, py::arg("extra"))
      .def("shrink_to_fit", &PageAllocator::shrink_to_fit)
      .def("fork", &PageAllocator::fork)
      .def("check_writable", &PageAllocator::check_writable, py::arg("what"))
      .def_property_readonly("shares_pages", &PageAllocator::shares_pages)
      .def("set_scores", &PageAllocator::set_scores, py::arg("scores"))
      .def_property_readonly("k", &PageAllocator::k)
      .def_property_readonly("v", &PageAllocator::v)
      .def_property_readonly("pos", &PageAllocator::pos)
      .def_property_readonly("scores", &PageAllocator::scores)
      .def_property_readonly("len", &PageAllocator::len)
      .def_property_readonly("page_table", &PageAllocator::page_table)
      .def_property_readonly("len_host", &PageAllocator::len_host)
      .def_property_readonly("pages_host", &PageAllocator::pages_host)
      .def_property_readonly("capacity", &PageAllocator::capacity)
      .def_property_readonly("num_pages", &PageAllocator::num_pages)
      .def_property_readonly("free_pages", &PageAllocator::free_pages)
      .def_property_readonly("num_slabs", &PageAllocator::num_slabs)
      .def_property_readonly("slab_allocations", &PageAllocator::slab_allocations)
      .def_property_readonly("repacks", &PageAllocator::repacks)
      .def_property_readonly("state_version", &PageAllocator::state_version)
      .def_property_readonly("num_tokens", &PageAllocator::num_tokens)
      .def_property_readonly("nbytes", &PageAllocator::nbytes)
      .def_property_readonly("batch", &PageAllocator::batch)
      .def_property_readonly("heads", &PageAllocator::heads)
      .def_property_readonly("head_dim", &PageAllocator::head_dim)
      .def_property_readonly("score_channels", &PageAllocator::score_channels)
      .def_property_readonly("page_size", &PageAllocator::page_size)
      .def_property_readonly("like", &PageAllocator::like)
      .def_property_readonly("kv_dtype", &PageAllocator::kv_dtype);
  // The eager decode step (ops.h): prepare_append + attention_plan + store_decode_step's work
  // + finish_compact after an eviction, in one host call.
  m.def("decode_step", &kvcache_ext::ops::decode_step, py::arg("allocator"), py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("pos"), py::arg("valid"), py::arg("q_pos"), py::arg("scale"), py::arg("mass"),
        py::arg("last"), py::arg("sum_sq"), py::arg("count"), py::arg("accumulate"), py::arg("rule"),
        py::arg("sinks"), py::arg("recent"), py::arg("last_pos"), py::arg("budget"), py::arg("budget_host"));
  // The page addresses the ops read on the current stream (ops.h), held by a captured graph.
  m.def("page_addresses",
        [](const std::vector<at::Tensor>& pool, const at::Tensor& page_table, const at::Tensor& len,
           int64_t page_size, int64_t head_dim, int64_t score_channels, at::ScalarType dtype) {
          return kvcache_ext::ops::page_addresses(pool, page_table, len, page_size, head_dim,
                                                  score_channels, dtype);
        },
        py::arg("pool"), py::arg("page_table"),
        py::arg("len"), py::arg("page_size"), py::arg("head_dim"), py::arg("score_channels"),
        py::arg("dtype"));
  // The page-size rule (ops.h), for the Python checks.
  m.attr("MAX_PAGE_SIZE") = kvcache_ext::ops::kMaxPageSize;
  // The byte layout of one page (store/paged_layout.h) and the host bookkeeping a store holds
  // per page and per segment (page_allocator.h), so that Python counts a store's bytes as the
  // store lays them out (serving's admission) rather than by a copy of the rule.
  m.def("page_layout",
        [](int64_t page_size, int64_t head_dim, int64_t element_size, int64_t score_channels,
           bool quantized) {
          kvcache_ext::ops::page_shift(page_size);
          TORCH_CHECK_VALUE(head_dim >= 1, "head_dim must be >= 1, got ", head_dim);
          TORCH_CHECK_VALUE(element_size >= 1, "element_size must be >= 1, got ", element_size);
          TORCH_CHECK_VALUE(score_channels >= 0, "score_channels must be >= 0, got ", score_channels);
          TORCH_CHECK_VALUE(!quantized || element_size == 1, "quantized pages hold int8 K/V (element_size "
                            "1), got element_size ", element_size);
          const auto record = kvcache_ext::store::page_record(page_size, head_dim, element_size,
                                                              score_channels, quantized);
          py::dict layout;
          layout["page_bytes"] = record.bytes;
          layout["offsets"] = std::vector<int64_t>(record.offset, record.offset + kvcache_ext::store::kParts);
          layout["row_bytes"] = std::vector<int64_t>(record.row_bytes, record.row_bytes + kvcache_ext::store::kParts);
          layout["page_address_bytes"] = kvcache_ext::PageAllocator::kPageAddressBytes;
          layout["table_entry_bytes"] = kvcache_ext::PageAllocator::kTableEntryBytes;
          layout["length_bytes"] = kvcache_ext::PageAllocator::kLengthBytes;
          return layout;
        },
        py::arg("page_size"), py::arg("head_dim"), py::arg("element_size"),
        py::arg("score_channels"), py::arg("quantized") = false);
  {
    py::dict faults;  // store_check's codes (ops.h) -> what each says
    namespace ops = kvcache_ext::ops;
    for (int32_t code : {ops::kStoreCheckNegativeLength, ops::kStoreCheckTooFewColumns, ops::kStoreCheckBadPage})
      faults[py::int_(code)] = ops::kStoreCheckFaults[code - 1];
    m.attr("STORE_CHECK_FAULTS") = faults;
  }
  // The vector ISA of the CPU attention (README "CPU kernels"); tests switch it to run each.
  m.def("cpu_isa", &kvcache_ext::attention::cpu_isa);
  m.def("set_cpu_isa", &kvcache_ext::attention::set_cpu_isa, py::arg("isa"));
  m.def("build_info", &kvcache_ext::build_info);
  // The head_dim sizes of the CUDA attention kernel (cuda_head_dims.h), also in a CPU-only build.
  {
    using kvcache_ext::attention::CudaHeadDims;
    m.attr("CUDA_HEAD_DIMS") = std::vector<int64_t>(CudaHeadDims::values,
                                                    CudaHeadDims::values + CudaHeadDims::count);
  }
}
