"""JSONL loading errors and the resumable epoch cursor."""

from __future__ import annotations

import json

import pytest

from hybrid_engine.envs.dataset import EpochCursor, Example, load_jsonl


def _write(tmp_path, lines: list[str]):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_load_jsonl_reads_records_and_skips_blank_lines(tmp_path):
    lines = ['{"prompt": "1+1=", "answer": "2"}', "", '{"prompt": "a", "answer": 7}']
    path = _write(tmp_path, lines)
    assert load_jsonl(path) == [Example("1+1=", "2"), Example("a", "7")]


@pytest.mark.parametrize(
    ("bad_line", "needle"),
    [
        ('{"prompt": "x", "answer": ', "malformed JSON"),
        ('{"prompt": "x"}', "missing key(s) 'answer'"),
        ('{"answer": "1"}', "missing key(s) 'prompt'"),
        ('{"prompt": 3, "answer": "1"}', "'prompt' must be a non-empty string"),
        ('{"prompt": "x", "answer": [1]}', "'answer' must be a string or an integer"),
        ('{"prompt": "x", "answer": true}', "'answer' must be a string or an integer"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_load_jsonl_errors_name_file_and_line(tmp_path, bad_line, needle):
    good = json.dumps({"prompt": "1+1=", "answer": "2"})
    path = _write(tmp_path, [good, "", bad_line])
    with pytest.raises(ValueError) as info:
        load_jsonl(path)
    assert f"{path}:3:" in str(info.value)
    assert needle in str(info.value)


def test_load_jsonl_empty_and_missing_file(tmp_path):
    path = _write(tmp_path, ["", "  "])
    with pytest.raises(ValueError, match="dataset is empty") as info:
        load_jsonl(path)
    assert str(path) in str(info.value)
    with pytest.raises(ValueError, match="not found"):
        load_jsonl(tmp_path / "nope.jsonl")


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


def test_load_jsonl_accepts_a_bom_and_names_the_line_of_bad_utf8(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "1+1=", "answer": 2}\n')
    assert load_jsonl(path) == [Example("1+1=", "2")]
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"prompt": "1+1=", "answer": 2}\n{"prompt": "caf\xe9", "answer": 1}\n')
    with pytest.raises(ValueError, match=r"latin1.jsonl:2: not valid UTF-8"):
        load_jsonl(bad)
