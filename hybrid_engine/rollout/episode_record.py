"""One multi-turn episode as the rollout loops record it, and the checks at its end.

Job: `EpisodeRecord` is what a loop (`episodes`' turn loop, `agent_loop`'s
per-episode loop) keeps of an episode besides the environment's own state:
the context it generates from, which response tokens the policy sampled and
their log-probs. `advance` feeds a segment to the environment and extends the
record; `finish` builds the environment's trajectory and checks it against
the record. `turn_seed` / `request_seed` give each turn's draws, the same
whichever loop runs it.

Invariant: prompt_ids + response_ids of a finished trajectory is the record's
context, loss_mask is True exactly on sampled tokens and rollout_logp on them
is what vLLM reported; anything else is a RuntimeError.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hybrid_engine.trajectory import Trajectory

__all__ = ["MAX_STEP_THREADS", "EpisodeRecord", "advance", "advance_all", "each_step",
           "end_when_full", "finish", "record", "request_seed", "turn_seed"]

T = TypeVar("T")

_SEED_MASK = 0x7FFFFFFF
MAX_STEP_THREADS = 64
"""Most env steps a loop runs at once (threads: they mostly wait for tools)."""


def turn_seed(seed: int, turn: int) -> int:
    """Seed of generation turn `turn` of `collect(..., seed=seed)`: seed itself
    for turn 0, a stable 31-bit hash of (seed, turn) after (same on every rank
    and every run, unlike Python's salted str hash)."""
    if turn == 0:
        return seed
    digest = hashlib.blake2b(f"episodes:{seed}:{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


def request_seed(engine_seed: int, seed: int, turn: int, key: int, sample: int = 0) -> int:
    """vLLM's seed for turn `turn` of an episode (`VLLMRollout.generate`'s
    (cfg.seed, seed, key, j) with seed = turn_seed(seed, turn)): turn 0 keys
    by prompt and sample, later turns by episode (key) with sample 0."""
    return hash((engine_seed, turn_seed(seed, turn), key, sample)) & _SEED_MASK


@dataclass(slots=True)
class EpisodeRecord:
    """A loop's own record of one episode (the env keeps its own state)."""

    state: Any
    group_id: int
    context: list[int]  # prompt + every segment + every env reply so far
    prompt_len: int
    policy_mask: list[bool] = field(default_factory=list)  # response-local, True = sampled
    policy_logp: list[float] = field(default_factory=list)  # one per sampled token
    num_segments: int = 0
    context_full: bool = False


def advance(env: Any, ep: EpisodeRecord, segment: list[int], logp: list[float]) -> bool:
    """Feeds one segment to the env and extends the record; True = still running."""
    env_ids, done = env.step(ep.state, segment)
    record(ep, segment, logp, list(env_ids))
    return not done


def each_step(env: Any, step: Callable[..., T], items: Sequence[tuple]) -> list[T]:
    """step(*item) for each item, in order, in threads when the env says its
    steps may run at once (`concurrent_steps`: tools of different episodes
    then run together)."""
    if not getattr(env, "concurrent_steps", False) or len(items) < 2:
        return [step(*item) for item in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(len(items), MAX_STEP_THREADS)) as pool:
        return list(pool.map(lambda item: step(*item), items))


def advance_all(env: Any, items: list[tuple[EpisodeRecord, list[int], list[float]]],
                ) -> list[bool]:
    """`advance` on each (record, segment, log-probs) (`each_step`); True =
    still running, in order."""
    return each_step(env, lambda *item: advance(env, *item), items)


def record(ep: EpisodeRecord, segment: list[int], logp: list[float], env_ids: list[int]) -> None:
    """Extends the record by a segment and the env's reply to it."""
    ep.context += segment + env_ids
    ep.policy_mask += [True] * len(segment) + [False] * len(env_ids)
    ep.policy_logp += logp
    ep.num_segments += bool(segment)


def end_when_full(env: Any, ep: EpisodeRecord) -> None:
    """Ends an episode whose context fills max_model_len: env.step on an empty
    segment must say done."""
    ep.context_full = True
    if advance(env, ep, [], []):
        raise RuntimeError(
            f"{type(env).__name__}.step() did not end an episode on an empty segment "
            f"(its context already fills max_model_len)")


def finish(env: Any, ep: EpisodeRecord) -> Trajectory:
    """The env's trajectory of a finished episode, checked against the record."""
    traj = env.build_trajectory(ep.state, ep.policy_logp, ep.group_id)
    name = type(env).__name__
    if list(traj.prompt_ids) + list(traj.response_ids) != ep.context:
        raise RuntimeError(f"{name}.build_trajectory(): prompt + response differ from the "
                           f"context the policy generated from")
    if list(traj.loss_mask) != ep.policy_mask:
        raise RuntimeError(f"{name}.build_trajectory(): loss_mask is not True exactly on the "
                           f"policy's sampled tokens")
    sampled = [float(lp) for lp, m in zip(traj.rollout_logp, ep.policy_mask, strict=True) if m]
    if len(sampled) != len(ep.policy_logp) or any(  # NaN: log-probs not asked for
            a != b and not (math.isnan(a) and math.isnan(b))
            for a, b in zip(sampled, ep.policy_logp)):
        raise RuntimeError(f"{name}.build_trajectory(): rollout_logp differs from the "
                           f"sampling log-probs")
    traj.info.setdefault("num_turns", 0)
    traj.info["num_segments"] = ep.num_segments
    traj.info["context_full"] = ep.context_full
    return traj
