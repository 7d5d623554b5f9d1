"""Environments on dataset files: the config's keys, an evaluation file, chat-message
prompts through the tokenizer's own chat template, answers and extra columns for
rewards, and a resume that still scores what was handed out before it. In-process.
Text prompts are raw here (env.chat_template=none) unless a test is about templates
(the knobs themselves: tests/envs/test_chat.py)."""

from __future__ import annotations

import json

import pytest

from hybrid_engine.config import EnvConfig
from hybrid_engine.envs import make_env
from hybrid_engine.envs.base import decode
from hybrid_engine.trajectory import Trajectory


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tiny models' tokenizer as transformers loads it: byte-level, ChatML template."""
    from transformers import AutoTokenizer

    from hybrid_engine.models.tokenizer import write_tokenizer_files

    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(folder)
    return AutoTokenizer.from_pretrained(folder)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _answer_traj(tokenizer, prompt_ids, text: str) -> Trajectory:
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return Trajectory(prompt_ids=list(prompt_ids), response_ids=ids, rollout_logp=[0.0] * len(ids),
                      loss_mask=[True] * len(ids))


def test_every_key_reaches_the_environment(tmp_path, tokenizer):
    """dataset_path, eval_dataset_path, prompt_key, answer_key and preprocess each
    change what the environment hands out (each would fail this if ignored)."""
    train = _jsonl(tmp_path / "train.jsonl",
                   [{"q": f"{i}+1=", "sol": {"n": str(i + 1)}} for i in range(20)])
    evals = _jsonl(tmp_path / "eval.jsonl", [{"q": f"{i}+2=", "sol": {"n": str(i + 2)}}
                                             for i in range(50, 53)])
    cfg = EnvConfig(dataset_path=train, eval_dataset_path=evals, prompt_key="q",
                    answer_key="sol.n", chat_template="none")
    env = make_env(cfg, tokenizer)
    train_texts = {decode(tokenizer, p) for p in env.sample_prompts(40)}
    assert train_texts == {f"{i}+1=" for i in range(20)}  # every row, no held-out share
    eval_ids = env.eval_prompts(3)
    assert [decode(tokenizer, p) for p in eval_ids] == ["50+2=", "51+2=", "52+2="]
    traj = _answer_traj(tokenizer, eval_ids[1], "53")
    env.score([traj])
    assert traj.reward_components["correct"] == 1.0  # the answer came from sol.n
    (tmp_path / "pre.py").write_text(
        "def pre(row):\n    return {'prompt': row['q'] + ' ', 'answer': row['sol']['n']}\n")
    env = make_env(EnvConfig(dataset_path=train, eval_dataset_path=evals, chat_template="none",
                             preprocess=f"{tmp_path / 'pre.py'}:pre"), tokenizer)
    assert all(decode(tokenizer, p).endswith("= ") for p in env.sample_prompts(5))


def test_without_an_eval_file_a_hashed_share_is_held_out_and_never_trained(tmp_path, tokenizer):
    from hybrid_engine.envs.bank import is_held_out

    rows = [{"prompt": f"Q{i}:", "answer": str(i)} for i in range(64)]
    env = make_env(EnvConfig(dataset_path=_jsonl(tmp_path / "d.jsonl", rows),
                             chat_template="none"), tokenizer)
    held = {r["prompt"] for r in rows if is_held_out(r["prompt"])}
    trained = {decode(tokenizer, p) for p in env.sample_prompts(300)}
    assert held and not held & trained and len(trained) == 64 - len(held)
    assert {decode(tokenizer, p) for p in env.eval_prompts(2)} <= held


def test_chat_messages_are_templated_once_exactly_as_apply_chat_template(tmp_path, tokenizer):
    msgs = [[{"role": "system", "content": "Answer with a number."},
             {"role": "user", "content": f"What is {i}+{i}?"}] for i in range(8)]
    path = tmp_path / "chat.parquet"
    import pandas as pd

    pd.DataFrame({"prompt": msgs, "answer": [str(2 * i) for i in range(8)]}).to_parquet(path)
    env = make_env(EnvConfig(dataset_path=str(path), eval_dataset_path=str(path)), tokenizer)
    got = env.eval_prompts(8)
    want = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for m in msgs]
    assert got == want
    traj = _answer_traj(tokenizer, got[3], "6")
    env.score([traj])
    assert traj.reward_components["correct"] == 1.0  # found by the templated prompt


def test_a_chat_prompt_without_a_chat_template_is_refused(tmp_path):
    from hybrid_engine.models.tokenizer import build_tokenizer

    path = tmp_path / "chat.jsonl"
    _jsonl(path, [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}] * 20)
    env = make_env(EnvConfig(dataset_path=str(path), eval_dataset_path=str(path)),
                   build_tokenizer())
    with pytest.raises(ValueError, match="needs a chat template; the tokenizer has none"):
        env.sample_prompts(1)


def test_a_resumed_environment_scores_prompts_handed_out_before_the_checkpoint(tmp_path,
                                                                               tokenizer):
    rows = [{"prompt": f"{i}*1=", "answer": str(i)} for i in range(30)]
    cfg = EnvConfig(dataset_path=_jsonl(tmp_path / "d.jsonl", rows),
                    eval_dataset_path=_jsonl(tmp_path / "e.jsonl", rows[:2]))
    env = make_env(cfg, tokenizer)
    ahead = env.sample_prompts(4)  # e.g. a batch generated ahead, not scored yet
    state = json.loads(json.dumps(env.state_dict()))
    resumed = make_env(cfg, tokenizer)
    resumed.load_state_dict(state)
    traj = _answer_traj(tokenizer, ahead[2], env.answer_for(decode(tokenizer, ahead[2])))
    resumed.score([traj])
    assert traj.reward_components["correct"] == 1.0
    assert resumed.sample_prompts(3) == env.sample_prompts(3)  # the stream goes on alike


def test_reward_functions_receive_the_rows_other_columns(tmp_path, tokenizer):
    rows = [{"prompt": f"{i}-0=", "answer": str(i), "level": i % 3, "topic": "sub"}
            for i in range(20)]
    data = _jsonl(tmp_path / "d.jsonl", rows)
    (tmp_path / "r.py").write_text(
        "def named(prompt, completion, answer, level):\n    return float(level)\n"
        "def everything(prompt, completion, answer, **cols):\n"
        "    return float(len(cols))\n"
        "def plain(prompt, completion, answer):\n    return 1.0\n")
    for fn, expected in (("named", lambda i: float(i % 3)), ("everything", lambda i: 2.0),
                         ("plain", lambda i: 1.0)):
        env = make_env(EnvConfig(dataset_path=data, eval_dataset_path=data, chat_template="none",
                                 reward_fn=f"{tmp_path / 'r.py'}:{fn}", reward_workers=0,
                                 reward_timeout_s=0), tokenizer)
        ids = env.sample_prompts(5)
        trajs = [_answer_traj(tokenizer, p, "0") for p in ids]
        env.score(trajs)
        got = [t.reward for t in trajs]
        want = [expected(int(decode(tokenizer, p).split("-")[0])) for p in ids]
        assert got == want, fn


def test_a_preprocess_without_a_dataset_is_refused():
    with pytest.raises(ValueError, match="env.preprocess needs env.dataset_path"):
        EnvConfig(preprocess="x.py:f")
    EnvConfig(preprocess="x.py:f", eval_dataset_path="e.jsonl")  # an evaluation's file alone
