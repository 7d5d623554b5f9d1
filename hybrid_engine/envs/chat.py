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

Invariant: every environment that templates (problem environments, the
multi-turn tool environment, the reward-model environment, evaluation) goes
through one `PromptFormat`, so training and evaluation prompts agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PromptFormat"]

Prompt = str | Sequence[Mapping[str, str]]


@dataclass(frozen=True)
class PromptFormat:
    """Chat template settings (see the module docstring)."""

    template: str = "auto"
    system_prompt: str = ""
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)

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

    def ids(self, tokenizer: Any, prompt: Prompt) -> list[int]:
        """A prompt's token ids (see the module docstring).

        Raises:
            ValueError: chat messages without a template in effect, or a template
                that fails to render them.
        """
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
