"""Typed wrappers over torch.ops.hybrid_engine, with fake impls and references.

Each op has: a wrapper that validates and calls the native kernel, a
`register_fake` so it traces under torch.compile, and a pure-torch `*_ref`
that defines its semantics (used by tests, and as the fallback when the
native extension is not built).

copy_blocks: one call copies many 2-D strided blocks between tensors with the
dtype cast fused. This is the pack / unpack / local-copy primitive of weight
resharding: pack = many parameter slices -> one flat send buffer; unpack = one
flat receive buffer -> many slices of vLLM parameters.

Block table legend (int64 CPU tensor, one row per block, see Block):
    src_idx, src_offset, src_row_stride, src_col_stride,
    dst_idx, dst_offset, dst_row_stride, dst_col_stride, rows, cols
Offsets and strides count elements from the tensor's data_ptr(), so a block
may address any part of a tensor's storage past its storage offset (checked).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from hybrid_engine import _native

__all__ = ["Block", "block_between", "blocks_tensor", "copy_blocks", "copy_blocks_ref"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Block(NamedTuple):
    """One 2-D strided block: dst[dst_idx][r, c] = src[src_idx][r, c] (cast)."""

    src_idx: int
    src_offset: int
    src_row_stride: int
    src_col_stride: int
    dst_idx: int
    dst_offset: int
    dst_row_stride: int
    dst_col_stride: int
    rows: int
    cols: int


def blocks_tensor(blocks: Sequence[Block]) -> torch.Tensor:
    """Packs blocks into the int64 CPU table the op takes: [num_blocks, 10]."""
    if not blocks:
        return torch.empty((0, len(Block._fields)), dtype=torch.int64)
    return torch.tensor(blocks, dtype=torch.int64)


def _as_2d(base: torch.Tensor, view: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(offset, row_stride, col_stride, rows, cols) of a <=2-D view of base's storage."""
    if view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
        raise ValueError("view does not share storage with its base tensor")
    if view.dim() > 2:
        raise ValueError(f"blocks are at most 2-D, got a view of shape {tuple(view.shape)}")
    offset = view.storage_offset() - base.storage_offset()
    if view.dim() == 0:
        return offset, 1, 1, 1, 1
    if view.dim() == 1:
        return offset, view.numel() * view.stride(0), view.stride(0), 1, view.shape[0]
    return offset, view.stride(0), view.stride(1), view.shape[0], view.shape[1]


def block_between(
    src_idx: int, src: torch.Tensor, src_view: torch.Tensor,
    dst_idx: int, dst: torch.Tensor, dst_view: torch.Tensor,
) -> Block:
    """The Block copying src_view (a view of src) into dst_view (a view of dst).

    Both views must have the same shape (at most 2-D).
    """
    if src_view.shape != dst_view.shape:
        raise ValueError(f"shape mismatch: {tuple(src_view.shape)} vs {tuple(dst_view.shape)}")
    so, srs, scs, rows, cols = _as_2d(src, src_view)
    do, drs, dcs, _, _ = _as_2d(dst, dst_view)
    return Block(src_idx, so, srs, scs, dst_idx, do, drs, dcs, rows, cols)


def copy_blocks_ref(
    srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], blocks: torch.Tensor
) -> None:
    """Pure-torch definition of copy_blocks: as_strided views and copy_."""
    for row in blocks.tolist():
        b = Block(*row)
        if b.rows == 0 or b.cols == 0:
            continue
        s, d = srcs[b.src_idx], dsts[b.dst_idx]
        sv = s.as_strided((b.rows, b.cols), (b.src_row_stride, b.src_col_stride),
                          s.storage_offset() + b.src_offset)
        dv = d.as_strided((b.rows, b.cols), (b.dst_row_stride, b.dst_col_stride),
                          d.storage_offset() + b.dst_offset)
        dv.copy_(sv)


def copy_blocks(
    srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], blocks: torch.Tensor
) -> None:
    """Copies every block of the table from srcs into dsts, casting dtypes.

    Args:
        srcs: source tensors (float32/bfloat16/float16), all on one device.
        dsts: destination tensors, same device; written in place.
        blocks: int64 CPU [num_blocks, 10] table (see module docstring and
            Block). Destination blocks must not overlap each other or any
            source block.
    """
    if _native.has_kernel("copy_blocks", _dispatch_key(srcs, dsts)):
        torch.ops.hybrid_engine.copy_blocks(list(srcs), list(dsts), blocks)
    else:
        copy_blocks_ref(srcs, dsts, blocks)


def _dispatch_key(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor]) -> str:
    t = srcs[0] if srcs else (dsts[0] if dsts else None)
    return "CUDA" if t is not None and t.is_cuda else "CPU"


if _native.load():

    @torch.library.register_fake("hybrid_engine::copy_blocks")
    def _copy_blocks_fake(srcs, dsts, blocks) -> None:  # noqa: ANN001
        return None
