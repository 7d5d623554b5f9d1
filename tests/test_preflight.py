"""Preflight checks that need no ranks: each input vLLM or the OS would refuse
late, with a message about their own internals, gets one sentence naming the
key to fix (issue 18, item 10)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hybrid_engine.config import RolloutConfig, apply_overrides
from hybrid_engine.config.recipes import get_recipe
from hybrid_engine.preflight import check_output_dir, check_rollout_limits, preflight


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny", PRESETS["tiny"])


@pytest.fixture(scope="module")
def hf(model_dir):  # noqa: ANN201
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def _rollout(**kw) -> RolloutConfig:  # noqa: ANN003
    return dataclasses.replace(RolloutConfig(max_model_len=128, max_tokens=8, kv_cache_gib=0.25), **kw)


def test_output_dir_under_a_file(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"cannot be made: '.*file' is a file"):
        check_output_dir(tmp_path / "file" / "run" / "deeper", resume=False, overwrite=False)
    check_output_dir(tmp_path / "new" / "run", resume=False, overwrite=False)  # made later


def test_stop_token_outside_the_vocabulary(hf) -> None:
    vocab = hf.vocab_size
    check_rollout_limits(_rollout(stop_token_ids=(0, vocab - 1)), hf, dtype="bfloat16")
    with pytest.raises(ValueError, match=rf"stop_token_ids \[{vocab}\] are outside the model's "
                                         rf"vocabulary \(vocab_size={vocab}\)"):
        check_rollout_limits(_rollout(stop_token_ids=(3, vocab)), hf, dtype="bfloat16")


def test_max_model_len_past_the_models_positions(hf, monkeypatch) -> None:
    positions = hf.max_position_embeddings
    check_rollout_limits(_rollout(max_model_len=positions), hf, dtype="bfloat16")
    with pytest.raises(ValueError, match=rf"max_model_len={positions + 1} is more than the "
                                         rf"model's max_position_embeddings={positions}"):
        check_rollout_limits(_rollout(max_model_len=positions + 1), hf, dtype="bfloat16")
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's own override
    check_rollout_limits(_rollout(max_model_len=positions + 1), hf, dtype="bfloat16")


def test_kv_cache_smaller_than_one_sequence(hf) -> None:
    """vLLM-CPU needs ceil(max_model_len / 128) blocks of 128 tokens plus its null
    block: measured on the tiny model (fp32, T=1, max_model_len=128) it asked for
    2 x 131072 bytes of kv_cache_memory_bytes."""
    text = hf.get_text_config()
    head_dim = text.hidden_size // text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * 4  # fp32, T=1
    assert 128 * per_token == 131072
    fits = 2 * 131072 / 2**30
    check_rollout_limits(_rollout(kv_cache_gib=fits), hf, dtype="float32")
    with pytest.raises(ValueError, match=rf"holds 0 tokens of this model per rank "
                                         rf"\({per_token} bytes each in float32"):
        check_rollout_limits(_rollout(kv_cache_gib=fits * 0.99), hf, dtype="float32")
    check_rollout_limits(_rollout(kv_cache_gib=fits / 2), hf, dtype="bfloat16")  # half the bytes
    with pytest.raises(ValueError, match="raise kv_cache_gib or lower max_model_len"):
        check_rollout_limits(_rollout(kv_cache_gib=fits, max_model_len=129), hf, dtype="float32")


def test_preflight_runs_the_rollout_limits(model_dir, tmp_path) -> None:
    cfg = apply_overrides(get_recipe("tiny_grpo_debug"), [f"model.path={model_dir}",
                                                          f"output_dir={tmp_path / 'run'}"])
    preflight(cfg, world_size=2, local_world_size=2, resume=False, overwrite=False)
    bad = apply_overrides(cfg, ["rollout.max_model_len=100000"])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        preflight(bad, world_size=2, local_world_size=2, resume=False, overwrite=False)


def test_preflight_checks_the_shard_group_against_the_trainer_ranks(model_dir, tmp_path) -> None:
    """train.sharding=hybrid: a group size that does not split the trainer ranks fails
    before any rank builds a mesh (under separate placement: the trainer ranks only)."""
    cfg = apply_overrides(get_recipe("tiny_grpo_debug"), [
        f"model.path={model_dir}", f"output_dir={tmp_path / 'run'}", "train.sharding=hybrid",
        "train.shard_group_size=2", "rollout.tensor_parallel_size=1"])
    preflight(cfg, world_size=4, local_world_size=4, resume=False, overwrite=False)
    with pytest.raises(ValueError, match="shard_group_size=2 must divide the 3 trainer"):
        preflight(cfg, world_size=3, local_world_size=3, resume=False, overwrite=False)
    separate = apply_overrides(cfg, ["placement=separate"])  # 2 of 4 ranks train
    with pytest.raises(ValueError, match="shard_group_size=2 must divide the 2 trainer"):
        preflight(separate, world_size=4, local_world_size=4, resume=False, overwrite=False)
