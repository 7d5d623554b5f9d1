"""Advantage estimators against hand-computed values, and their edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from hybrid_engine.algorithms import (
    ADVANTAGES,
    broadcast_to_tokens,
    drgrpo,
    gae,
    get_advantage,
    grpo,
    reinforce_pp,
    rloo,
    token_level_rewards,
)


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_grpo_hand_example():
    # group 0: mean 0.5, Bessel std sqrt(1/3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    # group 1: mean 1, deviations (1, -1, 0, 0), std sqrt(2/3) = 0.816497 -> +-1.224745
    adv = grpo(_t([[1, 0, 0, 1], [2, 0, 1, 1]]))
    expected = _t([[0.866025, -0.866025, -0.866025, 0.866025], [1.224745, -1.224745, 0, 0]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_drgrpo_and_unnormalised_grpo_subtract_the_group_mean_only():
    rewards = _t([[1, 0, 0, 1], [2, 0, 1, 1]])
    expected = _t([[0.5, -0.5, -0.5, 0.5], [1, -1, 0, 0]])
    torch.testing.assert_close(drgrpo(rewards), expected)
    torch.testing.assert_close(grpo(rewards, std_normalize=False), expected)


def test_rloo_hand_example():
    # r_0 - mean(0, 0, 1) = 1 - 1/3; r_1 - mean(1, 0, 1) = -2/3; [3, 0, 0] -> 3 - 0, 0 - 1.5
    adv = rloo(_t([[1, 0, 0, 1], [3, 0, 0, 0]]))
    expected = _t([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [3, -1, -1, -1]])
    torch.testing.assert_close(adv, expected)


def test_reinforce_pp_normalises_over_the_batch_with_k1():
    # mean 0.25, Bessel std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    adv = reinforce_pp(_t([[1], [0], [0], [0]]))
    torch.testing.assert_close(adv, _t([[1.5], [-0.5], [-0.5], [-0.5]]), atol=1e-5, rtol=0)
    assert torch.equal(reinforce_pp(_t([[3.0]])), _t([[0.0]]))


@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, -7.3])
def test_identical_rewards_give_exactly_zero(value):
    rewards = torch.full((3, 5), value)
    for est in (grpo, drgrpo, rloo, reinforce_pp):
        adv = est(rewards)
        assert torch.equal(adv, torch.zeros(3, 5)), est.__name__


def test_degenerate_group_is_zero_next_to_informative_ones():
    adv = grpo(_t([[0.1, 0.1, 0.1], [1, 0, 0]]))
    assert torch.equal(adv[0], torch.zeros(3))
    assert adv[1, 0] > 0 > adv[1, 1]


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo"])
def test_group_of_one_is_a_clear_error(name):
    with pytest.raises(ValueError, match="group of one has no"):
        get_advantage(name)(_t([[1.0], [0.0]]))


def test_registry_holds_the_documented_names_and_suggests_closest():
    assert {"grpo", "drgrpo", "rloo", "reinforce_pp", "gae"} <= set(ADVANTAGES.names())
    assert get_advantage("gae").per_token and not get_advantage("grpo").per_token
    assert get_advantage("rloo").min_group_size == 2
    assert get_advantage("reinforce_pp").min_group_size == 1
    with pytest.raises(ValueError, match=r"did you mean 'grpo'\?.*available: drgrpo, gae"):
        get_advantage("grp0")
    with pytest.raises(ValueError, match="did you mean 'reinforce_pp'"):
        get_advantage("reinforce++")


def test_gae_hand_example_skips_masked_tokens():
    # gamma 0.9, lam 0.8. Row 0: loss tokens 0 and 2, a tool token at 1.
    #   t=2: delta = 1 - 0.6 = 0.4, A = 0.4, R = 1.0
    #   t=0: next loss token is 2: delta = 0 + 0.9 * 0.6 - 0.5 = 0.04,
    #        A = 0.04 + 0.72 * 0.4 = 0.328, R = 0.828
    # Row 1: the same without the tool token (padding at the end, NaN value there).
    # Row 2: row 0 with a per-token reward -0.1 at t=0: A = 0.228, R = 0.728.
    # Row 3: no loss token.
    nan = math.nan
    rewards = _t([[0, 0, 1], [0, 1, 0], [-0.1, 0, 1], [0, 0, 0]])
    values = _t([[0.5, 0.3, 0.6], [0.5, 0.6, nan], [0.5, 0.3, 0.6], [1, 2, 3]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0], [1, 0, 1], [0, 0, 0]], dtype=torch.bool)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(
        adv, _t([[0.328, 0, 0.4], [0.328, 0.4, 0], [0.228, 0, 0.4], [0, 0, 0]])
    )
    torch.testing.assert_close(
        ret, _t([[0.828, 0, 1.0], [0.828, 1.0, 0], [0.728, 0, 1.0], [0, 0, 0]])
    )


def test_gae_gamma_lam_one_gives_reward_to_go_minus_value():
    rewards = _t([[0.5, 0, 2]])
    values = _t([[1, 1, 1]])
    adv, ret = gae(rewards, values, torch.ones(1, 3, dtype=torch.bool), gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, _t([[2.5, 2, 2]]))
    torch.testing.assert_close(adv, _t([[1.5, 1, 1]]))


def test_broadcast_to_tokens():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    out = broadcast_to_tokens(_t([1.5, -2]), mask)
    assert torch.equal(out, _t([[1.5, 1.5, 0], [0, -2, -2]]))


def test_token_level_rewards_on_last_loss_token_with_kl():
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]], dtype=torch.bool)
    rewards = _t([1, 2, 5])
    assert torch.equal(token_level_rewards(rewards, mask), _t([[0, 1, 0], [0, 0, 2], [0, 0, 0]]))
    kl = _t([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [9, 9, 9]])
    out = token_level_rewards(rewards, mask, kl_NT=kl, kl_coef=0.5)
    torch.testing.assert_close(out, _t([[-0.05, 0.9, 0], [-0.2, 0, 1.7], [0, 0, 0]]))
