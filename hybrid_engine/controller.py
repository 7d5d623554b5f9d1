"""The controller: calls the roles in order, step after step, until a stop condition.

Job: the RL loop and nothing else --

    inference layout -> generate K per prompt -> score (each scorer in the
    layout it needs: the drift scorer in inference, reference and critic in
    training; then the reward) [-> again, while the algorithm wants more prompts: dynamic
    sampling] -> advantages -> skip if no sample carries signal -> training
    layout -> train -> sync -> metrics

The layout switches are the colocated device's choreography: "inference" gives
the device to the engine (its KV cache back), "training" to the trainer (the
engine releases its memory where configured). The policy makes them no-ops
where the placement keeps the layouts apart; they are timed as `switch_s`.

With async_rollout.max_staleness = k > 0 the generation runs up to k steps ahead
(`policy.collect_async`), on one of two schedules (`RunConfig.ahead_burst`):
stream -- step s starts the batch of step s + k, sampled with the weights of
step s, and trains on the batch started k steps earlier, so under separate
placement the rollout ranks generate while the trainer ranks train; burst --
when no batch is queued, step s samples the batches of steps s .. s + k in one
pass with its weights (colocated: one generation pass for k + 1 steps).
Each trajectory carries the step whose weights sampled it (policy_version);
its staleness s - policy_version is at most k and reported per step. With
async_rollout.partial nothing runs ahead: the policy parks unfinished
sequences between steps (`rollout/partial.py`), so the controller passes the
step as the weights' version and the policy stamps each trajectory with its
oldest token's.

plus exit conditions (steps, wall time, reward EMA, the guards' aborts), evaluation on held-out
prompts (`evaluation.Evaluator`: before the first step, every eval.every steps and
after the last, as the eval section says), periodic checkpoints and a clean
stop on SIGINT/SIGTERM.

It never learns the placement (the policy object hides its layouts and how
weights move), the algorithm (advantages, sample selection and the loss come
from the algorithm object), the task (prompts and rewards come from the
environment) or the number of devices (every collective is inside a role,
except `any_rank`, which makes all ranks agree to stop).

Invariant: every rank runs the same sequence of role calls: all decisions
(skip, stop, eval, save) depend only on values that are identical on every
rank (gathered rewards, the step counter) or are agreed through `any_rank`.
A stop request finishes the current step, then saves a checkpoint (when
checkpointing is on), so nothing is written half-done.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybrid_engine.config import RunConfig
from hybrid_engine.evaluation import Evaluator, score_with
from hybrid_engine.guards import Guards, RunAborted
from hybrid_engine.metrics import PhaseTimer, staleness_metrics, trajectory_metrics
from hybrid_engine.parallel import signals
from hybrid_engine.parallel.dist import any_rank
from hybrid_engine.policy.ahead import batches_to_json, resumable_batches, split_burst
from hybrid_engine.roles.base import (Algorithm, Checkpointer, Environment, Layout, Learner,
                                      Pending, Policy, Scorer)
from hybrid_engine.trajectory import stamp_version

__all__ = ["Controller", "FinalEvaluationFailed"]


class FinalEvaluationFailed(ValueError):
    """The evaluation after the last step failed on bad input (an evaluation set
    smaller than eval.num_prompts, a reward that raises): the training is sound,
    and the last step was saved when checkpointing is on."""

_log = logging.getLogger(__name__)
_REFILL_SEED_OFFSET = 7_919_999  # a refill round's sampling seed offset (far from any step count)


@dataclass
class _State:
    step: int = 0
    reward_ema: float | None = None
    wall_s: float = 0.0  # accumulated over resumed segments
    history: list[dict[str, float]] = field(default_factory=list)


class Controller:
    """Drives policy, environment, algorithm and the other scorers (collective).

    Args:
        policy, env, algorithm: what `roles.base.Policy`, `Environment` and
            `Algorithm` describe (e.g. `HybridActor`, `ArithmeticEnv`, the
            algorithm role); the policy's `collect_async` serves
            async_rollout.max_staleness > 0, its `rollout_metrics()` are read after
            every step's sampling, and `rollout_state()` is checkpointed.
        cfg: the run config (steps, K, prompts per step, eval/checkpoint cadence).
        scorers: `Scorer`s, whose `score(trajs)` runs before the reward (reference,
            critic; a reward model on its own ranks, whose scores the reward
            takes), each in the layout it names (`roles.base.layout_of`).
        learners: `Learner`s, whose `train_step(trajs)` runs after the policy's (critic).
        checkpointer: saves job state every cfg.checkpoint_every steps; None = never.
        on_metrics: called with (step, metrics) after every step and eval, once
            the guards have flagged them; it writes, it decides nothing.
        on_samples: called with (step, trajectories) once a step's advantages are
            set, before it trains (the job's samples tables).
        on_eval_samples: called with the rows of every evaluated completion
            (`eval_samples.sample_rows`; the job's eval.samples_file).
        guards: the stop checks on metrics (mismatch alarm, non-finite streak);
            default `Guards(cfg)`. A failed check raises `RunAborted` on every rank,
            after the metrics are written and before the step's checkpoint.
    """

    def __init__(self, policy: Policy, env: Environment, algorithm: Algorithm, cfg: RunConfig, *,
                 scorers: Sequence[Scorer] = (), learners: Sequence[Learner] = (),
                 checkpointer: Checkpointer | None = None,
                 on_metrics: Callable[[int, dict[str, float]], None] | None = None,
                 on_samples: Callable[[int, list], None] | None = None,
                 on_eval_samples: Callable[[list[dict]], None] | None = None,
                 guards: Guards | None = None) -> None:
        self.policy, self.env, self.algorithm, self.cfg = policy, env, algorithm, cfg
        self.scorers, self.learners = list(scorers), list(learners)
        self.checkpointer, self.on_metrics = checkpointer, on_metrics or (lambda s, m: None)
        self.on_samples = on_samples or (lambda s, t: None)
        self.guards = guards or Guards(cfg)
        self.state = _State()
        self.evaluator = Evaluator(policy, env, cfg, write_samples=on_eval_samples)
        # async_rollout.max_staleness: (version, handle) of the batches of steps s, s+1, ...
        self._ahead: deque[tuple[int, Pending]] = deque()

    # --- state ---------------------------------------------------------------------

    def state_dict(self) -> dict:
        s = self.state
        return {"step": s.step, "reward_ema": s.reward_ema, "wall_s": s.wall_s,
                "history": s.history, "env": self.env.state_dict(),
                "guards": self.guards.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        self.state = _State(d["step"], d["reward_ema"], d["wall_s"], list(d["history"]))
        self.env.load_state_dict(d["env"])
        self.guards.load_state_dict(d.get("guards", {}))  # absent in older checkpoints
        size = self.cfg.train.prompts_per_step * self.cfg.rollout.num_samples_per_prompt
        self._ahead = deque(resumable_batches(d.get("ahead", []), d["step"], self._ahead_depth(),
                                              size))
        if d.get("rollout") is not None:  # parked partial rollouts
            self.policy.load_rollout_state(d["rollout"])

    # --- one step ------------------------------------------------------------------

    def _submit(self, step: int, want: int, rounds: int) -> tuple[int, Pending]:
        """Starts the generation of `want` prompt groups for step's round `rounds`
        with the current weights: (their version, the handle)."""
        prompts = self.env.sample_prompts(want)
        return self.state.step, self.policy.collect_async(
            self.env, prompts, num_samples=self.cfg.rollout.num_samples_per_prompt,
            seed=self._seed(step, rounds))

    def _queue_ahead(self, step: int, want: int, k: int) -> None:
        """Queues the batches of steps step .. step + k not yet started (stream), or,
        when none is queued, samples all k + 1 (fewer near train.num_steps: none
        past the last step) in one pass (burst): each batch gets
        its own prompts and group ids 0.., and a token-weighted share of the pass's
        engine seconds (`split_burst`)."""
        while not self.cfg.ahead_burst() and len(self._ahead) <= k:
            self._ahead.append(self._submit(step + len(self._ahead), want, 0))
        if not self._ahead:  # no batch past the run's last step
            n = min(k + 1, max(self.cfg.train.num_steps - step, 1))
            prompts = [p for _ in range(n) for p in self.env.sample_prompts(want)]
            K = self.cfg.rollout.num_samples_per_prompt
            trajs, seconds = self.policy.collect_async(self.env, prompts, num_samples=K,
                                                       seed=self._seed(step, 0)).result()
            self._ahead.extend((self.state.step, h)
                               for h in split_burst(trajs, seconds, n, want, K))

    def _ahead_depth(self) -> int:
        """How many steps ahead generation runs: max_staleness, except with partial
        rollouts, where the staleness comes from parked prefixes instead."""
        return 0 if self.cfg.async_rollout.partial else self.cfg.async_rollout.max_staleness

    def _seed(self, step: int, rounds: int) -> int:
        """The sampling seed of a step's generate round."""
        return self.cfg.seed * 1_000_003 + step + rounds * _REFILL_SEED_OFFSET

    def _sample(self, timer: PhaseTimer) -> tuple[list, int, float]:
        """Generates and scores prompt groups, in rounds while the algorithm wants
        more (dynamic sampling); returns every trajectory, the round count and
        the engine's seconds on them. max_staleness = k > 0: the first round is
        the step's batch from the queue (`_queue_ahead` refills it first)."""
        trajs, rounds, want, busy_s = [], 0, self.cfg.train.prompts_per_step, 0.0
        s, k, partial = self.state.step, self._ahead_depth(), self.cfg.async_rollout.partial
        while want:
            self._switch("inference", timer)
            with timer.phase("generate"):
                if not k:  # partial rollouts: the policy records each token's version
                    prompts = self.env.sample_prompts(want)
                    new, version = self.policy.collect(
                        self.env, prompts, num_samples=self.cfg.rollout.num_samples_per_prompt,
                        seed=self._seed(s, rounds), **({"version": s} if partial else {})), s
                else:
                    if rounds == 0:
                        self._queue_ahead(s, want, k)
                        version, handle = self._ahead.popleft()
                    else:  # a refill round: now, with the current weights
                        version, handle = self._submit(s, want, rounds)
                    new, seconds = handle.result()
                    busy_s += seconds
            if not partial:  # partial rollouts set it per trajectory (its oldest token's)
                stamp_version(new, version)
            score_with(self.policy, [*self.scorers, self.env], new, timer)
            trajs, rounds = trajs + new, rounds + 1
            want = self.algorithm.prompts_wanted(trajs, rounds)
        return trajs, rounds, busy_s

    def step(self) -> dict[str, float]:
        """One RL step; returns its metrics (identical on every rank)."""
        timer = PhaseTimer()
        trajs, rounds, busy_s = self._sample(timer)
        m = {**trajectory_metrics(trajs), **self.algorithm.compute_advantages(trajs),
             **staleness_metrics(trajs, self.state.step, self.cfg.async_rollout.max_staleness),
             **self.policy.rollout_metrics()}  # e.g. partial rollouts
        self.on_samples(self.state.step + 1, trajs)  # the step this one becomes
        train = self.algorithm.select(trajs)
        m.update(sampling_rounds=float(rounds), train_samples=float(len(train)),
                 skipped_degenerate=float(not train))
        if train:
            self._switch("training", timer)
            with timer.phase("train"):
                m.update(self.policy.train_step(train, self.algorithm.loss))
                for learner in self.learners:
                    m.update(learner.train_step(train))
            with timer.phase("sync"):
                m.update(self.policy.sync_weights())
        m.update(timer.metrics)
        # Sampled tokens (loss_mask: not env/tool tokens), each sample once, per generate second.
        m["generated_tokens"] = float(sum(sum(t.loss_mask) for t in trajs))
        if self._ahead_depth():  # generate_s is then the step's wait for them
            m["generate_busy_s"] = busy_s
        # Partial rollouts: the trained samples include prefixes sampled in earlier steps.
        sampled = m.get("partial/sampled_tokens", m["generated_tokens"])
        m["gen_tok_s"] = sampled / max(m.get("generate_busy_s", m["generate_s"]), 1e-9)
        return m

    def evaluate(self) -> dict[str, float]:
        """The held-out metrics of the current weights (`evaluation.Evaluator`)."""
        return self.evaluator(self.state.step)

    def _switch(self, layout: Layout, timer: PhaseTimer | None) -> None:
        """Gives the device to `layout` (a no-op where the placement has nothing to
        switch), timed as the step's `switch_s` when a timer is given."""
        with timer.phase("switch") if timer else contextlib.nullcontext():
            self.policy.switch_to(layout)


    # --- the run -------------------------------------------------------------------

    def _done(self, t_start: float) -> str | None:
        """Why to stop now (None: go on); the same answer on every rank."""
        s, cfg = self.state, self.cfg
        wall = s.wall_s + time.monotonic() - t_start
        if any_rank(signals.requested() is not None):
            return "signal"
        if s.step >= cfg.train.num_steps:
            return "num_steps"
        if any_rank(cfg.max_wall_s is not None and wall >= cfg.max_wall_s):
            return "max_wall_s"
        if cfg.target_reward_ema is not None and (s.reward_ema or -float("inf")) >= cfg.target_reward_ema:
            return "target_reward_ema"
        return None

    def run(self, *, handle_signals: bool = True) -> dict[str, Any]:
        """Steps until a stop condition; returns {"steps", "stop_reason", "wall_s", "history"}.

        handle_signals: catch SIGINT/SIGTERM during the run (`parallel.signals`;
        restored after) and stop after the current step instead of dying
        mid-step: every rank stops after the same step, also when only one
        rank got the signal.
        """
        s, cfg = self.state, self.cfg
        t_start = time.monotonic()
        with signals.stop_on_signals() if handle_signals else contextlib.nullcontext():
            every = cfg.eval.every
            if cfg.eval.at_start and s.step == 0 and not s.history:
                self._record(0, self.evaluate())
            while (reason := self._done(t_start)) is None:
                m = self.step()
                s.step += 1
                r = m["reward_mean"]
                s.reward_ema = r if s.reward_ema is None else 0.9 * s.reward_ema + 0.1 * r
                m["reward_ema"] = s.reward_ema
                m["elapsed_s"] = s.wall_s + time.monotonic() - t_start  # wall clock, step end
                if every and s.step % every == 0:
                    m.update(self.evaluate())
                self._record(s.step, m)
                if cfg.checkpoint_every and s.step % cfg.checkpoint_every == 0:
                    self._save(t_start)
            if reason != "signal" and cfg.eval.at_end and not (every and s.step % every == 0) \
                    and s.step:  # the final weights, unless just evaluated
                self._final_evaluation(t_start)
            if reason == "signal" and cfg.checkpoint_every and s.step % cfg.checkpoint_every:
                self._save(t_start)  # the finished steps are not lost
        s.wall_s += time.monotonic() - t_start
        return {"steps": s.step, "stop_reason": reason, "wall_s": s.wall_s, "history": s.history}

    def _final_evaluation(self, t_start: float) -> None:
        """Evaluates the final weights; on bad input, saves the last step first
        (unless just saved) and raises FinalEvaluationFailed."""
        try:
            self._record(self.state.step, self.evaluate())
        except ValueError as e:
            if self.cfg.checkpoint_every and self.state.step % self.cfg.checkpoint_every:
                self._save(t_start)
            raise FinalEvaluationFailed(f"the final evaluation failed: {e}") from e

    def _record(self, step: int, m: dict[str, float]) -> None:
        abort = self.guards.check(step, m)  # flags m; the same answer on every rank
        self.on_metrics(step, m)
        self.state.history.append({"step": step, **m})
        if abort:
            raise RunAborted(abort)

    def _save(self, t_start: float) -> None:
        if self.checkpointer is None:
            return
        extra = self.state_dict()
        extra["wall_s"] = self.state.wall_s + time.monotonic() - t_start
        extra["ahead"] = batches_to_json(self._ahead)
        extra["rollout"] = self.policy.rollout_state()
        self.checkpointer.save(self.state.step, extra)

