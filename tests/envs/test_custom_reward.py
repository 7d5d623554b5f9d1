"""A user's reward function (`env.reward_fn`): what it returns becomes the
reward; a sys.exit() or a call that never returns is a RewardError naming the
sample, never a silent exit or a hang."""

from __future__ import annotations

import threading
import time

import pytest

from hybrid_engine.config import EnvConfig
from hybrid_engine.envs import make_env
from hybrid_engine.envs.base import RewardError
from hybrid_engine.models.tokenizer import build_tokenizer
from hybrid_engine.trajectory import Trajectory

TOK = build_tokenizer()

_SOURCE = """
import sys, threading, time

def good(prompt, completion, answer):
    return {"len": float(len(completion)), "thread_is_main": float(threading.current_thread() is threading.main_thread())}

def exits(prompt, completion, answer):
    sys.exit(3)

def hangs(prompt, completion, answer):
    time.sleep(3600)

def slow(prompt, completion, answer):
    time.sleep(0.2)
    return 1.0

def nan(prompt, completion, answer):
    return float("nan")

def inf(prompt, completion, answer):
    return {"correct": float("inf")}

def word(prompt, completion, answer):
    return "high"
"""


def _env(tmp_path, name: str, **cfg):  # noqa: ANN003, ANN202
    (tmp_path / "reward.py").write_text(_SOURCE)
    return make_env(EnvConfig(reward_fn=f"{tmp_path / 'reward.py'}:{name}", **cfg), TOK)


def _traj() -> Trajectory:
    ids = TOK.encode("46").ids
    return Trajectory(prompt_ids=TOK.encode("12+34=").ids, response_ids=ids,
                      rollout_logp=[0.0] * len(ids))


def test_returned_components_become_the_reward(tmp_path) -> None:
    traj = _traj()
    _env(tmp_path, "good", reward_timeout_s=0).score([traj])
    assert traj.reward_components == {"len": 2.0, "thread_is_main": 1.0}  # no limit: no thread
    traj = _traj()
    _env(tmp_path, "good", reward_timeout_s=5).score([traj])
    assert traj.reward_components == {"len": 2.0, "thread_is_main": 0.0}


def test_sys_exit_is_a_reward_error(tmp_path) -> None:
    with pytest.raises(RewardError, match=r"raised SystemExit: 3") as info:
        _env(tmp_path, "exits").score([_traj()])
    assert "reward.py:exits" in str(info.value) and "'12+34='" in str(info.value)


@pytest.mark.parametrize(("name", "needles"), [
    ("nan", ["reward components must be finite numbers", "nan"]),
    ("inf", ["reward components must be finite numbers", "inf"]),
    ("word", ["must return a number or a non-empty mapping", "'high'"]),
])
def test_a_bad_value_is_a_reward_error_naming_the_sample(tmp_path, name, needles) -> None:
    """What a job's one error line says (tests/test_bad_input.py runs a raising and a
    hanging reward end to end; the other bad values take the same RewardError path)."""
    with pytest.raises(RewardError) as info:
        _env(tmp_path, name).score([_traj()])
    for needle in needles:
        assert needle in str(info.value)
    assert f"reward.py:{name}" in str(info.value) and "'12+34='" in str(info.value)


def test_a_call_past_the_timeout_is_a_reward_error_naming_the_sample(tmp_path) -> None:
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"TimeoutError: no result within "
                                          r"env.reward_timeout_s=0.5 s") as info:
        _env(tmp_path, "hangs", reward_timeout_s=0.5).score([_traj()])
    assert time.monotonic() - t0 < 5
    assert "reward.py:hangs" in str(info.value) and "'12+34='" in str(info.value)
    assert any(t.name == "reward_fn" and t.daemon for t in threading.enumerate())
    traj = _traj()  # slower than nothing, within the limit: a reward
    _env(tmp_path, "slow", reward_timeout_s=5).score([traj])
    assert traj.reward == 1.0
