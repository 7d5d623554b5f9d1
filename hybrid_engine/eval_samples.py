"""Evaluation samples a user can read: one JSON line per completion.

Job: turn an evaluation pass's scored trajectories into rows (`sample_rows`),
which rank 0 appends to a JSON-lines file (`metrics.SampleFile`): the in-run
`eval.samples_file` and `hybrid-engine eval --output`. A row:

    step          the step whose weights were evaluated (0: the start)
    pass          "greedy" (one completion per prompt at top_k=1) or "sampled"
                  (eval.num_samples per prompt)
    prompt_index  the prompt's place in the evaluation list (the same every time)
    sample        the completion's index among its prompt's (0 in the greedy pass)
    prompt        the prompt as the model saw it (its ids decoded, template included)
    completion    the response (a multi-turn episode's, tool results included)
    answer        the reference answer (null for a task without one)
    extracted     the sampled pass's answer as maj@k reads it (null: none found)
    rewards       each named reward part; reward: their weighted sum
    correct       whether the sample counts as correct (null: the task has no
                  correctness), the rule pass@k and accuracy use
    data_source   the row's data_source column, when the evaluation set has one

A sampled pass's lines give back its metrics: per prompt, c of n correct,
pass@k = 1 - C(n - c, k) / C(n, k), averaged over prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybrid_engine.envs.base import decode

__all__ = ["sample_rows"]


def _answer(env: Any, prompt: str) -> str | None:
    """The reference answer of an evaluation prompt (None: the task keeps none)."""
    try:
        return env.answer_for(prompt)
    except (AttributeError, ValueError):
        return None


def sample_rows(env: Any, trajs: Sequence[Any], *, step: int, kind: str,
                sources: Sequence[str | None],
                extracted: Sequence[str | None] | None = None) -> list[dict]:
    """The rows of one scored evaluation pass (prompt-major trajectories, as
    `collect` returns them); kind: "greedy" or "sampled"; extracted: the
    sampled pass's answers, aligned with trajs."""
    rows, seen = [], {}
    for i, t in enumerate(trajs):
        prompt = decode(env.tokenizer, t.info.get("source_prompt_ids", t.prompt_ids))
        k = seen[t.group_id] = seen.get(t.group_id, -1) + 1
        correct = t.info.get("correct", t.reward_components.get("correct"))
        row = {"step": step, "pass": kind, "prompt_index": t.group_id, "sample": k,
               "prompt": prompt, "completion": decode(env.tokenizer, t.response_ids),
               "answer": _answer(env, prompt),
               "extracted": extracted[i] if extracted is not None else None,
               "rewards": {n: float(v) for n, v in t.reward_components.items()},
               "reward": float(t.reward),
               "correct": None if correct is None else bool(correct > 0)}
        if sources[t.group_id] is not None:
            row["data_source"] = str(sources[t.group_id])
        rows.append(row)
    return rows

