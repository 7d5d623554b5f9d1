"""Arithmetic environment: seeded prompts, held-out split, reward, reward guard."""

from __future__ import annotations

import math
import re

import pytest

from hybrid_engine.envs.arithmetic import ArithmeticEnv, arithmetic_reward, parse_completion
from hybrid_engine.envs.bank import is_held_out
from hybrid_engine.envs.base import RewardError, checked_reward
from hybrid_engine.models.tokenizer import EOS_TOKEN_ID, build_tokenizer
from hybrid_engine.trajectory import Trajectory

TOK = build_tokenizer()


def _text(ids: list[int]) -> str:
    return TOK.decode(ids)


def _traj(prompt: str, response: str, *, eos: bool = False) -> Trajectory:
    ids = TOK.encode(response).ids + ([EOS_TOKEN_ID] if eos else [])
    prompt_ids = TOK.encode(prompt).ids
    return Trajectory(prompt_ids=prompt_ids, response_ids=ids, rollout_logp=[0.0] * len(ids))


def test_prompts_are_deterministic_by_seed():
    a, b, c = (ArithmeticEnv(TOK, seed=s).sample_prompts(20) for s in (0, 0, 1))
    assert a == b and a != c
    env = ArithmeticEnv(TOK, seed=0)
    assert env.sample_prompts(8) + env.sample_prompts(12) == a


def test_prompt_shape_follows_digits_and_operators():
    env = ArithmeticEnv(TOK, seed=2, min_digits=2, max_digits=3, operators=("+",))
    for ids in env.sample_prompts(50):
        assert re.fullmatch(r"[1-9][0-9]{1,2}\+[1-9][0-9]{1,2}=", _text(ids))
    env = ArithmeticEnv(TOK, seed=2, operators=("-",), allow_negative=False)
    for ids in env.sample_prompts(50):
        assert not env.answer_for(_text(ids)).startswith("-")
    with pytest.raises(ValueError, match="operators"):
        ArithmeticEnv(TOK, operators=("*",))


def test_held_out_set_is_fixed_and_disjoint_from_training():
    env = ArithmeticEnv(TOK, seed=0, max_digits=2)
    held_out = {_text(p) for p in env.eval_prompts(30)}
    assert len(held_out) == 30 and all(is_held_out(p) for p in held_out)
    train = {_text(p) for p in env.sample_prompts(1000)}
    assert not held_out & train
    assert {_text(p) for p in env.eval_prompts(30)} == held_out
    with pytest.raises(ValueError, match="found only"):
        ArithmeticEnv(TOK, max_digits=1, operators=("+",)).eval_prompts(100)


@pytest.mark.parametrize(
    ("response", "eos", "correct", "fmt"),
    [
        ("46", True, 1.0, 0.1),  # correct, stopped by EOS
        (" 46\nmore text", False, 1.0, 0.1),  # correct, stopped by newline
        ("46", False, 1.0, 0.0),  # correct, truncated (no stop)
        ("045", True, 0.0, 0.1),  # wrong but well formed
        ("-46", True, 0.0, 0.1),
        ("46 apples", True, 0.0, 0.0),  # malformed
        ("", True, 0.0, 0.0),
    ],
)
def test_reward_on_hand_examples(response, eos, correct, fmt):
    env = ArithmeticEnv(TOK)
    traj = _traj("12+34=", response, eos=eos)
    env.score([traj])
    assert traj.reward_components == {"correct": correct, "format": fmt}
    assert traj.reward == pytest.approx(correct + fmt)


def test_tokens_after_eos_are_ignored_and_negative_answers_parse():
    env = ArithmeticEnv(TOK)
    traj = _traj("5-12=", "-7", eos=True)
    traj.response_ids += TOK.encode("99").ids
    traj.rollout_logp = [0.0] * len(traj.response_ids)
    traj.loss_mask = [True] * len(traj.response_ids)
    env.score([traj])
    assert traj.reward == pytest.approx(1.1)
    assert parse_completion(" 3 \n4") == ("3", True)
    assert arithmetic_reward("+7", True, "7") == {"correct": 1.0, "format": 0.1}


def test_dataset_prompts_and_answers(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(f'{{"prompt": "Q{i}:", "answer": "a{i}"}}\n' for i in range(40)))
    env = ArithmeticEnv(TOK, dataset=str(path), seed=5)
    everything = {f"Q{i}:" for i in range(40)}
    held_out = {p for p in everything if is_held_out(p)}
    assert held_out and {_text(p) for p in env.eval_prompts(len(held_out))} == held_out
    train = everything - held_out
    prompts = [_text(p) for p in env.sample_prompts(2 * len(train))]
    assert set(prompts[: len(train)]) == set(prompts[len(train) :]) == train
    traj = _traj("Q3:", "a3", eos=True)
    env.score([traj])
    assert traj.reward_components["correct"] == 1.0
    with pytest.raises(RewardError, match="unknown prompt 'nope'"):
        env.score([_traj("nope", "1")])


def test_resume_continues_with_same_prompts(tmp_path):
    env = ArithmeticEnv(TOK, seed=9)
    env.sample_prompts(7)
    state = env.state_dict()
    expected = env.sample_prompts(5)
    fresh = ArithmeticEnv(TOK, seed=9)
    fresh.load_state_dict(state)
    assert fresh.sample_prompts(5) == expected


@pytest.mark.parametrize(
    ("result", "needle"),
    [
        (ZeroDivisionError("boom"), "raised ZeroDivisionError: boom"),
        ({"r": math.nan}, "finite numbers"),
        ({"r": math.inf}, "finite numbers"),
        ({"r": "1.0"}, "finite numbers"),
        ({"r": True}, "finite numbers"),
        (1.0, "mapping"),
        ({}, "mapping"),
    ],
)
def test_reward_guard_names_env_and_sample(result, needle):
    def fn(traj, prompt_text):
        if isinstance(result, Exception):
            raise result
        return result

    with pytest.raises(RewardError) as info:
        checked_reward("arithmetic", "12+34=", fn, _traj("12+34=", "46"))
    msg = str(info.value)
    assert "environment 'arithmetic'" in msg and "'12+34='" in msg and needle in msg
