"""RL algorithms as pure tensor functions: advantages, KL, losses, aggregation.

Job: everything the `algorithm` role computes, and nothing else: no model
code, no torch.distributed, no knowledge of the task or of the layout. Each
component is looked up by the name the config holds, in a registry whose
errors suggest the closest name:

    get_advantage(cfg.advantage)         grpo, drgrpo, rloo, reinforce_pp, gae
    get_policy_loss(name)                ppo (clip-higher, dual-clip), gspo
    get_kl_estimator(cfg.kl_estimator)   k1, k2, k3
    CORRECTIONS.get(cfg.rollout_correction)  token_tis, seq_tis, token_mask, seq_mask,
                                         icepop, geo_mask (`correction`)
    aggregate_loss(..., cfg.loss_agg)    token_mean, seq_mean_token_sum,
                                         seq_mean_token_mean, constant

The trainer calls one closure per micro-batch, `policy_loss_fn(cfg)`, with the
whole batch's `loss_normalizer` (contract in `losses`). DAPO's data-side
extras (dynamic sampling, overlong shaping) are in `dapo`.

Invariant: the functions are deterministic and stateless; masked positions
never contribute and never produce NaN; the micro-batch losses computed with
the whole batch's normaliser sum to the full-batch loss.
"""

from hybrid_engine.algorithms.advantages import (
    ADVANTAGES,
    AdvantageEstimator,
    broadcast_to_tokens,
    drgrpo,
    gae,
    get_advantage,
    grpo,
    register_advantage,
    reinforce_pp,
    rloo,
    token_level_rewards,
)
from hybrid_engine.algorithms.aggregation import (
    LOSS_AGG_MODES,
    aggregate_loss,
    check_loss_agg,
    loss_normalizer,
    masked_mean,
)
from hybrid_engine.algorithms.dapo import filter_degenerate_groups, overlong_penalty
from hybrid_engine.algorithms.kl import (
    KL_ESTIMATORS,
    get_kl_estimator,
    kl_divergence,
    kl_in_reward,
    register_kl_estimator,
)
from hybrid_engine.algorithms.losses import (
    POLICY_LOSSES,
    LossFn,
    LossInputs,
    combine_metrics,
    get_policy_loss,
    gspo,
    policy_loss_fn,
    ppo,
    register_policy_loss,
)
from hybrid_engine.algorithms.value_loss import value_loss

__all__ = [
    "ADVANTAGES",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdvantageEstimator",
    "LossFn",
    "LossInputs",
    "aggregate_loss",
    "broadcast_to_tokens",
    "check_loss_agg",
    "combine_metrics",
    "drgrpo",
    "filter_degenerate_groups",
    "gae",
    "get_advantage",
    "get_kl_estimator",
    "get_policy_loss",
    "grpo",
    "gspo",
    "kl_divergence",
    "kl_in_reward",
    "loss_normalizer",
    "masked_mean",
    "overlong_penalty",
    "policy_loss_fn",
    "ppo",
    "register_advantage",
    "register_kl_estimator",
    "register_policy_loss",
    "reinforce_pp",
    "rloo",
    "token_level_rewards",
    "value_loss",
]
