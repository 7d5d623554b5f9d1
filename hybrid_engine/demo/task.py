"""The demo's task as data files: GSM8K-shaped word problems in parquet.

Job: write `train.parquet` and `test.parquet` with GSM8K's columns -- a
`question` ("Tom has 12 apples and buys 7 more. How many apples does Tom
have?") and an `answer` text that works it out and ends in "#### N" -- so the
demo reads its task the way a user's GSM8K run does (`env.dataset_path`,
`env.preprocess=hybrid_engine.envs.preprocess:gsm8k`, the chat template, the
`math` and `format` rewards).

Operands are drawn as the arithmetic task draws them: a digit count from
min_digits to max_digits (1 or 2 by default) with equal odds, then a value
of that many digits. The test file holds
`num_eval` distinct operand pairs; no training row uses one of them, so the
held-out accuracy measures addition, not recall.

The demo's model, `DEMO_MODEL_SPEC`, is here too: its tokenizer holds the
task's words (`WORDS`) as tokens.

Invariant: the files are a function of `DemoTask` alone (same fields ->
same rows, byte for byte); `task_files` writes them once per key into a
temporary folder and renames it, so a crash never leaves a folder that
counts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from hybrid_engine.models.tiny import TinyModelSpec

__all__ = ["DEMO_MODEL_SPEC", "DemoTask", "WORDS", "task_files", "task_paths"]

NAMES = ("Tom", "Ann", "Sam", "Mia")
ITEMS = ("apples", "pens", "cards", "books")
_QUESTION = "{name} has {a} {item} and buys {b} more. How many {item} does {name} have?"
_SOLUTION = "{name} has {a} + {b} = <<{a}+{b}={s}>>{s} {item}.\n#### {s}"

WORDS: tuple[str, ...] = (
    *(" " + n for n in NAMES), *NAMES, *(" " + i for i in ITEMS),
    " has", " and", " buys", " more", " How", " many", " does", " have", "user", "assistant",
)
"""The task's and the chat template's words: the demo model's tokenizer encodes
each as one token (`models.tokenizer.build_tokenizer`), so a templated prompt is
~30 tokens instead of ~90 bytes. A word that is another's tail comes first,
so its merges win the tie (" Tom" before "Tom")."""


DEMO_MODEL_SPEC = TinyModelSpec(
    arch="qwen2", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
    intermediate_size=1024, vocab_size=384, max_position_embeddings=512, words=WORDS,
)
"""The RL demo's model (~4.1M parameters, head_dim 64, a vLLM-CPU head size):
the smallest tried that learns 1-2 digit addition to ~30% in ~1-2 minutes of
SFT on 2 cores (2 layers, or width 128, stay near 10% for as long). Its
tokenizer has the demo task's words as single tokens (`demo.task.WORDS`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoTask:
    """What the files hold."""

    num_train: int = 20000
    """Training rows (operand pairs drawn with repetition, never a test pair)."""
    num_eval: int = 400
    """Test rows: distinct operand pairs."""
    min_digits: int = 1
    """Fewest digits of an operand."""
    max_digits: int = 2
    """Most digits of an operand."""
    seed: int = 0
    """Seed of the draws, names and items."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {self.min_digits} "
                             f"and {self.max_digits}")

    def key(self) -> str:
        """Hex digest of the fields (the cache folder's name)."""
        text = json.dumps({"version": 1, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def rows(self) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
        """(train, test) columns: question and answer lists."""
        rng = random.Random(self.seed)
        held_out: dict[tuple[int, int], None] = {}
        while len(held_out) < self.num_eval:
            held_out[self._pair(rng)] = None
        train = []
        while len(train) < self.num_train:
            if (pair := self._pair(rng)) not in held_out:
                train.append(pair)
        return self._columns(train, rng), self._columns(list(held_out), rng)

    def _pair(self, rng: random.Random) -> tuple[int, int]:
        def operand() -> int:
            digits = rng.randint(self.min_digits, self.max_digits)
            return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

        return operand(), operand()

    @staticmethod
    def _columns(pairs: list[tuple[int, int]], rng: random.Random) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {"question": [], "answer": []}
        for a, b in pairs:
            fields = dict(name=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b, s=a + b)
            out["question"].append(_QUESTION.format(**fields))
            out["answer"].append(_SOLUTION.format(**fields))
        return out


def task_paths(cache: str | Path, task: DemoTask = DemoTask()) -> tuple[Path, Path]:
    """Where `task_files` puts (train.parquet, test.parquet) of task under cache."""
    folder = Path(cache) / f"task-{task.key()}"
    return folder / "train.parquet", folder / "test.parquet"


def task_files(cache: str | Path, task: DemoTask = DemoTask()) -> tuple[Path, Path]:
    """(train.parquet, test.parquet) of task under cache, written if missing.

    Not collective: call it on one rank, then barrier.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = task_paths(cache, task)
    folder = paths[0].parent
    if not paths[1].is_file():
        tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        train, test = task.rows()
        pq.write_table(pa.table(train), tmp / "train.parquet")
        pq.write_table(pa.table(test), tmp / "test.parquet")
        os.replace(tmp, folder)
    return paths
