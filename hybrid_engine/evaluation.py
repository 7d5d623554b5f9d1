"""Held-out evaluation: greedy accuracy, and mean@n, pass@k and maj@k from n samples.

Job: `Evaluator` generates completions of the environment's evaluation prompts
(`eval.num_prompts` of them, the same list every time) with the policy's
current weights, has them scored, and turns the scores into metrics. It
never trains. Two passes, each optional:

    greedy   one completion per prompt at top_k=1:
             eval/accuracy, eval/reward_mean, eval/response_len_mean
    sampled  n = eval.num_samples completions per prompt at eval.temperature
             and eval.top_p, seeded by (seed, step), so an evaluation repeats
             exactly after a resume: eval/mean@n, eval/pass@k and eval/maj@k
             for each k of eval.pass_k, eval/sampled_reward_mean,
             eval/sampled_response_len_mean

A sample is correct when the environment's "correct" score (its `math` reward
when `env.rewards` has one) is > 0. The estimators, per prompt with c of n
samples correct, then averaged over prompts:

    mean@n  c / n
    pass@k  1 - C(n - c, k) / C(n, k)   (the unbiased estimator: the chance that
            k of the n samples, drawn without replacement, include a correct one)
    maj@k   whether the answer given most often among the first k samples is
            correct. Answers are extracted with math-verify and compared by their
            parsed value; a sample with no answer does not vote; a tie goes to the
            answer reached first (by sample order); no answer at all counts wrong.

With `write_samples`, every completion of both passes is also a JSON line
(`eval_samples`: prompt, completion, answer, reward parts, correct, ...).

When the evaluation problems carry a `data_source` column, each metric is also
reported per source, as eval/<source>/<metric>.

The generation and the scoring are collective (shared over the rollout ranks);
the metrics are computed identically on every rank.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from hybrid_engine.config import RunConfig
from hybrid_engine.eval_samples import sample_rows
from hybrid_engine.metrics import TOOL_METRICS, PhaseTimer, trajectory_metrics
from hybrid_engine.roles.base import layout_of

__all__ = ["Evaluator", "answer_key", "majority_correct", "pass_at_k", "score_with"]

_EVAL_SEED_OFFSET = 5_003_333  # the sampled pass's seed offset (far from the steps' seeds)


def score_with(policy: Any, roles: Sequence[Any], trajs: list,
               timer: PhaseTimer | None = None) -> None:
    """Each role scores trajs in turn (the reference, the critic, ..., then the
    environment's reward), the policy switched to the layout the role
    needs first (`layout_of`): the one scoring path of training and evaluation.
    timer: times the switches as `switch`, the scoring as `score`."""
    for role in roles:
        if (layout := layout_of(role)) is not None:
            with timer.phase("switch") if timer else contextlib.nullcontext():
                policy.switch_to(layout)
        with timer.phase("score") if timer else contextlib.nullcontext():
            role.score(trajs)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with c of n samples correct.

    Raises:
        ValueError: not 1 <= k <= n, or c outside 0..n.
    """
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(answers: Sequence[str | None], correct: Sequence[bool]) -> bool:
    """Whether the most frequent answer is correct (None answers do not vote; a
    tie goes to the answer that comes first; no answer at all is wrong)."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return False
    top = max(counts.values())
    first = next(i for i, a in enumerate(answers) if a is not None and counts[a] == top)
    return bool(correct[first])


def answer_key(completion: str) -> str | None:
    """The completion's final answer as math-verify parses it (its value, so
    "12", "12 books" and "\\boxed{12}" agree), or None when it has none."""
    from math_verify import parse

    # math-verify's timeout uses SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    parsed = parse(completion, parsing_timeout=timeout)
    return str(parsed[0]) if parsed else None


def _correct(traj: Any) -> float | None:
    """A trajectory's correctness score (None when the environment gives none)."""
    return traj.info.get("correct", traj.reward_components.get("correct"))


def _by_source(trajs: Sequence[Any], sources: Sequence[str | None]) -> dict[str | None, list]:
    """{source: its trajectories}, every trajectory under None too."""
    groups: dict[str | None, list] = {None: list(trajs)}
    for t in trajs:
        src = sources[t.group_id]
        if src is not None:
            groups.setdefault(str(src), []).append(t)
    return groups


def _key(source: str | None, metric: str) -> str:
    return f"eval/{metric}" if source is None else f"eval/{source}/{metric}"


def greedy_metrics(trajs: Sequence[Any], sources: Sequence[str | None]) -> dict[str, float]:
    """eval/accuracy (when scores have a correctness), eval/reward_mean and
    eval/response_len_mean of one completion per prompt, per source too; for a
    chat environment's episodes also eval/tool/calls ... (`TOOL_METRICS`)."""
    out = {}
    for src, group in _by_source(trajs, sources).items():
        tm = trajectory_metrics(group)
        for name in ("accuracy", "reward_mean", "response_len_mean", *TOOL_METRICS):
            if name in tm:
                out[_key(src, name)] = tm[name]
    return out


def sampled_metrics(trajs: Sequence[Any], sources: Sequence[str | None], n: int,
                    ks: Sequence[int], answers: Sequence[str | None]) -> dict[str, float]:
    """mean@n, pass@k, maj@k (each k of ks), the sampled reward and response length
    of n completions per prompt (prompt-major, answers aligned with trajs); for
    a chat environment's episodes also eval/sampled_tool/calls ... (`TOOL_METRICS`)."""
    answer_of = {id(t): a for t, a in zip(trajs, answers, strict=True)}
    out = {}
    for src, group in _by_source(trajs, sources).items():
        tm = trajectory_metrics(group)
        out[_key(src, "sampled_reward_mean")] = tm["reward_mean"]
        out[_key(src, "sampled_response_len_mean")] = tm["response_len_mean"]
        out.update({_key(src, f"sampled_{m}"): tm[m] for m in TOOL_METRICS if m in tm})
        scores = [_correct(t) for t in group]
        if any(c is None for c in scores):
            continue  # no correctness to count
        per_prompt: dict[int, list] = {}
        for t in group:
            per_prompt.setdefault(t.group_id, []).append(t)
        ok = [[_correct(t) > 0 for t in ts] for ts in per_prompt.values()]
        out[_key(src, f"mean@{n}")] = sum(sum(o) / n for o in ok) / len(ok)
        for k in ks:
            out[_key(src, f"pass@{k}")] = sum(pass_at_k(n, sum(o), k) for o in ok) / len(ok)
            out[_key(src, f"maj@{k}")] = sum(
                majority_correct([answer_of[id(t)] for t in ts[:k]], o[:k])
                for ts, o in zip(per_prompt.values(), ok, strict=True)) / len(ok)
    return out


class Evaluator:
    """Evaluates the policy's current weights on the environment's evaluation
    prompts (collective); see the module docstring.

    Args:
        policy: has `collect(env, prompts, num_samples=, seed=, sampling=)`.
        env: has `eval_prompts(num)`, a `tokenizer` and, optionally,
            `eval_sources(num)` (each prompt's data_source or None).
        cfg: the run config (`eval`, `rollout.max_tokens`, `seed`).
        score: scores trajectories in place; None: the environment's reward in
            the layout it needs (`score_with`, as training scores).
        write_samples: takes the rows of every evaluated completion
            (`eval_samples.sample_rows`), e.g. `SampleFile.write`; None = nobody.
    """

    def __init__(self, policy: Any, env: Any, cfg: RunConfig,
                 score: Callable[[list], None] | None = None,
                 write_samples: Callable[[list[dict]], None] | None = None) -> None:
        self.policy, self.env, self.cfg = policy, env, cfg
        self.write_samples = write_samples
        self.score = score or (lambda trajs: score_with(policy, [env], trajs))

    def __call__(self, step: int) -> dict[str, float]:
        """The metrics of an evaluation at `step`, with eval_s (its seconds)."""
        e, timer = self.cfg.eval, PhaseTimer()
        out: dict[str, float] = {}
        with timer.phase("eval"):
            self.policy.switch_to("inference")
            prompts = self.env.eval_prompts(e.num_prompts)
            sources = (self.env.eval_sources(e.num_prompts) if hasattr(self.env, "eval_sources")
                       else [None] * len(prompts))
            max_tokens = {"max_tokens": e.max_tokens} if e.max_tokens else {}
            if e.greedy:
                trajs = self._collect(prompts, 1, 0, {"top_k": 1, **max_tokens})
                out.update(greedy_metrics(trajs, sources))
                self._write(trajs, step, "greedy", sources)
            if e.num_samples:
                seed = self.cfg.seed * 1_000_003 + step + _EVAL_SEED_OFFSET
                trajs = self._collect(prompts, e.num_samples, seed, {
                    "temperature": e.temperature, "top_p": e.top_p, **max_tokens})
                answers = [answer_key(self._text(t)) for t in trajs]
                out.update(sampled_metrics(trajs, sources, e.num_samples, e.ks(), answers))
                self._write(trajs, step, "sampled", sources, answers)
        out["eval/prompts"] = float(len(prompts))
        return {**out, "eval_s": timer.metrics["eval_s"]}

    def _collect(self, prompts: list, n: int, seed: int, sampling: dict) -> list:
        trajs = self.policy.collect(self.env, prompts, num_samples=n, seed=seed,
                                    sampling=sampling)
        self.score(trajs)
        return trajs

    def _write(self, trajs: list, step: int, kind: str, sources: Sequence[str | None],
               answers: Sequence[str | None] | None = None) -> None:
        if self.write_samples is not None:
            self.write_samples(sample_rows(self.env, trajs, step=step, kind=kind,
                                           sources=sources, extracted=answers))

    def _text(self, traj: Any) -> str:
        """The answer's text: a chat environment's final turn (`final_text`), else
        every sampled token (special tokens dropped)."""
        final = getattr(self.env, "final_text", None)
        if final is not None:
            return final(traj)
        ids = [i for i, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m]
        return self.env.tokenizer.decode(ids, skip_special_tokens=True)
