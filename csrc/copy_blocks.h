// Shared declarations for the batched strided block copy ("copy_blocks").
//
// A block is a 2-D strided region copied from one source tensor to one
// destination tensor, with a dtype cast fused into the copy. The block table
// is an int64 CPU tensor [num_blocks, kBlockCols]; offsets and strides count
// elements from each tensor's data_ptr() (its storage offset included).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace hybrid_engine {

// Columns of one row of the block table.
enum BlockCol : int64_t {
  kSrcIdx = 0,     // index into srcs
  kSrcOffset,      // elements from srcs[i].data_ptr()
  kSrcRowStride,
  kSrcColStride,
  kDstIdx,         // index into dsts
  kDstOffset,
  kDstRowStride,
  kDstColStride,
  kRows,
  kCols,
  kBlockCols       // number of columns
};

// Columns of a row are copied in chunks of at most this many elements, so one
// long row (a 1-D tensor seen as [1, n]) still spreads over threads.
constexpr int64_t kColChunk = 4096;

// Validates the block table against the tensors: every block's footprint lies
// inside its tensor's storage, indices are in range, dtypes are supported.
void check_blocks(const std::vector<at::Tensor>& srcs,
                  const std::vector<at::Tensor>& dsts,
                  const at::Tensor& blocks, c10::DeviceType device_type);

void copy_blocks_cpu(const std::vector<at::Tensor>& srcs,
                     const std::vector<at::Tensor>& dsts,
                     const at::Tensor& blocks);

}  // namespace hybrid_engine
