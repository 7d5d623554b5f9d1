"""Prompt/answer datasets in JSONL and a resumable, seeded cursor over them.

Job: read `{"prompt": str, "answer": str | int}` records, one JSON object per
line, into `Example`s; and hand out item indices epoch after epoch in a
seeded order (`EpochCursor`) whose position can be checkpointed.

Invariant: the order is a pure function of (seed, epoch), and the cursor's
state is just (epoch, position): a cursor restored from `state_dict()` yields
exactly the indices the saved one would have yielded next. A malformed file
is a `ValueError` naming the file and the 1-based line number.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["EpochCursor", "Example", "load_jsonl"]


@dataclass(frozen=True, slots=True)
class Example:
    """One problem: the prompt text and its reference answer (as text)."""

    prompt: str
    answer: str


def _parse_line(line: str, where: str) -> Example:
    """One JSONL line -> Example; `where` is "file:line" for error messages."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("prompt", "answer") if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing key(s) {', '.join(map(repr, missing))}")
    prompt, answer = obj["prompt"], obj["answer"]
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
    # bool is an int subclass; an answer of `true` is almost surely a mistake.
    if isinstance(answer, bool) or not isinstance(answer, (str, int)):
        raise ValueError(
            f"{where}: 'answer' must be a string or an integer, got {type(answer).__name__}"
        )
    return Example(prompt=prompt, answer=str(answer).strip())


def load_jsonl(path: str | os.PathLike) -> list[Example]:
    """Reads a JSONL file of `{"prompt": ..., "answer": ...}` objects.

    Blank lines are skipped; other keys in an object are ignored.

    Args:
        path: the file.

    Returns:
        The examples, in file order.

    Raises:
        ValueError: missing file, malformed JSON, a missing key, a wrong type,
            or no record at all; the message names the file (and the line).
    """
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{file}: dataset file not found")
    examples = []
    with file.open("rb") as f:  # bytes: a bad line is reported with its number
        for line_no, raw in enumerate(f, start=1):
            try:  # utf-8-sig: a byte-order mark (editors on Windows) is accepted
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{file}:{line_no}: not valid UTF-8 ({e.reason} at byte "
                                 f"{e.start})") from None
            if line.strip():
                examples.append(_parse_line(line, f"{file}:{line_no}"))
    if not examples:
        raise ValueError(f"{file}: dataset is empty (no JSON record)")
    return examples


class EpochCursor:
    """Infinite stream of indices in [0, num_items): a seeded permutation per epoch.

    Args:
        num_items: size of the collection (>= 1).
        seed: shuffle seed; epoch e uses the permutation drawn from (seed, e).
        shuffle: False keeps file order in every epoch.
    """

    def __init__(self, num_items: int, *, seed: int, shuffle: bool = True) -> None:
        if num_items < 1:
            raise ValueError(f"EpochCursor needs num_items >= 1, got {num_items}")
        self.num_items = num_items
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(self.num_items))
        if self.shuffle:
            # String seeds are hashed with sha512: stable across processes and versions.
            random.Random(f"cursor:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_indices(self, num: int) -> list[int]:
        """The next num indices, crossing epoch boundaries as needed."""
        out = []
        for _ in range(num):
            if self.position == self.num_items:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            out.append(self._order[self.position])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position (plus what it was computed for, to check on load)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_items": self.num_items,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a position saved by `state_dict()`.

        Raises:
            ValueError: the state was saved for another seed, size or order.
        """
        saved = (state["seed"], state["num_items"], state["shuffle"])
        if saved != (self.seed, self.num_items, self.shuffle):
            raise ValueError(
                f"cursor state is for (seed, num_items, shuffle)={saved}, "
                f"this cursor has {(self.seed, self.num_items, self.shuffle)}"
            )
        if not 0 <= state["position"] <= self.num_items or state["epoch"] < 0:
            raise ValueError(f"cursor state out of range: {state}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)
