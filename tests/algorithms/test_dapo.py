"""DAPO dynamic-sampling filter and overlong shaping against hand values."""

from __future__ import annotations

import pytest
import torch

from hybrid_engine.algorithms import filter_degenerate_groups, overlong_penalty


def test_filter_degenerate_groups():
    rewards = torch.tensor([[1.0, 1, 1], [0, 1, 0], [0, 0, 0], [0.5, 0.5, 0.5], [0.5, 0.5, 0.6]])
    keep, num_degenerate = filter_degenerate_groups(rewards)
    assert keep.tolist() == [False, True, False, False, True]
    assert num_degenerate == 3
    keep, num_degenerate = filter_degenerate_groups(rewards, atol=0.2)
    assert keep.tolist() == [False, True, False, False, False]
    assert num_degenerate == 4


def test_overlong_penalty_hand_example():
    # L_max 20, buffer 5: 0 up to 15 tokens, (15 - len) / 5 after, -1 from 20 on.
    lengths = torch.tensor([10, 15, 17, 20, 25])
    out = overlong_penalty(lengths, max_len=20, buffer=5)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.4, -1.0, -1.0]))
    half = overlong_penalty(lengths, max_len=20, buffer=5, penalty_factor=0.5)
    torch.testing.assert_close(half, torch.tensor([0.0, 0.0, -0.2, -0.5, -0.5]))


@pytest.mark.parametrize("buffer", [0, 21])
def test_overlong_buffer_bounds(buffer):
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([3]), max_len=20, buffer=buffer)
