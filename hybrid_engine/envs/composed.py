"""An environment whose reward is a weighted sum of terms (`env.rewards`).

Job: wrap a task environment so `score` computes, for every trajectory,

    reward = sum over terms of weight * (the term's value, or the sum of its parts)

with each part in `reward_components` under its name (logged as
`reward/<name>`, unweighted). The terms (`envs/rewards.py`):

    task          the wrapped environment's own reward, in this process
    reward_model  a reward model's score (collective: every rank, every sample)
    http, judge   a service's score, requested from this process (`envs/services.py`)
    functions     built-in (math, format) or the user's, in the reward pool's
                  worker processes (`envs/reward_pool.py`)

Each trajectory is scored exactly once across the ranks: rank r scores the
samples r, r + N, ... of the batch every rank holds, and the results are
gathered to every rank. A function call past env.reward_timeout_s is killed
(a service request that failed is given up): its term takes
env.reward_on_timeout, and the sample's `reward_timeouts` (info) counts it. A
judge's reply without a score takes env.judge_on_unparsed, counted in the
sample's `reward_unparsed` (info).

Invariant: a term that raises, returns a non-number, or (batched) a list of
the wrong length is a `RewardError` naming the term and the sample, raised on
every rank alike, never a silent NaN in the advantages.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hybrid_engine.envs.base import RewardError, decode, eos_token_id
from hybrid_engine.envs.reward_pool import Call, Outcome, RewardPool
from hybrid_engine.envs.rewards import RewardTerm

__all__ = ["RewardsEnv"]

log = logging.getLogger(__name__)


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _gather(obj: Any) -> list[Any]:
    """obj of every rank, in rank order (collective when distributed)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _parts(term: RewardTerm, value: Any) -> dict[str, float]:
    """A term's value as {component: float}.

    Raises:
        ValueError: not a finite number nor a non-empty mapping of them.
    """
    if _finite(value):
        return {term.name: float(value)}
    if isinstance(value, Mapping) and value and all(_finite(v) for v in value.values()):
        return {str(k): float(v) for k, v in value.items()}
    raise ValueError(f"must return a finite number or a non-empty mapping of them, got {value!r}")


class RewardsEnv:
    """`base_env` with the reward env.rewards composes (see the module docstring).

    Args:
        base_env: the task environment (prompts, answers, state, its own reward).
        terms: the weighted terms (`envs.rewards.parse_rewards`).
        tokenizer: the policy's tokenizer.
        pool: where function terms run.
        on_timeout: the value of a term whose call timed out.
        reward_model: the `RewardModelEnv` a reward_model term scores with.
        services: the scorer of each service term by name (`services.services`):
            samples -> one `Outcome` each.
    """

    def __init__(self, base_env: Any, terms: Sequence[RewardTerm], tokenizer: Any, *,
                 pool: RewardPool, on_timeout: float = 0.0, reward_model: Any = None,
                 services: Mapping[str, Callable[[Sequence[tuple]], list[Outcome]]] | None = None
                 ) -> None:
        self.base_env, self.terms, self.tokenizer = base_env, list(terms), tokenizer
        self.pool, self.on_timeout, self.reward_model = pool, on_timeout, reward_model
        self.services = dict(services or {})
        self._warned_timeouts = False
        self.eos_id = eos_token_id(tokenizer)
        names = "+".join(t.name for t in self.terms)
        self.name = f"{getattr(base_env, 'name', type(base_env).__name__)} (rewards {names})"
        if reward_model is not None:
            self.layout = "training"  # a model forward: scored beside no awake engine
        if any(t.spec for t in self.terms):
            pool.start()

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found normally: delegate to the task.
        if name == "base_env":
            raise AttributeError(name)
        return getattr(self.base_env, name)

    def close(self) -> None:
        """Stops the reward workers, and what the task started (its tool workers)."""
        self.pool.close()
        close = getattr(self.base_env, "close", None)
        if close is not None:
            close()

    def score(self, trajs: Sequence[Any]) -> None:
        """Fills reward, reward_components and info["reward_timeouts"] of every
        trajectory, each scored once across the ranks (collective).

        Raises:
            RewardError: on every rank, when any rank's share failed.
        """
        rm = self._reward_model_scores(trajs)
        rank, world = _rank_world()
        mine = list(range(rank, len(trajs), world))
        try:
            share = self._score_share([trajs[i] for i in mine], [rm[i] for i in mine])
            result: tuple[list[int], Any, str | None] = (mine, share, None)
        except RewardError as e:
            result = (mine, None, str(e))
        gathered = _gather(result)
        errors = [err for _, _, err in gathered if err]
        if errors:
            raise RewardError(errors[0])
        for idx, share, _ in gathered:
            for i, (parts, total, counts) in zip(idx, share, strict=True):
                trajs[i].reward_components, trajs[i].reward = parts, total
                trajs[i].info["reward_timeouts"] = counts["timeout"]
                if "judge" in self.services:
                    trajs[i].info["reward_unparsed"] = counts["unparsed"]
                if "math" in parts and "correct" not in parts:
                    trajs[i].info["correct"] = parts["math"]
        self._warn_if_all_timed_out(trajs)

    def _warn_if_all_timed_out(self, trajs: Sequence[Any]) -> None:
        """Once per run, from rank 0: every sample of a batch had a call time out,
        which only the reward/timeouts metric would otherwise show."""
        if self._warned_timeouts or not trajs or not all(t.info["reward_timeouts"] for t in trajs):
            return
        self._warned_timeouts = True
        if _rank_world()[0] == 0:
            log.warning("env.rewards: every sample of this batch (%d) had a reward call time out "
                        "after env.reward_timeout_s=%g s and scored env.reward_on_timeout=%g, "
                        "so its groups carry no learning signal: a reward function that hangs, "
                        "or a timeout too short for it (reward/timeouts counts them)",
                        len(trajs), self.pool.timeout_s, self.on_timeout)

    def _reward_model_scores(self, trajs: Sequence[Any]) -> list[float | None]:
        """The reward model's score of every trajectory (collective), or Nones."""
        if self.reward_model is None:
            return [None] * len(trajs)
        self.reward_model.score(trajs)  # sets reward = its score, checked finite
        return [float(t.reward) for t in trajs]

    def _sample(self, traj: Any) -> tuple[str, str, str | None, dict]:
        """(prompt text, completion up to EOS (a multi-turn episode: its final answer),
        reference answer, row columns)."""
        prompt = decode(self.tokenizer, traj.info.get("source_prompt_ids", traj.prompt_ids))
        final_text = getattr(self.base_env, "final_text", None)  # a multi-turn episode's answer
        ids = list(traj.response_ids)
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        try:
            answer = self.base_env.answer_for(prompt)
        except (AttributeError, ValueError):
            answer = None
        example_for = getattr(self.base_env, "example_for", None)
        ex = example_for(prompt) if example_for is not None else None
        completion = final_text(traj) if final_text else decode(self.tokenizer, ids)
        return prompt, completion, answer, dict(ex.extras) if ex else {}

    def _score_share(self, share: Sequence[Any], rm: Sequence[float | None]) -> list[tuple]:
        """[(components, weighted total, {"timeout": n, "unparsed": n})] of this
        rank's trajectories.

        Raises:
            RewardError: a term failed on one of them.
        """
        samples = [self._sample(t) for t in share]
        out = [({}, 0.0, {"timeout": 0, "unparsed": 0}) for _ in share]
        for term in self.terms:
            values = self._term_values(term, share, samples, rm)
            for i, (outcome, (prompt, *_)) in enumerate(zip(values, samples, strict=True)):
                parts, total, counts = out[i]
                if outcome.kind in ("timeout", "unparsed"):
                    counts[outcome.kind] += 1
                    new = {term.name: self.on_timeout if outcome.kind == "timeout"
                           else float(outcome.value)}
                elif outcome.kind == "error":
                    raise RewardError(self._where(term, prompt) + f" raised {outcome.value}")
                else:
                    try:
                        new = _parts(term, outcome.value)
                    except ValueError as e:
                        raise RewardError(f"{self._where(term, prompt)} {e}") from None
                clash = set(new) & set(parts)
                if clash:
                    raise RewardError(f"{self._where(term, prompt)} reward component "
                                      f"{sorted(clash)[0]!r} is given by two terms of env.rewards")
                out[i] = ({**parts, **new}, total + term.weight * math.fsum(new.values()), counts)
        return out

    def _where(self, term: RewardTerm, prompt: str) -> str:
        return f"env.rewards term {term.name!r} ({term.spec or term.name}), sample with prompt " \
               f"{prompt[:200]!r}:"

    def _term_values(self, term: RewardTerm, share: Sequence[Any], samples: Sequence[tuple],
                     rm: Sequence[float | None]) -> list[Outcome]:
        """One outcome per sample of this rank's share."""
        if term.name == "reward_model":
            return [Outcome("ok", s) for s in rm]
        if term.name == "task":
            return self._task_values(share)
        if not samples:
            return []
        if term.name in self.services:
            return self.services[term.name](samples)
        cols = [{k: v for k, v in c.items() if term.columns is None or k in term.columns}
                for *_, c in samples]
        if not term.batched:
            return self.pool.run([Call(term.spec, (p, c, a), {**col, **term.settings})
                                  for (p, c, a, _), col in zip(samples, cols, strict=True)])
        columns = {k: [col.get(k) for col in cols] for k in sorted({k for c in cols for k in c})}
        [got] = self.pool.run([Call(term.spec, tuple(map(list, zip(*[s[:3] for s in samples]))),
                                    {**columns, **term.settings})])
        if got.kind != "ok":
            return [got] * len(samples)
        if not isinstance(got.value, Sequence) or len(got.value) != len(samples):
            n = len(got.value) if isinstance(got.value, Sequence) else type(got.value).__name__
            raise RewardError(f"{self._where(term, samples[0][0])} a batched reward must return "
                              f"a list of {len(samples)} values (one per sample), got {n}")
        return [Outcome("ok", v) for v in got.value]

    def _task_values(self, share: Sequence[Any]) -> list[Outcome]:
        """The wrapped environment's own reward parts of each trajectory."""
        self.base_env.score(share)
        return [Outcome("ok", dict(t.reward_components)) for t in share]
