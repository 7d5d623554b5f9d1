"""Environment registry: lookup by config name, helpful error on a typo."""

from __future__ import annotations

import pytest

from hybrid_engine.config import EnvConfig
from hybrid_engine.envs import ArithmeticEnv, CalcEnv, make_env
from hybrid_engine.models.tokenizer import build_tokenizer
from hybrid_engine.roles.base import Environment


def test_make_env_builds_registered_envs():
    tok = build_tokenizer()
    arith = make_env(EnvConfig(name="arithmetic", seed=1), tok)
    tool = make_env(EnvConfig(name="tool"), tok)
    assert isinstance(arith, ArithmeticEnv) and isinstance(tool, CalcEnv)
    assert isinstance(arith, Environment) and isinstance(tool, Environment)


def test_unknown_env_lists_names_and_closest():
    with pytest.raises(ValueError) as info:
        make_env(EnvConfig(name="arithmatic"), build_tokenizer())
    msg = str(info.value)
    assert "unknown environment 'arithmatic'" in msg
    assert "did you mean 'arithmetic'" in msg
    assert "arithmetic, tool" in msg


def test_make_env_passes_dataset_path(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "x", "answer": }\n')
    with pytest.raises(ValueError, match=r"d\.jsonl', line 1, column 27: not valid JSON"):
        make_env(EnvConfig(name="arithmetic", dataset_path=str(path)), build_tokenizer())


def test_max_turns_reaches_the_calculator() -> None:
    from hybrid_engine.config import EnvConfig
    from hybrid_engine.envs import make_env
    from hybrid_engine.models.tokenizer import build_tokenizer

    assert make_env(EnvConfig(name="tool", max_turns=7, chat_template="none"),
                    build_tokenizer()).max_turns == 7
