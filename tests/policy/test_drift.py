"""The colocated drift scorer's sample (`mismatch_split_sequences`): which
sequences the engine re-scores, and what the others carry. The engine here
is a recorder of the score call (the real prefill runs in tests/policy/
test_async.py's colocated k = 1 job)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from hybrid_engine.policy.colocated import DriftScorer
from hybrid_engine.trajectory import Trajectory


class _Engine:
    def __init__(self) -> None:
        self.calls: list[tuple[list[list[int]], list[int]]] = []

    def score(self, seqs, prompt_lens):  # noqa: ANN001, ANN201
        self.calls.append((seqs, prompt_lens))
        # -0.1 x the token id; the last token unscorable (NaN), as at max_model_len
        return [[-0.1 * tok for tok in s[p:-1]] + [math.nan] for s, p in zip(seqs, prompt_lens)]


def _actor(engine: _Engine, fresh: list[Trajectory] = ()) -> SimpleNamespace:
    noop = lambda: None  # noqa: E731
    return SimpleNamespace(rollout=engine, phases=SimpleNamespace(to_rollout=noop, check_rollout=noop),
                           fresh={id(t): t for t in fresh})


def _trajs(n: int) -> list[Trajectory]:
    return [Trajectory(prompt_ids=[1, 2], response_ids=[10 + i, 20 + i, 30 + i],
                       rollout_logp=[-7.0, -8.0, -9.0], group_id=i // 4) for i in range(n)]


@pytest.mark.parametrize("sequences, picked", [(4, [0, 4, 8, 12]), (3, [0, 5, 10]),
                                               (16, list(range(16))), (40, list(range(16)))])
def test_the_scorer_rescores_an_evenly_spaced_sample(sequences, picked) -> None:
    engine, trajs = _Engine(), _trajs(16)
    DriftScorer(_actor(engine), sequences).score(trajs)
    ((seqs, plens),) = engine.calls  # one prefill, of the sample only
    assert seqs == [[1, 2] + trajs[i].response_ids for i in picked] and plens == [2] * len(picked)
    for i, t in enumerate(trajs):
        if i in picked:  # the engine's log-probs; its unscorable last token stays NaN
            assert t.engine_logp[:2] == pytest.approx([-0.1 * (10 + i), -0.1 * (20 + i)])
            assert math.isnan(t.engine_logp[2])
        else:
            assert len(t.engine_logp) == 3 and all(math.isnan(x) for x in t.engine_logp)


def test_fresh_trajectories_join_the_split_with_their_sampling_logprobs() -> None:
    """Sampled by the engine's current weights (no sync since): no prefill for them;
    the stale ones' sample is spaced over the stale ones only."""
    engine, trajs = _Engine(), _trajs(16)
    fresh = trajs[:8]
    DriftScorer(_actor(engine, fresh), 4).score(trajs)
    ((seqs, _),) = engine.calls
    assert seqs == [[1, 2] + trajs[i].response_ids for i in (8, 10, 12, 14)]
    assert all(t.engine_logp == [-7.0, -8.0, -9.0] for t in fresh)
    assert all(math.isnan(trajs[i].engine_logp[0]) for i in (9, 11, 13, 15))
    # an equal but distinct object is not fresh (identity, not id reuse or equality)
    engine, copies = _Engine(), _trajs(2)
    DriftScorer(_actor(engine, _trajs(2)), 4).score(copies)
    assert len(engine.calls[0][0]) == 2
    # all fresh: no prefill at all
    engine, trajs = _Engine(), _trajs(4)
    DriftScorer(_actor(engine, trajs), 4).score(trajs)
    assert engine.calls == [] and all(t.engine_logp == t.rollout_logp for t in trajs)
    # the trainer stepped since (weights stale, no sync yet): nothing is fresh
    engine, trajs = _Engine(), _trajs(4)
    actor = _actor(engine, trajs)
    actor.phases.trainer_changed = True
    DriftScorer(actor, 4).score(trajs)
    assert len(engine.calls[0][0]) == 4


def test_the_scorer_needs_a_sample() -> None:
    with pytest.raises(ValueError, match="sequences >= 1"):
        DriftScorer(_actor(_Engine()), 0)


@pytest.mark.parametrize("overrides, scores", [
    ({"async_rollout.max_staleness": 1, "algorithm.behaviour_logp": "rollout"}, 32),
    ({"async_rollout.max_staleness": 1, "algorithm.behaviour_logp": "rollout",
      "guards.mismatch_split_sequences": 5}, 5),
    ({"async_rollout.max_staleness": 1, "algorithm.behaviour_logp": "rollout",
      "guards.mismatch_split_sequences": 0}, None),  # 0 = no split
    # truncated sampling: its (processed) log-probs are not the prompt log-probs
    ({"async_rollout.max_staleness": 1, "algorithm.behaviour_logp": "rollout",
      "rollout.top_k": 3}, None),
    ({"async_rollout.max_staleness": 1, "algorithm.behaviour_logp": "rollout",
      "rollout.top_p": 0.5}, None),
    ({"async_rollout.max_staleness": 1, "algorithm.behaviour_logp": "rollout",
      "rollout.temperature": 0.7}, None),
    ({}, None),  # synchronous: nothing is stale
])
def test_the_actor_builds_the_scorer_from_the_config(overrides, scores) -> None:
    from hybrid_engine.config import RunConfig
    from hybrid_engine.config.overrides import apply_overrides
    from hybrid_engine.policy.colocated import HybridActor

    holder = SimpleNamespace(cfg=apply_overrides(RunConfig(), overrides))
    scorer = HybridActor.drift_scorer(holder)
    assert (scorer and scorer.sequences) == scores


def test_only_trajectories_wholly_of_the_current_weights_count_as_fresh() -> None:
    """Partial rollouts: a continued sample (a parked prefix of version 2) or a parked
    finished group of version 2 is stale at version 3; plain collect: all fresh."""
    from hybrid_engine.policy.colocated import HybridActor

    holder = SimpleNamespace(fresh={})
    trajs = _trajs(3)
    for t, versions in zip(trajs, ([3, 3, 3], [2, 3, 3], [2, 2, 2]), strict=True):
        t.token_versions = versions
    assert HybridActor._sampled_now(holder, trajs, 3) is trajs
    assert list(holder.fresh.values()) == [trajs[0]]
    plain = _trajs(2)
    HybridActor._sampled_now(holder, plain, None)
    assert [t for t in holder.fresh.values()] == [trajs[0], *plain]
