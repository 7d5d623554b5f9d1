"""Partial rollouts of multi-turn episodes: a step stops early, episodes park mid-turn.

Job: `sample_turns(rollout, env, groups, want=, budget=, version=)` advances
the unfinished episodes of `groups` (one replica's slice of
`rollout.partial.PartialRollouts`' pool) through one run of vLLM's engine
loop (`VLLMRollout.open_run`): when an episode's segment ends (at the
environment's turn-ending strings, EOS or its token limit), the environment
answers it right after that engine step, together with the other segments
that ended in it (in threads when it allows), and the episode's next turn
enters the engine before the next step. The engine waits for those answers:
every decision then depends on the sampled tokens only, so the ranks of a
tensor-parallel group (each runs the environment, as the turn loop does)
stay in lockstep and a resumed run repeats a straight one. The call stops
when `want` groups are done, or once `budget` tokens are sampled with one
group done: the requests still in the engine are aborted and their episodes
park where they stand, in the middle of a segment (or between turns when one
was just answered). A parked segment continues next step, after the sync, as
a new request (context so far, what is left of the segment's token limit);
the environment sees the whole segment once it ends.

An episode's own part (`Turns`) is plain data: the environment's episode state
as `env.save_episode(state)` gives it (loaded again with `env.load_episode`
around every step), the loss mask, the segment in progress, the seeds. So the
pool is checkpointed as it stands and a loaded pool continues exactly.

Seeds: as the turn loop's (`episode_record.request_seed`: turn 0 by prompt and
sample, turn t by the call's seed, t and the episode's index in its call); a
parked segment's continuation draws from (its turn's seed, tokens so far). So
when nothing parks, a replica samples the tokens `episodes.collect` samples
with the same seed wherever vLLM's numerics do not depend on the batch
(log-probs to float noise, as `agent_loop`'s).

Invariant: every episode is advanced by its own replica only; the caller
gathers the slice's samples (`PartialRollouts`), so every rank holds the same
pool after every call. Versions are per response token: an observation
carries the version of the call that appended it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybrid_engine.rollout.episode_record import EpisodeRecord, each_step, finish, request_seed
from hybrid_engine.rollout.episodes import turn_stops
from hybrid_engine.trajectory import Trajectory

if TYPE_CHECKING:
    from hybrid_engine.rollout.engine import VLLMRollout

__all__ = ["Turns", "check_env", "sample_turns", "trajectory"]

_SEED_MASK = 0x7FFFFFFF


@dataclass(slots=True)
class Turns:
    """A multi-turn episode's own part of a pool sample (JSON-able)."""

    call_seed: int  # the seed of the collect call that started it
    key: int  # its index among that call's episodes (its later turns' seed key)
    episode: Any = None  # env.save_episode(state); None: not reset yet
    mask: list[bool] = field(default_factory=list)  # per response token: sampled
    segment: int = 0  # tokens of the segment in progress sampled so far
    num_segments: int = 0
    context_full: bool = False

    def restarted(self, salt: int) -> Turns:
        """A fresh episode in its place, drawing other seeds (a regenerated group)."""
        return Turns(hash((self.call_seed, salt)) & _SEED_MASK, self.key)


def check_env(env: Any) -> None:
    """Refuses a multi-turn env whose episodes cannot be parked (checkpointed).

    Raises:
        ValueError: env lacks save_episode / load_episode.
    """
    if not all(callable(getattr(env, m, None)) for m in ("save_episode", "load_episode")):
        raise ValueError(
            f"async_rollout.partial with a multi-turn environment needs its save_episode(state) "
            f"and load_episode(data) methods (parked episodes are checkpointed as plain data); "
            f"{type(env).__name__} has none")


def sample_turns(rollout: VLLMRollout, env: Any, groups: Sequence[Any], *, want: int,
                 budget: int, version: int) -> Counter[str]:
    """Advances groups' unfinished episodes in place (see the module docstring);
    returns the call's counts (sampled_tokens, continued_samples)."""
    live = [(g, s) for g in groups for s in g.samples if not s.finished]
    for g, s in live:
        if s.turns.episode is None:
            s.turns.episode = env.save_episode(env.reset(g.prompt_ids))
    before = {id(s): len(s.tokens) for _, s in live}
    counts: Counter[str] = Counter()
    if live and sum(g.done() for g in groups) < want:
        run = rollout.open_run("partial")
        in_engine: dict[int, tuple[Any, Any]] = {}
        try:
            _admit(rollout, env, run, in_engine, live, version)
            _loop(rollout, env, run, in_engine, groups, want, budget, version, counts)
        finally:
            run.abort_unfinished()  # what is still in the engine parks mid-segment
        for i, (_, s) in in_engine.items():
            _extend(s, run.tokens[i], run.logps[i], version)
    counts["continued_samples"] = sum(1 for _, s in live if 0 < before[id(s)] < len(s.tokens))
    return counts


def _loop(rollout: VLLMRollout, env: Any, run: Any, in_engine: dict[int, tuple[Any, Any]],
          groups: Sequence[Any], want: int, budget: int, version: int,
          counts: Counter[str]) -> None:
    """Engine steps until every episode is done, `want` groups are, or `budget`
    tokens are sampled with one group done; each segment that ends is answered
    by the env (with the others of its engine step) and the episode's next turn
    added before the next engine step."""
    while in_engine:
        advanced = run.step()
        counts["sampled_tokens"] += sum(n for _, n in advanced)
        ended = [i for i, _ in advanced if run.finished[i]]
        items = [in_engine.pop(i) for i in ended]
        for i, (_, s) in zip(ended, items, strict=True):
            if any(math.isnan(x) for x in run.logps[i]):
                raise RuntimeError("sampled tokens have NaN log-probs: vLLM's weights are "
                                   "not valid")
            _extend(s, run.tokens[i], run.logps[i], version)
        _step_all(env, [(g, s, False) for g, s in items], version)
        _admit(rollout, env, run, in_engine, [(g, s) for g, s in items if not s.finished],
               version)
        done = sum(g.done() for g in groups)
        if done >= want or (counts["sampled_tokens"] >= budget and done >= 1):
            return


def _admit(rollout: VLLMRollout, env: Any, run: Any, in_engine: dict[int, tuple[Any, Any]],
           items: list[tuple[Any, Any]], version: int) -> None:
    """Adds each episode's next request (its next turn, or the rest of its parked
    segment); an episode with no room left in its context is ended instead."""
    from vllm import TokensPrompt

    cfg = rollout.cfg
    full = [(g, s) for g, s in items if s.turns.segment == 0
            and cfg.max_model_len - len(g.prompt_ids) - len(s.tokens) < 1]
    _step_all(env, [(g, s, True) for g, s in full], version)
    todo = [(g, s) for g, s in items if not s.finished]
    stops = turn_stops(cfg, env)
    params = [rollout.sampling_params(_limit(cfg, g, s), _seed(cfg.seed, s), stop=stops,
                                      include_stop_str=True) for g, s in todo]
    added = run.add([TokensPrompt(prompt_token_ids=g.prompt_ids + s.tokens) for g, s in todo],
                    params)
    in_engine.update(zip(added, todo, strict=True))


def _extend(s: Any, tokens: list[int], logps: list[float], version: int) -> None:
    """Appends sampled tokens to an episode's segment in progress."""
    s.tokens += tokens
    s.logp += logps
    s.versions += [version] * len(tokens)
    s.turns.mask += [True] * len(tokens)
    s.turns.segment += len(tokens)


def _limit(cfg: Any, group: Any, s: Any) -> int:
    """What is left of the segment's token limit: min(max_tokens, room in the
    context) at the segment's start, less what was sampled of it already."""
    return min(cfg.max_tokens - s.turns.segment,
               cfg.max_model_len - len(group.prompt_ids) - len(s.tokens))


def _seed(engine_seed: int, s: Any) -> int:
    """The next request's seed: its turn's, or, continuing a parked segment, one of
    (the turn's, tokens sampled of it)."""
    t = s.turns
    turn = s.seed if t.num_segments == 0 else request_seed(engine_seed, t.call_seed,
                                                          t.num_segments, t.key)
    return turn if t.segment == 0 else hash((turn, t.segment)) & _SEED_MASK


def _step_all(env: Any, items: list[tuple[Any, Any, bool]], version: int) -> None:
    """`_step` on each (group, sample, full), in threads when the env allows it."""
    each_step(env, lambda *item: _step(env, *item, version), items)


def _step(env: Any, group: Any, s: Any, full: bool, version: int) -> None:
    """The env's answer to the segment that just ended (full: none, the context
    has no room for another: env.step on an empty segment must end it)."""
    t = s.turns
    segment = [] if full else s.tokens[len(s.tokens) - t.segment:]
    state = env.load_episode(t.episode)
    env_ids, done = env.step(state, segment)
    if full and not done:
        raise RuntimeError(f"{type(env).__name__}.step() did not end an episode on an empty "
                           f"segment (its context already fills max_model_len)")
    t.episode = env.save_episode(state)
    s.tokens += list(env_ids)
    s.versions += [version] * len(env_ids)
    t.mask += [False] * len(env_ids)
    t.num_segments += bool(segment)
    t.segment, t.context_full = 0, t.context_full or full
    s.finished = bool(done)


def trajectory(env: Any, group: Any, s: Any, group_id: int) -> Trajectory:
    """A finished episode's trajectory, checked against what was sampled (`finish`)."""
    t = s.turns
    record = EpisodeRecord(state=env.load_episode(t.episode), group_id=group_id,
                           context=group.prompt_ids + s.tokens, prompt_len=len(group.prompt_ids),
                           policy_mask=list(t.mask), policy_logp=list(s.logp),
                           num_segments=t.num_segments, context_full=t.context_full)
    return finish(env, record)
