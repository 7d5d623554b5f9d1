"""The tool demo (`hybrid-engine demo --task tools`): the tiny model learns to call a calculator.

Job: what the word-problem demo needs to run a multi-turn tool task instead:
- the task's files (`TOOL_TASK`): the demo's GSM8K-shaped word problems with
  3- and 4-digit operands, which the 4M-parameter model cannot add;
- the model (`TOOL_MODEL_SPEC`): the demo's, its tokenizer also holding the
  tool-call format's words as tokens;
- the chat template (`HERMES_NAMES_TEMPLATE`): Qwen2.5's hermes calls and
  `<tool_response>` turns, the tools listed by name so a prompt stays short;
- the warm start's traces (`ToolTraces`): a share `tool_share` of the problems
  call the built-in `calculator` and then answer with its result, the rest
  answer at once (the right answer, which the model mostly fails to learn);
  `copy_share` more traces call too, their calls out of the loss: they teach
  the answer after a tool's result without raising the share of calls;
- the RL phase's settings (`rl_overrides`): env.name=tools with the calculator,
  the hermes parser, two turns, each turn ending at `<|im_end|>`.

So RL starts from a policy that calls the tool now and then, and learns that
calling it pays: the held-out accuracy and the tool-call rate rise together.

Invariant: a trace is built by the RL phase's own environment (`envs.agent.ChatEnv`
with `ToolTask`, the calculator run in this process): the prompt's ids through
the template, each scripted turn's ids, the observations the template adds
(loss mask False), so the warm start trains on the token layout RL samples.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybrid_engine.demo.task import DEMO_MODEL_SPEC, WORDS, DemoTask
from hybrid_engine.models.templates import HERMES_NAMES_TEMPLATE
from hybrid_engine.models.tokenizer import SPECIAL_TOKENS

if TYPE_CHECKING:
    from hybrid_engine.trajectory import Trajectory

__all__ = ["END_OF_TURN_ID", "TOOL_MODEL_SPEC", "TOOL_TASK", "TOOL_WORDS", "ToolTraces",
           "call_text", "rl_overrides", "template_file"]

TOOL_TASK = DemoTask(num_eval=200, min_digits=3, max_digits=4)
"""3- and 4-digit additions, 200 held-out pairs."""

TOOL_WORDS: tuple[str, ...] = (
    "system", "<tools", "_call", ">calculator", "calculator", "</", "tools", ">\n", "<tool",
    "_response", "tool", ' {"', '{"', "name", '":', ' "', '",', "arguments", "expression",
    '"}}\n',
)
"""The hermes format's pieces as the split regex cuts them. A word whose inside holds
another's first two letters comes before it, so its merges win: "_call" before
"calculator" ("ca"), "calculator" before "tools" ("to"), ' {"' before '{"'."""


TOOL_MODEL_SPEC = replace(DEMO_MODEL_SPEC, vocab_size=512, words=WORDS + TOOL_WORDS)
"""The demo's 4M-parameter Qwen2, its vocabulary grown for the tool-call words."""

END_OF_TURN_ID = 256 + SPECIAL_TOKENS.index("<|im_end|>")
"""`<|im_end|>`: where a sampled turn ends (rollout.stop_token_ids)."""

_OPERANDS = re.compile(r"has (\d+) \w+ and buys (\d+) more")


def template_file(cache: str | Path) -> Path:
    """`HERMES_NAMES_TEMPLATE` as cache/hermes_names.jinja (written if it differs)."""
    path = Path(cache) / "hermes_names.jinja"
    if not path.is_file() or path.read_text() != HERMES_NAMES_TEMPLATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(HERMES_NAMES_TEMPLATE)
        tmp.replace(path)
    return path


def call_text(question: str) -> str:
    """The calculator call a trace makes for a question: its two operands added,
    as the template renders an assistant turn that only calls."""
    found = _OPERANDS.search(question)
    if found is None:
        raise ValueError(f"not a demo word problem: {question!r}")
    call = {"name": "calculator", "arguments": {"expression": "+".join(found.groups())}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def rl_overrides(template: str | Path) -> dict[str, Any]:
    """The RL phase's settings on top of the demo recipe (`demo.demo_config`)."""
    return {
        "env.name": "tools", "env.tools": "calculator", "env.tool_parser": "hermes",
        "env.chat_template": str(template), "env.tool_workers": 0, "env.max_turns": 2,
        "rollout.stop_token_ids": [END_OF_TURN_ID], "rollout.max_tokens": 32,
        "rollout.max_model_len": 160,
    }


class ToolTraces:
    """The warm start's training stream for the tool demo (see the module docstring).

    Args:
        tokenizer: the demo model's tokenizer.
        dataset: the training file; preprocess: its `env.preprocess`.
        chat_template: the template file.
        tool_share: the probability that a trace calls the calculator.
        copy_share: extra traces per trace that call, the call out of the loss.
        seed: the problems' shuffle and the call draws.
    """

    def __init__(self, tokenizer: Any, *, dataset: str, preprocess: str, chat_template: str,
                 tool_share: float, copy_share: float = 0.0, seed: int = 0) -> None:
        from hybrid_engine.envs.agent import ChatEnv, ToolTask
        from hybrid_engine.envs.chat import PromptFormat
        from hybrid_engine.envs.dataset import DatasetSpec
        from hybrid_engine.envs.reward_pool import RewardPool
        from hybrid_engine.tools.functions import load_tools
        from hybrid_engine.tools.parsers import tool_parser

        tools = load_tools("calculator")
        fmt = PromptFormat(chat_template)
        self.env = ChatEnv(tokenizer, ToolTask(tools, RewardPool(0, 0.0), prompt_format=fmt),
                           dataset=DatasetSpec(dataset, preprocess=preprocess),
                           parser=tool_parser("hermes"), tools=tools, max_turns=2,
                           seed=seed, prompt_format=fmt)
        self.tokenizer, self.share, self.copy_share = tokenizer, tool_share, copy_share
        self.eos_id = self.env.eos_id
        self._rng = random.Random(seed)

    def next(self, num: int) -> list[Trajectory]:
        """The next num training problems as traces, then round(num * copy_share)
        more that call, the call out of the loss (see `WarmStartConfig.copy_share`)."""
        out = [self._trace(ids, self._rng.random() < self.share, train_call=True)
               for ids in self.env.sample_prompts(num)]
        extra = self.env.sample_prompts(round(num * self.copy_share))
        return out + [self._trace(ids, True, train_call=False) for ids in extra]

    def _trace(self, ids: list[int], calls: bool, *, train_call: bool) -> Trajectory:
        from hybrid_engine.envs.base import decode

        state = self.env.reset(ids)
        if calls:
            self._turn(state, call_text(state.messages[-1]["content"]))
            answer = state.messages[-1]["content"]  # what the calculator returned
        else:
            answer = self.env.answer_for(decode(self.tokenizer, ids))
        self._turn(state, answer)
        assert state.done, "a trace ends after its answer"
        if calls and not train_call:  # the call's ids: the first sampled run of the mask
            call = state.loss_mask.index(False)
            state.loss_mask[:call] = [False] * call
        return self.env.build_trajectory(state)

    def _turn(self, state: Any, text: str) -> None:
        from hybrid_engine.envs.base import encode

        self.env.step(state, encode(self.tokenizer, text) + [END_OF_TURN_ID])
