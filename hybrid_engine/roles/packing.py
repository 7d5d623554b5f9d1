"""Padding-free micro-batches: a micro-batch's sequences packed into as few rows as fit.

Job: `train.packing`. A micro-batch is right-padded to its longest sequence;
packing places its sequences first-fit (they come longest first) into rows of
that same width, one after another, each with its own position ids from 0.
The model is called without an attention mask: transformers reads the
position ids' restarts as document boundaries (`find_packed_sequence_indices`)
and masks attention to causal within each sequence, for SDPA and eager alike.
A row's unused tail is one more short sequence of pad tokens that nothing
reads. Rows are never wider than the padded micro-batch, so attention never
costs more than padded; the decoder's other work shrinks with the padding.

Shape legend: B sequences, T padded width, P packed rows (P <= B), N loss tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Packed", "pack"]


@dataclass(frozen=True, slots=True)
class Packed:
    tokens_PT: Tensor        # int64, the sequences back to back, pad tokens in each tail
    position_ids_PT: Tensor  # int64, from 0 in every sequence (and in every tail)
    row_B: Tensor            # int64 [B], the packed row of sequence b
    offset_B: Tensor         # int64 [B], where sequence b starts in its row

    def index(self, rows_N: Tensor, cols_N: Tensor) -> tuple[Tensor, Tensor]:
        """Where padded position (rows_N, cols_N) lies in the packed rows."""
        return self.row_B[rows_N], self.offset_B[rows_N] + cols_N


def _first_fit(lens: list[int], width: int) -> tuple[list[int], list[int], list[int]]:
    """(row, offset) of each length, first fit in order, and each row's used width."""
    used: list[int] = []
    rows, offsets = [], []
    for n in lens:
        r = next((i for i, u in enumerate(used) if u + n <= width), len(used))
        if r == len(used):
            used.append(0)
        rows.append(r)
        offsets.append(used[r])
        used[r] += n
    return rows, offsets, used


def pack(tokens_BT: Tensor, position_ids_BT: Tensor, seq_lens_B: Tensor) -> Packed:
    """The sequences of a right-padded micro-batch (tokens_BT[b, :seq_lens_B[b]], their
    position ids from 0), packed first-fit into rows of width T."""
    num_rows, width = tokens_BT.shape
    lens = [max(int(n), 0) for n in seq_lens_B.tolist()]
    rows, offsets, used = _first_fit(lens, width)
    tokens_PT = torch.zeros((len(used), width), dtype=tokens_BT.dtype, device=tokens_BT.device)
    position_ids_PT = torch.empty_like(tokens_PT)
    for b in range(num_rows):
        r, o, n = rows[b], offsets[b], lens[b]
        tokens_PT[r, o : o + n] = tokens_BT[b, :n]
        position_ids_PT[r, o : o + n] = position_ids_BT[b, :n]
    for r, u in enumerate(used):  # the tail: a sequence of its own
        position_ids_PT[r, u:] = torch.arange(width - u)
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=tokens_BT.device)  # noqa: E731
    return Packed(tokens_PT, position_ids_PT, as_tensor(rows), as_tensor(offsets))
