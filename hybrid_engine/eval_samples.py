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

__all__ = ["compare", "per_prompt", "read_rows", "sample_rows"]


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



def read_rows(path: str) -> list[dict]:
    """The rows of an evaluation samples file, those of its last step (a run's
    file holds every evaluation).

    Raises:
        ValueError: the file is missing, has a line that is not JSON, or holds
            no row with a "correct" value.
    """
    import json
    from pathlib import Path

    try:
        lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
    except OSError as e:
        raise ValueError(f"--compare: cannot read {path!r} ({e.strerror})") from None
    try:
        rows = [json.loads(ln) for ln in lines]
    except json.JSONDecodeError as e:
        raise ValueError(f"--compare: {path!r}, line {e.lineno}: not JSON") from None
    rows = [r for r in rows if r.get("correct") is not None]
    if not rows:
        raise ValueError(f"--compare: {path!r} holds no sample with a correctness "
                         "(an evaluation samples file: hybrid-engine eval --output)")
    last = max(r["step"] for r in rows)
    return [r for r in rows if r["step"] == last]


def per_prompt(rows: Sequence[dict]) -> dict[str, float]:
    """{prompt: its share of correct samples} (the greedy pass where there is
    one, else the sampled pass's mean@n)."""
    kind = "greedy" if any(r["pass"] == "greedy" for r in rows) else "sampled"
    counts: dict[str, list[bool]] = {}
    for r in rows:
        if r["pass"] == kind:
            counts.setdefault(r["prompt"], []).append(bool(r["correct"]))
    return {p: sum(c) / len(c) for p, c in counts.items()}


def compare(a: Sequence[dict], b: Sequence[dict]) -> dict[str, Any]:
    """Two evaluations' rows prompt by prompt (the prompts both hold): how many
    each got right, and the prompts that flipped (fixed: wrong in a, right in
    b; broken: the other way), a prompt counting as right when at least half
    its samples are."""
    pa, pb = per_prompt(a), per_prompt(b)
    both = [p for p in pa if p in pb]
    fixed = [p for p in both if pa[p] < 0.5 <= pb[p]]
    broken = [p for p in both if pb[p] < 0.5 <= pa[p]]
    return {"prompts": len(both), "only_a": len(pa) - len(both), "only_b": len(pb) - len(both),
            "a_right": sum(pa[p] >= 0.5 for p in both), "b_right": sum(pb[p] >= 0.5 for p in both),
            "fixed": fixed, "broken": broken}
