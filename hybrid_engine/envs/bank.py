"""A task's problems: generated from a seed, or rows of dataset files.

Job: `ProblemBank` supplies training problems as a resumable stream and
evaluation problems as a fixed list, and remembers the problems it handed
out recently (by the prompt's text as the rewards see it), so a reward can
find a prompt's answer and its row's other columns.

Generated mode: training problem i is drawn from a `random.Random` seeded by
(seed, i), skipping held-out prompts, so the stream's state is the integer i.
Dataset mode: the rows of `DatasetSpec.path` (memory-mapped, `envs.dataset`)
served by an `EpochCursor` over row indices; evaluation problems are the rows
of `DatasetSpec.eval_path`, or, without one, the held-out share of `path`.
`split` computes the same division from the prompts alone, for the preflight.

Invariant: training and evaluation problems are disjoint -- by file when an
eval file is given, else by a stable hash of the prompt's text (a prompt is
held out iff `is_held_out`). The bank keeps row indices (4 bytes a row),
never the rows.
"""

from __future__ import annotations

import random
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybrid_engine.envs.dataset import DatasetSpec, EpochCursor, Example, Records, prompt_text
from hybrid_engine.envs.user_code import load_function

__all__ = ["ProblemBank", "Split", "is_held_out", "split"]

_HELD_OUT_BUCKETS = 16  # 1/16 of the problem space is held out for evaluation
# Problems remembered for their answers: more than a step's prompts, its refills,
# the batches generated ahead and the parked partial groups, with the eval set.
_RECENT = 8192


def is_held_out(prompt: str) -> bool:
    """True for the held-out (evaluation) share of prompts; stable across runs."""
    return zlib.crc32(prompt.encode("utf-8")) % _HELD_OUT_BUCKETS == 0


@dataclass(frozen=True, slots=True)
class Split:
    """How a dataset divides into training and evaluation problems, as the bank
    divides it (`split`).

    Attributes:
        num_rows: rows of the training file(s).
        num_train: of them, the training rows.
        trained: one per distinct evaluation problem, in the bank's order: whether
            its prompt is also a training prompt (never, for the held-out share).
    """

    num_rows: int
    num_train: int
    trained: np.ndarray


def split(train: Records, evaluation: Records | None) -> Split:
    """The split `ProblemBank` makes of these tables (evaluation None: the held-out
    share of train), from every row's prompt alone, so a malformed prompt in any
    row (a chat role that is not one) is found here, naming its file and row."""
    if evaluation is None:
        held: set[str] = set()
        num_train = 0
        for text in train.prompt_texts():
            if is_held_out(text):
                held.add(text)
            else:
                num_train += 1
        return Split(len(train), num_train, np.zeros(len(held), dtype=bool))
    trained = {hash(t) for t in train.prompt_texts()}  # hashes: 8 bytes a row, not the texts
    seen: set[str] = set()
    flags = []
    for text in evaluation.prompt_texts():
        if text not in seen:
            seen.add(text)
            flags.append(hash(text) in trained)
    return Split(len(train), len(train), np.array(flags, dtype=bool))


class ProblemBank:
    """Training problems (resumable stream), evaluation problems (fixed list) and
    the problems handed out recently; see the module docstring.

    Args:
        generate: rng -> Example, used without a dataset.
        dataset: where dataset rows come from, or None (generated problems).
        seed: generation / shuffle seed.
        name: the environment's name, for error messages.
    """

    def __init__(self, generate: Callable[[random.Random], Example], *,
                 dataset: DatasetSpec | None, seed: int, name: str) -> None:
        self.generate, self.seed, self.name = generate, seed, name
        self.index = 0
        self.cursor: EpochCursor | None = None
        self.tables: dict[str, Records] = {}
        self._rows: dict[str, np.ndarray] = {}  # "train" / "eval" -> row indices
        self._recent: OrderedDict[str, Example] = OrderedDict()
        if dataset is not None and dataset.path:
            self._load(dataset)

    def _load(self, spec: DatasetSpec) -> None:
        fn = load_function(spec.preprocess, "env.preprocess") if spec.preprocess else None
        keys = {"prompt_key": spec.prompt_key, "answer_key": spec.answer_key, "preprocess": fn}
        train = self.tables["train"] = Records(spec.path, source="train", **keys)
        if spec.eval_path:
            self.tables["eval"] = Records(spec.eval_path, key="env.eval_dataset_path",
                                          source="eval", **keys)
            self._rows = {"train": np.arange(len(train), dtype=np.uint32),
                          "eval": np.arange(len(self.tables["eval"]), dtype=np.uint32)}
        else:
            held = np.fromiter((is_held_out(t) for t in train.prompt_texts()), dtype=bool,
                               count=len(train))
            self.tables["eval"] = train
            self._rows = {"train": np.flatnonzero(~held).astype(np.uint32),
                          "eval": np.flatnonzero(held).astype(np.uint32)}
            if not len(self._rows["train"]):
                raise ValueError(f"env.dataset_path={spec.path!r}: every row falls in the "
                                 "held-out split; give a training file with more rows, or "
                                 "env.eval_dataset_path")
        self.cursor = EpochCursor(len(self._rows["train"]), seed=self.seed)

    # --- problems ---------------------------------------------------------------

    def next_train(self, num: int) -> list[Example]:
        """The next num training problems."""
        if self.cursor is not None:
            rows = self._rows["train"]
            return [self.tables["train"][rows[i]] for i in self.cursor.next_indices(num)]
        out = []
        for _ in range(num):
            for attempt in range(1000):
                ex = self.generate(random.Random(f"train:{self.seed}:{self.index}:{attempt}"))
                if not is_held_out(ex.prompt):
                    break
            else:
                raise AssertionError("generator only produces held-out prompts")
            out.append(ex)
            self.index += 1
        return out

    def eval_problems(self, num: int) -> list[Example]:
        """The first num distinct evaluation problems (the same list every call);
        num 0 = all of them (a dataset's).

        Raises:
            ValueError: fewer than num evaluation problems exist, or num is 0
                without a dataset.
        """
        if num == 0 and self.cursor is None:
            raise ValueError(f"environment {self.name!r}: eval.num_prompts=0 (all) needs a "
                             "dataset (env.dataset_path); generated problems never run out: "
                             "give a number")
        found = list(self._eval_iter(num or len(self._rows["eval"])))
        if len(found) < num:
            raise ValueError(
                f"environment {self.name!r}: asked for {num} evaluation problems, "
                f"found only {len(found)} (problem space or dataset too small; see "
                "eval.num_prompts)"
            )
        return found

    def _eval_iter(self, num: int) -> Iterator[Example]:
        seen: set[str] = set()
        if self.cursor is not None:
            candidates = (self.tables["eval"][i] for i in self._rows["eval"])
        else:
            candidates = (self.generate(random.Random(f"eval:{self.seed}:{j}"))
                          for j in range(num * _HELD_OUT_BUCKETS * 50))
        for ex in candidates:
            text = prompt_text(ex.prompt)
            if len(seen) == num:
                return
            if (self.cursor is not None or is_held_out(text)) and text not in seen:
                seen.add(text)
                yield ex

    # --- what was handed out ---------------------------------------------------

    def remember(self, key: str, ex: Example) -> None:
        """Records that the problem whose prompt reads `key` (as the rewards see it)
        was handed out; the oldest of more than _RECENT are forgotten."""
        self._recent[key] = ex
        self._recent.move_to_end(key)
        while len(self._recent) > _RECENT:
            self._recent.popitem(last=False)

    def recalled(self, key: str) -> Example | None:
        """The problem handed out with prompt `key`, if it is recent."""
        return self._recent.get(key)

    def origin(self, ex: Example) -> str | None:
        """Where a dataset problem is, for a message ('env.dataset_path=..., row i');
        None for a generated one."""
        if ex.source is None or ex.source[0] not in self.tables:
            return None
        return self.tables[ex.source[0]].where(ex.source[1])

    # --- state -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Position of the training stream, and the dataset rows handed out
        recently (a resumed run may still score their samples)."""
        if self.cursor is not None:
            recent = [list(ex.source) for ex in self._recent.values() if ex.source is not None]
            return {"cursor": self.cursor.state_dict(), "recent": recent}
        return {"index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> list[Example]:
        """Restores a position saved by `state_dict()`; returns the rows handed out
        recently, for the environment to remember under their prompts."""
        if self.cursor is not None:
            self.cursor.load_state_dict(state["cursor"])
            return [self.tables[table][row] for table, row in state.get("recent", [])]
        if state["seed"] != self.seed:
            raise ValueError(f"state saved with seed {state['seed']}, bank has {self.seed}")
        self.index = int(state["index"])
        return []
