"""Bad input to `hybrid-engine train` under torchrun on 2 ranks: one clear message
(from rank 0, once; no rank's traceback), a non-zero exit, nothing half-written.

The first group fails in preflight, before any engine starts (seconds each);
the second needs the engine running (rewards, prompts, checkpoints, NaNs)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from hybrid_engine.testing import run_torchrun

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# A rank's own traceback names the exception; torchrun's launcher report does not.
_RANK_TRACEBACK = re.compile(r"\b(ValueError|RewardError|RunAborted|FileNotFoundError|KeyError)\b")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny", PRESETS["tiny"])


def _train(model: Path | str, out: Path, *extra: str, recipe: str = "tiny_grpo_debug"):  # noqa: ANN202
    return run_torchrun(
        ["-m", "hybrid_engine.cli", "train", f"--recipe={recipe}", "--no-progress",
         f"--model.path={model}", f"--output_dir={out}", "--env.num_eval_prompts=4",
         "--rollout.max_tokens=8", "--sync.verify=false", *extra], 2, timeout=300, check=False)


def _assert_one_error(proc, out: Path, expected: str | list[str]) -> str:  # noqa: ANN001
    """Non-zero exit, exactly one error line (rank 0's) holding expected, no
    rank traceback, no half-written checkpoint or final model. Returns the line."""
    text = proc.stdout
    assert proc.returncode != 0, text[-3000:]
    errors = [ln for ln in text.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: "), text[-3000:]
    for part in [expected] if isinstance(expected, str) else expected:
        assert part in errors[0], errors[0]
    assert not _RANK_TRACEBACK.search(text), text[-3000:]
    assert not list(out.glob("checkpoints/*.tmp-*")) and not (out / "final").exists()
    return errors[0]


def _edit_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# --- preflight: before any engine starts --------------------------------------


def _model_case(kind: str, model_dir: Path, tmp: Path) -> Path:
    if kind == "missing":
        return tmp / "no" / "such-model"
    if kind == "no_config":
        (tmp / "empty").mkdir()
        return tmp / "empty"
    if kind == "corrupt_config":
        bad = _edit_config(model_dir, tmp / "corrupt")
        (bad / "config.json").write_text("{not json")
        return bad
    if kind == "unsupported_arch":
        return _edit_config(model_dir, tmp / "gpt2", architectures=["GPT2LMHeadModel"])
    if kind == "no_weights":
        shutil.copytree(model_dir, tmp / "noweights", ignore=shutil.ignore_patterns("*.safetensors"))
        return tmp / "noweights"
    if kind == "vocab_mismatch":
        return _edit_config(model_dir, tmp / "smallvocab", vocab_size=64)
    if kind in ("zero_byte", "truncated", "corrupt_header", "nan_weights"):
        bad = _edit_config(model_dir, tmp / kind)
        weights = bad / "model.safetensors"
        data = weights.read_bytes()
        if kind == "zero_byte":
            weights.write_bytes(b"")
        elif kind == "truncated":
            weights.write_bytes(data[: len(data) - 1000])
        elif kind == "corrupt_header":
            weights.write_bytes(data[:8] + b"\x00garbage" + data[17:])
        else:  # one NaN in the last rows: only rank 1 reads it, both must stop
            from safetensors.torch import load_file, save_file

            tensors = load_file(weights)
            tensors["model.layers.1.mlp.up_proj.weight"][-1, 3] = float("nan")
            save_file(tensors, weights)
        return bad
    if kind == "no_tokenizer":
        return Path(shutil.copytree(model_dir, tmp / "notok",
                                    ignore=shutil.ignore_patterns("tokenizer*")))
    raise AssertionError(kind)


@pytest.mark.parametrize(("kind", "expected"), [
    ("missing", "does not exist"),
    ("no_config", "has no config.json"),
    ("corrupt_config", "config.json is unreadable"),
    ("unsupported_arch", ["unsupported architecture 'GPT2LMHeadModel'", "Qwen2ForCausalLM",
                          "LlamaForCausalLM", "Qwen3ForCausalLM"]),
    ("no_weights", "no *.safetensors weights"),
    ("vocab_mismatch", ["the tokenizer has", "vocab_size is 64"]),
    ("zero_byte", "is 0 bytes: not a safetensors file"),
    ("truncated", "truncated or padded"),
    ("corrupt_header", "corrupt safetensors header"),
    ("no_tokenizer", "has no tokenizer"),
    ("nan_weights", ["model.layers.1.mlp.up_proj.weight holds NaN or inf", "meaningless"]),
])
def test_bad_model_folder(model_dir, tmp_path, kind, expected) -> None:
    out = tmp_path / "run"
    proc = _train(_model_case(kind, model_dir, tmp_path), out)
    _assert_one_error(proc, out, expected)
    assert not out.exists()  # failed before writing anything


@pytest.mark.parametrize(("args", "expected"), [
    (["--train.lrr=1e-4"], "did you mean 'train.lr'"),
    (["--train.lr=-1"], "train.lr"),
    (["--algorithm.clip_low=-0.1"], "algorithm.clip_low"),
    (["--sync.bucket_mb=0"], "sync.bucket_mb"),
    (["--train.num_steps=abc"], "train.num_steps"),
    (["--train.lr"], "needs a value"),
    (["--rollout.tensor_parallel_size=3"], "must divide the world size 2"),
    (["--placement=separate", "--rollout.num_ranks=2"], "must leave at least one of the 2 ranks"),
    (["--placement=separate", "--rollout.num_ranks=1", "--rollout.tensor_parallel_size=2"],
     "must divide the rollout ranks (rollout.num_ranks=1)"),
    (["--placement=nope"], "placement"),
    (["--placement=separate", "--train.offload_optimizer=true"], "needs placement=colocated"),
    (["--rollout.num_samples_per_prompt=1"], "algorithm.advantage='grpo' needs >= 2 samples"),
    (["--algorithm.advantage=nope"], "algorithm.advantage: unknown advantage estimator 'nope'"),
    (["--algorithm.kl_estimator=k4"], "algorithm.kl_estimator: unknown KL estimator 'k4'"),
    (["--env.name=nope"], "unknown environment 'nope'"),
    (["--env.min_digits=3", "--env.max_digits=2"], "env.min_digits=3 must be <="),
    (["--rollout.kv_cache_gib=100000"], ["rollout.kv_cache_gib=100000", "lower rollout.kv_cache_gib"]),
    (["--resume"], "no complete checkpoint under"),
    (["--env.reward_fn=no_colon"], "must look like 'path/to/file.py:function'"),
    (["--env.reward_fn=/no/such/file.py:reward"], "does not exist"),
    (["--env.reward_fn=x.py:r", "--env.reward_model_path=/m"], "set at most one of env.reward_fn"),
    (["--rollout.max_model_len=100000"], "more than the model's max_position_embeddings=512"),
    (["--rollout.kv_cache_gib=0.0001"], ["less than one sequence of rollout.max_model_len=128",
                                         "raise kv_cache_gib"]),
    (["--rollout.stop_token_ids=99999"], "stop_token_ids [99999] are outside the model's vocab"),
    (["--env.max_digits=5000"], "env.max_digits must be <= 4000"),
    (["--algorithm.advantage=reinforce_pp", "--algorithm.dynamic_sampling=true",
      "--rollout.num_samples_per_prompt=1"], "a group of 1 never does"),
    (["--env.name=tool", "--algorithm.overlong_buffer=4"],
     "env 'tool' is multi-turn): set algorithm.overlong_buffer=0"),
])
def test_bad_config(model_dir, tmp_path, args, expected) -> None:
    out = tmp_path / "run"
    _assert_one_error(_train(model_dir, out, *args), out, expected)
    assert not out.exists()


def test_unknown_recipe(model_dir, tmp_path) -> None:
    out = tmp_path / "run"
    _assert_one_error(_train(model_dir, out, recipe="tiny_grpo_debgu"), out,
                      "did you mean 'tiny_grpo_debug'")


@pytest.mark.parametrize(("content", "expected"), [
    (None, "cannot read the config file"),
    ("train:\n  lr: [1e-4\n", "invalid YAML"),
])
def test_bad_yaml_file(model_dir, tmp_path, content, expected) -> None:
    path = tmp_path / "cfg.yaml"
    if content is not None:
        path.write_text(content)
    out = tmp_path / "run"
    _assert_one_error(_train(model_dir, out, f"--config={path}"), out, [str(path), expected])


@pytest.mark.parametrize(("lines", "expected"), [
    (None, "does not exist"),
    ([], "dataset is empty"),
    (['{"prompt": "1+1=", "answer": "2"}', "", '{"prompt": "2+2=" "answer": "4"}'],
     ["data.jsonl:3: malformed JSON"]),
    (['{"prompt": "1+1=", "answer": "2"}', '{"prompt": "2+2="}'],
     ["data.jsonl:2: missing key(s) 'answer'"]),
])
def test_bad_dataset(model_dir, tmp_path, lines, expected) -> None:
    path = tmp_path / "data.jsonl"
    if lines is not None:
        path.write_text("\n".join(lines))
    out = tmp_path / "run"
    _assert_one_error(_train(model_dir, out, f"--env.dataset_path={path}"), out, expected)


@pytest.mark.parametrize(("source", "spec", "expected"), [
    ("def other(p, c, a):\n    return 0.0\n", "reward.py:reward", "has no function 'reward'"),
    ("import no_such_module\n", "reward.py:reward",
     ["importing", "ModuleNotFoundError: No module named 'no_such_module'"]),
])
def test_bad_reward_fn_file(model_dir, tmp_path, source, spec, expected) -> None:
    (tmp_path / "reward.py").write_text(source)
    out = tmp_path / "run"
    _assert_one_error(_train(model_dir, out, f"--env.reward_fn={tmp_path / spec}"), out, expected)


def test_output_dir_is_a_file(model_dir, tmp_path) -> None:
    out = tmp_path / "run"
    out.write_text("not a folder")
    _assert_one_error(_train(model_dir, out), out, "exists and is not a folder")
    _assert_one_error(_train(model_dir, out / "sub"), out / "sub", "cannot be made")


# --- with the engine running ------------------------------------------------------

_REWARDS = {
    "raises": "def reward(prompt, completion, answer):\n"
              "    if len(completion) > 2:\n        return 1 / 0\n    return 0.0\n",
    "exits": "import sys\n\ndef reward(prompt, completion, answer):\n    sys.exit(3)\n",
    "hangs": "import time\n\ndef reward(prompt, completion, answer):\n    time.sleep(3600)\n",
}


@pytest.mark.parametrize(("kind", "expected"), [
    ("raises", ["reward function raised ZeroDivisionError", "reward.py:reward",
                "sample with prompt '"]),
    ("exits", ["reward function raised SystemExit: 3", "sample with prompt '"]),
    ("hangs", ["no result within env.reward_timeout_s=2 s", "reward.py:reward",
               "sample with prompt '"]),
])
def test_bad_reward(model_dir, tmp_path, kind, expected) -> None:
    """A raising, exiting or hanging reward inside a job: one error line naming the
    sample, no checkpoint. Non-finite and non-numeric values are the same RewardError
    (their messages: tests/envs/test_custom_reward.py)."""
    (tmp_path / "reward.py").write_text(_REWARDS[kind])
    out = tmp_path / "run"
    proc = _train(model_dir, out, f"--env.reward_fn={tmp_path / 'reward.py'}:reward",
                  "--env.reward_timeout_s=2")
    _assert_one_error(proc, out, expected)
    assert not (out / "checkpoints").exists()  # failed in step 1, before any save


def test_prompt_too_long_rejected_or_truncated_and_counted(model_dir, tmp_path) -> None:
    long_prompt = "+".join(["1"] * 80) + "="  # 161 tokens > max_model_len 128 - max_tokens 8
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]
    rows.append({"prompt": long_prompt, "answer": "80"})
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    args = (f"--env.dataset_path={data}", "--train.prompts_per_step=41", "--train.num_steps=1",
            "--checkpoint_every=0")
    out = tmp_path / "reject"
    _assert_one_error(_train(model_dir, out, *args), out,
                      ["tokens, more than rollout.max_model_len", "rollout.prompt_too_long=truncate"])
    out = tmp_path / "truncate"
    proc = _train(model_dir, out, *args, "--rollout.prompt_too_long=truncate")
    assert proc.returncode == 0, proc.stdout[-3000:]
    step = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert step["prompts_truncated"] == 1.0


def test_nonfinite_steps_are_skipped_then_abort(model_dir, tmp_path) -> None:
    """Steps 1-2 train normally; from step 3 the rewards are 0 or 1e30 (finite,
    so accepted; Dr.GRPO does not divide by their std), which makes the
    gradient norm overflow: each such step is skipped and counted, the second
    in a row aborts, before its checkpoint."""
    per_step = 4 * 4  # prompts_per_step x K of tiny_grpo_debug; no eval
    (tmp_path / "reward.py").write_text(
        "import zlib\ncalls = 0\n\n"
        "def reward(prompt, completion, answer):\n"
        "    global calls\n    calls += 1\n"
        f"    if calls <= {2 * per_step}:\n"
        "        return float(zlib.crc32(completion.encode()) % 2)\n"
        "    return 1e30 * (zlib.crc32(completion.encode()) % 2)\n")
    out = tmp_path / "run"
    proc = _train(model_dir, out, f"--env.reward_fn={tmp_path / 'reward.py'}:reward",
                  "--algorithm.advantage=drgrpo", "--train.num_steps=6", "--checkpoint_every=1",
                  "--keep_checkpoints=5",
                  "--train.max_nonfinite_in_a_row=2")
    line = _assert_one_error(proc, out, ["step 4: 2 steps in a row had a non-finite loss",
                                         "step_00000003"])
    rows = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert [rows[s]["skipped"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 1.0], line
    assert [rows[s]["nonfinite_in_a_row"] for s in (3, 4)] == [1.0, 2.0]
    # The abort came before step 4's save; step 3's checkpoint holds step 2's weights.
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved == ["step_00000001", "step_00000002", "step_00000003"]
    meta = json.loads((out / "checkpoints" / "step_00000003" / "meta.json").read_text())
    assert meta["step"] == 2  # optimizer steps taken: the skipped one did not count
