"""roles/packing.py: where each sequence of a micro-batch lands when packed."""

from __future__ import annotations

import torch

from hybrid_engine.roles.packing import pack


def test_sequences_pack_first_fit_with_their_own_positions_and_a_tail():
    lens = torch.tensor([6, 4, 3, 2, 1])  # longest first, as micro-batches come
    tokens_BT = torch.zeros((5, 6), dtype=torch.int64)
    for b, n in enumerate(lens.tolist()):
        tokens_BT[b, :n] = torch.arange(n) + 10 * (b + 1)
    positions_BT = torch.arange(6).expand(5, 6)
    p = pack(tokens_BT, positions_BT, lens)
    # 6 | 4 + 2 | 3 + 1 (+ a tail of 2): three rows of width 6 instead of five
    assert p.row_B.tolist() == [0, 1, 2, 1, 2] and p.offset_B.tolist() == [0, 0, 0, 4, 3]
    assert p.tokens_PT.tolist() == [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 40, 41],
                                    [30, 31, 32, 50, 0, 0]]
    assert p.position_ids_PT.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 0, 1],
                                          [0, 1, 2, 0, 0, 1]]
    # Padded (row, column) -> packed: each token found where it was put.
    rows_N, cols_N = (tokens_BT != 0).nonzero(as_tuple=True)
    at_P, at_T = p.index(rows_N, cols_N)
    assert torch.equal(p.tokens_PT[at_P, at_T], tokens_BT[rows_N, cols_N])
