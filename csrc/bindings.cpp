// The one Python module, kvcache_ext._C. Bindings only; the work is in store/, select/ and
// attention/.
#include <torch/extension.h>
#include <torch/version.h>

#include "attention/attention_cpu_tiles.h"
#include "attention/cuda_head_dims.h"
#include "attention/ragged_attention.h"
#include "ops.h"
#include "select/topk.h"
#include "store/ragged_store.h"

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
  using kvcache_ext::RaggedKVStore;
  m.doc() = "kvcache_ext kernels: ragged per-head KV store, segmented top-k, attention";
  py::class_<RaggedKVStore>(m, "RaggedKVStore")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, const at::Tensor&, int64_t>(),
           py::arg("batch"), py::arg("heads"), py::arg("head_dim"), py::arg("score_channels"),
           py::arg("like"), py::arg("page_size"))
      .def("append", &RaggedKVStore::append, py::arg("k"), py::arg("v"), py::arg("pos"),
           py::arg("valid") = py::none())
      .def("replace", &RaggedKVStore::replace, py::arg("slot"), py::arg("k"), py::arg("v"),
           py::arg("pos"), py::arg("check_bounds") = true)
      .def("compact", &RaggedKVStore::compact, py::arg("keep"))
      // The host halves of append and compact around their ops (ops.h), and the state the
      // Python store passes to the ops.
      .def("prepare_append", &RaggedKVStore::prepare_append, py::arg("k"), py::arg("v"),
           py::arg("pos"), py::arg("valid") = py::none())
      .def("finish_compact", &RaggedKVStore::finish_compact)
      .def("append_and_attend", &RaggedKVStore::append_and_attend, py::arg("q"), py::arg("k"),
           py::arg("v"), py::arg("pos"), py::arg("scale"))
      .def("state", [](const RaggedKVStore& s) {
        return py::make_tuple(s.pool(), s.page_table_device(), s.len_device());
      })
      .def("attention_plan", &RaggedKVStore::attention_plan, py::arg("rows"))
      .def("select", &RaggedKVStore::select, py::arg("scores"), py::arg("k"), py::arg("grouped"))
      .def("reserve", &RaggedKVStore::reserve, py::arg("extra"))
      .def("repack", &RaggedKVStore::repack, py::arg("extra"))
      .def("shrink_to_fit", &RaggedKVStore::shrink_to_fit)
      .def("set_scores", &RaggedKVStore::set_scores, py::arg("scores"))
      .def_property_readonly("k", &RaggedKVStore::k)
      .def_property_readonly("v", &RaggedKVStore::v)
      .def_property_readonly("pos", &RaggedKVStore::pos)
      .def_property_readonly("scores", &RaggedKVStore::scores)
      .def_property_readonly("len", &RaggedKVStore::len)
      .def_property_readonly("page_table", &RaggedKVStore::page_table)
      .def_property_readonly("len_host", &RaggedKVStore::len_host)
      .def_property_readonly("pages_host", &RaggedKVStore::pages_host)
      .def_property_readonly("capacity", &RaggedKVStore::capacity)
      .def_property_readonly("num_pages", &RaggedKVStore::num_pages)
      .def_property_readonly("free_pages", &RaggedKVStore::free_pages)
      .def_property_readonly("num_slabs", &RaggedKVStore::num_slabs)
      .def_property_readonly("slab_allocations", &RaggedKVStore::slab_allocations)
      .def_property_readonly("repacks", &RaggedKVStore::repacks)
      .def_property_readonly("state_version", &RaggedKVStore::state_version)
      .def_property_readonly("num_tokens", &RaggedKVStore::num_tokens)
      .def_property_readonly("nbytes", &RaggedKVStore::nbytes)
      .def_property_readonly("batch", &RaggedKVStore::batch)
      .def_property_readonly("heads", &RaggedKVStore::heads)
      .def_property_readonly("head_dim", &RaggedKVStore::head_dim)
      .def_property_readonly("score_channels", &RaggedKVStore::score_channels)
      .def_property_readonly("page_size", &RaggedKVStore::page_size)
      .def_property_readonly("like", &RaggedKVStore::like);
  m.def("segmented_topk", &kvcache_ext::segmented_topk, py::arg("scores"), py::arg("pos"),
        py::arg("start"), py::arg("len"), py::arg("k"), py::arg("check_values") = true);
  m.def("grouped_topk", &kvcache_ext::grouped_topk, py::arg("scores"), py::arg("pos"),
        py::arg("start"), py::arg("len"), py::arg("group_size"), py::arg("k"),
        py::arg("check_values") = true);
  m.def("ragged_attention", &kvcache_ext::ragged_attention, py::arg("q"), py::arg("store"),
        py::arg("scale"), py::arg("q_pos") = py::none(), py::arg("mass") = false,
        py::arg("last") = false, py::arg("sum_sq") = false, py::arg("count") = false);
  // The host step of the attention (ops.h): the work partition for the attention_run op.
  m.def("attention_plan", &kvcache_ext::ops::attention_plan, py::arg("lens"), py::arg("rows"),
        py::arg("device"));
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
