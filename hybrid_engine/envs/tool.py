"""Multi-turn calculator-tool environment: the policy may call `<calc>EXPR</calc>`.

Job: between generation segments, find the policy's calculator call, evaluate
it with `tools.calculator.calculate` (a small integer parser, never `eval`) and hand back the
environment tokens `<result>VALUE</result>` to append; assemble the episode
into a `Trajectory` whose env tokens carry loss_mask False; reward the final
answer.

Episode protocol (a rollout loop alternates generation and `step`; a natural
vLLM setting is stop=["</calc>"] with the stop string kept in the output):

    state = env.reset(prompt_ids)
    while not done:
        new_ids = generate(prompt_ids + state.response_ids)
        env_ids, done = env.step(state, new_ids)
    traj = env.build_trajectory(state, policy_logp)

`step` on a segment: an EOS token ends the episode (what precedes EOS in the
segment is the final answer); else a complete `<calc>...</calc>` gets its
result appended (a turn; the episode ends after `max_turns` of them); else
(the segment was cut by the token limit) the episode ends with that segment as
the final answer. Errors (division by zero, bad syntax) are results too:
`<result>error: division by zero</result>`; they never crash the rollout.

Reward: {"correct": 1.0} when the final answer (the response after the last
env token, cut at EOS and at the first newline, stripped) is an integer equal
to the reference, else {"correct": 0.0}.

Invariant: `response_ids` = policy and env tokens in order, and
`loss_mask[j]` is False exactly on env tokens, so scoring needs nothing but
the trajectory.
"""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hybrid_engine.envs.base import ProblemEnv, decode, encode, eos_token_id
from hybrid_engine.envs.bank import ProblemBank
from hybrid_engine.envs.chat import PromptFormat
from hybrid_engine.envs.dataset import DatasetSpec, Example
from hybrid_engine.tools.calculator import CalcError, calculate
from hybrid_engine.trajectory import Trajectory

__all__ = ["ToolEnv", "ToolEpisode"]

_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_INT = re.compile(r"[+-]?[0-9]+")
_PROMPT_EXPR = re.compile(r"^Compute (.+?)\.", re.MULTILINE)  # its own line if templated


@dataclass(slots=True)
class ToolEpisode:
    """One episode in progress; response-local fields grow with every step."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    num_turns: int = 0
    num_tool_errors: int = 0
    done: bool = False


class ToolEnv(ProblemEnv):
    """`Environment` with calculator calls; see the module docstring.

    Args:
        tokenizer: `tokenizers.Tokenizer` or a transformers tokenizer.
        seed: generation / shuffle seed.
        dataset: where the problems come from (`envs.dataset.DatasetSpec`, or a
            path); None = generated.
        max_turns: most tool calls per episode (>= 1).
        num_operands: most operands of a generated problem (>= 2).
        max_operand: largest operand of a generated problem.
        prompt_format: how prompts become token ids (`envs.chat.PromptFormat`;
            None = the tokenizer's chat template if it has one).
    """

    name = "tool"
    turn_stop = ("</calc>",)  # a generation segment ends at a tool call (episodes.collect)

    def __init__(
        self, tokenizer: Any, *, seed: int = 0, dataset: DatasetSpec | str | None = None,
        max_turns: int = 4, num_operands: int = 3, max_operand: int = 99,
        prompt_format: PromptFormat | None = None,
    ) -> None:
        if max_turns < 1 or num_operands < 2 or max_operand < 1:
            raise ValueError(
                f"need max_turns >= 1, num_operands >= 2, max_operand >= 1; "
                f"got {max_turns}, {num_operands}, {max_operand}"
            )
        self.tokenizer, self.eos_id = tokenizer, eos_token_id(tokenizer)
        self.prompt_format = prompt_format or PromptFormat()
        self.prompt_format.check(tokenizer)
        self.max_turns, self.num_operands, self.max_operand = max_turns, num_operands, max_operand
        if isinstance(dataset, str):
            dataset = DatasetSpec(dataset) if dataset else None
        self.bank = ProblemBank(self._generate, dataset=dataset, seed=seed, name=self.name)

    def _generate(self, rng: random.Random) -> Example:
        expr = str(rng.randint(0, self.max_operand))
        for _ in range(rng.randint(2, self.num_operands) - 1):
            operand = str(rng.randint(0, self.max_operand))
            if rng.random() < 0.3:
                operand = f"({operand}{rng.choice('+-')}{rng.randint(0, self.max_operand)})"
            expr += rng.choice("+-*") + operand
        prompt = f"Compute {expr}. You may call <calc>EXPR</calc>. Answer with the integer.\n"
        return Example(prompt=prompt, answer=calculate(expr))

    def _answer_from_prompt(self, prompt_text: str) -> str | None:
        m = _PROMPT_EXPR.search(prompt_text)
        return None if m is None else calculate(m[1])

    def reset(self, prompt_ids: Sequence[int]) -> ToolEpisode:
        """A fresh episode for one prompt."""
        return ToolEpisode(prompt_ids=list(prompt_ids))

    def save_episode(self, state: ToolEpisode) -> dict[str, Any]:
        """An episode in progress as plain data (partial rollouts park it)."""
        return asdict(state)

    def load_episode(self, data: dict[str, Any]) -> ToolEpisode:
        """The episode `save_episode` saved."""
        return ToolEpisode(**copy.deepcopy(data))

    def step(self, state: ToolEpisode, new_policy_tokens: Sequence[int]) -> tuple[list[int], bool]:
        """Appends one generation segment, and the tool's answer if it called the tool.

        Args:
            state: the episode (mutated: response_ids, loss_mask, counters, done).
            new_policy_tokens: the tokens the policy generated since the last step.

        Returns:
            (env token ids appended after the segment, maybe []; episode done).
        """
        assert not state.done, "step() on a finished episode"
        segment = list(new_policy_tokens)
        state.response_ids += segment
        state.loss_mask += [True] * len(segment)
        call = None if self.eos_id in segment else _CALL.search(decode(self.tokenizer, segment))
        if call is None:
            state.done = True
            return [], True
        try:
            result = calculate(call[1])
        except CalcError as exc:
            result, state.num_tool_errors = f"error: {exc}", state.num_tool_errors + 1
        return self._reply(state, result)

    def _reply(self, state: ToolEpisode, result: str) -> tuple[list[int], bool]:
        """Appends `<result>RESULT</result>` as env tokens (out of the loss); one turn."""
        env_ids = encode(self.tokenizer, f"<result>{result}</result>")
        state.response_ids += env_ids
        state.loss_mask += [False] * len(env_ids)
        state.num_turns += 1
        state.done = state.num_turns >= self.max_turns
        return env_ids, state.done

    def build_trajectory(
        self, state: ToolEpisode, policy_logp: Sequence[float] | None = None, group_id: int = 0
    ) -> Trajectory:
        """The episode as a Trajectory (env tokens in response_ids, loss_mask False).

        Args:
            state: the episode.
            policy_logp: sampling log-probs of the policy tokens only, in order
                (one per True in loss_mask); None = zeros. Env tokens get 0.
            group_id: the prompt group.
        """
        num_policy = sum(state.loss_mask)
        logp = [0.0] * num_policy if policy_logp is None else list(policy_logp)
        if len(logp) != num_policy:
            raise ValueError(f"policy_logp has {len(logp)} entries, episode has {num_policy}")
        it = iter(logp)
        rollout_logp = [next(it) if m else 0.0 for m in state.loss_mask]
        return Trajectory(
            prompt_ids=list(state.prompt_ids), response_ids=list(state.response_ids),
            rollout_logp=rollout_logp, loss_mask=list(state.loss_mask), group_id=group_id,
            info={"num_turns": state.num_turns, "num_tool_errors": state.num_tool_errors},
        )

    def _reward(self, traj: Trajectory, prompt_text: str) -> dict[str, float]:
        mask = list(traj.loss_mask)
        start = len(mask) - mask[::-1].index(False) if False in mask else 0
        final = list(traj.response_ids[start:])
        if self.eos_id in final:
            final = final[: final.index(self.eos_id)]
        text = decode(self.tokenizer, final).partition("\n")[0].strip()
        expected = self.answer_for(prompt_text)
        if _INT.fullmatch(text) and _INT.fullmatch(expected):
            correct = int(text) == int(expected)
        else:
            correct = text == expected
        return {"correct": 1.0 if correct else 0.0}

