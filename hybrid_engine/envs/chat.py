"""How a prompt becomes token ids: raw text, or through a chat template.

Job: `PromptFormat.ids(tokenizer, prompt)` templates and tokenizes a prompt
once (`apply_chat_template(..., add_generation_prompt=True)`), so the ids the
policy sees are exactly the template's, with no decode round trip.

    template 'auto'  the tokenizer's chat template if it has one, else raw text
             'none'  raw text (chat-message prompts are refused)
             PATH    a Jinja file used as the chat template

A text prompt under a template is one user message. `system_prompt` is put
first when the prompt has no system message of its own; `template_kwargs`
reach the template (e.g. enable_thinking=false for Qwen3).

`TaggedTurns` is the other way a multi-turn episode's turns are written: as
tags inside one assistant message (the calculator environment's
`<calc>EXPR</calc>` answered by `<result>VALUE</result>`), the prompt still
through the `PromptFormat`.

Invariant: every environment that templates (problem environments, the
multi-turn tool environment, the reward-model environment, evaluation) goes
through one `PromptFormat`, so training and evaluation prompts agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

__all__ = ["PromptFormat", "TaggedTurns"]

Prompt = str | Sequence[Mapping[str, str]]


@dataclass(frozen=True)
class PromptFormat:
    """Chat template settings (see the module docstring)."""

    template: str = "auto"
    system_prompt: str = ""
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    keeps_turn_end: ClassVar[bool] = False  # an assistant message's content is without it

    def __post_init__(self) -> None:
        if self.template not in ("auto", "none") and not Path(self.template).is_file():
            raise ValueError(f"env.chat_template={self.template!r}: no such file (a Jinja chat "
                             "template, or 'auto' / 'none')")

    def jinja(self, tokenizer: Any) -> str | None:
        """The template text in effect for tokenizer (None: raw text)."""
        if self.template == "none":
            return None
        if self.template == "auto":
            return getattr(tokenizer, "chat_template", None) or None
        return Path(self.template).read_text()

    def check(self, tokenizer: Any) -> None:
        """Refuses settings that would be silently ignored with this tokenizer, and a
        template that fails to render.

        Raises:
            ValueError: system_prompt or template_kwargs without a template in
                effect, or a template that raises on a one-message conversation.
        """
        if self.jinja(tokenizer) is None:
            for key, value in (("system_prompt", self.system_prompt),
                               ("chat_template_kwargs", self.template_kwargs)):
                if value:
                    why = ("env.chat_template=none" if self.template == "none"
                           else "the tokenizer has no chat template")
                    raise ValueError(f"env.{key} is set but no chat template is in effect "
                                     f"({why}); set env.chat_template=PATH.jinja or drop it")
            return
        self.ids(tokenizer, "1+1=")

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        """The conversation a prompt stands for, the system prompt first."""
        msgs = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                else [dict(m) for m in prompt])
        if self.system_prompt and not (msgs and msgs[0].get("role") == "system"):
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def ids(self, tokenizer: Any, prompt: Prompt, *,
            tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """A prompt's token ids (see the module docstring); tools: the JSON schemas
        the template lists for the model (`apply_chat_template(tools=...)`).

        Raises:
            ValueError: chat messages without a template in effect, or a template
                that fails to render them.
        """
        if tools:
            return self._encode(tokenizer, self.render(tokenizer, self.messages(prompt),
                                                       tools=tools, generation_prompt=True))
        jinja = self.jinja(tokenizer)
        if jinja is None:
            if not isinstance(prompt, str):
                raise ValueError("a prompt given as chat messages needs a chat template; "
                                 + ("env.chat_template=none" if self.template == "none"
                                    else "the tokenizer has none (set env.chat_template=PATH)"))
            out = tokenizer.encode(prompt, add_special_tokens=False)
            return list(getattr(out, "ids", out))
        try:
            out = tokenizer.apply_chat_template(
                self.messages(prompt), chat_template=jinja, add_generation_prompt=True,
                tokenize=True, **self.template_kwargs)
        except Exception as e:  # jinja2's TemplateError and whatever a template raises
            raise ValueError(f"the chat template ({self.template}) failed to render a prompt: "
                             f"{type(e).__name__}: {e}") from e
        return list(out["input_ids"] if isinstance(out, Mapping) else out)

    def render(self, tokenizer: Any, messages: Sequence[Mapping[str, Any]], *,
               tools: Sequence[Mapping[str, Any]] | None = None,
               generation_prompt: bool = False) -> str:
        """The template's text of a conversation (messages as given: no system
        prompt added).

        Raises:
            ValueError: no template in effect, or it fails to render them.
        """
        jinja = self.jinja(tokenizer)
        if jinja is None:
            raise ValueError("a multi-turn chat needs a chat template; "
                             + ("env.chat_template=none" if self.template == "none"
                                else "the tokenizer has none (set env.chat_template=PATH)"))
        try:
            return tokenizer.apply_chat_template(
                [dict(m) for m in messages], tools=list(tools) if tools else None,
                chat_template=jinja, add_generation_prompt=generation_prompt, tokenize=False,
                **self.template_kwargs)
        except Exception as e:  # jinja2's TemplateError and whatever a template raises
            raise ValueError(f"the chat template ({self.template}) failed to render a "
                             f"conversation: {type(e).__name__}: {e}") from e

    def continuation_ids(self, tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                         new: Sequence[Mapping[str, Any]], sampled_text: str, *,
                         tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The ids that follow a sampled assistant turn when `new` messages (tool
        results, a user's reply) and the next generation prompt are appended: what
        the template adds past `messages` (whose last one is that assistant turn),
        preceded by the end of the assistant turn the model did not sample itself
        (e.g. the newline after `<|im_end|>`). The sampled tokens are never
        re-encoded: only these new ids are.

        Args:
            messages: the conversation so far, its last message the assistant's turn.
            new: the messages to append.
            sampled_text: the assistant turn as sampled (decoded), for its ending.

        Raises:
            ValueError: a template that renders earlier messages differently once
                more follow (not append-only), so no continuation exists.
        """
        before = self.render(tokenizer, messages, tools=tools)
        after = self.render(tokenizer, [*messages, *new], tools=tools, generation_prompt=True)
        if not after.startswith(before):
            raise ValueError(f"the chat template ({self.template}) renders the conversation "
                             "differently once more messages follow it, so a turn's tokens "
                             "cannot be kept as sampled: use an append-only template")
        end = self._turn_end(tokenizer, tools)
        kept = next((n for n in range(len(end), 0, -1) if sampled_text.endswith(end[:n])), 0)
        return self._encode(tokenizer, end[kept:] + after[len(before):])

    def turn_ends(self, tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None,
                  ) -> tuple[str, ...]:
        """The text that closes an assistant turn in this template, stripped ("\x00":
        the template writes none, so only EOS does)."""
        return (self._turn_end(tokenizer, tools).rstrip() or "\x00",)

    def _turn_end(self, tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None) -> str:
        """What the template writes right after an assistant message's content."""
        mark = "\x00turn-end\x00"
        text = self.render(tokenizer, [{"role": "user", "content": "q"},
                                       {"role": "assistant", "content": mark}], tools=tools)
        return text[text.rindex(mark) + len(mark):]

    @staticmethod
    def _encode(tokenizer: Any, text: str) -> list[int]:
        out = tokenizer.encode(text, add_special_tokens=False)
        return list(getattr(out, "ids", out))


@dataclass(frozen=True)
class TaggedTurns:
    """A multi-turn episode written as tags inside one assistant message: the
    prompt is prompt_format's (templated, or raw text), a turn ends at one of
    turn_stop (kept in the assistant's content: the tags are the call's
    syntax) or at EOS, and each tool result comes back as raw text, `result`
    with "{}" replaced by its content. Offers what `envs.agent.ChatEnv` uses of
    a `PromptFormat`."""

    prompt_format: PromptFormat
    turn_stop: tuple[str, ...]
    result: str = "{}"

    keeps_turn_end: ClassVar[bool] = True

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        return self.prompt_format.messages(prompt)

    def ids(self, tokenizer: Any, prompt: Prompt, *,
            tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The prompt's ids (tools: not listed; the prompt says how to call). One
        user message without a template in effect is its raw text."""
        if (not isinstance(prompt, str) and len(prompt) == 1
                and self.prompt_format.jinja(tokenizer) is None):
            prompt = prompt[0]["content"]
        return self.prompt_format.ids(tokenizer, prompt)

    def continuation_ids(self, tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                         new: Sequence[Mapping[str, Any]], sampled_text: str, *,
                         tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The new messages' contents as results, right after the sampled tag."""
        text = "".join(self.result.replace("{}", str(m.get("content", ""))) for m in new)
        return PromptFormat._encode(tokenizer, text)

    def turn_ends(self, tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None,
                  ) -> tuple[str, ...]:
        return self.turn_stop
