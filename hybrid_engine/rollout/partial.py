"""Partial rollouts: a step's generation stops early and parks what is unfinished.

Job: `PartialRollouts.collect(rollout, prompt_ids, num_samples=K, seed=s,
version=v)` returns up to len(prompt_ids) finished groups of K trajectories
for step v, sampled with the current weights (version v) as far as they were
sampled this step. It is the colocated answer to the long tail: instead of
waiting for the few longest sequences (the device decoding a batch of one or
two), generation stops as soon as the step has its groups, or has spent
`async_rollout.step_token_budget` tokens with at least one group finished; the
unfinished sequences are parked with their tokens, log-probs and per-token
versions and continue next step, after the sync, as new requests (prompt +
tokens so far) sampled with the new weights. Their prefix is the old
version's, their continuation the new one's; `token_versions` says
which token came from which, and the trajectory's policy_version is its
oldest token's.

The pool: the parked groups (oldest first), then the new ones. Each call adds
up to len(prompt_ids) new groups, keeping at most 2 x len(prompt_ids) in the
pool (prompts beyond that are skipped: `partial/skipped_prompts`). A parked
group whose oldest token is more than `async_rollout.max_staleness` versions old is
restarted from its prompt (`async_rollout.stale_partial=regenerate`) or discarded
(`drop`) before generation, so no trained token is staler than the bound.
Groups returned are taken in pool order among the finished ones; finished
groups beyond what the step asked for stay parked (finished) for the next.

Multi-turn environments (`env` given): a pool sample is an episode, parked
between turns or mid-segment with its environment state as plain data, and
advanced in rounds of turns (`rollout.partial_turns`); the environment needs
`save_episode` / `load_episode`.

Replicas (N/T > 1): the pool is the same on every rank; replica r samples its
contiguous slice of the groups with its share of the wanted groups and of the
budget, and the results are all-gathered, so every rank updates the pool the
same way (no per-engine-step collective; multi-turn: each replica's episodes
as they stand after its rounds).

Invariant: every rank holds the same pool after every call; `state_dict()`
is JSON-able with exact floats (checkpoints), and a loaded pool continues
exactly as the saved one would have.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hybrid_engine.rollout import partial_turns
from hybrid_engine.rollout.partial_turns import Turns
from hybrid_engine.trajectory import Trajectory

if TYPE_CHECKING:
    from hybrid_engine.config import AsyncConfig, RolloutConfig
    from hybrid_engine.rollout.engine import VLLMRollout

__all__ = ["PartialRollouts"]

_SEED_MASK = 0x7FFFFFFF


@dataclass(slots=True)
class _Sample:
    seed: int  # the seed of its first request; continuations derive theirs from it
    tokens: list[int] = field(default_factory=list)  # its response so far
    logp: list[float] = field(default_factory=list)  # per sampled token
    versions: list[int] = field(default_factory=list)  # per token: the weights that sampled it
    finished: bool = False
    turns: Turns | None = None  # a multi-turn episode's own part

    def request_seed(self) -> int:
        """The seed of its next request: its own seed first, then one per prefix length."""
        return self.seed if not self.tokens else hash((self.seed, len(self.tokens))) & _SEED_MASK


@dataclass(slots=True)
class _Group:
    prompt_ids: list[int]  # as sampled from (after any truncation)
    source_ids: list[int]  # the whole prompt (the reward may need it)
    samples: list[_Sample]

    def oldest(self) -> int | None:
        return min((s.versions[0] for s in self.samples if s.versions), default=None)

    def done(self) -> bool:
        return all(s.finished for s in self.samples)


class PartialRollouts:
    """The pool of partially generated groups of a colocated run (see the module
    docstring). cfg: the rollout section (max_tokens, seed); ahead: the
    async_rollout section (max_staleness, step_token_budget, stale_partial)."""

    def __init__(self, cfg: RolloutConfig, ahead: AsyncConfig) -> None:
        self.cfg, self.ahead = cfg, ahead
        self.pool: list[_Group] = []
        self._counts: Counter[str] = Counter()

    # --- one call ------------------------------------------------------------------

    def collect(self, rollout: VLLMRollout, prompt_ids: Sequence[Sequence[int]], *,
                num_samples: int, seed: int, version: int, env: Any = None) -> list[Trajectory]:
        """Up to len(prompt_ids) finished groups (collective over the rollout's
        world); see the module docstring. env: a multi-turn environment, whose
        episodes the samples then are (None: single-turn).

        Raises:
            ValueError: a multi-turn env without save_episode / load_episode.
        """
        if env is not None:
            partial_turns.check_env(env)
        want = len(prompt_ids)
        self._age_out(version)
        self._add(rollout, prompt_ids, num_samples, seed, multi_turn=env is not None)
        replica, replicas = rollout.replica()
        slices = [self._share(len(self.pool), r, replicas) for r in range(replicas)]
        lo, hi = slices[replica]
        wants = [self._share(want, r, replicas) for r in range(replicas)]
        w0, w1 = wants[replica]
        b0, b1 = self._share(self.ahead.step_token_budget, replica, replicas)
        if env is None:
            local: Any = self._sample(rollout, lo, hi, w1 - w0, b1 - b0)
        else:
            local = self._sample_turns(rollout, env, lo, hi, w1 - w0, b1 - b0, version)
        results = self._gather(rollout, local, replicas, env is not None)
        out: list[Trajectory] = []
        taken: set[int] = set()
        for (a, b), (w0, w1), result in zip(slices, wants, results, strict=True):
            if env is None:
                self._apply(a, b, result, version)
            else:
                self._replace(a, b, result)
            ready = [g for g in range(a, b) if self.pool[g].done()][: w1 - w0]
            taken.update(ready)
            out += self._trajectories(ready, len(out) // num_samples, version, env)
        self.pool = [g for i, g in enumerate(self.pool) if i not in taken]
        self._counts["parked_groups"] = len(self.pool)
        self._counts["parked_tokens"] = sum(len(s.tokens) for g in self.pool for s in g.samples)
        return out

    def _add(self, rollout: VLLMRollout, prompt_ids: Sequence[Sequence[int]], k: int,
             seed: int, *, multi_turn: bool) -> None:
        """The call's new groups into the pool, up to 2 x len(prompt_ids) groups."""
        want = len(prompt_ids)
        new = list(prompt_ids)[: max(0, min(want, 2 * want - len(self.pool)))]
        self._counts["skipped_prompts"] += want - len(new)
        for p, (ids, source) in enumerate(zip(rollout.prompt_ids(new), new, strict=True)):
            self.pool.append(_Group(ids, list(source), [
                _Sample(hash((self.cfg.seed, seed, p, j)) & _SEED_MASK,
                        turns=Turns(seed, p * k + j) if multi_turn else None)
                for j in range(k)]))

    @staticmethod
    def _share(n: int, r: int, parts: int) -> tuple[int, int]:
        """Bounds of part r of n split into contiguous parts."""
        return n * r // parts, n * (r + 1) // parts

    def _age_out(self, version: int) -> None:
        """Regenerates or drops the parked groups too old to train at `version`."""
        keep = []
        for g in self.pool:
            oldest = g.oldest()
            if oldest is None or version - oldest <= self.ahead.max_staleness:
                keep.append(g)
            elif self.ahead.stale_partial == "drop":
                self._counts["dropped_groups"] += 1
            else:
                self._counts["regenerated_groups"] += 1
                g.samples = [_Sample(hash((s.seed, -version)) & _SEED_MASK, turns=None if s.turns
                                     is None else s.turns.restarted(-version)) for s in g.samples]
                keep.append(g)
        self.pool = keep

    def _requests(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """(group, sample) of every unfinished sample of pool[lo:hi]."""
        return [(g, j) for g in range(lo, hi) for j, s in enumerate(self.pool[g].samples)
                if not s.finished]

    def _sample(self, rollout: VLLMRollout, lo: int, hi: int, want: int, budget: int,
                ) -> tuple[list[list[int]], list[list[float]], list[bool]]:
        """This replica's engine loop over pool[lo:hi]: stops once `want` of its groups
        are done, or `budget` tokens are sampled with one group done."""
        reqs = self._requests(lo, hi)
        done_before = sum(self.pool[g].done() for g in range(lo, hi))
        if not reqs or done_before >= want:
            return [[] for _ in reqs], [[] for _ in reqs], [False] * len(reqs)
        pending = Counter(g for g, _ in reqs)

        def stop_now(finished: list[bool], tokens: int) -> bool:
            left = Counter(g for (g, _), f in zip(reqs, finished, strict=True) if not f)
            done = done_before + sum(1 for g in pending if not left[g])
            return done >= want or (tokens >= budget and done >= 1)

        max_len = rollout.cfg.max_tokens
        samples = [self.pool[g].samples[j] for g, j in reqs]
        return rollout.sample_until(
            [self.pool[g].prompt_ids + s.tokens for (g, _), s in zip(reqs, samples, strict=True)],
            [max_len - len(s.tokens) for s in samples], [s.request_seed() for s in samples],
            stop_now)

    def _sample_turns(self, rollout: VLLMRollout, env: Any, lo: int, hi: int, want: int,
                      budget: int, version: int) -> tuple[list[list[_Sample]], Counter[str]]:
        """This replica's rounds of turns over pool[lo:hi] (`partial_turns`): its
        groups' samples as they stand after them, and the rounds' counts."""
        counts = partial_turns.sample_turns(rollout, env, self.pool[lo:hi], want=want,
                                            budget=budget, version=version)
        return [g.samples for g in self.pool[lo:hi]], counts

    def _replace(self, lo: int, hi: int, result: tuple[list[list[_Sample]], Counter[str]],
                 ) -> None:
        """pool[lo:hi]'s samples as one replica advanced them (multi-turn)."""
        samples, counts = result
        for g, group_samples in zip(range(lo, hi), samples, strict=True):
            self.pool[g].samples = group_samples
        self._counts.update(counts)

    def _gather(self, rollout: VLLMRollout, local: Any, replicas: int, multi_turn: bool,
                ) -> list[Any]:
        """Every replica's result, in replica order: (tokens, log-probs, finished),
        or (multi-turn) (its groups' samples, its counts)."""
        if replicas == 1:
            return [local]
        if multi_turn:
            import torch.distributed as dist

            out: list[Any] = [None] * dist.get_world_size(rollout.group)
            dist.all_gather_object(out, local, group=rollout.group)
            return out[:: rollout.cfg.tensor_parallel_size][:replicas]
        from hybrid_engine.parallel.dist import all_gather_ragged

        tokens, logps, finished = local
        ids = all_gather_ragged([torch.tensor(t, dtype=torch.int64) for t in tokens], rollout.group)
        lps = all_gather_ragged([torch.tensor(x, dtype=torch.float64) for x in logps], rollout.group)
        flags = all_gather_ragged([torch.tensor(finished, dtype=torch.int64)], rollout.group)
        tp = rollout.cfg.tensor_parallel_size
        return [([t.tolist() for t in ids[r * tp]], [x.tolist() for x in lps[r * tp]],
                 [bool(f) for f in flags[r * tp][0].tolist()]) for r in range(replicas)]

    def _apply(self, lo: int, hi: int, result: tuple, version: int) -> None:
        """Extends pool[lo:hi]'s samples with what one replica sampled at `version`."""
        for (g, j), t, lp, f in zip(self._requests(lo, hi), *result, strict=True):
            s = self.pool[g].samples[j]
            if s.tokens and t:
                self._counts["continued_samples"] += 1
            s.tokens += t
            self._counts["sampled_tokens"] += len(t)
            s.logp += lp
            s.versions += [version] * len(t)
            s.finished = f or len(s.tokens) >= self.cfg.max_tokens

    def _trajectories(self, groups: list[int], first_id: int, version: int, env: Any,
                      ) -> list[Trajectory]:
        out = []
        for i, g in enumerate(groups):
            group = self.pool[g]
            for s in group.samples:
                if s.turns is None:
                    t = Trajectory(prompt_ids=list(group.prompt_ids), response_ids=list(s.tokens),
                                   rollout_logp=list(s.logp), group_id=first_id + i, info={
                                       "num_turns": 0, "num_segments": 1, "context_full": False})
                else:
                    t = partial_turns.trajectory(env, group, s, first_id + i)
                t.token_versions = list(s.versions)
                t.policy_version = s.versions[0] if s.versions else version
                if len(group.prompt_ids) < len(group.source_ids):
                    t.info["source_prompt_ids"] = list(group.source_ids)
                out.append(t)
        return out

    # --- metrics and checkpoints -------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """partial/* counts since the last call (parked_*: the pool now;
        sampled_tokens: tokens the engine sampled, against the trained
        trajectories' generated_tokens, which include parked prefixes)."""
        out = {f"partial/{k}": float(self._counts[k]) for k in (
            "parked_groups", "parked_tokens", "sampled_tokens", "continued_samples", "regenerated_groups",
            "dropped_groups", "skipped_prompts")}
        parked = self._counts["parked_groups"], self._counts["parked_tokens"]
        self._counts.clear()
        self._counts["parked_groups"], self._counts["parked_tokens"] = parked
        return out

    def state_dict(self) -> dict:
        return {"pool": [asdict(g) for g in self.pool]}

    def load_state_dict(self, d: dict) -> None:
        self.pool = [_Group(g["prompt_ids"], g["source_ids"], [
            _Sample(**{**s, "turns": Turns(**s["turns"]) if s.get("turns") else None})
            for s in g["samples"]]) for g in d["pool"]]
