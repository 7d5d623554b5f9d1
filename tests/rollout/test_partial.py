"""Partial rollouts (rollout/partial.py) on real vLLM engines: parked sequences,
their continuation with new weights, per-token versions, staleness aging and
the pool's checkpoint."""

from __future__ import annotations

import json

import pytest

from hybrid_engine.testing import run_ranks

PROMPTS = [[11, 12, 13, 14 + i] for i in range(6)]
# 60 of the tiny model's 1000 ids end a completion: lengths are geometric (mean ~16), so a
# few sequences in a batch run far longer than the rest -- the long tail partial rollouts park.
STOP_IDS = tuple(range(200, 260))
MAX_TOKENS = 40


def _cfg():
    from hybrid_engine.config import RolloutConfig

    return RolloutConfig(num_samples_per_prompt=2, max_tokens=MAX_TOKENS, max_model_len=96,
                         enforce_eager=True, seed=5, stop_token_ids=STOP_IDS)


def _ahead(**kw):
    from hybrid_engine.config import AsyncConfig

    return AsyncConfig(max_staleness=1, partial=True, step_token_budget=60, **kw)


def _score(rollout, seq: list[int]) -> list[float]:
    """The engine's log-prob of every token of seq after the first (a prefill)."""
    from vllm import SamplingParams, TokensPrompt

    out = rollout.llm.generate([TokensPrompt(prompt_token_ids=seq)],
                               SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [lp[t].logprob for t, lp in zip(seq[1:], out[0].prompt_logprobs[1:], strict=True)]


def _parked_then_continued(model_dir: str, other_dir: str) -> dict:
    from safetensors.torch import load_file

    from hybrid_engine.rollout.engine import VLLMRollout
    from hybrid_engine.config import MemoryConfig
    from hybrid_engine.rollout.partial import PartialRollouts

    rollout = VLLMRollout(model_dir, _cfg(), memory=MemoryConfig(kv_cache_gib=0.05),
                          dtype="float32")
    pool = PartialRollouts(rollout.cfg, _ahead())
    first = pool.collect(rollout, PROMPTS[:3], num_samples=2, seed=1, version=0)
    parked = {(tuple(g.prompt_ids), s.seed): (list(s.tokens), list(s.logp))
              for g in pool.pool for s in g.samples if s.tokens and not s.finished}
    old_scores = {key: _score(rollout, list(key[0]) + toks) for key, (toks, _) in parked.items()}
    saved = json.loads(json.dumps(pool.state_dict()))
    m0 = pool.metrics()
    # New weights: another random model (the "sync" of a trained step).
    rollout.load_full_weights(load_file(f"{other_dir}/model.safetensors").items())
    second = pool.collect(rollout, PROMPTS[3:], num_samples=2, seed=2, version=1)
    continued = []
    for t in second:
        v = t.token_versions
        if 0 in v and 1 in v:
            n0 = v.count(0)
            key = next(k for k in parked if list(k[0]) == t.prompt_ids
                       and parked[k][0] == t.response_ids[:n0])
            new_scores = _score(rollout, t.prompt_ids + t.response_ids)[len(t.prompt_ids) - 1:]
            continued.append({
                "versions": v, "policy_version": t.policy_version,
                "prefix_equal": (t.response_ids[:n0], list(t.rollout_logp[:n0])) == parked[key],
                "prefix_vs_old": max(abs(a - b) for a, b in zip(parked[key][1], old_scores[key][len(key[0]) - 1:])),
                "cont_vs_new": max(abs(a - b) for a, b in zip(t.rollout_logp[n0:], new_scores[n0:])),
                "prefix_vs_new": max(abs(a - b) for a, b in zip(t.rollout_logp[:n0], new_scores[:n0])),
            })
    reloaded = PartialRollouts(rollout.cfg, _ahead())
    reloaded.load_state_dict(saved)
    out = {
        "first_groups": len(first) // 2, "second_groups": len(second) // 2,
        "first_versions": sorted({x for t in first for x in t.token_versions}),
        "parked": len(parked), "continued": continued, "metrics0": m0,
        "metrics1": pool.metrics(), "reload_equal": reloaded.state_dict() == saved,
        "group_ids": [t.group_id for t in second],
    }
    rollout.shutdown()
    return out


@pytest.mark.vllm
@pytest.mark.slow
def test_parked_sequences_continue_with_the_new_weights(two_models):
    out = run_ranks(_parked_then_continued, 1, *two_models, timeout=300)[0]
    # Step 0 stopped on its token budget with sequences unfinished: parked with their tokens.
    assert out["parked"] >= 1 and out["first_groups"] >= 1
    assert out["first_versions"] == [0]
    assert out["metrics0"]["partial/parked_groups"] >= 1
    assert out["metrics0"]["partial/parked_tokens"] >= out["parked"]
    # Step 1 finished them: prefix sampled by version 0 (kept exactly), continuation by 1.
    assert out["continued"], out
    for c in out["continued"]:
        assert c["versions"] == sorted(c["versions"]) and c["policy_version"] == 0
        assert c["prefix_equal"]
        assert c["prefix_vs_old"] < 1e-3, c   # prefix log-probs: the old weights' engine
        assert c["cont_vs_new"] < 1e-3, c     # continuation: the new weights' engine
        assert c["prefix_vs_new"] > 1e-2, c   # (the two models do differ on the prefix)
    assert out["metrics1"]["partial/continued_samples"] >= len(out["continued"])
    assert out["group_ids"] == sorted(out["group_ids"]) and out["group_ids"][0] == 0
    assert out["reload_equal"]


# --- units (no engine) ------------------------------------------------------------------


def _pool(stale: str):
    from hybrid_engine.rollout.partial import PartialRollouts, _Group, _Sample

    pool = PartialRollouts(_cfg(), _ahead(stale_partial=stale))
    old = _Group([1, 2], [1, 2], [_Sample(7, [5, 6], [-0.1, -0.2], [0, 0]), _Sample(8, [9], [-1.0], [1],
                                                                                   finished=True)])
    fresh = _Group([3, 4], [3, 4], [_Sample(9, [5], [-0.3], [1]), _Sample(10)])
    pool.pool = [old, fresh]
    return pool


@pytest.mark.parametrize("stale", ["regenerate", "drop"])
def test_a_group_past_max_staleness_is_regenerated_or_dropped(stale):
    """At version 2 with max_staleness 1, a group holding a version-0 token cannot
    train (staleness 2): regenerate restarts all its samples from the prompt (new
    seeds, nothing kept), drop discards it; the version-1 group continues as it is."""
    pool = _pool(stale)
    pool._age_out(1)  # staleness 1 <= 1: both stay
    assert [len(g.samples[0].tokens) for g in pool.pool] == [2, 1]
    pool._age_out(2)
    if stale == "drop":
        assert [g.prompt_ids for g in pool.pool] == [[3, 4]]
        assert pool.metrics()["partial/dropped_groups"] == 1
    else:
        old = pool.pool[0]
        assert [(s.tokens, s.logp, s.versions, s.finished) for s in old.samples] == [([], [], [], False)] * 2
        assert [s.seed for s in old.samples] != [7, 8]
        assert pool.pool[1].samples[0].tokens == [5]
        assert pool.metrics()["partial/regenerated_groups"] == 1


def test_pool_state_round_trips_through_json():
    from hybrid_engine.rollout.partial import PartialRollouts

    pool = _pool("drop")
    state = json.loads(json.dumps(pool.state_dict()))
    other = PartialRollouts(pool.cfg, pool.ahead)
    other.load_state_dict(state)
    assert other.pool == pool.pool


def test_a_continued_sample_draws_from_a_seed_of_its_prefix_length():
    from hybrid_engine.rollout.partial import _Sample

    s = _Sample(123)
    assert s.request_seed() == 123
    s.tokens = [1, 2]
    first = s.request_seed()
    s.tokens = [1, 2, 3]
    assert first != s.request_seed() != 123 and 0 <= first < 2**31


@pytest.mark.parametrize("overrides, match", [
    ({"async_rollout.step_token_budget": 100}, "bounds partial rollouts"),
    ({"async_rollout.partial": True, "async_rollout.step_token_budget": 100}, "max_staleness >= 1"),
    ({"async_rollout.partial": True, "async_rollout.max_staleness": 1,
      "algorithm.behaviour_logp": "rollout"}, "step_token_budget > 0"),
    ({"async_rollout.partial": True, "async_rollout.max_staleness": 1, "placement": "separate",
      "async_rollout.step_token_budget": 100, "algorithm.behaviour_logp": "rollout"},
     "placement=colocated"),
])
def test_partial_rollout_settings_are_checked(overrides, match):
    from hybrid_engine.config import RunConfig, apply_overrides

    with pytest.raises(ValueError, match=match):
        apply_overrides(RunConfig(), overrides)


def test_a_multi_turn_env_that_cannot_save_its_episodes_is_refused():
    from hybrid_engine.envs.tool import CalcEnv
    from hybrid_engine.models.tokenizer import build_tokenizer
    from hybrid_engine.rollout.partial_turns import check_env

    env = CalcEnv(build_tokenizer())
    check_env(env)
    state = env.reset([1, 2])
    env.step(state, [3, 4])
    saved = json.loads(json.dumps(env.save_episode(state)))
    assert env.load_episode(saved) == state and env.load_episode(saved) is not state

    class Unsaved:
        def reset(self, prompt_ids): ...
        def step(self, state, segment): ...
        def build_trajectory(self, state, policy_logp=None, group_id=0): ...

    with pytest.raises(ValueError, match="save_episode.*Unsaved has none"):
        check_env(Unsaved())


def test_a_parked_episode_round_trips_through_json():
    from hybrid_engine.rollout.partial import PartialRollouts, _Group, _Sample
    from hybrid_engine.rollout.partial_turns import Turns

    pool = PartialRollouts(_cfg(), _ahead())
    pool.pool = [_Group([1, 2], [1, 2], [_Sample(7, [5, 6, 9], [-0.1, -0.2], [0, 0, 0], turns=Turns(
        11, 3, {"prompt_ids": [1, 2], "response_ids": [5, 6, 9]}, [True, False, True], 1, 1))])]
    other = PartialRollouts(pool.cfg, pool.ahead)
    other.load_state_dict(json.loads(json.dumps(pool.state_dict())))
    assert other.pool == pool.pool
    pool._age_out(5)  # too stale: the episode restarts from its prompt, with other seeds
    (s,) = pool.pool[0].samples
    assert (s.tokens, s.turns.episode, s.turns.mask, s.turns.key) == ([], None, [], 3)
    assert s.turns.call_seed != 11
