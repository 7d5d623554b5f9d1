"""The rollout loop: prompts in, unscored Trajectories out, single- or multi-turn.

Job: `collect(rollout, env, prompt_ids, num_samples=K, seed=s)` samples K
episodes per prompt and returns len(prompt_ids) * K `Trajectory`s,
prompt-major (index p * K + k), `group_id` = p, `rollout_logp` filled,
reward left to the caller (`env.score(trajs)`).

- Single-turn environment (no `step`): one `rollout.generate` call; each
  completion is one trajectory (all tokens in the loss).
- Multi-turn environment (`MultiTurnEnvironment`: `reset` / `step` /
  `build_trajectory`, e.g. `envs.agent.ChatEnv`): generation and environment
  steps alternate, on one of two schedules (rollout.schedule):
  'episode' (`agent_loop`, a rollout that drives its engine by hand: a
  `VLLMRollout` without in-flight updates, or separate placement's rollout
  ranks' view of it): each
  episode's next turn enters the engine as soon as the env has answered its
  last, while the others keep decoding; env steps of different episodes run
  at once in threads when the env allows it (`concurrent_steps`).
  'turn' (else): turn 0 is one `generate(prompts, num_samples=K, seed=s)`
  (so its draws are those of the single-turn call with the same seed and
  stop strings); each later turn t is one `generate` over the episodes still
  running, context = prompt + response so far (policy and env tokens), one
  sample each. Both give a turn the same vLLM seed (`episode_record.
  request_seed`: turn 0 by prompt and sample, turn t by turn_seed(s, t) and
  episode), so they sample the same tokens where vLLM's numerics do not
  depend on the batch. Every call stops at the environment's
  turn-ending strings (`env.turn_stop`, default `TOOL_CALL_STOP` =
  ("</calc>",)) plus rollout.stop, and the stop string's tokens stay in the
  segment handed to `env.step` (vLLM keeps them in token_ids; see
  `VLLMRollout._sample`). A segment's new-token limit is
  min(rollout.max_tokens, max_model_len - context length); an episode whose
  context fills max_model_len is ended by `env.step(state, [])` without
  another generation.

Multi-turn environment protocol (what `step` must do):

    state = env.reset(prompt_ids)                  # per episode
    env_ids, done = env.step(state, segment)       # after each generated segment
    traj = env.build_trajectory(state, policy_logp, group_id)
    data = env.save_episode(state)                 # optional: plain (JSON-able) data,
    state = env.load_episode(data)                 # for partial rollouts to park it

`step` records the policy's segment and returns the environment tokens to
append after it (maybe none) and whether the episode is over. A segment that
does not end in a turn-ending string (it hit EOS, or the token limit, or is
empty because the context is full) must end the episode. `build_trajectory`
returns prompt_ids = the episode's prompt and response_ids = every segment and
every env reply in order, loss_mask False exactly on env tokens, and
rollout_logp = policy_logp on policy tokens (0 on env tokens). The
environment must be deterministic: under the turn loop every rank runs it on
the same completions (per episode, each episode runs once, on its replica's
first rank).

Invariants: (1) collective: the turn loop makes the same sequence of
`generate` calls with the same arguments on every rank (each rank gets all
completions, the env is deterministic); the per-episode loop keeps each TP
group in lockstep and gathers the trajectories once (`agent_loop`); either
way every rank returns the same list. (2) The loop
checks every multi-turn trajectory against the tokens it actually generated
from: prompt_ids + response_ids is the final context, loss_mask is True
exactly on the tokens the policy sampled, and rollout_logp on them is what
vLLM reported; a disagreeing environment is a RuntimeError, never a silently
misaligned loss. (3) Generation never exceeds max_model_len: a trajectory is
at most max_model_len tokens plus the environment's last reply (which the
policy never conditions on). (4) The loop ends: each generation adds >= 1
token to a context bounded by max_model_len.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from hybrid_engine.rollout.agent_loop import ScheduleStats, collect_per_episode
from hybrid_engine.rollout.episode_record import (
    EpisodeRecord, advance_all, end_when_full, finish, turn_seed,
)
from hybrid_engine.rollout.prompt_limit import PromptTooLong
from hybrid_engine.trajectory import Trajectory

if TYPE_CHECKING:
    from hybrid_engine.config import RolloutConfig
    from hybrid_engine.rollout.engine import Completions

__all__ = ["TOOL_CALL_STOP", "MultiTurnEnvironment", "collect", "is_multi_turn", "per_episode",
           "turn_seed", "turn_stops"]

TOOL_CALL_STOP: tuple[str, ...] = ("</calc>",)
"""Turn-ending strings of an environment without a `turn_stop` attribute
(the calculator environment's closing tag, `envs.tool.CALC_STOP`)."""


@runtime_checkable
class MultiTurnEnvironment(Protocol):
    """An environment that answers between generation segments (see the module
    docstring for the protocol). May also define `turn_stop: Sequence[str]`,
    the strings that end a segment to be answered (default TOOL_CALL_STOP)."""

    def reset(self, prompt_ids: Sequence[int]) -> Any:
        """A fresh episode state for one prompt."""
        ...

    def step(self, state: Any, new_policy_tokens: Sequence[int]) -> tuple[list[int], bool]:
        """Records a segment; returns (env token ids to append, episode done)."""
        ...

    def build_trajectory(
        self, state: Any, policy_logp: Sequence[float] | None = None, group_id: int = 0
    ) -> Trajectory:
        """The finished episode as a Trajectory (env tokens with loss_mask False)."""
        ...


def is_multi_turn(env: Any) -> bool:
    """Whether env answers between segments (`MultiTurnEnvironment`'s methods).
    Checked by attribute, not `isinstance`: from Python 3.12 a runtime
    Protocol check ignores `__getattr__`, so an environment behind a
    forwarding wrapper would pass for single-turn."""
    return all(callable(getattr(env, m, None)) for m in ("reset", "step", "build_trajectory"))


class _Rollout(Protocol):
    """What the loop needs of a rollout (`rollout.engine.VLLMRollout`)."""

    cfg: RolloutConfig

    def generate(
        self, prompts: Sequence[Sequence[int]], *, num_samples: int | None = None, seed: int = 0,
        stop: Sequence[str] | None = None, include_stop_str: bool = False,
        max_tokens: int | Sequence[int] | None = None, keys: Sequence[int] | None = None,
    ) -> Completions: ...


def collect(
    rollout: _Rollout, env: Any, prompt_ids: list[list[int]], *, num_samples: int, seed: int,
    stop: Sequence[str] | None = None, stats: ScheduleStats | None = None,
) -> list[Trajectory]:
    """Samples num_samples episodes per prompt; collective over the world.

    Args:
        rollout: a `VLLMRollout` (or anything with its `cfg` and `generate`).
        env: a `MultiTurnEnvironment`, or a single-turn environment (no `step`).
        prompt_ids: the prompts' token ids (the same on every rank).
        num_samples: K episodes per prompt (>= 1).
        seed: sampling seed of this call; the same seed gives the same
            trajectories (per-turn seeds from `turn_seed`; per episode, the
            log-probs to float noise: the batches depend on tool timing).
        stop: multi-turn only: turn-ending strings replacing env.turn_stop /
            TOOL_CALL_STOP (rollout.stop is always added).
        stats: multi-turn only: filled in with where the call's time went
            (`agent_loop.ScheduleStats`: the engine's idle share).

    Returns:
        len(prompt_ids) * K trajectories, prompt-major, group_id = prompt
        index, reward not computed. info["num_segments"] = generated segments
        (1 for single-turn); info["num_turns"] = env turns (tool calls; set by
        the env, 0 when it does not); info["context_full"] = the episode ended
        because max_model_len left no room; info["source_prompt_ids"] = the
        whole prompt, on trajectories whose prompt_ids the rollout truncated
        (rollout.prompt_too_long='truncate'), for scoring.

    Raises:
        ValueError: num_samples < 1.
        PromptTooLong: a prompt with no room for its completion (rollout.prompt_too_long=
            reject), named by where env got it when env has `prompt_origin(ids)`.
        RuntimeError: a multi-turn env broke the protocol (see the module docstring).
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if not prompt_ids:
        return []
    if is_multi_turn(env):
        trajs = _multi_turn(rollout, env, prompt_ids, num_samples, seed, stop,
                            stats if stats is not None else ScheduleStats())
    else:
        out = _first_turn(rollout, env, prompt_ids, num_samples=num_samples, seed=seed)
        trajs = [
            Trajectory(
                prompt_ids=list(out.prompt_ids[i // num_samples]), response_ids=list(tokens),
                rollout_logp=list(logp), group_id=i // num_samples,
                info={"num_turns": 0, "num_segments": 1, "context_full": False},
            )
            for i, (tokens, logp) in enumerate(zip(out.token_ids, out.logprobs, strict=True))
        ]
        if getattr(out, "installs", None) is not None:  # in-flight weight updates
            for t, installs in zip(trajs, out.installs, strict=True):
                t.info["installs"] = list(installs)
    for t in trajs:  # truncated to fit max_model_len: the reward still needs the whole prompt
        if len(t.prompt_ids) < len(prompt_ids[t.group_id]):
            t.info["source_prompt_ids"] = list(prompt_ids[t.group_id])
    return trajs


def _multi_turn(rollout: _Rollout, env: Any, prompt_ids: list[list[int]], k: int, seed: int,
                stop: Sequence[str] | None, stats: ScheduleStats) -> list[Trajectory]:
    """The per-episode loop or the turn loop (`per_episode`), stopping at the env's
    turn-ending strings (or stop) and rollout.stop."""
    stops = turn_stops(rollout.cfg, env, stop)
    if per_episode(rollout):
        return _named(env, prompt_ids, lambda: collect_per_episode(
            rollout, env, prompt_ids, k, seed, stops, stats))
    return _collect_multi_turn(rollout, env, prompt_ids, k, seed, stops, stats)


def turn_stops(cfg: RolloutConfig, env: Any, stop: Sequence[str] | None = None) -> list[str]:
    """The strings that end a multi-turn segment: stop, else env.turn_stop
    (default TOOL_CALL_STOP), then rollout.stop; ordered, no duplicates."""
    turn_stop = stop if stop is not None else getattr(env, "turn_stop", TOOL_CALL_STOP)
    return list(dict.fromkeys([*cfg.stop, *turn_stop]))


def per_episode(rollout: Any) -> bool:
    """Whether multi-turn episodes run per episode (`agent_loop`): rollout.schedule
    is 'episode' and the rollout drives its engine by hand (a `VLLMRollout`
    without an in-flight install hook)."""
    return (rollout.cfg.schedule == "episode" and callable(getattr(rollout, "open_run", None))
            and getattr(rollout, "between_steps", None) is None)


def _first_turn(rollout: _Rollout, env: Any, prompt_ids: list[list[int]],
                **kwargs: Any) -> Completions:
    """rollout.generate(prompt_ids, **kwargs), a too-long prompt named (`_named`)."""
    return _named(env, prompt_ids, lambda: rollout.generate(prompt_ids, **kwargs))


def _named(env: Any, prompt_ids: list[list[int]], sample: Callable[[], Any]) -> Any:
    """sample(); a prompt too long for it is named by where env got it
    (`prompt_origin`: a dataset's file and row), when env knows."""
    try:
        return sample()
    except PromptTooLong as e:
        origin = getattr(env, "prompt_origin", None)  # environments on a ProblemBank
        where = origin(prompt_ids[e.index]) if origin is not None else None
        if where is None:
            raise
        raise PromptTooLong(e.index, e.detail, where) from None


def _collect_multi_turn(
    rollout: _Rollout, env: MultiTurnEnvironment, prompt_ids: list[list[int]], k: int, seed: int,
    stops: Sequence[str], stats: ScheduleStats,
) -> list[Trajectory]:
    """The turn loop: one generate per turn over the episodes still running
    (stats: wall time, and time outside generate as the engine's idle time)."""
    cfg, start = rollout.cfg, time.perf_counter()
    first = _first_turn(rollout, env, prompt_ids, num_samples=k, seed=turn_seed(seed, 0),
                        stop=stops, include_stop_str=True)
    stats.engine_s = time.perf_counter() - start
    episodes = []
    for i in range(len(prompt_ids) * k):
        prompt = list(first.prompt_ids[i // k])  # as generated from (after any truncation)
        episodes.append(EpisodeRecord(state=env.reset(prompt), group_id=i // k,
                                      context=list(prompt), prompt_len=len(prompt)))
    active, segments, logps = list(range(len(episodes))), first.token_ids, first.logprobs
    turn = 0
    while active:
        running = advance_all(env, [(episodes[e], list(s), list(lp))
                                    for e, s, lp in zip(active, segments, logps, strict=True)])
        turn += 1
        still = [e for e, more in zip(active, running, strict=True) if more]
        active, budgets = [], []
        for e in still:
            room = cfg.max_model_len - len(episodes[e].context)
            if room >= 1:
                active.append(e)
                budgets.append(min(cfg.max_tokens, room))
            else:
                end_when_full(env, episodes[e])
        if not active:
            break
        t = time.perf_counter()
        out = rollout.generate([episodes[e].context for e in active], num_samples=1,
                               seed=turn_seed(seed, turn), stop=stops, include_stop_str=True,
                               max_tokens=budgets, keys=active)
        stats.engine_s += time.perf_counter() - t
        segments, logps = out.token_ids, out.logprobs
    stats.wall_s = time.perf_counter() - start
    stats.idle_s = stats.wall_s - stats.engine_s
    return [finish(env, ep) for ep in episodes]
