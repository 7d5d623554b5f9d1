"""Rollout corrections (algorithms/correction.py) against the peers' own formulas.

Each peer formula below is written again here from the peer's code, read at:
- verl, github.com/volcengine/verl @ b178a3cd56f58b2d502255daba591e92833930a7,
  verl/trainer/ppo/rollout_corr_helper.py, compute_rollout_correction_weights
  (levels "token" and "sequence"; truncation above only), weights multiplying
  pg_losses in core_algos.compute_policy_loss_vanilla;
  and @ 2f2996b7dcc037b3b3d4112665b13ab8797e3ad5, same file,
  compute_rollout_rejection_mask(rollout_rs="geometric") (the response mask
  times the kept sequences);
- TRL, github.com/huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8,
  trl/trainer/grpo_trainer.py, vllm_importance_sampling_mode token_truncate /
  sequence_truncate / token_mask / sequence_mask with clip_min / clip_max,
  per_token_loss *= importance_sampling_ratio;
- OpenRLHF, github.com/OpenRLHF/OpenRLHF @ 3c3be6234e0cb353e76bb8019947db9dfe99fca7,
  openrlhf/models/loss.py, PolicyLoss.forward, is_correction_type="icepop";
- SkyRL, github.com/NovaSky-AI/SkyRL @ a9564572eb8e91076be43c1bd5e4615e3de17265,
  skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py,
  compute_sequence_mask (geometric).
The loss compared is the PPO token-mean loss at ratio 1 (logp = old), so the
policy term is -A per token and the correction's weight is all that differs.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybrid_engine.algorithms.correction import CORRECTIONS, correction_weights
from hybrid_engine.algorithms.losses import LossInputs, policy_loss_fn
from hybrid_engine.config import AlgorithmConfig

# 4 sequences x 5 positions; the last positions of rows 1 and 3 are padding.
LR = torch.tensor([[0.1, -0.3, 1.2, 0.0, -0.05],
                   [0.02, -0.01, 0.005, 9.0, 9.0],
                   [-0.9, 0.4, 0.8, -0.2, 1.3],
                   [0.005, -0.004, 0.0, 0.001, 5.0]])
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0]],
                    dtype=torch.bool)
ADV = torch.tensor([[1.0], [-0.5], [2.0], [0.25]]).expand(4, 5)
OLD = torch.full((4, 5), -1.5)
ROLLOUT = OLD - LR  # lr = old - rollout


# --- the peers' formulas, written again --------------------------------------------


def verl_is(level: str, threshold: float) -> torch.Tensor:
    lr = (OLD - ROLLOUT) * MASK
    if level == "token":
        w = torch.exp(lr.clamp(-20, 20))
    else:  # "sequence": the masked sum
        w = torch.exp(lr.sum(-1, keepdim=True).clamp(-20, 20)).expand_as(lr)
    return (w * MASK).clamp(max=threshold)


def verl_geometric_keep(lo: float, hi: float) -> torch.Tensor:
    lr = (OLD - ROLLOUT) * MASK
    g = torch.exp((lr.sum(-1) / MASK.sum(-1)).clamp(-20, 20))
    return ((g >= lo) & (g <= hi))[:, None].expand_as(lr) & MASK


def skyrl_geometric_keep(lo: float, hi: float) -> torch.Tensor:
    lr = (OLD - ROLLOUT).clamp(-20, 20)
    g = torch.exp((lr * MASK).sum(-1) / MASK.sum(-1).clamp(min=1))
    return ((g >= lo) & (g <= hi))[:, None].expand_as(lr) & MASK


def trl_ratio(mode: str, clip_min: float | None, clip_max: float) -> torch.Tensor:
    d = (OLD - ROLLOUT) * MASK
    rho = torch.exp(d.sum(-1, keepdim=True)) if mode.startswith("sequence") else torch.exp(d)
    if mode.endswith("truncate"):
        rho = rho.clamp(min=clip_min, max=clip_max)
    else:
        out = rho > clip_max
        if clip_min is not None:
            out |= rho < clip_min
        rho = rho.masked_fill(out, 0.0)
    return rho.expand_as(d) * MASK


def openrlhf_icepop(low: float, high: float) -> torch.Tensor:
    w = torch.exp(OLD - ROLLOUT)
    return w * ((w >= low) & (w <= high)) * MASK


def peer_loss(w: torch.Tensor) -> float:
    """-A * w per token, the masked token mean (the normaliser unchanged by a mask)."""
    return float((-ADV * w * MASK).sum() / MASK.sum())


def ours(name: str, **bounds) -> tuple[torch.Tensor, float]:
    cfg = AlgorithmConfig(rollout_correction=name, **bounds)
    w, _ = correction_weights(name, OLD, ROLLOUT, MASK, cap=cfg.correction_cap,
                              low=cfg.correction_low, high=cfg.correction_high)
    inputs = LossInputs(logp_BT=OLD.clone().requires_grad_(), old_logp_BT=OLD,
                        rollout_logp_BT=ROLLOUT, advantages_BT=ADV, mask_BT=MASK)
    loss, _ = policy_loss_fn(cfg)(inputs)
    return w, float(loss.detach())


# --- equal to the peers ----------------------------------------------------------------


@pytest.mark.parametrize("name, level", [("token_tis", "token"), ("seq_tis", "sequence")])
def test_truncated_is_equals_verl_and_trl_truncate(name, level):
    w, loss = ours(name, correction_cap=2.0)
    want = verl_is(level, 2.0)
    torch.testing.assert_close(w, want, rtol=1e-6, atol=0)
    trl_mode = "token_truncate" if level == "token" else "sequence_truncate"
    torch.testing.assert_close(w, trl_ratio(trl_mode, None, 2.0), rtol=1e-6, atol=0)
    assert loss == pytest.approx(peer_loss(want), rel=1e-6)
    assert (want == 2.0).any() and (want[MASK] < 2.0).any()  # both branches taken


@pytest.mark.parametrize("name, mode", [("token_mask", "token_mask"),
                                        ("seq_mask", "sequence_mask")])
def test_masked_is_equals_trl_mask(name, mode):
    w, loss = ours(name, correction_low=0.6, correction_high=3.0)
    want = trl_ratio(mode, 0.6, 3.0)
    torch.testing.assert_close(w, want, rtol=1e-6, atol=0)
    assert loss == pytest.approx(peer_loss(want), rel=1e-6)
    assert (want[MASK] == 0).any() and (want[MASK] > 0).any()


def test_icepop_equals_openrlhf():
    w, loss = ours("icepop")  # its own bounds: [0.5, 5]
    want = openrlhf_icepop(0.5, 5.0)
    torch.testing.assert_close(w, want, rtol=1e-6, atol=0)
    assert loss == pytest.approx(peer_loss(want), rel=1e-6)
    assert (want[MASK] == 0).any() and (want[MASK] > 0).any()


def test_geo_mask_equals_verl_and_skyrl_masks():
    w, loss = ours("geo_mask", correction_low=0.99, correction_high=1.01)
    keep = verl_geometric_keep(0.99, 1.01)
    assert torch.equal(w.bool(), keep) and torch.equal(keep, skyrl_geometric_keep(0.99, 1.01))
    assert keep.any(dim=-1).tolist() == [False, True, False, True]
    # verl and SkyRL take masked tokens out of the normaliser; here they stay in it
    # (weight 0), as in TRL and OpenRLHF: the losses differ by exactly that factor.
    verl_loss = float((-ADV * keep).sum() / keep.sum())
    assert loss == pytest.approx(verl_loss * float(keep.sum()) / float(MASK.sum()), rel=1e-6)


def test_the_worked_example():
    """lr = (0.1, -0.3, 1.2): the figures the peers' code gives."""
    old = torch.zeros(1, 3)
    rollout = -torch.tensor([[0.1, -0.3, 1.2]])
    mask = torch.ones(1, 3, dtype=torch.bool)

    def w(name: str, **kw) -> list[float]:
        return [round(x, 4) for x in correction_weights(name, old, rollout, mask, cap=2.0,
                                                        **kw)[0][0].tolist()]

    assert w("token_tis") == [1.1052, 0.7408, 2.0]
    assert w("seq_tis") == [2.0] * 3
    assert w("icepop", low=0.5, high=2.0) == [1.1052, 0.7408, 0.0]
    assert w("seq_mask", low=0.0, high=3.0) == [round(math.e, 4)] * 3
    assert w("geo_mask") == [0.0] * 3  # exp(1/3) = 1.3956 > 1.01


# --- knobs, metrics, errors ----------------------------------------------------------


def test_every_correction_is_registered_with_its_bounds():
    assert CORRECTIONS.names() == ["geo_mask", "icepop", "none", "seq_mask", "seq_tis",
                                   "token_mask", "token_tis"]
    assert CORRECTIONS.get("icepop").bounds == (0.5, 5.0)
    assert CORRECTIONS.get("geo_mask").bounds == (0.99, 1.01)


@pytest.mark.parametrize("knob, a, b", [
    ("correction_cap", 2.0, 1.5), ("correction_low", 0.6, 0.95),
    ("correction_high", 3.0, 1.5)])
def test_each_bound_acts(knob, a, b):
    name = "token_tis" if knob == "correction_cap" else "token_mask"
    assert ours(name, **{knob: a})[1] != ours(name, **{knob: b})[1]


def test_the_metrics_report_what_was_clipped_and_the_ratios_quantiles():
    _, m = correction_weights("icepop", OLD, ROLLOUT, MASK, cap=2.0)
    ratios = torch.exp(LR)[MASK]
    out = ((ratios < 0.5) | (ratios > 5.0)).float().mean()
    assert m["correction/clipped_frac"].item() == pytest.approx(float(out))
    assert m["correction/ratio_p50"].item() == pytest.approx(float(ratios.median()), rel=0.2)
    assert m["correction/ratio_p10"] <= m["correction/ratio_p50"] <= m["correction/ratio_p90"]


@pytest.mark.parametrize("overrides, match", [
    ({"rollout_correction": "icepopp"}, "did you mean 'icepop'"),
    ({"rollout_correction": "icepop", "correction_low": 6.0}, r"\[6.0, 5.0\]"),
    ({"rollout_correction": "token_mask", "correction_low": 2.0, "correction_high": 1.0},
     "correction_low=2.0 must be below"),
    ({"correction_cap": -1.0}, "correction_cap must be > 0"),
    ({"tis_cap": 2.0, "rollout_correction": "icepop"}, "keep one"),
])
def test_bad_corrections_are_one_clear_error(overrides, match):
    from hybrid_engine.algorithms.algorithm import Algorithm

    with pytest.raises(ValueError, match=match):
        Algorithm(AlgorithmConfig(**overrides), num_samples=2, max_tokens=8)


def test_the_old_tis_cap_key_is_token_tis():
    from hybrid_engine.config import RunConfig, apply_overrides

    cfg = apply_overrides(RunConfig(), {"algorithm.tis_cap": 1.5})
    a = cfg.algorithm
    assert (a.rollout_correction, a.correction_cap, a.tis_cap) == ("token_tis", 1.5, None)
