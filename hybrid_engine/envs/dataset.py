"""Prompt/answer datasets through HF `datasets`, and a resumable, seeded cursor over them.

Job: open a file, a glob or a folder of jsonl / json / parquet / arrow / csv
files (the format chosen by the extension) as one Arrow-backed
`datasets.Dataset`, memory-mapped from `datasets`' cache, never a Python list
of every row; read row i as an `Example` -- a prompt (text, or chat messages
`[{"role", "content"}, ...]`), its reference answer and the row's other
columns -- through `prompt_key` / `answer_key` (dotted keys reach nested
fields) or a user's `preprocess(row) -> {"prompt", "answer", ...}`; and hand
out row indices epoch after epoch in a seeded order (`EpochCursor`) whose
position can be checkpointed.

Invariant: the order is a pure function of (seed, epoch), and the cursor's
state is just (epoch, position): a cursor restored from `state_dict()` yields
exactly the indices the saved one would have yielded next. A bad file, a
missing column or a malformed row is a `ValueError` naming the file (and the
line that does not parse, or the row -- counted in its own file when a path
names several -- and the columns that exist).
"""

from __future__ import annotations

import glob
import json
import logging
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets

__all__ = ["FORMATS", "DatasetSpec", "EpochCursor", "Example", "Records", "prompt_text"]

# File extension -> the `datasets` builder that reads it.
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow",
           ".csv": "csv"}
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class Example:
    """One problem: the prompt (text, or chat messages), its reference answer (as
    text), the row's other columns (for reward functions) and, for a dataset
    row, where it is: (table, row index)."""

    prompt: str | tuple[Mapping[str, str], ...]
    answer: str
    extras: Mapping[str, Any] = field(default_factory=dict)
    source: tuple[str, int] | None = None


def prompt_text(prompt: str | tuple[Mapping[str, str], ...]) -> str:
    """A prompt as one string: itself, or its messages as JSON (for hashing)."""
    return prompt if isinstance(prompt, str) else json.dumps(list(prompt), sort_keys=True)


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    """Where a task's problems come from and how a row reads (`EnvConfig`'s keys).

    Attributes:
        path: file, glob or folder of training problems.
        eval_path: file, glob or folder of evaluation problems; '' = a held-out
            share of `path`.
        prompt_key, answer_key: the columns (dotted: nested fields).
        preprocess: 'file.py:function' or 'module:function' mapping a row to
            {"prompt", "answer", ...}; '' = the keys.
    """

    path: str
    eval_path: str = ""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    preprocess: str = ""


def data_files(path: str, key: str = "env.dataset_path") -> list[str]:
    """The files a path names (a file, a glob or a folder), all of one format.

    Raises:
        ValueError: nothing there, an unknown extension, or mixed formats.
    """
    p = Path(path)
    if p.is_dir():
        files = sorted(str(f) for f in p.iterdir() if f.is_file() and f.suffix in FORMATS)
    elif any(c in path for c in "*?["):
        files = sorted(f for f in glob.glob(path) if Path(f).is_file())
    else:
        files = [path] if p.is_file() else []
    if not files:
        raise ValueError(f"{key}={path!r}: no dataset file there (a file, a glob or a folder "
                         f"of {', '.join(FORMATS)})")
    kinds = {Path(f).suffix for f in files}
    unknown = sorted(kinds - set(FORMATS))
    if unknown:
        raise ValueError(f"{key}={path!r}: unknown file type {unknown[0]!r}; the formats are "
                         f"{', '.join(FORMATS)}")
    if len({FORMATS[k] for k in kinds}) > 1:
        raise ValueError(f"{key}={path!r}: files of several formats ({', '.join(sorted(kinds))}); "
                         "one format per dataset")
    return files


def open_table(path: str, key: str = "env.dataset_path") -> datasets.Dataset:
    """The rows of path as one memory-mapped `datasets.Dataset`."""
    import datasets

    files = data_files(path, key)
    builder = FORMATS[Path(files[0]).suffix]
    if builder == "parquet":  # its footer counts the rows; datasets fails on none
        import pyarrow.parquet as pq

        try:
            rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
        except Exception as exc:  # not a parquet file
            raise ValueError(f"{key}={path!r}: cannot read parquet data: "
                             f"{type(exc).__name__}: {str(exc)[:500]}") from None
        if rows == 0:
            raise ValueError(f"{key}={path!r}: the dataset has no rows")
    bars = not datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # one per rank and file would flood the console
    verbosity = datasets.utils.logging.get_verbosity()
    # datasets logs a bad file itself (once per rank); the error below says it once.
    datasets.utils.logging.set_verbosity(logging.CRITICAL + 1)
    try:
        table = datasets.load_dataset(builder, data_files=files, split="train")
    except Exception as exc:  # a malformed file: find where
        if all(_blank(f) for f in files):
            raise ValueError(f"{key}={path!r}: the dataset has no rows") from None
        raise ValueError(f"{key}={path!r}{_unreadable(files, builder, exc, path)}") from None
    finally:
        datasets.utils.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()
    if len(table) == 0:
        raise ValueError(f"{key}={path!r}: the dataset has no rows")
    return table


def _unreadable(files: list[str], builder: str, exc: BaseException, path: str) -> str:
    """What follows `key=path` in the error about files `datasets` could not read:
    the first bad line of the first bad file (json: each line parsed on its own;
    csv: each file through pandas), else the library's reason.

    Args:
        files: the files of path, in order.
        builder: the `datasets` builder that failed (a value of FORMATS).
        exc: what it raised.
        path: the configured path (a file named by it is not named again).
    """
    for f in files:
        where = _bad_json(f) if builder == "json" else _bad_csv(f) if builder == "csv" else None
        if where is not None:
            return f"{'' if f == path else f', file {f!r}'}{where}"
    cause = exc.__cause__ or exc  # DatasetGenerationError wraps the reader's own error
    return f": cannot read {builder} data: {type(cause).__name__}: {str(cause)[:500]}"


def _bad_json(file: str) -> str | None:
    """', line N, column C: ...' of the first line of a json/jsonl file that is
    not a JSON object (a .json file may also be one JSON document); None: it parses."""
    if file.endswith(".json"):
        data = Path(file).read_bytes()
        try:
            json.loads(data)
            return None
        except ValueError as e:
            if data.lstrip()[:1] == b"[":  # one document: a list of rows
                return _json_error(e, None)
    with open(file, "rb") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip(b"\r\n"))
            except ValueError as e:
                return _json_error(e, n)
            if not isinstance(row, dict):
                return (f", line {n}: a row must be a JSON object {{\"column\": value, ...}}, "
                        f"got {line.strip()[:80].decode(errors='replace')}")
    return None


def _json_error(e: ValueError, line: int | None) -> str:
    """An error of json.loads on one line (line) or on a whole document (None)."""
    if not isinstance(e, json.JSONDecodeError):
        return f", line {line or '?'}: not UTF-8 text ({e})"
    return f", line {line or e.lineno}, column {e.colno}: not valid JSON ({e.msg})"


def _bad_csv(file: str) -> str | None:
    """pandas' reason (naming the line) when it cannot read a csv file; None: it can."""
    import pandas as pd

    try:
        pd.read_csv(file)
    except Exception as e:  # the parser's error names the line
        return f": pandas cannot read it: {type(e).__name__}: {str(e).strip()[:300]}"
    return None


def _rows_in(file: str) -> int:
    """The rows `datasets` reads from one file (in the order it reads them)."""
    kind = FORMATS[Path(file).suffix]
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(file).metadata.num_rows
    if kind == "arrow":
        import pyarrow as pa

        with pa.memory_map(file) as source:
            return sum(b.num_rows for b in pa.ipc.open_stream(source))
    if kind == "csv":
        import pandas as pd

        return len(pd.read_csv(file))
    if file.endswith(".json"):
        try:
            doc = json.loads(Path(file).read_bytes())
            if isinstance(doc, dict):  # columns: {"prompt": [...], "answer": [...]}
                return len(next(iter(doc.values()), []))
            return len(doc)
        except ValueError:
            pass  # JSON lines
    with open(file, "rb") as fh:
        return sum(1 for line in fh if line.strip())


def _blank(file: str) -> bool:
    """Whether a file holds nothing but whitespace (read only when it is small)."""
    size = Path(file).stat().st_size
    return size == 0 or (size < 1 << 16 and not Path(file).read_bytes().strip())


def _get(row: Mapping[str, Any], dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def _columns(row: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Every key of a row, nested ones dotted."""
    out = []
    for k, v in row.items():
        out.append(prefix + k)
        if isinstance(v, Mapping):
            out += _columns(v, f"{prefix}{k}.")
    return out


class Records:
    """A dataset's rows as `Example`s (see the module docstring).

    Args:
        path: file, glob or folder.
        prompt_key, answer_key: the columns, dotted for nested fields.
        preprocess: a function row -> {"prompt", "answer", ...}, or None.
        key: the config key naming path, for messages.
        source: the table's name in each Example's `source`.
    """

    def __init__(self, path: str, *, prompt_key: str = "prompt", answer_key: str = "answer",
                 preprocess: Callable[[dict], Mapping[str, Any]] | None = None,
                 key: str = "env.dataset_path", source: str = "train") -> None:
        self.path, self.key, self.source = path, key, source
        self.prompt_key, self.answer_key, self.preprocess = prompt_key, answer_key, preprocess
        self.table = open_table(path, key)
        self.files = data_files(path, key)
        self._file_rows: list[int] | None = None  # counted when a message needs them
        self[0]  # a missing column is found now, naming the columns that exist

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i: int) -> Example:
        return self._example(self.table[int(i)], int(i))

    def __iter__(self) -> Iterator[Example]:
        for i, row in enumerate(self.table):
            yield self._example(row, i)

    def prompt_texts(self) -> Iterator[str]:
        """Every row's `prompt_text`, in order (without a preprocess function only
        the prompt's column is read)."""
        if self.preprocess is not None:
            yield from (prompt_text(ex.prompt) for ex in self)
            return
        top = self.prompt_key.split(".")[0]
        i = 0
        for batch in self.table.select_columns([top]).iter(batch_size=4096):
            for value in batch[top]:
                yield prompt_text(self._prompt(_get({top: value}, self.prompt_key), i))
                i += 1

    def where(self, i: int) -> str:
        """Row i for a message: 'key=path, row i', and when path names several
        files, the file and its row ('key=path, file f, row j')."""
        if len(self.files) > 1:
            if self._file_rows is None:
                self._file_rows = [_rows_in(f) for f in self.files]
            for f, n in zip(self.files, self._file_rows, strict=True):
                if i < n:
                    return f"{self.key}={self.path!r}, file {f!r}, row {i}"
                i -= n
        return f"{self.key}={self.path!r}, row {i}"

    def _example(self, row: dict, i: int) -> Example:
        prompt_key, answer_key = self.prompt_key, self.answer_key
        if self.preprocess is not None:
            try:
                row = dict(self.preprocess(dict(row)))
            except Exception as exc:  # the user's function: name it and the row
                raise ValueError(f"{self.where(i)}: env.preprocess raised "
                                 f"{type(exc).__name__}: {exc}") from exc
            prompt_key, answer_key = "prompt", "answer"
        try:
            prompt, answer = _get(row, prompt_key), _get(row, answer_key)
        except KeyError as missing:
            raise ValueError(f"{self.where(i)}: no column {missing.args[0]!r}; the columns "
                             f"are {', '.join(_columns(row))}") from None
        extras = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
        return Example(self._prompt(prompt, i), self._answer(answer, i), extras,
                       (self.source, i))

    def _prompt(self, prompt: Any, i: int) -> str | tuple[Mapping[str, str], ...]:
        if isinstance(prompt, str) and prompt:
            return prompt
        if isinstance(prompt, list) and prompt:
            for m in prompt:
                if not (isinstance(m, Mapping) and isinstance(m.get("content"), str)
                        and m.get("role") in ROLES):
                    raise ValueError(f"{self.where(i)}: a chat message must be {{'role': one of "
                                     f"{', '.join(ROLES)}, 'content': str}}, got {m!r}")
            return tuple({"role": m["role"], "content": m["content"]} for m in prompt)
        raise ValueError(f"{self.where(i)}: the prompt must be a non-empty string or a list of "
                         f"chat messages, got {prompt!r:.200}")

    def _answer(self, answer: Any, i: int) -> str:
        # bool is an int subclass; an answer of `true` is almost surely a mistake.
        if answer is None or isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(f"{self.where(i)}: the answer must be a string or a number, got "
                             f"{answer!r:.200}")
        return str(answer).strip()


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
