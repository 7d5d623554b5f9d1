"""What `env.rewards` names: weighted reward terms.

Job: parse 'math:1.0,format:0.1,my.py:fn:0.5' into `RewardTerm`s, each a
built-in reward (math, format, code), the environment's own (`task`), a reward model
(`reward_model`, the model at env.reward_model_path), a service (`http`, the
endpoint at env.reward_url; `judge`, the LLM judge at env.judge_url:
`envs/services.py`) or a user function ('file.py:function' / 'module:function'),
with a weight (default 1.0).

A function term is called per sample as

    fn(prompt, completion, answer, **columns) -> float | {name: float}

or, when its first two parameters are named `prompts` and `completions`, once
per batch as

    fn(prompts, completions, answers, **columns) -> list[float | {name: float}]

with every argument a list (one entry per sample). `columns` are the dataset
row's other columns: those the function names, or all with **kwargs.

Invariant: the spec is checked whole (names, weights, that each function
loads) before any engine starts, so a bad name is one error naming it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybrid_engine.envs.user_code import load_function

__all__ = ["BUILTIN_REWARDS", "SERVICE_TERMS", "RewardTerm", "check_columns", "function_term", "parse_rewards"]

BUILTIN_REWARDS = {
    "math": "hybrid_engine.envs.verifiers:math_reward",
    "format": "hybrid_engine.envs.verifiers:format_reward",
    "code": "hybrid_engine.envs.code_reward:code_reward",
}
"""Built-in function terms: name -> the function a reward worker loads."""

MODEL_TERMS = ("task", "reward_model")
"""Terms scored in the ranks' own processes: the environment's own reward, a reward model."""

SERVICE_TERMS = ("http", "judge")
"""Terms scored by a service, from the ranks' own processes (`envs/services.py`)."""


@dataclass(frozen=True)
class RewardTerm:
    """One weighted part of the reward.

    Attributes:
        name: its component name ('math', 'task', or the user function's name).
        weight: its factor in the total.
        spec: the function to load ('module:function' or 'file.py:function'),
            '' for task and reward_model.
        batched: called once per batch with lists, not once per sample.
        columns: the row columns it receives (None: all of them).
        settings: fixed keyword arguments (format's pattern, code's sandbox).
        required: the columns it names without a default (each row must have them).
    """

    name: str
    weight: float
    spec: str = ""
    batched: bool = False
    columns: frozenset[str] | None = frozenset()
    settings: dict = field(default_factory=dict)
    required: frozenset[str] = frozenset()


def _split_weight(item: str) -> tuple[str, float]:
    """('name', weight) of 'name[:weight]', where name may hold one ':' itself
    ('file.py:fn'). A built-in's or model term's one ':' is its weight."""
    head = item.split(":", 1)[0]
    parts = item.rsplit(":", 1)
    has_weight = ":" in item and (head in BUILTIN_REWARDS or head in MODEL_TERMS
                                  or head in SERVICE_TERMS or item.count(":") == 2)
    if not has_weight:
        return item, 1.0
    try:
        weight = float(parts[1])
    except ValueError:
        raise ValueError(f"env.rewards: the weight of {parts[0]!r} must be a number, got "
                         f"{parts[1]!r}") from None
    if not math.isfinite(weight):
        raise ValueError(f"env.rewards: the weight of {parts[0]!r} must be finite, got {weight}")
    return parts[0], weight


def function_term(spec: str, weight: float = 1.0, *, name: str = "", settings: dict | None = None,
                  key: str = "env.rewards") -> RewardTerm:
    """The term of one function ('file.py:function' or 'module:function'), named
    by name or by the function's own name.

    Raises:
        ValueError: the function cannot be loaded (the message names key).
    """
    settings = settings or {}
    fn = load_function(spec, key)
    name = name or spec.rsplit(":", 1)[1]
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: per sample, no columns
        params = []
    batched = [p.name for p in params[:2]] == ["prompts", "completions"]
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
    named = frozenset(p.name for p in params[3:]
                      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)) - set(settings)
    if params:
        _check_call(fn, spec, key, batched, {**dict.fromkeys(named), **settings})
    required = frozenset(p.name for p in params[3:] if p.default is p.empty and p.kind in (
        p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)) - set(settings)
    return RewardTerm(name, weight, spec, batched, None if takes_all else named, settings,
                      required)


def check_columns(terms: Sequence[RewardTerm], columns: Iterable[str], where: str) -> None:
    """Every column a term requires is among a dataset row's columns.

    Raises:
        ValueError: naming the term, the missing column and where the row is.
    """
    have = set(columns)
    for term in terms:
        missing = sorted(term.required - have)
        if missing:
            raise ValueError(f"env.rewards term {term.name!r} ({term.spec}) takes column "
                             f"{missing[0]!r}, which {where} does not have (its columns: "
                             f"{', '.join(sorted(have)) or 'none besides prompt and answer'})")


def _check_call(fn: Any, spec: str, key: str, batched: bool, kwargs: dict) -> None:
    """fn takes the call a term makes: (prompt, completion, answer, **columns), or
    the batched form's lists.

    Raises:
        ValueError: the signature cannot take it (found now, not at the first step).
    """
    try:
        inspect.signature(fn).bind("p", "c", "a", **kwargs)
    except TypeError as e:
        form = ("(prompts, completions, answers, **columns), each a list" if batched
                else "(prompt, completion, answer, **columns)")
        raise ValueError(f"{key}: {spec!r} cannot be called as a reward {form}: {e}") from None


def _default_settings(name: str, format_pattern: str) -> dict[str, Any]:
    """A built-in term's fixed arguments unless the caller gives them."""
    if name == "format":
        return {"pattern": format_pattern}
    if name == "code":
        from hybrid_engine.tools.sandbox import Sandbox

        return {"sandbox": Sandbox(), "budget_s": 0.0}
    return {}


def parse_rewards(text: str, *, format_pattern: str = "",
                  settings: Mapping[str, Mapping[str, Any]] | None = None) -> list[RewardTerm]:
    """The terms of an env.rewards value (see the module docstring).

    Args:
        text: the env.rewards value.
        format_pattern: format's regex ('' = its default).
        settings: fixed keyword arguments of built-in terms, by name (code's
            sandbox and budget_s; default: a local `Sandbox()`, no budget).

    Raises:
        ValueError: an empty item, a weight that is not a number, a name that
            is neither built in nor a loadable function (the built-in names are
            listed), or a name given twice.
    """
    terms: list[RewardTerm] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            raise ValueError(f"env.rewards={text!r}: an empty item (items are "
                             "NAME[:WEIGHT], separated by commas)")
        name, weight = _split_weight(item)
        if name in MODEL_TERMS or name in SERVICE_TERMS:
            terms.append(RewardTerm(name, weight))
        elif name in BUILTIN_REWARDS:
            fixed = {**_default_settings(name, format_pattern), **(settings or {}).get(name, {})}
            terms.append(function_term(BUILTIN_REWARDS[name], weight, name=name, settings=fixed))
        elif ":" in name and name.rsplit(":", 1)[1].isidentifier():
            terms.append(function_term(name, weight))
        else:
            known = ", ".join([*BUILTIN_REWARDS, *MODEL_TERMS, *SERVICE_TERMS])
            raise ValueError(f"env.rewards: unknown reward {name.split(':')[0]!r}; the built-in "
                             f"ones are {known}, or name a function as 'file.py:function'")
    names = [t.name for t in terms]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"env.rewards={text!r}: {', '.join(twice)} given twice")
    return terms
