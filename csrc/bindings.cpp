// All operator schemas of torch.ops.hybrid_engine live here (one
// TORCH_LIBRARY per namespace: two would abort the process at load time).
// Backends register with TORCH_LIBRARY_IMPL in their own files.
#include <Python.h>

#include <torch/library.h>

#include "copy_blocks.h"

// Importing hybrid_engine._C runs the static registrations below; the module
// itself exposes nothing to Python.
extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr,
                                          -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace hybrid_engine {

void check_blocks(const std::vector<at::Tensor>& srcs,
                  const std::vector<at::Tensor>& dsts,
                  const at::Tensor& blocks, c10::DeviceType device_type) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kLong,
              "copy_blocks: blocks must be an int64 CPU tensor");
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(1) == kBlockCols,
              "copy_blocks: blocks must be [num_blocks, ", kBlockCols,
              "], got ", blocks.sizes());
  TORCH_CHECK(blocks.is_contiguous(), "copy_blocks: blocks must be contiguous");
  auto check_tensor = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.device().type() == device_type, "copy_blocks: ", what,
                " on ", t.device(), ", expected ", device_type);
    auto st = t.scalar_type();
    TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
                "copy_blocks: ", what, " dtype ", st,
                " not supported (float32, bfloat16, float16)");
  };
  for (const auto& t : srcs) check_tensor(t, "source");
  for (const auto& t : dsts) check_tensor(t, "destination");
  if (!srcs.empty() && !dsts.empty()) {
    TORCH_CHECK(srcs[0].device() == dsts[0].device(),
                "copy_blocks: sources and destinations on different devices");
  }

  // Elements addressable from data_ptr() to the end of the storage.
  auto span = [](const at::Tensor& t) -> int64_t {
    return static_cast<int64_t>(t.storage().nbytes() / t.element_size()) -
           t.storage_offset();
  };
  const int64_t* b = blocks.data_ptr<int64_t>();
  const int64_t num_srcs = static_cast<int64_t>(srcs.size());
  const int64_t num_dsts = static_cast<int64_t>(dsts.size());
  for (int64_t i = 0; i < blocks.size(0); ++i, b += kBlockCols) {
    const int64_t rows = b[kRows], cols = b[kCols];
    TORCH_CHECK(rows >= 0 && cols >= 0, "copy_blocks: block ", i,
                " has negative shape");
    TORCH_CHECK(b[kSrcIdx] >= 0 && b[kSrcIdx] < num_srcs && b[kDstIdx] >= 0 &&
                    b[kDstIdx] < num_dsts,
                "copy_blocks: block ", i, " tensor index out of range");
    if (rows == 0 || cols == 0) continue;
    TORCH_CHECK(b[kSrcOffset] >= 0 && b[kSrcRowStride] >= 0 &&
                    b[kSrcColStride] >= 0 && b[kDstOffset] >= 0 &&
                    b[kDstRowStride] >= 0 && b[kDstColStride] >= 0,
                "copy_blocks: block ", i, " has a negative offset or stride");
    const int64_t src_last = b[kSrcOffset] + (rows - 1) * b[kSrcRowStride] +
                             (cols - 1) * b[kSrcColStride];
    const int64_t dst_last = b[kDstOffset] + (rows - 1) * b[kDstRowStride] +
                             (cols - 1) * b[kDstColStride];
    TORCH_CHECK(src_last < span(srcs[b[kSrcIdx]]), "copy_blocks: block ", i,
                " reads past the end of source ", b[kSrcIdx]);
    TORCH_CHECK(dst_last < span(dsts[b[kDstIdx]]), "copy_blocks: block ", i,
                " writes past the end of destination ", b[kDstIdx]);
  }
}

}  // namespace hybrid_engine

TORCH_LIBRARY(hybrid_engine, m) {
  // Copies many 2-D strided blocks between tensors in one call, casting the
  // dtype on the fly. blocks: int64 CPU [num_blocks, 10], see copy_blocks.h.
  m.def("copy_blocks(Tensor[] srcs, Tensor(a!)[] dsts, Tensor blocks) -> ()");
}

TORCH_LIBRARY_IMPL(hybrid_engine, CPU, m) {
  m.impl("copy_blocks", &hybrid_engine::copy_blocks_cpu);
}
