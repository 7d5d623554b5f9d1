"""`VLLMRollout.prompt_ids`: a prompt longer than max_model_len minus its new-token
limit is refused (rollout.prompt_too_long=reject) or cut to its last tokens and
counted (truncate), against the config in force for the call (evaluation swaps
in its own max_tokens); a dataset prompt refused as it is sampled is named by
its file and row (`episodes.collect` asks the environment). No engine is
started: the check runs before sampling."""

from __future__ import annotations

import dataclasses

import pytest

from hybrid_engine.config import RolloutConfig
from hybrid_engine.models.tokenizer import build_tokenizer
from hybrid_engine.rollout.engine import VLLMRollout

TOK = build_tokenizer()


def _rollout(**cfg) -> VLLMRollout:  # noqa: ANN003
    r = object.__new__(VLLMRollout)  # the check needs only the config and the tokenizer
    r.cfg, r.tokenizer, r.num_truncated = RolloutConfig(max_model_len=64, **cfg), TOK, 0
    return r


def test_a_long_prompt_is_refused_naming_the_limit_and_the_fix() -> None:
    r = _rollout(max_tokens=8)
    assert len(r.prompt_ids([list(range(56))])[0]) == 56  # exactly the limit: accepted
    with pytest.raises(ValueError, match=r"prompt 1 has 57 tokens, more than "
                       r"rollout.max_model_len - rollout.max_tokens = 56 \(set "
                       r"rollout.prompt_too_long=truncate"):
        r.prompt_ids([[1, 2], list(range(57))])
    with pytest.raises(ValueError, match="max_tokens=20 = 44"):
        r.prompt_ids([list(range(50))], max_tokens=[20])


def test_truncate_keeps_the_last_tokens_and_counts() -> None:
    r = _rollout(max_tokens=8, prompt_too_long="truncate")
    assert r.prompt_ids([list(range(60)), [7]]) == [list(range(4, 60)), [7]]
    assert r.num_truncated == 1


def test_the_limit_follows_the_config_swapped_in_for_a_call() -> None:
    r = _rollout(max_tokens=8)
    r.prompt_ids([list(range(50))])
    r.cfg = dataclasses.replace(r.cfg, max_tokens=20)  # as evaluation's eval.max_tokens does
    with pytest.raises(ValueError, match="= 44"):
        r.prompt_ids([list(range(50))])


class _LengthsOnly:
    """A rollout that checks its prompts as the engine does (`prompt_ids`) before
    sampling, and samples nothing: the check is what is under test."""

    def __init__(self, engine: VLLMRollout) -> None:
        self.engine, self.cfg = engine, engine.cfg

    def generate(self, prompts, **kwargs):  # noqa: ANN001, ANN003, ANN201
        self.engine.prompt_ids(prompts)
        raise AssertionError("every prompt fits")


def test_a_dataset_prompt_too_long_at_sampling_names_its_file_and_row(tmp_path) -> None:
    """Past the rows the preflight templates, a prompt found too long as it is
    sampled is named by its file and row, not by its place in the batch."""
    import json

    from hybrid_engine.config import EnvConfig
    from hybrid_engine.envs import make_env
    from hybrid_engine.envs.bank import is_held_out
    from hybrid_engine.rollout.episodes import collect

    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]
    long = next(i for i in range(30, 40) if not is_held_out("+".join(["1"] * 60) + f"={i}"))
    rows[long]["prompt"] = "+".join(["1"] * 60) + f"={long}"  # about 120 tokens
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = make_env(EnvConfig(dataset_path=str(path), chat_template="none"), TOK)
    prompts = env.sample_prompts(37)  # an epoch's worth of training rows: the long one too
    with pytest.raises(ValueError) as info:
        collect(_LengthsOnly(_rollout(max_tokens=8)), env, prompts, num_samples=2, seed=0)
    assert str(info.value).startswith(
        f"env.dataset_path={str(path)!r}, row {long}: its prompt has ")
    assert "tokens, more than rollout.max_model_len - rollout.max_tokens = 56" in str(info.value)
