"""Dataset files through HF `datasets` (every format, keys, preprocessors, errors) and
the resumable epoch cursor. In-process and offline: each test writes its own files."""

from __future__ import annotations

import json

import pytest

from hybrid_engine.envs.dataset import EpochCursor, Records

ROWS = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(6)]


def _write(path, rows: list[dict]):
    """rows as a file whose format the extension names (through pandas / pyarrow)."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    kind = path.suffix
    if kind == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == ".json":
        path.write_text(json.dumps(rows))
    elif kind == ".parquet":
        frame.to_parquet(path)
    elif kind == ".csv":
        frame.to_csv(path, index=False)
    elif kind == ".arrow":
        import pyarrow as pa

        table = pa.Table.from_pandas(frame, preserve_index=False)
        with pa.ipc.new_stream(str(path), table.schema) as w:
            w.write_table(table)
    return path


@pytest.mark.parametrize("ext", [".jsonl", ".json", ".parquet", ".csv", ".arrow"])
def test_every_format_reads_the_same_examples(tmp_path, ext):
    path = _write(tmp_path / f"d{ext}", ROWS)
    records = Records(str(path))
    assert len(records) == 6
    assert [(e.prompt, e.answer) for e in records] == [(r["prompt"], r["answer"]) for r in ROWS]
    assert records[2].source == ("train", 2)


def test_a_glob_and_a_folder_read_every_file_in_order(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    _write(folder / "a.parquet", ROWS[:3])
    _write(folder / "b.parquet", ROWS[3:])
    for path in (folder, folder / "*.parquet"):
        assert [e.prompt for e in Records(str(path))] == [r["prompt"] for r in ROWS]
    _write(folder / "c.jsonl", ROWS[:1])
    with pytest.raises(ValueError, match="several formats"):
        Records(str(folder))


def test_keys_select_columns_nested_ones_dotted_and_the_rest_are_extras(tmp_path):
    rows = [{"question": "Q0", "meta": {"gold": "7", "src": "x"}, "level": 3}]
    path = _write(tmp_path / "d.jsonl", rows)
    ex = Records(str(path), prompt_key="question", answer_key="meta.gold")[0]
    assert (ex.prompt, ex.answer) == ("Q0", "7")
    assert ex.extras == {"meta": {"gold": "7", "src": "x"}, "level": 3}
    with pytest.raises(ValueError) as info:
        Records(str(path))  # default keys: no 'prompt' column
    msg = str(info.value)
    assert str(path) in msg and "no column 'prompt'" in msg
    assert "question, meta, meta.gold, meta.src, level" in msg


def test_chat_message_prompts_are_kept_as_messages(tmp_path):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    path = _write(tmp_path / "d.parquet", [{"prompt": msgs, "answer": "2"}])
    assert Records(str(path))[0].prompt == tuple(msgs)


@pytest.mark.parametrize(("row", "needle"), [
    ({"prompt": [{"role": "robot", "content": "hi"}], "answer": "1"}, "a chat message must be"),
    ({"prompt": "", "answer": "1"}, "non-empty string or a list of chat messages"),
    ({"prompt": "x", "answer": None}, "the answer must be a string or a number"),
    ({"prompt": "x", "answer": True}, "the answer must be a string or a number"),
])
def test_a_bad_row_names_the_file_and_the_row(tmp_path, row, needle):
    path = _write(tmp_path / "d.jsonl", [row])
    with pytest.raises(ValueError, match=needle) as info:
        Records(str(path))
    assert f"{path}', row 0" in str(info.value)


@pytest.mark.parametrize(("name", "content", "needle"), [
    ("missing.jsonl", None, "no dataset file there"),
    ("d.txt", "x", "unknown file type '.txt'"),
    ("d.jsonl", '{"prompt": "x", "answer": \n', "line 1, column 27: not valid JSON"),
    ("empty.jsonl", "", "no rows"),
    ("fake.parquet", "not parquet", "cannot read parquet data"),
])
def test_a_bad_file_is_one_clear_error(tmp_path, name, content, needle):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=needle) as info:
        Records(str(path))
    assert str(path) in str(info.value)


def test_a_malformed_line_is_named_by_file_and_line_and_said_once(tmp_path, capfd):
    """`datasets` says only 'An error occurred' (and logs its own report): the
    error names the file and the line, and nothing else is printed."""
    lines = [json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) for i in range(100)]
    lines[49] = '{"prompt": "49+49=" "answer": "98"}'
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    capfd.readouterr()
    with pytest.raises(ValueError) as info:
        Records(str(path))
    assert str(info.value) == (f"env.dataset_path={str(path)!r}, line 50, column 21: not valid "
                               "JSON (Expecting ',' delimiter)")
    out, err = capfd.readouterr()
    assert "Failed" not in out + err and "line 50" not in out + err
    lines[49] = "[1, 2]"  # JSON, but not a row
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl', line 50: a row must be a JSON object"):
        Records(str(path))


def test_a_bad_file_among_several_is_named_and_so_is_a_bad_rows_file(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    _write(folder / "a.jsonl", ROWS[:3])
    (folder / "b.jsonl").write_text(json.dumps(ROWS[3]) + "\n\n{oops\n")
    with pytest.raises(ValueError) as info:
        Records(str(folder))
    assert f"{str(folder)!r}, file {str(folder / 'b.jsonl')!r}, line 3, column 2" in str(
        info.value)
    chat = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
            for r in ROWS]
    _write(folder / "a.jsonl", chat[:3])
    (folder / "b.jsonl").write_text(json.dumps(chat[3]) + "\n\n" + json.dumps(
        {"prompt": [{"role": "robot", "content": "beep"}], "answer": "1"}) + "\n")
    records = Records(str(folder))  # row 0 is fine; the robot is row 4 of 5 (b's row 1)
    assert records.where(4) == f"env.dataset_path={str(folder)!r}, file " \
                               f"{str(folder / 'b.jsonl')!r}, row 1"
    with pytest.raises(ValueError, match=r"b.jsonl', row 1: a chat message must be"):
        list(records.prompt_texts())
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,answer\n" + "".join(
        f"{i}+{i}=,{2 * i}\n" if i != 49 else "49+49=,98,extra\n" for i in range(100)))
    with pytest.raises(ValueError, match=r"d.csv': pandas cannot read it: ParserError: .*"
                                         r"Expected 2 fields in line 51, saw 3"):
        Records(str(csv))


def test_a_zero_row_parquet_is_refused(tmp_path):
    import pandas as pd

    path = tmp_path / "empty.parquet"
    pd.DataFrame({"prompt": pd.Series([], dtype=str), "answer": pd.Series([], dtype=str)}) \
        .to_parquet(path)
    with pytest.raises(ValueError, match="no rows"):
        Records(str(path))


def test_shipped_preprocessors_read_gsm8k_and_math_rows(tmp_path):
    from hybrid_engine.envs.preprocess import gsm8k, last_boxed, math

    gsm = _write(tmp_path / "gsm8k.parquet", [
        {"question": "Tom has 1,200 apples...", "answer": "He has 1,200.\n#### 1,200"}])
    ex = Records(str(gsm), preprocess=gsm8k)[0]
    assert (ex.prompt, ex.answer) == ("Tom has 1,200 apples...", "1200")
    assert ex.extras["solution"].endswith("#### 1,200")
    rows = [{"problem": "Simplify.", "solution": r"So $\boxed{\frac{1}{2}}$.", "level": "L1"}]
    ex = Records(str(_write(tmp_path / "math.jsonl", rows)), preprocess=math)[0]
    assert (ex.prompt, ex.answer, ex.extras["level"]) == ("Simplify.", r"\frac{1}{2}", "L1")
    assert last_boxed(r"\boxed{a} then \boxed{b{c}}") == "b{c}" and last_boxed("none") is None
    bad = _write(tmp_path / "bad.jsonl", [{"question": "q", "answer": "no marker"}])
    with pytest.raises(ValueError, match=r"row 0: env.preprocess raised ValueError: a GSM8K"):
        Records(str(bad), preprocess=gsm8k)


def test_prompt_texts_match_the_examples_without_reading_other_columns(tmp_path):
    msgs = [{"role": "user", "content": "hi"}]
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    records = Records(str(_write(tmp_path / "d.jsonl", rows)))
    assert list(records.prompt_texts()) == ["a", "b"]
    chat = Records(str(_write(tmp_path / "c.parquet", [{"prompt": msgs, "answer": "1"}])))
    assert list(chat.prompt_texts()) == [json.dumps(msgs, sort_keys=True)]


def test_cursor_covers_each_epoch_and_is_seeded():
    cursor = EpochCursor(7, seed=3)
    first, second = cursor.next_indices(7), cursor.next_indices(7)
    assert sorted(first) == sorted(second) == list(range(7))
    assert first != second  # a new permutation per epoch (for this seed)
    assert EpochCursor(7, seed=3).next_indices(14) == first + second
    assert EpochCursor(7, seed=4).next_indices(14) != first + second
    assert EpochCursor(4, seed=3, shuffle=False).next_indices(6) == [0, 1, 2, 3, 0, 1]


def test_cursor_save_restore_continues_identically():
    cursor = EpochCursor(5, seed=1)
    cursor.next_indices(8)  # mid second epoch
    state = json.loads(json.dumps(cursor.state_dict()))
    expected = cursor.next_indices(9)
    restored = EpochCursor(5, seed=1)
    restored.load_state_dict(state)
    assert restored.next_indices(9) == expected
    with pytest.raises(ValueError, match="seed"):
        EpochCursor(5, seed=2).load_state_dict(state)
