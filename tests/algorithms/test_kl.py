"""KL estimators and KL-in-reward against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from hybrid_engine.algorithms import KL_ESTIMATORS, get_kl_estimator, kl_divergence, kl_in_reward
from hybrid_engine.config import AlgorithmConfig

# Token 0: pi = 0.5, pi_ref = 0.25 (log r = log 0.5);
# token 1: pi = 0.25, pi_ref = 0.5 (log r = log 2).
LOGP = [[math.log(0.5), math.log(0.25)]]
REF = [[math.log(0.25), math.log(0.5)]]
HAND = {
    "k1": [0.693147, -0.693147],  # -log r
    "k2": [0.240227, 0.240227],  # (log r)^2 / 2
    "k3": [0.193147, 0.306853],  # (r - 1) - log r: 0.5 - 1 + 0.693147; 2 - 1 - 0.693147
}


@pytest.mark.parametrize("name", sorted(HAND))
def test_estimators_hand_example(name):
    mask = torch.ones(1, 2, dtype=torch.bool)
    kl = kl_divergence(torch.tensor(LOGP), torch.tensor(REF), mask, name)
    torch.testing.assert_close(kl, torch.tensor([HAND[name]]), atol=1e-6, rtol=0)


def test_masked_positions_are_zero_with_finite_gradient():
    logp = torch.tensor([[-1.0, math.nan, 500.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, -1.0, -500.0]])
    mask = torch.tensor([[True, False, False]])
    kl = kl_divergence(logp, ref, mask, "k3")
    assert kl[0, 1:].tolist() == [0.0, 0.0]
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()
    # d k3 / d logp = 1 - exp(ref - logp) = 1 - e^-1 on the loss token.
    assert logp.grad.tolist()[0] == pytest.approx([1 - math.exp(-1), 0.0, 0.0])


def test_kl_in_reward_sums_over_loss_tokens():
    rewards = torch.tensor([1.0, 0.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    # 1 - 0.1 * 0.6; 0 - 0.1 * 1.0
    out = kl_in_reward(rewards, kl, mask, kl_coef=0.1)
    torch.testing.assert_close(out, torch.tensor([0.94, -0.1]))


def test_registry_holds_the_config_default_and_suggests():
    assert AlgorithmConfig().kl_estimator in KL_ESTIMATORS
    assert {"k1", "k2", "k3"} <= set(KL_ESTIMATORS.names())
    with pytest.raises(ValueError, match="did you mean 'k3'"):
        get_kl_estimator("k4")
