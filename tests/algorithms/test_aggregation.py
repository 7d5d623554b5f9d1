"""Loss aggregation: hand values per mode, empty rows/batches, micro-batch exactness."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch

from hybrid_engine.algorithms import LOSS_AGG_MODES, aggregate_loss, loss_normalizer
from hybrid_engine.config.sections import LossAgg

# Row 0: three loss tokens (1, 2, 3); row 1: one (4); row 2: none (an empty
# response / padding row). NaN and inf sit at masked positions on purpose.
LOSS = [[1.0, 2.0, 3.0], [4.0, math.nan, math.inf], [7.0, 7.0, math.nan]]
MASK = [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
# token_mean 10 / 4; seq_mean_token_sum (6 + 4) / 2; seq_mean_token_mean (2 + 4) / 2;
# constant (Dr.GRPO, constant 4) 10 / (2 * 4).
HAND = {"token_mean": 2.5, "seq_mean_token_sum": 5.0, "seq_mean_token_mean": 3.0, "constant": 1.25}


def test_modes_match_config():
    assert set(get_args(LossAgg)) == set(LOSS_AGG_MODES) == set(HAND)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_hand_example_and_no_nan_gradient(mode):
    loss_BT = torch.tensor(LOSS, requires_grad=True)
    mask = torch.tensor(MASK, dtype=torch.bool)
    out = aggregate_loss(loss_BT, mask, mode, constant=4)
    assert out.item() == pytest.approx(HAND[mode], abs=1e-6)
    out.backward()
    assert torch.isfinite(loss_BT.grad).all()
    assert torch.equal(loss_BT.grad[~mask], torch.zeros(5))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("shape", [(3, 4), (0, 4), (2, 0)])
def test_empty_batch_is_zero_with_a_graph(mode, shape):
    loss_BT = torch.randn(shape, requires_grad=True)
    out = aggregate_loss(loss_BT, torch.zeros(shape, dtype=torch.bool), mode, constant=8)
    assert out.item() == 0.0
    out.backward()  # still backpropagates (every rank must run backward under FSDP)
    assert torch.equal(loss_BT.grad, torch.zeros(shape))


def _random_batch(seed, num_seqs=8, num_tokens=6):
    g = torch.Generator().manual_seed(seed)
    loss_BT = torch.randn(num_seqs, num_tokens, generator=g)
    lengths = torch.randint(1, num_tokens + 1, (num_seqs,), generator=g)
    mask = torch.arange(num_tokens)[None, :] < lengths[:, None]
    mask[3] = False  # an empty response
    mask[5, 0] = False  # a masked (tool) token inside a response
    return loss_BT, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("sizes", [(2, 2, 2, 2), (3, 1, 2, 2)])
def test_micro_batches_with_whole_batch_normalizer_sum_to_full_loss(mode, sizes):
    loss_BT, mask = _random_batch(seed=sum(sizes))
    full = aggregate_loss(loss_BT, mask, mode, constant=16)
    norm = loss_normalizer(mask, mode, constant=16)
    parts = [
        aggregate_loss(lb, mb, mode, normalizer=norm)
        for lb, mb in zip(loss_BT.split(sizes), mask.split(sizes), strict=True)
    ]
    assert len(parts) == 4
    assert abs(sum(parts).item() - full.item()) <= 1e-6
    # The normaliser is a count: additive over micro-batches (and ranks).
    split_norm = sum(loss_normalizer(mb, mode, constant=16) for mb in mask.split(sizes))
    assert split_norm.item() == norm.item()


def test_float_normalizer_accepted():
    loss_BT, mask = _random_batch(seed=0)
    a = aggregate_loss(loss_BT, mask, "token_mean", normalizer=float(mask.sum()))
    b = aggregate_loss(loss_BT, mask, "token_mean")
    torch.testing.assert_close(a, b)


def test_bad_mode_and_missing_constant():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="did you mean 'token_mean'"):
        loss_normalizer(mask, "token-mean")
    with pytest.raises(ValueError, match="did you mean 'seq_mean_token_mean'"):
        aggregate_loss(torch.zeros(2, 3), mask, "seq_mean_tok_mean")
    with pytest.raises(ValueError, match="constant > 0"):
        loss_normalizer(mask, "constant")
