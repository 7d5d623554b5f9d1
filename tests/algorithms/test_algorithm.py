"""The algorithm role on hand-made trajectories: advantages, degenerate marks, selection."""

from __future__ import annotations

import math

import pytest
import torch

from hybrid_engine.algorithms.algorithm import Algorithm
from hybrid_engine.algorithms.mismatch import mismatch_metrics, with_mismatch_metrics
from hybrid_engine.config import AlgorithmConfig
from hybrid_engine.trajectory import Trajectory


def _trajs(rewards: list[float], lens: list[int] | None = None, k: int = 2) -> list[Trajectory]:
    lens = lens or [3] * len(rewards)
    return [Trajectory(prompt_ids=[1, 2], response_ids=list(range(n)), rollout_logp=[-1.0] * n,
                       reward=r, group_id=i // k) for i, (r, n) in enumerate(zip(rewards, lens))]


def test_grpo_advantages_and_degenerate_groups() -> None:
    algo = Algorithm(AlgorithmConfig(), num_samples=2, max_tokens=8)
    trajs = _trajs([1.0, 0.0, 0.5, 0.5])  # group 0 informative, group 1 flat
    m = algo.compute_advantages(trajs)
    # GRPO: (r - mean) / (std + eps) with the unbiased std of [1, 0] = 0.7071.
    expected = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert torch.allclose(torch.as_tensor(trajs[0].advantages), torch.full((3,), expected))
    assert torch.allclose(torch.as_tensor(trajs[1].advantages), torch.full((3,), -expected))
    assert [t.degenerate for t in trajs] == [False, False, True, True]
    assert m["groups_flat"] == 1 and m["degenerate_frac"] == 0.5
    assert algo.select(trajs) == trajs  # without dynamic sampling every sample trains


def test_all_flat_groups_skip_the_step() -> None:
    algo = Algorithm(AlgorithmConfig(), num_samples=2, max_tokens=8)
    trajs = _trajs([1.0, 1.0, 0.0, 0.0])
    algo.compute_advantages(trajs)
    assert algo.select(trajs) == []


def test_dynamic_sampling_drops_flat_groups_even_with_a_batch_baseline() -> None:
    cfg = AlgorithmConfig(advantage="reinforce_pp", dynamic_sampling=True)
    algo = Algorithm(cfg, num_samples=2, max_tokens=8)
    trajs = _trajs([1.0, 0.0, 1.0, 1.0])
    algo.compute_advantages(trajs)
    # REINFORCE++ whitens over the batch, so group 1 has non-zero advantages...
    # ...but dynamic sampling drops it.
    assert [t.degenerate for t in trajs] == [False, False, True, True]
    assert algo.select(trajs) == trajs[:2]


def test_dynamic_sampling_keeps_a_kept_groups_sample_at_its_mean() -> None:
    """DAPO filters groups, not samples: a kept group trains whole, its sample at the
    group's mean (advantage 0) included, so the loss's denominators and KL/entropy
    terms count it; a flat group still goes."""
    cfg = AlgorithmConfig(dynamic_sampling=True)
    algo = Algorithm(cfg, num_samples=3, max_tokens=8)
    trajs = _trajs([0.0, 0.5, 1.0, 1.0, 1.0, 1.0], k=3)
    algo.compute_advantages(trajs)
    assert trajs[1].degenerate and float(trajs[1].advantages[0]) == 0.0
    assert algo.select(trajs) == trajs[:3]


def test_dynamic_sampling_needs_groups_of_two() -> None:
    with pytest.raises(ValueError, match="a group of 1 never does"):
        Algorithm(AlgorithmConfig(advantage="reinforce_pp", dynamic_sampling=True),
                  num_samples=1, max_tokens=8)


def test_kl_in_reward_leaves_flat_groups_flat_by_their_task_rewards() -> None:
    """The KL penalty moves a task-flat group's advantages off 0 (before the group
    normalisation, as in verl), but the group still counts as flat, and dynamic
    sampling drops it as select() would."""
    trajs = _trajs([1.0, 1.0, 0.0, 1.0])
    for t, ref in zip(trajs, (-0.5, -2.0, -1.0, -1.0), strict=True):
        t.ref_logp = [ref] * len(t.response_ids)
    plain = Algorithm(AlgorithmConfig(kl_coef=0.1, kl_in_reward=True), num_samples=2,
                      max_tokens=8)
    m = plain.compute_advantages(trajs)
    assert m["groups_flat"] == 1 and float(trajs[0].advantages[0]) != 0.0
    dyn = Algorithm(AlgorithmConfig(kl_coef=0.1, kl_in_reward=True, dynamic_sampling=True),
                    num_samples=2, max_tokens=8)
    m = dyn.compute_advantages(trajs)
    assert m["groups_flat"] == 1 and dyn.select(trajs) == trajs[2:]


def test_overlong_shaping_changes_rewards_before_advantages() -> None:
    cfg = AlgorithmConfig(overlong_buffer=4, overlong_penalty_factor=1.0)
    algo = Algorithm(cfg, num_samples=2, max_tokens=8)
    trajs = _trajs([1.0, 1.0], lens=[2, 8])  # equal rewards, one sample at the limit
    algo.compute_advantages(trajs)
    assert not trajs[0].degenerate and float(trajs[0].advantages[0]) > 0
    assert float(trajs[1].advantages[0]) < 0


def test_kl_in_reward_needs_and_uses_ref_logp() -> None:
    cfg = AlgorithmConfig(kl_coef=0.5, kl_in_reward=True, kl_estimator="k1")
    algo = Algorithm(cfg, num_samples=2, max_tokens=8)
    assert algo.needs_reference
    trajs = _trajs([1.0, 1.0])
    with pytest.raises(ValueError, match="ref_logp"):
        algo.compute_advantages(trajs)
    trajs[0].ref_logp = [-1.0] * 3          # k1 = 0
    trajs[1].ref_logp = [-2.0] * 3          # k1 = logp - ref = 1 per token -> reward - 1.5
    m = algo.compute_advantages(trajs)
    assert float(trajs[0].advantages[0]) > 0 > float(trajs[1].advantages[0])
    assert m["kl_in_reward"] == pytest.approx(0.5)


def test_gae_needs_values_and_fills_returns() -> None:
    algo = Algorithm(AlgorithmConfig(advantage="gae", lam=1.0, gamma=1.0), num_samples=1,
                     max_tokens=8)
    assert algo.needs_values
    trajs = _trajs([1.0, 0.0], k=1)
    with pytest.raises(ValueError, match="critic"):
        algo.compute_advantages(trajs)
    for t in trajs:
        t.values = torch.zeros(3)
    algo.compute_advantages(trajs)
    # gamma = lam = 1, zero values: return and advantage = the outcome reward on every token.
    assert torch.allclose(torch.as_tensor(trajs[0].returns), torch.ones(3))
    assert torch.allclose(torch.as_tensor(trajs[0].advantages), torch.ones(3))
    assert trajs[1].degenerate


def test_group_estimator_rejects_k_1_and_bad_counts() -> None:
    with pytest.raises(ValueError, match="samples per prompt"):
        Algorithm(AlgorithmConfig(advantage="rloo"), num_samples=1, max_tokens=8)
    algo = Algorithm(AlgorithmConfig(), num_samples=2, max_tokens=8)
    with pytest.raises(ValueError, match="multiple of K=2"):
        algo.compute_advantages(_trajs([1.0, 0.0, 1.0]))


def test_drgrpo_constant_defaults_to_max_tokens() -> None:
    algo = Algorithm(AlgorithmConfig(advantage="drgrpo", loss_agg="constant"), num_samples=2,
                     max_tokens=16)
    assert (algo.loss.agg, algo.loss.agg_constant) == ("constant", 16.0)


def test_mismatch_metrics_by_hand() -> None:
    logp = torch.tensor([[0.0, -1.0, -2.0, 5.0]])
    rollout = torch.tensor([[0.0, -1.5, -1.9, 0.0]])
    mask = torch.tensor([[False, True, True, False]])
    m = mismatch_metrics(logp, rollout, mask)
    assert float(m["mismatch_abs_mean"]) == pytest.approx(0.3)
    assert float(m["mismatch_abs_max"]) == pytest.approx(0.5)
    # ratios exp(0.5) = 1.65 (out of [0.8, 1.25]) and exp(-0.1) = 0.905 (in).
    assert float(m["mismatch_ratio_out"]) == pytest.approx(0.5)


def test_the_mismatch_skips_tokens_without_rollout_logprobs_and_combines_by_their_count() -> None:
    """Completions outside the mismatch sample carry NaN rollout log-probs: they
    leave the metrics, and a micro-batch without sampled tokens does not dilute
    the means when micro-batches combine."""
    from hybrid_engine.algorithms.losses import LossInputs, combine_metrics, policy_loss_fn

    fn = with_mismatch_metrics(policy_loss_fn(AlgorithmConfig()))
    nan = float("nan")

    def mb(rollout: list[float]) -> dict:
        _, m = fn(LossInputs(logp_BT=torch.tensor([[-1.0, -1.0, -1.0]]),
                             advantages_BT=torch.ones(1, 3), mask_BT=torch.tensor([[True] * 3]),
                             rollout_logp_BT=torch.tensor([rollout])), None)
        assert torch.isfinite(m["loss"])
        return m

    sampled, unsampled = mb([-1.5, nan, -1.1]), mb([nan, nan, nan])
    assert float(sampled["mismatch_abs_mean"]) == pytest.approx(0.3)
    assert float(sampled["mismatch_tokens"]) == 2.0 and float(unsampled["mismatch_tokens"]) == 0
    both = combine_metrics([sampled, unsampled])
    assert float(both["mismatch_abs_mean"]) == pytest.approx(0.3)
    assert float(both["mismatch_abs_max"]) == pytest.approx(0.5)
    assert float(both["mismatch_tokens"]) == 2.0 and float(both["num_tokens"]) == 6.0


def test_with_mismatch_metrics_keeps_the_loss() -> None:
    from hybrid_engine.algorithms.losses import LossInputs, policy_loss_fn

    fn = policy_loss_fn(AlgorithmConfig())
    logp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    inputs = LossInputs(logp_BT=logp, advantages_BT=torch.tensor([[0.0, 1.0, -1.0]]),
                        mask_BT=torch.tensor([[False, True, True]]),
                        rollout_logp_BT=torch.tensor([[0.0, -1.0, -2.5]]))
    loss_a, m_a = fn(inputs, None)
    loss_b, m_b = with_mismatch_metrics(fn)(inputs, None)
    assert torch.equal(loss_a, loss_b) and set(m_a) < set(m_b)
    assert float(m_b["mismatch_abs_max"]) == pytest.approx(0.5)


def test_engine_logprobs_split_the_mismatch_into_drift_and_numerics() -> None:
    """Stale samples: rollout (old weights) -> engine now differ by drift, engine now
    -> trainer by numerics; the total stays trainer vs rollout."""
    from hybrid_engine.algorithms.losses import LossInputs, policy_loss_fn

    fn = with_mismatch_metrics(policy_loss_fn(AlgorithmConfig()))
    mask = torch.tensor([[False, True, True]])
    rollout = torch.tensor([[0.0, -1.0, -2.0]])
    engine = torch.tensor([[0.0, -1.4, -2.2]])          # drift 0.4, 0.2
    trainer = torch.tensor([[9.0, -1.401, -2.199]])      # numerics 1e-3 each
    base = {"logp_BT": trainer, "advantages_BT": torch.zeros(1, 3), "mask_BT": mask,
            "rollout_logp_BT": rollout}
    _, m = fn(LossInputs(**base, engine_logp_BT=engine), None)
    assert float(m["mismatch_drift_abs_mean"]) == pytest.approx(0.3)
    assert float(m["mismatch_drift_abs_max"]) == pytest.approx(0.4)
    assert float(m["mismatch_numerics_abs_mean"]) == pytest.approx(1e-3, abs=1e-6)
    assert float(m["mismatch_abs_mean"]) == pytest.approx(0.3, abs=1e-3)
    _, plain = fn(LossInputs(**base), None)
    assert not any(k.startswith(("mismatch_drift", "mismatch_numerics")) for k in plain)


def test_the_split_covers_the_scored_sequences_and_combines_weighted_by_their_tokens() -> None:
    """Sequences outside the drift scorer's sample carry NaN engine log-probs: they
    leave the split (not the total), and a micro-batch or update without scored
    tokens does not dilute the split's means when they combine."""
    from hybrid_engine.algorithms.losses import LossInputs, combine_metrics, policy_loss_fn
    from hybrid_engine.roles.updates import combine_updates

    fn = with_mismatch_metrics(policy_loss_fn(AlgorithmConfig()))
    nan = float("nan")

    def mb(engine: list[float]) -> dict:
        _, m = fn(LossInputs(logp_BT=torch.tensor([[-1.0, -1.0]]), advantages_BT=torch.zeros(1, 2),
                             mask_BT=torch.tensor([[True, True]]),
                             rollout_logp_BT=torch.tensor([[-1.5, -1.5]]),
                             engine_logp_BT=torch.tensor([engine])), None)
        return m

    scored, unscored = mb([-1.25, -1.25]), mb([nan, nan])
    assert float(scored["mismatch_split_tokens"]) == 2 and float(unscored["mismatch_split_tokens"]) == 0
    assert float(scored["mismatch_drift_abs_mean"]) == pytest.approx(0.25)
    assert float(unscored["mismatch_abs_mean"]) == pytest.approx(0.5)  # the total keeps them
    both = combine_metrics([scored, unscored])
    assert float(both["mismatch_drift_abs_mean"]) == pytest.approx(0.25)  # not 0.125
    assert float(both["mismatch_numerics_abs_max"]) == pytest.approx(0.25)
    assert float(both["mismatch_split_tokens"]) == 2
    updates = combine_updates([{k: float(v) for k, v in m.items()} for m in (unscored, scored)])
    assert updates["mismatch_drift_abs_mean"] == pytest.approx(0.25)
    assert updates["mismatch_numerics_abs_mean"] == pytest.approx(0.25)
    assert updates["mismatch_abs_mean"] == pytest.approx(0.5)


# --------------------------------------------------------------------------
# Dynamic sampling refills (DAPO): how many more prompts, and what trains
# --------------------------------------------------------------------------


def _dapo(**kw) -> Algorithm:
    return Algorithm(AlgorithmConfig(dynamic_sampling=True, **kw), num_samples=2, max_tokens=8,
                     prompts_per_step=2)


def test_refill_asks_for_the_missing_groups_scaled_by_the_signal_rate() -> None:
    algo = _dapo()
    # Round 1: 2 groups drawn, 1 with signal -> 1 missing at a 1/2 rate -> 2 more prompts.
    first = _trajs([1.0, 0.0, 0.5, 0.5])
    assert algo.prompts_wanted(first, rounds=1) == 2
    # No signal at all yet: a whole step's worth again.
    assert algo.prompts_wanted(_trajs([1.0, 1.0, 0.0, 0.0]), rounds=1) == 2
    # Round 2 brings a second group with signal: enough.
    assert algo.prompts_wanted(first + _trajs([0.0, 1.0, 1.0, 1.0]), rounds=2) == 0


def test_refill_stops_at_max_sampling_rounds_and_without_dynamic_sampling() -> None:
    flat = _trajs([1.0, 1.0, 0.0, 0.0])
    assert _dapo(max_sampling_rounds=3).prompts_wanted(flat, rounds=2) == 2
    assert _dapo(max_sampling_rounds=3).prompts_wanted(flat, rounds=3) == 0
    assert _dapo(max_sampling_rounds=1).prompts_wanted(flat, rounds=1) == 0
    plain = Algorithm(AlgorithmConfig(), num_samples=2, max_tokens=8, prompts_per_step=2)
    assert plain.prompts_wanted(flat, rounds=1) == 0


def test_select_keeps_the_first_prompts_per_step_groups_with_signal() -> None:
    algo = _dapo()
    trajs = _trajs([1.0, 0.0, 0.5, 0.5, 0.0, 1.0, 1.0, 0.0])  # signal, flat, signal, signal
    m = algo.compute_advantages(trajs)
    assert m["groups_flat"] == 1
    # Groups 0 and 2 are the first two with signal; group 3 is surplus.
    assert algo.select(trajs) == trajs[:2] + trajs[4:6]
    # Without a target every group with signal trains.
    free = Algorithm(AlgorithmConfig(dynamic_sampling=True), num_samples=2, max_tokens=8)
    free.compute_advantages(trajs)
    assert free.select(trajs) == trajs[:2] + trajs[4:]


def test_behaviour_logp_rollout_refuses_a_correction_that_could_never_act() -> None:
    with pytest.raises(ValueError, match="rollout_correction='token_tis' would never act"):
        AlgorithmConfig(behaviour_logp="rollout", tis_cap=2.0)
    with pytest.raises(ValueError, match="rollout_correction='icepop' would never act"):
        AlgorithmConfig(behaviour_logp="rollout", rollout_correction="icepop")
    with pytest.raises(ValueError, match="behaviour_logp"):
        AlgorithmConfig(behaviour_logp="both")


def test_refill_that_runs_out_of_rounds_says_so(caplog) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="hybrid_engine.algorithms.algorithm"):
        assert _dapo(max_sampling_rounds=2).prompts_wanted(_trajs([1.0, 1.0, 0.0, 1.0]),
                                                           rounds=2) == 0
    assert "1 of 2 wanted groups carry signal after 2 rounds" in caplog.text
