// CUDA backend of copy_blocks. Blocks are grouped by (source, destination)
// dtype pair; each group is one kernel launch over (block, row, column chunk)
// work items, one thread block per item.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <map>
#include <utility>
#include <vector>

#include "copy_blocks.h"

namespace hybrid_engine {
namespace {

// One block, resolved to raw addresses on the host.
struct BlockDesc {
  int64_t src;  // byte address of element 0 of the block
  int64_t dst;
  int64_t src_rs, src_cs, dst_rs, dst_cs;  // element strides
  int64_t rows, cols;
  int64_t item_start;  // first work item of this block
};

template <typename S, typename D>
__global__ void copy_blocks_kernel(const BlockDesc* __restrict__ descs,
                                   int64_t num_blocks, int64_t num_items) {
  for (int64_t item = blockIdx.x; item < num_items; item += gridDim.x) {
    // Binary search for the block holding this item (uniform per CTA).
    int64_t lo = 0, hi = num_blocks - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (descs[mid].item_start <= item) lo = mid; else hi = mid - 1;
    }
    const BlockDesc& d = descs[lo];
    const int64_t chunks = (d.cols + kColChunk - 1) / kColChunk;
    const int64_t local = item - d.item_start;
    const int64_t row = local / chunks;
    const int64_t col0 = (local % chunks) * kColChunk;
    const int64_t n = min(kColChunk, d.cols - col0);
    const S* s = reinterpret_cast<const S*>(d.src) + row * d.src_rs +
                 col0 * d.src_cs;
    D* o = reinterpret_cast<D*>(d.dst) + row * d.dst_rs + col0 * d.dst_cs;
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
      o[c * d.dst_cs] = static_cast<D>(static_cast<float>(s[c * d.src_cs]));
    }
  }
}

template <typename S, typename D>
void launch(const BlockDesc* descs, int64_t num_blocks, int64_t num_items,
            cudaStream_t stream) {
  const int64_t grid = std::min<int64_t>(num_items, 1 << 16);
  copy_blocks_kernel<S, D><<<grid, 256, 0, stream>>>(descs, num_blocks,
                                                     num_items);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename S>
void launch_for_dst(at::ScalarType dst, const BlockDesc* descs,
                    int64_t num_blocks, int64_t num_items,
                    cudaStream_t stream) {
  switch (dst) {
    case at::kFloat: return launch<S, float>(descs, num_blocks, num_items, stream);
    case at::kBFloat16: return launch<S, c10::BFloat16>(descs, num_blocks, num_items, stream);
    case at::kHalf: return launch<S, c10::Half>(descs, num_blocks, num_items, stream);
    default: TORCH_CHECK(false, "copy_blocks: unsupported dtype ", dst);
  }
}

}  // namespace

void copy_blocks_cuda(const std::vector<at::Tensor>& srcs,
                      const std::vector<at::Tensor>& dsts,
                      const at::Tensor& blocks) {
  check_blocks(srcs, dsts, blocks, c10::DeviceType::CUDA);
  if (blocks.size(0) == 0) return;
  const at::Tensor& any = srcs.empty() ? dsts[0] : srcs[0];
  const c10::cuda::OptionalCUDAGuard guard(any.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  // Group blocks by dtype pair: one launch per pair (usually exactly one).
  std::map<std::pair<at::ScalarType, at::ScalarType>, std::vector<BlockDesc>>
      groups;
  const int64_t* b = blocks.data_ptr<int64_t>();
  for (int64_t i = 0; i < blocks.size(0); ++i, b += kBlockCols) {
    if (b[kRows] == 0 || b[kCols] == 0) continue;
    const at::Tensor& s = srcs[b[kSrcIdx]];
    const at::Tensor& d = dsts[b[kDstIdx]];
    auto& g = groups[{s.scalar_type(), d.scalar_type()}];
    const int64_t start = g.empty() ? 0
        : g.back().item_start +
              g.back().rows * ((g.back().cols + kColChunk - 1) / kColChunk);
    g.push_back(BlockDesc{
        reinterpret_cast<int64_t>(s.const_data_ptr()) +
            b[kSrcOffset] * static_cast<int64_t>(s.element_size()),
        reinterpret_cast<int64_t>(d.data_ptr()) +
            b[kDstOffset] * static_cast<int64_t>(d.element_size()),
        b[kSrcRowStride], b[kSrcColStride], b[kDstRowStride],
        b[kDstColStride], b[kRows], b[kCols], start});
  }
  for (auto& [dtypes, g] : groups) {
    const BlockDesc& last = g.back();
    const int64_t num_items =
        last.item_start + last.rows * ((last.cols + kColChunk - 1) / kColChunk);
    const int64_t nbytes = static_cast<int64_t>(g.size() * sizeof(BlockDesc));
    // Pinned staging + async copy on the current stream; the caching host
    // allocator keeps the pinned buffer alive until the copy has run.
    at::Tensor host = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    std::memcpy(host.data_ptr(), g.data(), nbytes);
    at::Tensor dev = host.to(any.device(), /*non_blocking=*/true);
    const auto* descs = reinterpret_cast<const BlockDesc*>(dev.const_data_ptr());
    const int64_t n = static_cast<int64_t>(g.size());
    switch (dtypes.first) {
      case at::kFloat: launch_for_dst<float>(dtypes.second, descs, n, num_items, stream); break;
      case at::kBFloat16: launch_for_dst<c10::BFloat16>(dtypes.second, descs, n, num_items, stream); break;
      case at::kHalf: launch_for_dst<c10::Half>(dtypes.second, descs, n, num_items, stream); break;
      default: TORCH_CHECK(false, "copy_blocks: unsupported dtype ", dtypes.first);
    }
  }
}

}  // namespace hybrid_engine

TORCH_LIBRARY_IMPL(hybrid_engine, CUDA, m) {
  m.impl("copy_blocks", &hybrid_engine::copy_blocks_cuda);
}
