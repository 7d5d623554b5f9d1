// CUDA backend of copy_blocks. Blocks are grouped by (source, destination)
// dtype pair; each group is one kernel launch. A block's rows are flattened
// and cut into work items of kItemElems elements, one thread block per item.
// Blocks with unit column strides and aligned rows move 16-byte vectors.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "copy_blocks.h"

namespace hybrid_engine {
namespace {

// Elements of a block one thread block copies per work item. A block's rows
// are flattened (row-major) and cut into items of this size, so short rows
// (a row-parallel slice of 512 columns) still fill a thread block.
constexpr int64_t kItemElems = 8192;
constexpr int kThreads = 256;

// One block, resolved to raw addresses on the host.
struct BlockDesc {
  int64_t src;  // byte address of element 0 of the block
  int64_t dst;
  int64_t src_rs, src_cs, dst_rs, dst_cs;  // element strides
  int64_t rows, cols;
  int64_t item_start;  // first work item of this block
  int64_t vec;  // 1: unit column strides, every row start and cols aligned to V
};

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Row and column of flat element e of a block with `cols` columns; 32-bit
// division when the block is small enough (nearly always: 64-bit division
// costs several times more instructions).
__device__ __forceinline__ void row_col(int64_t e, int64_t cols, bool small,
                                        int64_t& row, int64_t& col) {
  if (small) {
    const uint32_t r = static_cast<uint32_t>(e) / static_cast<uint32_t>(cols);
    row = r;
    col = e - static_cast<int64_t>(r) * cols;
  } else {
    row = e / cols;
    col = e - row * cols;
  }
}

// V = elements per vector: 16 bytes of the wider of the two dtypes.
template <typename S, typename D, int V>
__global__ void __launch_bounds__(kThreads)
copy_blocks_kernel(const BlockDesc* __restrict__ descs, int64_t num_blocks,
                   int64_t num_items) {
  for (int64_t item = blockIdx.x; item < num_items; item += gridDim.x) {
    // Binary search for the block holding this item (uniform per CTA).
    int64_t lo = 0, hi = num_blocks - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (descs[mid].item_start <= item) lo = mid; else hi = mid - 1;
    }
    const BlockDesc d = descs[lo];
    const int64_t total = d.rows * d.cols;
    const int64_t first = (item - d.item_start) * kItemElems;
    const int64_t last = min(first + kItemElems, total);
    const bool small = total <= INT32_MAX;
    const S* src = reinterpret_cast<const S*>(d.src);
    D* dst = reinterpret_cast<D*>(d.dst);
    int64_t row, col;
    if (d.vec) {
      // cols % V == 0, so a vector never crosses a row end.
      for (int64_t e = first + threadIdx.x * V; e < last; e += kThreads * V) {
        row_col(e, d.cols, small, row, col);
        const Vec<S, V> in =
            *reinterpret_cast<const Vec<S, V>*>(src + row * d.src_rs + col);
        Vec<D, V> out;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          out.v[k] = static_cast<D>(static_cast<float>(in.v[k]));
        }
        *reinterpret_cast<Vec<D, V>*>(dst + row * d.dst_rs + col) = out;
      }
    } else {
      for (int64_t e = first + threadIdx.x; e < last; e += kThreads) {
        row_col(e, d.cols, small, row, col);
        dst[row * d.dst_rs + col * d.dst_cs] = static_cast<D>(
            static_cast<float>(src[row * d.src_rs + col * d.src_cs]));
      }
    }
  }
}

// Work items of a block: its elements in chunks of kItemElems.
int64_t items(const BlockDesc& d) {
  return (d.rows * d.cols + kItemElems - 1) / kItemElems;
}

// Elements per 16-byte vector of the wider dtype of the pair.
int64_t vec_width(int64_t src_size, int64_t dst_size) {
  return 16 / std::max(src_size, dst_size);
}

template <typename S, typename D>
void launch(const BlockDesc* descs, int64_t num_blocks, int64_t num_items,
            cudaStream_t stream) {
  constexpr int V = 16 / (sizeof(S) > sizeof(D) ? sizeof(S) : sizeof(D));
  const int64_t grid = std::min<int64_t>(num_items, 1 << 16);
  copy_blocks_kernel<S, D, V><<<grid, kThreads, 0, stream>>>(descs, num_blocks,
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
    BlockDesc bd{
        reinterpret_cast<int64_t>(s.const_data_ptr()) +
            b[kSrcOffset] * static_cast<int64_t>(s.element_size()),
        reinterpret_cast<int64_t>(d.data_ptr()) +
            b[kDstOffset] * static_cast<int64_t>(d.element_size()),
        b[kSrcRowStride], b[kSrcColStride], b[kDstRowStride],
        b[kDstColStride], b[kRows], b[kCols], 0, 0};
    // Rows that follow each other in both tensors are one long row.
    if (bd.rows > 1 && bd.src_rs == bd.cols * bd.src_cs &&
        bd.dst_rs == bd.cols * bd.dst_cs) {
      bd.cols *= bd.rows;
      bd.rows = 1;
    }
    const int64_t v = vec_width(s.element_size(), d.element_size());
    bd.vec = bd.src_cs == 1 && bd.dst_cs == 1 && bd.cols % v == 0 &&
             (bd.rows == 1 || (bd.src_rs % v == 0 && bd.dst_rs % v == 0)) &&
             bd.src % (v * s.element_size()) == 0 &&
             bd.dst % (v * d.element_size()) == 0;
    bd.item_start = g.empty() ? 0 : g.back().item_start + items(g.back());
    g.push_back(bd);
  }
  for (auto& [dtypes, g] : groups) {
    const BlockDesc& last = g.back();
    const int64_t num_items = last.item_start + items(last);
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
