"""The calculator environment (`env.name=tool`): the policy may call `<calc>EXPR</calc>`.

Job: `CalcEnv`, a `ChatEnv` (envs/agent.py) whose turns are tags inside one
assistant message (`envs.chat.TaggedTurns`): a segment ends at `</calc>`
(kept) or EOS; the `calc` tool-call parser reads each `<calc>EXPR</calc>` as a
call of the built-in `calculator` tool (`tools.calculator`, a small integer
parser, never `eval`), which `envs.agent.ToolTask` runs in this process; its
result comes back as the environment tokens `<result>VALUE</result>`
(`<result>error: ...</result>` for a bad expression: errors are results and
never crash the rollout). A turn without a call ends the episode, as does one
cut by the token limit, and env.max_turns model turns.

Problems are generated ("Compute 3*(4+5)-7. You may call <calc>EXPR</calc>.
Answer with the integer.") unless a dataset is given; the prompt goes through
the chat template when one is in effect, the turns stay raw text inside the
assistant's message.

Reward: {"correct": 1.0} when the final answer (the last turn's text, cut at
the first newline, stripped) is an integer equal to the reference, else
{"correct": 0.0}.

Invariant: `ChatEnv`'s: `response_ids` = policy and env tokens in order,
`loss_mask` False exactly on env tokens; sampled text is never re-encoded.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from hybrid_engine.envs.agent import ChatEnv, ChatEpisode, ToolTask
from hybrid_engine.envs.base import decode
from hybrid_engine.envs.chat import PromptFormat, TaggedTurns
from hybrid_engine.envs.dataset import DatasetSpec, Example
from hybrid_engine.envs.reward_pool import RewardPool
from hybrid_engine.tools.calculator import calculate
from hybrid_engine.trajectory import Trajectory

__all__ = ["CALC_RESULT", "CALC_STOP", "CalcEnv"]

CALC_STOP = ("</calc>",)
"""Where a segment that calls the calculator ends (kept in the segment)."""
CALC_RESULT = "<result>{}</result>"
"""How a result comes back ("{}": the calculator's answer)."""

_INT = re.compile(r"[+-]?[0-9]+")
_PROMPT_EXPR = re.compile(r"^Compute (.+?)\.", re.MULTILINE)  # its own line if templated


class CalcEnv(ChatEnv):
    """The calculator environment; see the module docstring.

    Args:
        tokenizer: `tokenizers.Tokenizer` or a transformers tokenizer.
        seed: generation / shuffle seed.
        dataset: where the problems come from (`envs.dataset.DatasetSpec`, or a
            path); None = generated.
        max_turns: most model turns per episode (>= 1): max_turns - 1 calls
            and an answer.
        max_episode_tokens, at_budget: the episode's token budget and what an
            episode cut by it scores (`ChatEnv`'s).
        num_operands: most operands of a generated problem (>= 2).
        max_operand: largest operand of a generated problem.
        prompt_format: how prompts become token ids (`envs.chat.PromptFormat`;
            None = the tokenizer's chat template if it has one).
    """

    def __init__(
        self, tokenizer: Any, *, seed: int = 0, dataset: DatasetSpec | str | None = None,
        max_turns: int = 4, num_operands: int = 3, max_operand: int = 99,
        prompt_format: PromptFormat | None = None, max_episode_tokens: int = 0,
        at_budget: str = "keep",
    ) -> None:
        from hybrid_engine.tools.functions import load_tools
        from hybrid_engine.tools.parsers import tool_parser

        if max_turns < 1 or num_operands < 2 or max_operand < 1:
            raise ValueError(
                f"need max_turns >= 1, num_operands >= 2, max_operand >= 1; "
                f"got {max_turns}, {num_operands}, {max_operand}"
            )
        prompt_format = prompt_format or PromptFormat()
        prompt_format.check(tokenizer)
        self.num_operands, self.max_operand = num_operands, max_operand
        turns = TaggedTurns(prompt_format, CALC_STOP, CALC_RESULT)
        task = ToolTask(load_tools("calculator"), RewardPool(0, 0.0), prompt_format=turns)
        if isinstance(dataset, str):
            dataset = DatasetSpec(dataset) if dataset else None
        super().__init__(tokenizer, task, dataset=dataset, parser=tool_parser("calc"),
                         max_turns=max_turns, max_episode_tokens=max_episode_tokens,
                         at_budget=at_budget, seed=seed, prompt_format=turns, name="tool",
                         generate=self._generate)

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

    def reset(self, prompt_ids: Sequence[int]) -> ChatEpisode:
        """A fresh episode for a prompt, handed out by this environment or not
        (the turns need no conversation: results follow the tags as raw text)."""
        if tuple(prompt_ids) in self._conversations:
            return super().reset(prompt_ids)
        text = decode(self.tokenizer, prompt_ids)
        return ChatEpisode(prompt_ids=list(prompt_ids),
                           messages=[{"role": "user", "content": text}])

    def _reward(self, traj: Trajectory, prompt_text: str) -> dict[str, float]:
        if self.scores_zero(traj):
            return {"correct": 0.0}
        text = self.final_text(traj).partition("\n")[0].strip()
        expected = self.answer_for(prompt_text)
        if _INT.fullmatch(text) and _INT.fullmatch(expected):
            correct = int(text) == int(expected)
        else:
            correct = text == expected
        return {"correct": 1.0 if correct else 0.0}
