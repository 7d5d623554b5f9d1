"""copy_blocks: native kernel vs its pure-torch reference, bit for bit."""

from __future__ import annotations

import itertools

import pytest
import torch

from hybrid_engine import _native
from hybrid_engine.reshard.ops import (
    SUPPORTED_DTYPES,
    Block,
    block_between,
    blocks_tensor,
    copy_blocks,
    copy_blocks_ref,
)

# The CUDA kernel's cases always exist: marked gpu, skipped with the reason on CPU.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPE_PAIRS = list(itertools.product(SUPPORTED_DTYPES, SUPPORTED_DTYPES))


def _rand(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(device)


def _native_op():
    return torch.ops.hybrid_engine.copy_blocks


def test_native_cpu_kernel_is_built():
    # The build must register the CPU kernel: without it every other test in
    # this file would silently compare the reference with itself.
    assert _native.load(), _native.load_error()
    assert _native.has_kernel("copy_blocks", "CPU")


def _random_blocks(srcs, dsts, num_blocks, gen):
    """Non-overlapping blocks: each writes its own row band of the destination."""
    blocks, dst_row = [], {i: 0 for i in range(len(dsts))}
    for _ in range(num_blocks):
        si = int(torch.randint(len(srcs), (1,), generator=gen))
        di = int(torch.randint(len(dsts), (1,), generator=gen))
        s, d = srcs[si], dsts[di]
        rows = int(torch.randint(0, 4, (1,), generator=gen))
        if dst_row[di] + rows > d.shape[0]:
            continue
        cols = int(torch.randint(0, min(s.shape[1], d.shape[1]) + 1, (1,), generator=gen))
        r0 = int(torch.randint(0, s.shape[0] - rows + 1, (1,), generator=gen))
        c0 = int(torch.randint(0, s.shape[1] - cols + 1, (1,), generator=gen))
        dc0 = int(torch.randint(0, d.shape[1] - cols + 1, (1,), generator=gen))
        src_view = s[r0 : r0 + rows, c0 : c0 + cols]
        dst_view = d[dst_row[di] : dst_row[di] + rows, dc0 : dc0 + cols]
        blocks.append(block_between(si, s, src_view, di, d, dst_view))
        dst_row[di] += rows
    return blocks_tensor(blocks)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype,dst_dtype", DTYPE_PAIRS)
def test_random_blocks_match_reference(device, src_dtype, dst_dtype):
    gen = torch.Generator().manual_seed(0)
    # Odd shapes, one transposed (column stride != 1) source.
    srcs = [
        _rand((13, 37), src_dtype, device, 1),
        _rand((29, 5), src_dtype, device, 2).t(),
        _rand((64, 4099), src_dtype, device, 3),
    ]
    srcs[1] = srcs[1][:, 1:]  # also a storage offset
    dsts_native = [torch.zeros(40, 41, dtype=dst_dtype, device=device),
                   torch.zeros(31, 4100, dtype=dst_dtype, device=device)]
    dsts_ref = [d.clone() for d in dsts_native]
    blocks = _random_blocks(srcs, dsts_native, 60, gen)
    assert blocks.shape[0] > 10
    copy_blocks(srcs, dsts_native, blocks)
    copy_blocks_ref(srcs, dsts_ref, blocks)
    for a, b in zip(dsts_native, dsts_ref):
        assert torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                           b.view(torch.int16 if b.element_size() == 2 else torch.int32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype,dst_dtype", DTYPE_PAIRS)
def test_aligned_blocks_match_reference(device, src_dtype, dst_dtype):
    """The shapes a sync moves: 16-byte aligned row and column slices (the CUDA
    kernel's vector path), contiguous row bands merged into one long row, blocks
    longer than one work item, next to a misaligned block (the scalar path)."""
    src = _rand((96, 1024), src_dtype, device, 7)
    dst = torch.zeros(96, 2048, dtype=dst_dtype, device=device)
    dst_ref = dst.clone()
    pairs = [
        (src[0:32], dst[0:32, 1024:2048]),        # row band -> column slice (strided rows)
        (src[32:64, 512:1024], dst[32:64, 0:512]),  # column slice -> column slice
        (src[64:80], dst[64:80].view(-1)[: 16 * 1024].view(16, 1024)),  # contiguous: merged
        (src[80:90, 8:520], dst[80:90, 1032:1544]),  # aligned column slices, 8 apart
        (src[90:96, 3:100], dst[90:96, 5:102]),      # misaligned: scalar path
    ]
    blocks = blocks_tensor([block_between(0, src, s, 0, dst, d) for s, d in pairs])
    copy_blocks([src], [dst], blocks)
    copy_blocks_ref([src], [dst_ref], blocks)
    width = torch.int16 if dst.element_size() == 2 else torch.int32
    assert torch.equal(dst.view(width), dst_ref.view(width))
    assert dst.view(width).count_nonzero() > 0.9 * sum(d.numel() for _, d in pairs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype,dst_dtype", DTYPE_PAIRS)
def test_cast_equals_tensor_to(device, src_dtype, dst_dtype):
    """Pack whole tensors (incl. a long 1-D one) into a flat buffer: == Tensor.to()."""
    srcs = [_rand((17, 33), src_dtype, device, 4), _rand((10007,), src_dtype, device, 5),
            _rand((3, 5), src_dtype, device, 6).t()]
    total = sum(s.numel() for s in srcs)
    buf = torch.full((total + 3,), -7.0, dtype=dst_dtype, device=device)
    blocks, off = [], 1
    for i, s in enumerate(srcs):
        blocks.append(block_between(i, s, s, 0, buf, buf[off : off + s.numel()].view(s.shape)))
        off += s.numel()
    copy_blocks(srcs, [buf], blocks_tensor(blocks))
    expected = torch.cat([s.reshape(-1).to(dst_dtype) for s in srcs])
    assert torch.equal(buf[1 : 1 + total], expected)
    assert buf[0].item() == -7.0 and torch.all(buf[1 + total :] == -7.0)


@pytest.mark.parametrize("device", DEVICES)
def test_unpack_into_fused_parameter(device):
    """Unpack: q/k/v row blocks and a column block of a row-parallel weight."""
    q, k, v = (_rand((8, 6), torch.float32, device, s) for s in (7, 8, 9))
    qkv = torch.zeros(24, 6, dtype=torch.bfloat16, device=device)
    o = _rand((6, 10), torch.float32, device, 10)
    o_shard = torch.zeros(6, 5, dtype=torch.bfloat16, device=device)
    srcs, dsts = [q, k, v, o], [qkv, o_shard]
    blocks = [block_between(i, t, t, 0, qkv, qkv[8 * i : 8 * (i + 1)]) for i, t in enumerate((q, k, v))]
    blocks.append(block_between(3, o, o[:, 5:], 1, o_shard, o_shard))
    copy_blocks(srcs, dsts, blocks_tensor(blocks))
    assert torch.equal(qkv, torch.cat([q, k, v]).bfloat16())
    assert torch.equal(o_shard, o[:, 5:].bfloat16())


def test_empty_table_and_empty_blocks_are_noops():
    s, d = torch.randn(3, 3), torch.zeros(3, 3)
    copy_blocks([s], [d], blocks_tensor([]))
    copy_blocks([s], [d], blocks_tensor([Block(0, 0, 3, 1, 0, 0, 3, 1, 0, 3)]))
    assert torch.count_nonzero(d) == 0


@pytest.mark.parametrize(
    "block,match",
    [
        (Block(0, 0, 3, 1, 0, 0, 3, 1, 4, 3), "reads past the end"),
        (Block(0, 0, 3, 1, 0, 1, 3, 1, 3, 3), "writes past the end"),
        (Block(1, 0, 3, 1, 0, 0, 3, 1, 1, 1), "index out of range"),
        (Block(0, -1, 3, 1, 0, 0, 3, 1, 1, 1), "negative offset"),
    ],
)
def test_out_of_bounds_blocks_are_rejected(block, match):
    s, d = torch.randn(3, 3), torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=match):
        _native_op()([s], [d], blocks_tensor([block]))


def test_storage_offset_is_respected_in_bounds_check():
    base = torch.randn(20)
    s = base[15:]  # 5 elements left in the storage past the offset
    d = torch.zeros(8)
    with pytest.raises(RuntimeError, match="reads past the end"):
        _native_op()([s], [d], blocks_tensor([Block(0, 0, 6, 1, 0, 0, 6, 1, 1, 6)]))


def test_unsupported_dtype_is_rejected():
    with pytest.raises(RuntimeError, match="not supported"):
        _native_op()([torch.arange(4)], [torch.zeros(4, dtype=torch.int64)],
                     blocks_tensor([Block(0, 0, 4, 1, 0, 0, 4, 1, 1, 4)]))


def test_block_between_rejects_foreign_views():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with pytest.raises(ValueError, match="share storage"):
        block_between(0, a, b[:2], 0, a, a[:2])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    srcs = [_rand((5, 7), torch.float32, device, 11), _rand((9,), torch.bfloat16, device, 12)]
    dsts = [torch.zeros(30, dtype=torch.bfloat16, device=device)]
    blocks = blocks_tensor([
        block_between(0, srcs[0], srcs[0][1:4, 2:5], 0, dsts[0], dsts[0][:9].view(3, 3)),
        block_between(1, srcs[1], srcs[1], 0, dsts[0], dsts[0][9:18]),
    ])
    torch.library.opcheck(_native_op().default, (srcs, dsts, blocks))


def test_works_under_torch_compile():
    @torch.compile(fullgraph=True, backend="eager")
    def pack(a, b, buf, blocks):
        torch.ops.hybrid_engine.copy_blocks([a, b], [buf], blocks)
        return buf * 2

    a, b = torch.randn(4, 4), torch.randn(6)
    buf = torch.zeros(22)
    blocks = blocks_tensor([block_between(0, a, a, 0, buf, buf[:16].view(4, 4)),
                            block_between(1, b, b, 0, buf, buf[16:])])
    out = pack(a, b, buf, blocks)
    assert torch.equal(out, torch.cat([a.reshape(-1), b]) * 2)
