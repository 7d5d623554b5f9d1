// CPU backend of copy_blocks: one at::parallel_for over (block, row, column
// chunk) work items, a per-block row-copy function chosen once by dtype pair.
// Build with -fopenmp, else at::parallel_for silently runs on one thread.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "copy_blocks.h"

namespace hybrid_engine {
namespace {

using RowFn = void (*)(const char* src, int64_t src_cs, char* dst,
                       int64_t dst_cs, int64_t n);

// Casts go through float, as torch's own CPU copy does, so results match
// Tensor.to(dtype) bit for bit (round to nearest even for finite values).
template <typename S, typename D>
inline D cast(S x) {
  if constexpr (std::is_same_v<S, D>) {
    return x;
  } else {
    return static_cast<D>(static_cast<float>(x));
  }
}

// The contiguous path is compiled for several ISAs; the loader picks the best
// one the CPU has (GCC function multi-versioning), so the cast vectorizes
// without building the whole extension for one machine.
template <typename S, typename D>
__attribute__((target_clones("avx512f", "avx2", "default"))) void
copy_contiguous(const S* __restrict__ s, D* __restrict__ d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = cast<S, D>(s[i]);
}

template <typename S, typename D>
void copy_row(const char* src, int64_t src_cs, char* dst, int64_t dst_cs,
              int64_t n) {
  const S* s = reinterpret_cast<const S*>(src);
  D* d = reinterpret_cast<D*>(dst);
  if (src_cs == 1 && dst_cs == 1) {
    if constexpr (std::is_same_v<S, D>) {
      std::memcpy(d, s, n * sizeof(S));
    } else {
      copy_contiguous<S, D>(s, d, n);
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) d[i * dst_cs] = cast<S, D>(s[i * src_cs]);
}

template <typename S>
RowFn row_fn_for_dst(at::ScalarType dst) {
  switch (dst) {
    case at::kFloat: return &copy_row<S, float>;
    case at::kBFloat16: return &copy_row<S, c10::BFloat16>;
    case at::kHalf: return &copy_row<S, c10::Half>;
    default: TORCH_CHECK(false, "copy_blocks: unsupported dtype ", dst);
  }
}

RowFn row_fn(at::ScalarType src, at::ScalarType dst) {
  switch (src) {
    case at::kFloat: return row_fn_for_dst<float>(dst);
    case at::kBFloat16: return row_fn_for_dst<c10::BFloat16>(dst);
    case at::kHalf: return row_fn_for_dst<c10::Half>(dst);
    default: TORCH_CHECK(false, "copy_blocks: unsupported dtype ", src);
  }
}

}  // namespace

void copy_blocks_cpu(const std::vector<at::Tensor>& srcs,
                     const std::vector<at::Tensor>& dsts,
                     const at::Tensor& blocks) {
  check_blocks(srcs, dsts, blocks, c10::DeviceType::CPU);
  const int64_t num_blocks = blocks.size(0);
  const int64_t* b = blocks.data_ptr<int64_t>();

  // item_start[i]: first work item of block i; an item is one column chunk
  // of one row.
  std::vector<int64_t> item_start(num_blocks + 1, 0);
  std::vector<RowFn> fns(num_blocks);
  int64_t total_elems = 0;
  for (int64_t i = 0; i < num_blocks; ++i) {
    const int64_t* r = b + i * kBlockCols;
    const int64_t chunks = (r[kCols] + kColChunk - 1) / kColChunk;
    item_start[i + 1] = item_start[i] + r[kRows] * chunks;
    total_elems += r[kRows] * r[kCols];
    fns[i] = row_fn(srcs[r[kSrcIdx]].scalar_type(),
                    dsts[r[kDstIdx]].scalar_type());
  }
  const int64_t num_items = item_start[num_blocks];
  if (num_items == 0) return;

  // About 64K elements per task amortizes the scheduling cost.
  const int64_t grain = std::max<int64_t>(
      1, num_items * (int64_t{1} << 16) / std::max<int64_t>(total_elems, 1));
  at::parallel_for(0, num_items, grain, [&](int64_t begin, int64_t end) {
    int64_t blk = std::upper_bound(item_start.begin(), item_start.end(), begin) -
                  item_start.begin() - 1;
    for (int64_t item = begin; item < end; ++item) {
      while (item >= item_start[blk + 1]) ++blk;
      const int64_t* r = b + blk * kBlockCols;
      const at::Tensor& src = srcs[r[kSrcIdx]];
      const at::Tensor& dst = dsts[r[kDstIdx]];
      const int64_t chunks = (r[kCols] + kColChunk - 1) / kColChunk;
      const int64_t local = item - item_start[blk];
      const int64_t row = local / chunks;
      const int64_t col = (local % chunks) * kColChunk;
      const int64_t n = std::min(kColChunk, r[kCols] - col);
      const char* s = static_cast<const char*>(src.const_data_ptr()) +
                      (r[kSrcOffset] + row * r[kSrcRowStride] +
                       col * r[kSrcColStride]) * src.element_size();
      char* d = static_cast<char*>(dst.data_ptr()) +
                (r[kDstOffset] + row * r[kDstRowStride] +
                 col * r[kDstColStride]) * dst.element_size();
      fns[blk](s, r[kSrcColStride], d, r[kDstColStride], n);
    }
  });
}

}  // namespace hybrid_engine
