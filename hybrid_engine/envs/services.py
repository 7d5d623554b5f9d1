"""Reward terms served from outside the process: a scoring endpoint and an LLM judge.

Job: score a rank's share of the samples over HTTP, each sample once, with a
bound on every request and on the requests in flight, so a service that is
down, slow or broken costs its samples env.reward_on_timeout, never the run.

    http   `HttpReward`: POSTs env.reward_url, env.service_batch_size samples
           per request (requests, with urllib3's retries and backoff)
    judge  `JudgeReward`: one chat completion per sample from an
           OpenAI-compatible server (the openai client, its own retries),
           the score read from the reply with env.judge_pattern

The http term's request body and its reply (docs/rewards.md#services):

    POST env.reward_url   {"samples": [{"prompt": str, "completion": str,
                                        "answer": str | null, "columns": {...}}, ...]}
    200                   {"rewards": [number | {name: number}, ...]}  one per sample, in order

Outcomes (`reward_pool.Outcome`), one per sample, in order:

    ok        the score (a number, or named parts)
    timeout   the request failed after env.service_retries retries: no
              connection, past env.service_timeout_s, a 4xx/5xx status, a
              reply that is not that JSON (malformed, wrong length, not numbers)
    unparsed  the judge replied without a score: env.judge_on_unparsed

The first failure of each scorer is logged once (the metrics count them all).
"""

from __future__ import annotations

import logging
import math
import os
import re
import string
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybrid_engine.envs.reward_pool import Outcome

__all__ = ["DEFAULT_JUDGE_TEMPLATE", "HttpReward", "JudgeReward", "ServiceLimits",
           "judge_template", "services"]

log = logging.getLogger(__name__)

DEFAULT_JUDGE_TEMPLATE = (
    "You are grading a response to a task.\n\n"
    "Task:\n{prompt}\n\n"
    "Reference answer (may be empty):\n{answer}\n\n"
    "Response:\n{completion}\n\n"
    "Rate how well the response solves the task, from 0 (wrong or useless) to 10 "
    "(fully correct and clear). Reply with one line: Score: <0-10>")
_FIELDS = {"prompt", "completion", "answer"}

Sample = tuple[str, str, "str | None", Mapping[str, Any]]  # prompt, completion, answer, columns


@dataclass(frozen=True)
class ServiceLimits:
    """Bounds of every request: env.service_timeout_s, _retries, _concurrency,
    _batch_size."""

    timeout_s: float = 30.0
    retries: int = 2
    concurrency: int = 8
    batch_size: int = 32


def _is_score(x: object) -> bool:
    if isinstance(x, Mapping):
        return bool(x) and all(_is_score(v) for v in x.values()) and all(
            not isinstance(v, Mapping) for v in x.values())
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class _FirstFailure:
    """Logs a scorer's first failure, once (later ones are only counted)."""

    def __init__(self, what: str) -> None:
        self.what, self.said = what, False

    def __call__(self, error: str) -> Outcome:
        if not self.said:
            self.said = True
            log.warning("%s: %s; its samples score env.reward_on_timeout (reward/timeouts "
                        "counts them; later failures are not logged)", self.what, error)
        return Outcome("timeout", error)


class HttpReward:
    """The http term: a rank's samples POSTed to url in batches (module docstring).

    Args:
        url: env.reward_url.
        limits: the requests' bounds.
    """

    def __init__(self, url: str, limits: ServiceLimits) -> None:
        import requests
        from requests.adapters import HTTPAdapter
        from urllib3.util.retry import Retry

        self.url, self.limits = url, limits
        retry = Retry(total=limits.retries, backoff_factor=0.25, allowed_methods=None,
                      status_forcelist=range(500, 600), raise_on_status=False)
        self.session = requests.Session()
        adapter = HTTPAdapter(max_retries=retry, pool_maxsize=limits.concurrency)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self._fail = _FirstFailure(f"env.reward_url={url!r}")

    def __call__(self, samples: Sequence[Sample]) -> list[Outcome]:
        n = self.limits.batch_size
        batches = [samples[i:i + n] for i in range(0, len(samples), n)]
        with ThreadPoolExecutor(self.limits.concurrency) as pool:
            return [o for outcomes in pool.map(self._post, batches) for o in outcomes]

    def _post(self, batch: Sequence[Sample]) -> list[Outcome]:
        import requests

        body = {"samples": [{"prompt": p, "completion": c, "answer": a, "columns": dict(cols)}
                            for p, c, a, cols in batch]}
        try:
            reply = self.session.post(self.url, json=body, timeout=self.limits.timeout_s)
            reply.raise_for_status()
            rewards = reply.json()["rewards"]
        except (requests.RequestException, ValueError, KeyError, TypeError) as e:
            return [self._fail(f"{type(e).__name__}: {e}")] * len(batch)
        if not isinstance(rewards, list) or len(rewards) != len(batch):
            got = len(rewards) if isinstance(rewards, list) else type(rewards).__name__
            return [self._fail(f"'rewards' must be a list of {len(batch)} (one per sample), "
                               f"got {got}")] * len(batch)
        return [Outcome("ok", r) if _is_score(r) else self._fail(
            f"a reward must be a finite number or a mapping of them, got {r!r}") for r in rewards]


class JudgeReward:
    """The judge term: one chat completion per sample (module docstring).

    Args:
        url: env.judge_url (an OpenAI-compatible API base, e.g. http://host:8000/v1).
        model: env.judge_model ('' = the first model the server lists).
        template: the prompt (`judge_template`).
        pattern: env.judge_pattern (group 1 is the score).
        score_range: env.judge_range (lo, hi).
        on_unparsed: env.judge_on_unparsed.
        max_tokens: env.judge_max_tokens.
        limits: the requests' bounds.
    """

    def __init__(self, url: str, *, model: str, template: str, pattern: str,
                 score_range: tuple[float, float], on_unparsed: float, max_tokens: int,
                 limits: ServiceLimits) -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                             timeout=limits.timeout_s, max_retries=limits.retries)
        self.model, self.template, self.pattern = model, template, re.compile(pattern)
        self.range, self.on_unparsed, self.max_tokens = score_range, on_unparsed, max_tokens
        self.limits = limits
        self._fail = _FirstFailure(f"env.judge_url={url!r}")

    def __call__(self, samples: Sequence[Sample]) -> list[Outcome]:
        if samples and not self.model:
            try:
                self.model = self.client.models.list().data[0].id
            except Exception as e:  # noqa: BLE001 -- the openai client's errors, an empty list
                return [self._fail(f"listing its models: {type(e).__name__}: {e}")] * len(samples)
        with ThreadPoolExecutor(self.limits.concurrency) as pool:
            return list(pool.map(self._judge, samples))

    def _judge(self, sample: Sample) -> Outcome:
        import openai

        prompt, completion, answer, _ = sample
        text = self.template.format(prompt=prompt, completion=completion, answer=answer or "")
        try:
            reply = self.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": text}],
                temperature=0.0, max_tokens=self.max_tokens)
            content = reply.choices[0].message.content or ""
        except (openai.OpenAIError, IndexError, AttributeError) as e:
            return self._fail(f"{type(e).__name__}: {e}")
        return self.score(content)

    def score(self, reply: str) -> Outcome:
        """The term's outcome of one reply: (score - lo) / (hi - lo) clipped to
        [0, 1], or "unparsed" (env.judge_on_unparsed) without a score."""
        found = self.pattern.search(reply)
        try:
            value = float(found.group(1)) if found else math.nan
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            return Outcome("unparsed", self.on_unparsed)
        lo, hi = self.range
        return Outcome("ok", min(max((value - lo) / (hi - lo), 0.0), 1.0))


def judge_template(value: str) -> str:
    """env.judge_template's text: itself, the file it names, or the built-in one.

    Raises:
        ValueError: it has no {completion}, or a placeholder other than
            {prompt}, {completion}, {answer}.
    """
    text = DEFAULT_JUDGE_TEMPLATE if not value else (
        Path(value).read_text() if os.path.isfile(value) else value)
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
    except ValueError as e:
        raise ValueError(f"env.judge_template: {e} (write a literal brace as {{{{ or }}}})") from None
    if "completion" not in names or names - _FIELDS:
        raise ValueError(f"env.judge_template needs the placeholder {{completion}} and may use "
                         f"{{prompt}} and {{answer}}; it has "
                         f"{', '.join('{' + n + '}' for n in sorted(names)) or 'none'}")
    return text


def services(cfg: Any, names: Sequence[str]) -> dict[str, Callable[[Sequence[Sample]], list]]:
    """The scorers of the service terms among names (cfg: the env section)."""
    limits = ServiceLimits(cfg.service_timeout_s, cfg.service_retries,
                           cfg.service_concurrency, cfg.service_batch_size)
    out: dict[str, Callable[[Sequence[Sample]], list]] = {}
    if "http" in names:
        out["http"] = HttpReward(cfg.reward_url, limits)
    if "judge" in names:
        out["judge"] = JudgeReward(
            cfg.judge_url, model=cfg.judge_model, template=judge_template(cfg.judge_template),
            pattern=cfg.judge_pattern, score_range=tuple(cfg.judge_range),
            on_unparsed=cfg.judge_on_unparsed, max_tokens=cfg.judge_max_tokens, limits=limits)
    return out
