"""The error of a prompt too long for its completion, kept light to import.

Job: `PromptTooLong` is what `VLLMRollout.prompt_ids` raises under
rollout.prompt_too_long=reject. It carries the prompt's position in the call,
so `episodes.collect`, which knows the environment the prompts came from, can
say where the prompt is (a dataset's file and row) in place of its position.

Invariant: the message reads 'prompt i has N tokens, more than ... (set
rollout.prompt_too_long=truncate ...)' until a caller names the prompt's
origin: '<origin>: its prompt has N tokens, ...', as the preflight says it of
the rows it reads.
"""

from __future__ import annotations

__all__ = ["PromptTooLong"]


class PromptTooLong(ValueError):
    """A prompt with no room left for its completion (rollout.prompt_too_long=reject).

    Args:
        index: the prompt's position among the call's prompts.
        detail: what is wrong after 'has': 'N tokens, more than ...'.
        where: the prompt's origin (e.g. "env.dataset_path='d.jsonl', row 12");
            None: its position.
    """

    def __init__(self, index: int, detail: str, where: str | None = None) -> None:
        self.index, self.detail = index, detail
        super().__init__(f"prompt {index} has {detail}" if where is None
                         else f"{where}: its prompt has {detail}")
