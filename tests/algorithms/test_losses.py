"""Policy/value losses and the loss closure against hand-computed values.

Every expected number is written out (derivation in the comment), never
recomputed with the formula under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybrid_engine.algorithms import (
    LOSS_AGG_MODES,
    LossInputs,
    aggregate_loss,
    combine_metrics,
    get_policy_loss,
    gspo,
    loss_normalizer,
    policy_loss_fn,
    ppo,
    value_loss,
)
from hybrid_engine.config import AlgorithmConfig

LOG_OLD = math.log(0.3)


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


def _ppo_batch():
    """Row 0: six loss tokens with ratios / advantages below, then a masked NaN; row 1: all masked.

    clip_low 0.2, clip_high 0.28 (clip-higher), dual_clip 3:
      ratio A    -A*r   -A*clip(r)  max     dual     note
      1.0   +1   -1     -1          -1      -1
      1.5   +1   -1.5   -1.28       -1.28   -1.28    clipped high
      0.5   +1   -0.5   -0.8        -0.5    -0.5
      0.5   -1   0.5    0.8         0.8     0.8      clipped low
      1.5   -1   1.5    1.28        1.5     1.5
      4.0   -1   4      1.28        4       3        dual-clipped (cap 3 * |A|)
    """
    ratios = [1.0, 1.5, 0.5, 0.5, 1.5, 4.0]
    old = torch.full((2, 7), LOG_OLD)
    logp = old.clone()
    logp[0, :6] += torch.log(_t(ratios))
    logp[0, 6] = math.nan  # garbage at a masked position
    logp[1] = 300.0
    adv = torch.zeros(2, 7)
    adv[0, :6] = _t([1, 1, 1, -1, -1, -1])
    adv[1] = 5.0
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[0, :6] = True
    return logp.requires_grad_(), old, adv, mask


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_hand_example_and_clip_fractions(dual_clip):
    logp, old, adv, mask = _ppo_batch()
    loss_BT, m = ppo(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip)
    last = 4.0 if dual_clip is None else 3.0
    expected = torch.zeros(2, 7)
    expected[0, :6] = _t([-1, -1.28, -0.5, 0.8, 1.5, last])
    torch.testing.assert_close(loss_BT, expected, atol=1e-5, rtol=0)
    assert m["clip_frac"].item() == pytest.approx(2 / 6)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 6)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 6)
    assert ("dual_clip_frac" in m) == (dual_clip is not None)
    if dual_clip is not None:
        assert m["dual_clip_frac"].item() == pytest.approx(1 / 6)
    assert m["ratio_mean"].item() == pytest.approx(1.5, abs=1e-5)  # 9 / 6
    assert m["ratio_max"].item() == pytest.approx(4.0, abs=1e-5)
    assert m["ratio_min"].item() == pytest.approx(0.5, abs=1e-5)
    # -(2 log 1.5 + 2 log 0.5 + log 4) / 6 = -0.810930 / 6
    assert m["ppo_kl"].item() == pytest.approx(-0.135155, abs=1e-5)


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_gradient_inside_and_outside_clip_range(dual_clip):
    logp, old, adv, mask = _ppo_batch()
    loss_BT, _ = ppo(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip)
    aggregate_loss(loss_BT, mask, "token_mean").backward()
    # Unclipped token: d(-A r)/d logp = -A r; clipped or dual-clipped: 0. Token mean: / 6.
    last = 4.0 if dual_clip is None else 0.0
    expected = torch.zeros(2, 7)
    expected[0, :6] = _t([-1, 0, -0.5, 0, 1.5, last]) / 6
    torch.testing.assert_close(logp.grad, expected, atol=1e-6, rtol=0)


def test_dual_clip_must_exceed_one():
    logp, old, adv, mask = _ppo_batch()
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip=1.0)


def test_gspo_hand_example_and_gradient():
    # Row 0: token log ratios (0.2, 0.0) -> s = exp(0.1) = 1.105171, inside [0.8, 1.2].
    # Row 1: (0.6, 0.4, masked) -> s = exp(0.5) = 1.648721, clipped to 1.2. A = 1 for both.
    old = torch.zeros(2, 3)
    logp = _t([[0.2, 0.0, 0.0], [0.6, 0.4, -50.0]]).requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    loss_BT, m = gspo(logp, old, torch.ones(2, 3), mask, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(
        loss_BT, _t([[-1.105171, -1.105171, 0], [-1.2, -1.2, 0]]), atol=1e-5, rtol=0
    )
    assert m["clip_frac"].item() == pytest.approx(0.5)
    loss = aggregate_loss(loss_BT, mask, "seq_mean_token_mean")
    assert loss.item() == pytest.approx(-1.152585, abs=1e-5)  # (-1.105171 - 1.2) / 2
    loss.backward()
    # GSPO: J = mean_b s_b A_b, d s_0 / d logp_t = s_0 / |y_0|:
    # -(1/2) * 1.105171 / 2 = -0.276293 on row 0; row 1 is clipped: 0.
    torch.testing.assert_close(
        logp.grad, _t([[-0.276293, -0.276293, 0], [0, 0, 0]]), atol=1e-6, rtol=0
    )


def test_token_tis_weights_hand_example():
    from hybrid_engine.algorithms.correction import correction_weights

    # old - rollout = (0, log 3, -log 2, log 1.5), cap 2 -> (1, 2, 0.5, 1.5).
    old = torch.zeros(1, 5)
    rollout = -_t([[0, math.log(3), -math.log(2), math.log(1.5), 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    w, m = correction_weights("token_tis", old, rollout, mask, cap=2.0)
    torch.testing.assert_close(w, _t([[1, 2, 0.5, 1.5, 0]]))
    assert m["correction/weight_mean"].item() == pytest.approx(1.25)
    assert m["correction/clipped_frac"].item() == pytest.approx(0.25)
    # the ratios (1, 3, 0.5, 1.5): torch.quantile's linear interpolation
    assert m["correction/ratio_p50"].item() == pytest.approx(1.25)
    # k3(x) = e^x - 1 - x: 0, 0.901388, 0.193147, 0.094535 -> mean 0.297268
    assert m["rollout_kl"].item() == pytest.approx(0.297268, abs=1e-5)


def test_loss_fn_with_tis_scales_the_policy_gradient():
    cfg = AlgorithmConfig(rollout_correction="token_tis", correction_cap=2.0)
    old = torch.full((1, 4), LOG_OLD)
    logp = old.clone().requires_grad_()  # ratio 1, inside the clip range
    rollout = old - _t([[0, math.log(3), -math.log(2), math.log(1.5)]])
    inputs = LossInputs(
        logp_BT=logp,
        old_logp_BT=old,
        rollout_logp_BT=rollout,
        advantages_BT=torch.ones(1, 4),
        mask_BT=torch.ones(1, 4, dtype=torch.bool),
    )
    loss, m = policy_loss_fn(cfg)(inputs)
    assert loss.item() == pytest.approx(-1.25)  # -(1 + 2 + 0.5 + 1.5) / 4
    loss.backward()
    torch.testing.assert_close(logp.grad, -_t([[1, 2, 0.5, 1.5]]) / 4)
    assert m["correction/clipped_frac"].item() == pytest.approx(0.25)


@pytest.mark.parametrize("kl_in_reward", [False, True])
def test_loss_fn_kl_and_entropy_terms(kl_in_reward):
    # pi = 0.5, pi_ref = 0.25 on both tokens: k3 = 0.193147, d k3 / d logp = 1 - 0.5.
    # A = 0, so the policy term is 0; entropy (1, 2), coef 0.01 -> -0.015.
    cfg = AlgorithmConfig(
        kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01, kl_in_reward=kl_in_reward
    )
    logp = torch.full((1, 2), math.log(0.5), requires_grad=True)
    entropy = _t([[1.0, 2.0]]).requires_grad_()
    inputs = LossInputs(
        logp_BT=logp,
        ref_logp_BT=torch.full((1, 2), math.log(0.25)),
        entropy_BT=entropy,
        advantages_BT=torch.zeros(1, 2),
        mask_BT=torch.ones(1, 2, dtype=torch.bool),
    )
    loss, m = policy_loss_fn(cfg)(inputs)
    loss.backward()
    assert m["entropy"].item() == pytest.approx(1.5)
    torch.testing.assert_close(entropy.grad, _t([[-0.005, -0.005]]))
    if kl_in_reward:
        assert loss.item() == pytest.approx(-0.015, abs=1e-7)
        assert "kl" not in m
        torch.testing.assert_close(logp.grad, torch.zeros(1, 2))
    else:
        assert loss.item() == pytest.approx(0.0043147, abs=1e-6)  # 0.0193147 - 0.015
        assert m["kl"].item() == pytest.approx(0.193147, abs=1e-6)
        torch.testing.assert_close(logp.grad, _t([[0.025, 0.025]]))  # 0.1 * 0.5 / 2


def test_the_entropy_metric_is_the_mean_over_its_sample():
    """Without an entropy term the train step computes the entropy on a sample of
    tokens (NaN elsewhere): the metric is their mean and the loss stays finite."""
    nan = float("nan")
    logp = torch.full((1, 4), math.log(0.5), requires_grad=True)
    inputs = LossInputs(logp_BT=logp, entropy_BT=_t([[1.0, nan, 3.0, nan]]),
                        advantages_BT=torch.ones(1, 4), mask_BT=torch.ones(1, 4, dtype=torch.bool))
    loss, m = policy_loss_fn(AlgorithmConfig())(inputs)
    assert m["entropy"].item() == pytest.approx(2.0) and torch.isfinite(loss)


def test_loss_fn_missing_inputs_are_clear_errors():
    x = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    base = {"logp_BT": x, "advantages_BT": x, "mask_BT": mask}
    with pytest.raises(ValueError, match="ref_logp_BT"):
        policy_loss_fn(AlgorithmConfig(kl_coef=0.1))(LossInputs(**base))
    with pytest.raises(ValueError, match="rollout_logp_BT"):
        policy_loss_fn(AlgorithmConfig(rollout_correction="icepop"))(LossInputs(**base))
    with pytest.raises(ValueError, match="entropy_BT"):
        policy_loss_fn(AlgorithmConfig(entropy_coef=0.01))(LossInputs(**base))
    with pytest.raises(ValueError, match="constant > 0"):
        policy_loss_fn(AlgorithmConfig(loss_agg="constant"))
    with pytest.raises(ValueError, match="did you mean 'gspo'"):
        policy_loss_fn(AlgorithmConfig(), policy_loss="gpso")
    with pytest.raises(ValueError, match="did you mean 'ppo'"):
        get_policy_loss("ppo2")


def test_all_masked_micro_batch_gives_zero_loss_and_finite_grad():
    logp = torch.full((2, 3), math.nan, requires_grad=True)
    inputs = LossInputs(
        logp_BT=logp,
        old_logp_BT=torch.zeros(2, 3),
        advantages_BT=torch.ones(2, 3),
        mask_BT=torch.zeros(2, 3, dtype=torch.bool),
    )
    loss, m = policy_loss_fn(AlgorithmConfig(dual_clip=3.0))(inputs, 10.0)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 3))
    assert all(torch.isfinite(v) for v in m.values())


def _random_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    b, t = 8, 6
    old = -torch.rand(b, t, generator=g) * 3
    logp = (old + 0.4 * torch.randn(b, t, generator=g)).requires_grad_()
    mask = torch.arange(t)[None, :] < torch.randint(1, t + 1, (b, 1), generator=g)
    mask[6:] = False  # the last micro-batch of 2 rows has no loss token
    adv = torch.randn(b, 1, generator=g).expand(b, t)
    return logp, old, adv, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", ["ppo", "gspo"])
def test_loss_fn_micro_batches_sum_to_full_batch(mode, name):
    cfg = AlgorithmConfig(loss_agg=mode, clip_low=0.1, clip_high=0.2, dual_clip=2.0)
    loss_fn = policy_loss_fn(cfg, constant=6, policy_loss=name)
    logp, old, adv, mask = _random_inputs(seed=LOSS_AGG_MODES.index(mode))

    whole = LossInputs(logp_BT=logp, old_logp_BT=old, advantages_BT=adv, mask_BT=mask)
    full, full_m = loss_fn(whole)
    (full_grad,) = torch.autograd.grad(full, logp)

    norm = loss_normalizer(mask, mode, constant=6)
    per_mb = []
    for rows in torch.arange(8).split(2):
        inputs = LossInputs(
            logp_BT=logp[rows], old_logp_BT=old[rows], advantages_BT=adv[rows], mask_BT=mask[rows]
        )
        loss, m = loss_fn(inputs, norm)
        loss.backward()
        per_mb.append(m)
    total = combine_metrics(per_mb)
    assert abs(total["loss"].item() - full.item()) <= 1e-6
    torch.testing.assert_close(logp.grad, full_grad, atol=1e-6, rtol=0)
    for key in ("clip_frac", "ratio_mean", "ratio_max", "ratio_min", "num_tokens", "num_seqs"):
        assert total[key].item() == pytest.approx(full_m[key].item(), abs=1e-6), key


def test_value_loss_hand_example():
    # old 1.0, returns 2.0, clip 0.2:
    #   V = 1.5: V_clip = 1.2, max(0.25, 0.64) / 2 = 0.32 (clipped branch, grad 0)
    #   V = 1.1: V_clip = 1.1, 0.81 / 2 = 0.405, grad V - R = -0.9
    values = _t([[1.5, 1.1, math.nan]]).requires_grad_()
    old, ret = _t([[1.0, 1.0, 1.0]]), _t([[2.0, 2.0, 2.0]])
    mask = torch.tensor([[True, True, False]])
    loss_BT, m = value_loss(values, old, ret, mask, clip=0.2)
    torch.testing.assert_close(loss_BT, _t([[0.32, 0.405, 0]]))
    assert m["vf_clip_frac"].item() == pytest.approx(0.5)
    loss_BT.sum().backward()
    torch.testing.assert_close(values.grad, _t([[0.0, -0.9, 0.0]]))
    unclipped, m = value_loss(values.detach(), old, ret, mask, clip=None)
    torch.testing.assert_close(unclipped, _t([[0.125, 0.405, 0]]))
    assert m["vf_clip_frac"].item() == 0.0


def test_behaviour_logp_picks_the_ratios_denominator():
    # One sequence, 2 tokens, A = +1; current logp 0 (p = 1).
    # trainer (default, no old): ratio 1 -> loss -1 per token.
    # rollout: rollout_logp = (log 0.5, log 2) -> ratios (2, 0.5), clip 0.2/0.28 ->
    #   max(-2, -1.28) = -1.28 and max(-0.5, -0.8) = -0.5 -> token mean -0.89.
    # old given: old wins over both (ratio exp(0 - log 0.25) = 4 -> -1.28 each).
    logp = torch.zeros(1, 2, requires_grad=True)
    rollout = _t([[math.log(0.5), math.log(2.0)]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.ones(1, 2)

    def loss(behaviour, old=None):
        cfg = AlgorithmConfig(clip_low=0.2, clip_high=0.28, behaviour_logp=behaviour)
        out, m = policy_loss_fn(cfg)(LossInputs(logp_BT=logp, advantages_BT=adv, mask_BT=mask,
                                                rollout_logp_BT=rollout, old_logp_BT=old), None)
        return out.item(), m

    assert loss("trainer")[0] == pytest.approx(-1.0)
    value, m = loss("rollout")
    assert value == pytest.approx(-0.89, abs=1e-6)
    assert m["clip_frac_high"].item() == pytest.approx(0.5)  # token 0 only (pessimistic max)
    assert m["clip_frac_low"].item() == 0.0
    assert loss("rollout", old=torch.full((1, 2), math.log(0.25)))[0] == pytest.approx(-1.28)
    with pytest.raises(ValueError, match="rollout_logp_BT is required"):
        policy_loss_fn(AlgorithmConfig(behaviour_logp="rollout"))(
            LossInputs(logp_BT=logp, advantages_BT=adv, mask_BT=mask), None)


def test_mismatch_is_measured_on_the_old_logprobs_when_the_trainer_computed_them():
    from hybrid_engine.algorithms.mismatch import with_mismatch_metrics

    logp = torch.full((1, 2), -1.0)  # later update: weights moved
    old = torch.full((1, 2), -2.0)  # trainer, rollout's weights
    rollout = torch.full((1, 2), -2.5)
    mask = torch.ones(1, 2, dtype=torch.bool)
    fn = with_mismatch_metrics(policy_loss_fn(AlgorithmConfig()))
    _, m = fn(LossInputs(logp_BT=logp, advantages_BT=torch.ones(1, 2), mask_BT=mask,
                         old_logp_BT=old, rollout_logp_BT=rollout), None)
    assert m["mismatch_abs_mean"].item() == pytest.approx(0.5)
    _, m = fn(LossInputs(logp_BT=logp, advantages_BT=torch.ones(1, 2), mask_BT=mask,
                         rollout_logp_BT=rollout), None)
    assert m["mismatch_abs_mean"].item() == pytest.approx(1.5)
