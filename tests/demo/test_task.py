"""The demo's data files: GSM8K-shaped rows that the gsm8k preprocessor and the
math reward read as a user's GSM8K files, test pairs never trained on, the same
bytes for the same task, and every DemoTask field in effect."""

from __future__ import annotations

import dataclasses
import re

import pytest

from hybrid_engine.demo.task import WORDS, DemoTask, task_files, task_paths

SMALL = DemoTask(num_train=300, num_eval=40)


def _pairs(questions: list[str]) -> list[tuple[int, int]]:
    return [tuple(int(n) for n in re.findall(r"[0-9]+", q)) for q in questions]


def test_files_read_as_gsm8k_with_the_sum_as_answer_and_disjoint_test_pairs(tmp_path) -> None:
    from hybrid_engine.envs.dataset import Records
    from hybrid_engine.envs.preprocess import gsm8k
    from hybrid_engine.envs.verifiers import math_reward

    train, test = task_files(tmp_path, SMALL)
    assert (train, test) == task_paths(tmp_path, SMALL)
    rows = {}
    for name, path in (("train", train), ("test", test)):
        rows[name] = list(Records(str(path), preprocess=gsm8k))
    assert len(rows["train"]) == 300 and len(rows["test"]) == 40
    for ex in rows["train"][:20] + rows["test"]:
        a, b = _pairs([ex.prompt])[0]
        assert ex.answer == str(a + b) and ex.extras["solution"].endswith(f"#### {a + b}")
        assert math_reward(ex.prompt, str(a + b), ex.answer) == 1.0
    test_pairs = set(_pairs([ex.prompt for ex in rows["test"]]))
    assert len(test_pairs) == 40
    assert not test_pairs & set(_pairs([ex.prompt for ex in rows["train"]]))
    before = train.read_bytes()
    assert task_files(tmp_path, SMALL) == (train, test) and train.read_bytes() == before


@pytest.mark.parametrize("field,value", [("num_train", 301), ("num_eval", 41), ("max_digits", 1),
                                         ("seed", 1)])
def test_every_field_changes_the_rows(field: str, value: int) -> None:
    other = dataclasses.replace(SMALL, **{field: value})
    assert other.key() != SMALL.key() and other.rows() != SMALL.rows()
    train, test = other.rows()
    if field == "max_digits":
        assert max(max(p) for p in _pairs(train["question"])) <= 9
    if field in ("num_train", "num_eval"):
        assert (len(train["question"]), len(test["question"])) == (other.num_train, other.num_eval)


def test_a_templated_prompt_is_short_with_the_demo_tokenizer() -> None:
    from hybrid_engine.demo.warmstart import DEMO_MODEL_SPEC
    from hybrid_engine.envs.chat import PromptFormat
    from hybrid_engine.models.tokenizer import CHAT_TEMPLATE, build_tokenizer

    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(WORDS))
    tok.chat_template = CHAT_TEMPLATE
    assert DEMO_MODEL_SPEC.words == WORDS
    question = SMALL.rows()[0]["question"][0]
    ids = PromptFormat("auto").ids(tok, question)
    assert len(ids) <= 32 < len(question.encode())
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")


def test_the_warm_start_trains_on_the_files_templated_rows_and_keys_its_cache_by_their_bytes(
        tmp_path) -> None:
    from transformers import AutoTokenizer

    from hybrid_engine.demo.warmstart import WarmStartConfig, cache_key, sft_trajectories
    from hybrid_engine.envs.chat import PromptFormat
    from hybrid_engine.models.tiny import TinyModelSpec, write_tiny_model
    from hybrid_engine.models.tokenizer import tokenizer_vocab_size

    spec = TinyModelSpec(vocab_size=tokenizer_vocab_size(WORDS), words=WORDS)
    base = write_tiny_model(tmp_path / "base", spec)
    tok = AutoTokenizer.from_pretrained(base)
    train, _ = task_files(tmp_path / "a", SMALL)
    cfg = WarmStartConfig(dataset=str(train), preprocess="hybrid_engine.envs.preprocess:gsm8k",
                          chat_template="auto")
    trajs = sft_trajectories(cfg.make_env(tok), 8)
    train_ids = {tuple(PromptFormat("auto").ids(tok, q)) for q in SMALL.rows()[0]["question"]}
    assert all(tuple(t.prompt_ids) in train_ids for t in trajs)  # the file's rows, templated
    for t in trajs:  # the response is the preprocessed answer, the sum, then EOS
        a, b = _pairs([tok.decode(t.prompt_ids)])[0]
        assert tok.decode(t.response_ids[:-1]) == str(a + b)
        assert t.response_ids[-1] == tok.eos_token_id
    raw = sft_trajectories(WarmStartConfig(dataset=str(train), preprocess=cfg.preprocess)
                           .make_env(tok), 1)[0]  # chat_template="none": the question alone
    assert tok.decode(raw.prompt_ids) in SMALL.rows()[0]["question"]
    # The cache key follows the data file's bytes, not its path.
    other_path, _ = task_files(tmp_path / "b", SMALL)
    changed, _ = task_files(tmp_path / "c", dataclasses.replace(SMALL, seed=1))
    key = cache_key(base, cfg)
    assert cache_key(base, dataclasses.replace(cfg, dataset=str(other_path))) == key
    assert cache_key(base, dataclasses.replace(cfg, dataset=str(changed))) != key
    assert cache_key(base, dataclasses.replace(cfg, chat_template="none")) != key
