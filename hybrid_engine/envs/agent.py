"""Multi-turn chat environments: a task written over chat messages, run token-in/token-out.

Job: `ChatEnv` runs a `ChatTask` (what a user writes: `reset(row) -> messages`,
`step(messages) -> (new messages, done, reward parts)`) as a
`MultiTurnEnvironment` of the rollout loop (`rollout/episodes.py`):

    prompt ids   = the chat template of task.reset(row), tools listed, with the
                   generation prompt (`PromptFormat.ids(..., tools=...)`)
    after a turn = the model's segment exactly as sampled (it ends at the end of
                   the model's turn: EOS or a rollout.stop string), parsed by the
                   tool-call parser into an assistant message for task.step
    observation  = the ids the template adds when task.step's messages and the
                   next generation prompt are appended (`PromptFormat.continuation_ids`):
                   sampled text is never decoded and encoded again

`ToolTask` is the built-in task: the model calls the tools `env.tools` names in
its own tool-call format (`env.tool_parser`); each call runs in a worker process
with a timeout (`envs.reward_pool.RewardPool`), and the results come back as
`{"role": "tool"}` messages in call order; a turn without calls ends the episode.

An episode ends when the task says so, when a segment does not end the model's
turn (cut by the token limit, or empty because the context is full), after
env.max_turns turns, or when the next observation would pass
env.max_episode_tokens (then `at_budget` decides its reward: kept, or 0).

Invariant: `response_ids` = the sampled segments and the observations in order,
`loss_mask` False exactly on observations. Tools must be deterministic: under the
turn loop every rank runs them on the same completions (per episode, once per
replica). A task's `step` may run in threads, several episodes at once, unless
the task sets `concurrent_steps = False`.
"""

from __future__ import annotations

import copy
import json
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from hybrid_engine.envs.base import ProblemEnv, decode, eos_token_id
from hybrid_engine.envs.bank import ProblemBank
from hybrid_engine.envs.chat import PromptFormat, TaggedTurns
from hybrid_engine.envs.dataset import DatasetSpec, Example
from hybrid_engine.envs.reward_pool import Call, RewardPool
from hybrid_engine.trajectory import Trajectory

__all__ = ["AT_BUDGET", "ChatEnv", "ChatEpisode", "ChatTask", "ToolTask"]

AT_BUDGET = ("keep", "zero")
"""What an episode cut by env.max_episode_tokens scores: its reward as it stands, or 0."""

Message = dict[str, Any]


@runtime_checkable
class ChatTask(Protocol):
    """A multi-turn task over chat messages (what `env.name=file.py:Class` names)."""

    def reset(self, row: Example) -> list[Message]:
        """The conversation an episode of this row starts from (its last message
        the user's)."""
        ...

    def step(self, messages: list[Message]) -> tuple[list[Message], bool, dict[str, float]]:
        """Answers the model's turn: messages is the conversation so far, its last
        the assistant's ({"role": "assistant", "content", and "tool_calls" when it
        called any}). Returns (messages to append, episode done, reward parts of
        this step, summed over the episode). Steps of different episodes may run
        at once in threads: a task that is not thread-safe sets a class
        attribute `concurrent_steps = False`."""
        ...


@dataclass(slots=True)
class ChatEpisode:
    """One episode in progress (response-local lists grow with every step)."""

    prompt_ids: list[int]
    messages: list[Message]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    parts: dict[str, float] = field(default_factory=dict)
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    num_tool_timeouts: int = 0
    num_observed: int = 0
    over_budget: bool = False
    final_text: str = ""
    done: bool = False


class ChatEnv(ProblemEnv):
    """A `ChatTask` as a multi-turn environment (see the module docstring).

    Args:
        tokenizer: a transformers tokenizer with a chat template (or one given by
            prompt_format).
        task: the `ChatTask`.
        dataset: where the rows come from (`envs.dataset.DatasetSpec`).
        parser: the tool-call parser (`tools.parsers`); None: no calls are parsed,
            the assistant message is the turn's text.
        tools: the tools the template lists for the model (`tools.functions.Tool`).
        max_turns: most model turns per episode (>= 1).
        max_episode_tokens: most response tokens of an episode, sampled and
            observed (0: bounded by max_model_len only).
        at_budget: what an episode cut by max_episode_tokens scores (`AT_BUDGET`).
        seed: shuffle seed (and generate's).
        prompt_format: how conversations become token ids: a `PromptFormat`
            (each turn a message of the chat template), or `TaggedTurns`
            (turns as tags inside one assistant message).
        name: the environment's name (messages, metrics).
        generate: where problems come from without a dataset (`ProblemBank`'s
            generator); None: dataset is required.
    """

    def __init__(self, tokenizer: Any, task: ChatTask, *, dataset: DatasetSpec | None,
                 parser: Any = None, tools: Sequence[Any] = (), max_turns: int = 4,
                 max_episode_tokens: int = 0, at_budget: str = "keep", seed: int = 0,
                 prompt_format: PromptFormat | TaggedTurns | None = None, name: str = "chat",
                 generate: Callable[[random.Random], Example] | None = None) -> None:
        if max_turns < 1 or max_episode_tokens < 0 or at_budget not in AT_BUDGET:
            raise ValueError(f"need env.max_turns >= 1, env.max_episode_tokens >= 0 and "
                             f"env.at_budget in {AT_BUDGET}; got {max_turns}, "
                             f"{max_episode_tokens}, {at_budget!r}")
        if (dataset is None or not dataset.path) and generate is None:
            raise ValueError(f"env.name={name!r} needs env.dataset_path (its problems)")
        self.name, self.tokenizer, self.task, self.parser = name, tokenizer, task, parser
        self.schemas = [t.schema for t in tools]
        self.max_turns, self.max_episode_tokens, self.at_budget = (
            max_turns, max_episode_tokens, at_budget)
        self.prompt_format = prompt_format or PromptFormat()
        # A segment ends where the model ends its turn, or at a tag's end (TaggedTurns).
        self.turn_stop = tuple(getattr(self.prompt_format, "turn_stop", ()))
        self.eos_id = eos_token_id(tokenizer)
        self.bank = ProblemBank(generate or self._no_generated, dataset=dataset, seed=seed,
                                name=name)
        self._conversations: dict[tuple[int, ...], list[Message]] = {}
        self._lock = threading.Lock()  # the tokenizer, the parser and the template

    @property
    def concurrent_steps(self) -> bool:
        """Whether the rollout loops may run steps of different episodes at once, in
        threads: unless the task says otherwise (`concurrent_steps = False`)."""
        return bool(getattr(self.task, "concurrent_steps", True))

    def close(self) -> None:
        """Stops what the task started (its tool workers)."""
        close = getattr(self.task, "close", None)
        if close is not None:
            close()

    def _no_generated(self, rng: Any) -> Example:
        raise AssertionError("a chat environment's problems come from its dataset")

    def _answer_from_prompt(self, prompt_text: str) -> str | None:
        return None  # every prompt is a dataset row's (`ProblemEnv.answer_for`)

    def _hand_out(self, examples: Sequence[Example]) -> list[list[int]]:
        """The rows' conversations (task.reset) as ids, tools listed; each remembered
        for its answer and its messages."""
        out = []
        for ex in examples:
            messages = self.prompt_format.messages(self.task.reset(ex))
            ids = self.prompt_format.ids(self.tokenizer, messages, tools=self.schemas or None)
            self.bank.remember(decode(self.tokenizer, ids), ex)
            self._conversations[tuple(ids)] = messages
            out.append(ids)
        return out

    def reset(self, prompt_ids: Sequence[int]) -> ChatEpisode:
        """A fresh episode for a prompt this environment handed out."""
        messages = self._conversations.get(tuple(prompt_ids))
        if messages is None:
            raise ValueError(f"environment {self.name!r}: a prompt it did not hand out "
                             "(a chat episode starts from its own conversations)")
        return ChatEpisode(prompt_ids=list(prompt_ids), messages=[dict(m) for m in messages])

    def save_episode(self, state: ChatEpisode) -> dict[str, Any]:
        """An episode in progress as plain data (partial rollouts park it)."""
        return asdict(state)

    def load_episode(self, data: dict[str, Any]) -> ChatEpisode:
        """The episode `save_episode` saved."""
        return ChatEpisode(**copy.deepcopy(data))

    def step(self, state: ChatEpisode, segment: Sequence[int]) -> tuple[list[int], bool]:
        """Records one sampled turn and answers it (see the module docstring).
        Steps of different episodes may run at once (`concurrent_steps`): the
        tokenizer is used under a lock, the task's step (the tools) outside it.

        Returns:
            (the observation's ids, maybe []; episode done).
        """
        assert not state.done, "step() on a finished episode"
        segment = list(segment)
        state.response_ids += segment
        state.loss_mask += [True] * len(segment)
        with self._lock:
            text = self.tokenizer.decode(segment, skip_special_tokens=False)  # kept as ids
            reply = self._assistant(state, text)
            ended = self._ended_turn(segment, text)
        state.final_text = reply["content"]
        if not ended:  # cut by the token limit, or no room left
            state.done = True
            return [], True
        state.messages.append(reply)
        state.num_turns += 1
        new, done, parts = self.task.step([dict(m) for m in state.messages])
        for k, v in parts.items():
            state.parts[k] = state.parts.get(k, 0.0) + float(v)
        if done or not new or state.num_turns >= self.max_turns:
            state.done = True
            return [], True
        with self._lock:
            obs = self.prompt_format.continuation_ids(self.tokenizer, state.messages, new, text,
                                                      tools=self.schemas or None)
        budget = self.max_episode_tokens
        if budget and len(state.response_ids) + len(obs) > budget:
            state.over_budget = state.done = True
            return [], True
        state.messages += [dict(m) for m in new]
        failed = [m.get("error") for m in new if m.get("role") == "tool" and m.get("error")]
        state.num_tool_errors += len(failed)
        state.num_tool_timeouts += failed.count("timeout")
        state.num_observed += len(obs)
        state.response_ids += obs
        state.loss_mask += [False] * len(obs)
        return obs, False

    def _ended_turn(self, segment: list[int], text: str) -> bool:
        """Whether the segment ends the model's turn (EOS, or a stop string it kept)."""
        return bool(segment) and (segment[-1] == self.eos_id or text.endswith(self._turn_ends()))

    def _turn_ends(self) -> tuple[str, ...]:
        """The texts that close a turn (`PromptFormat.turn_ends`, `TaggedTurns`')."""
        return self.prompt_format.turn_ends(self.tokenizer, self.schemas or None)

    def _assistant(self, state: ChatEpisode, text: str) -> Message:
        """The assistant message of a sampled turn: its text less the turn's end
        (unless the format keeps it: tags), and the tool calls the parser finds in it."""
        end = next((e for e in self._turn_ends() if text.endswith(e)), "")
        body = text[: -len(end)] if end and not self.prompt_format.keeps_turn_end else text
        eos = self.tokenizer.decode([self.eos_id], skip_special_tokens=False)
        body = body[: -len(eos)] if eos and body.endswith(eos) else body
        if self.parser is None:
            return {"role": "assistant", "content": body}
        parsed = self.parser.parse(body)
        state.num_tool_calls += len(parsed.calls) + len(parsed.errors)
        state.num_tool_errors += len(parsed.errors)
        msg: Message = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            msg["tool_calls"] = [{"type": "function", "function": {
                "name": c.name, "arguments": c.arguments}} for c in parsed.calls]
        if parsed.errors:
            msg["tool_call_errors"] = list(parsed.errors)
        return msg

    def build_trajectory(self, state: ChatEpisode, policy_logp: Sequence[float] | None = None,
                         group_id: int = 0) -> Trajectory:
        """The episode as a Trajectory: observations in response_ids with loss_mask
        False; its counts, reward parts and final answer in info."""
        num_policy = sum(state.loss_mask)
        logp = [0.0] * num_policy if policy_logp is None else list(policy_logp)
        if len(logp) != num_policy:
            raise ValueError(f"policy_logp has {len(logp)} entries, episode has {num_policy}")
        it = iter(logp)
        return Trajectory(
            prompt_ids=list(state.prompt_ids), response_ids=list(state.response_ids),
            rollout_logp=[next(it) if m else 0.0 for m in state.loss_mask],
            loss_mask=list(state.loss_mask), group_id=group_id,
            info={"num_turns": state.num_turns, "num_tool_calls": state.num_tool_calls,
                  "num_tool_errors": state.num_tool_errors,
                  "num_tool_timeouts": state.num_tool_timeouts,
                  "observation_tokens": state.num_observed, "over_budget": state.over_budget,
                  "episode_parts": dict(state.parts), "final_text": state.final_text})

    def final_text(self, traj: Trajectory) -> str:
        """The episode's answer: its last turn's text (what reward terms score)."""
        return str(traj.info.get("final_text", ""))

    def _reward(self, traj: Trajectory, prompt_text: str) -> dict[str, float]:
        """The reward parts the task returned over the episode; all 0 when the
        episode passed its token budget and at_budget is 'zero'."""
        parts = {k: float(v) for k, v in traj.info.get("episode_parts", {}).items()}
        if self.scores_zero(traj):
            parts = {k: 0.0 for k in parts}
        return parts or {"episode": 0.0}

    def scores_zero(self, traj: Trajectory) -> bool:
        """The episode passed env.max_episode_tokens and env.at_budget is 'zero'."""
        return bool(traj.info.get("over_budget")) and self.at_budget == "zero"


class ToolTask:
    """The built-in `ChatTask`: the row's prompt as the conversation, the model's
    tool calls answered by the tools (see the module docstring).

    Args:
        tools: the tools (`tools.functions.Tool`), each with the spec it loads from.
        pool: where calls run (workers with timeouts; workers=0: in this process).
        prompt_format: puts the system prompt first.
        error_penalty: reward part `tool_errors` = -error_penalty per failed call
            (0: no such part).
    """

    def __init__(self, tools: Sequence[Any], pool: RewardPool, *,
                 prompt_format: PromptFormat | None = None, error_penalty: float = 0.0) -> None:
        self.tools = {t.name: t for t in tools}
        self.pool, self.error_penalty = pool, error_penalty
        self.prompt_format = prompt_format or PromptFormat()
        pool.start()  # the workers spawn now, before the engine starts in this process

    def reset(self, row: Example) -> list[Message]:
        return self.prompt_format.messages(row.prompt)

    def close(self) -> None:
        """Stops the tool workers."""
        self.pool.close()

    def step(self, messages: list[Message]) -> tuple[list[Message], bool, dict[str, float]]:
        """Runs the last assistant turn's calls in call order; no call ends the episode."""
        turn = messages[-1]
        calls = [c["function"] for c in turn.get("tool_calls", [])]
        bad = list(turn.get("tool_call_errors", []))
        if not calls and not bad:
            return [], True, {}
        results = self._run(calls)
        failed = len(bad) + sum(1 for r in results if r.get("error"))
        # Calls the parser could not read are counted by the environment already.
        results += [{"role": "tool", "name": "", "content": f"error: {e}"} for e in bad]
        parts = {"tool_errors": -self.error_penalty * failed} if self.error_penalty else {}
        return results, False, parts

    def _run(self, calls: list[Mapping[str, Any]]) -> list[Message]:
        """One tool message per call, in call order (valid calls run together)."""
        from hybrid_engine.tools.functions import validate_arguments

        out: list[Message | None] = []
        todo: list[tuple[int, Call]] = []
        for c in calls:
            tool = self.tools.get(c["name"])
            problem = (f"unknown tool {c['name']!r} (tools: {', '.join(self.tools)})"
                       if tool is None else validate_arguments(tool, c["arguments"]))
            if problem:
                out.append({"role": "tool", "name": c["name"], "content": f"error: {problem}",
                            "error": "arguments"})
            else:
                todo.append((len(out), Call(tool.spec, (), {**c["arguments"], **tool.settings})))
                out.append(None)
        for (i, call), got in zip(todo, self.pool.run([c for _, c in todo]), strict=True):
            name = calls[i]["name"]
            if got.kind == "ok":
                out[i] = {"role": "tool", "name": name, "content": _as_text(got.value)}
            else:
                why = "timed out" if got.kind == "timeout" else got.value
                out[i] = {"role": "tool", "name": name, "content": f"error: {why}",
                          "error": got.kind}
        return [m for m in out if m is not None]


def _as_text(value: Any) -> str:
    """A tool's result as the tool message's content."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
