"""Bad input to `hybrid-engine train` under torchrun on 2 ranks: one clear message
(from rank 0, once; no rank's traceback), a non-zero exit, nothing half-written.

The first group proves the wiring with a few inputs refused before any engine
starts (the rest of them are checked in-process: tests/test_preflight.py); the
second needs the engine running (rewards, prompts, checkpoints, NaNs)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hybrid_engine.testing import run_torchrun
from tests.bad_models import EXPECTED, bad_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# A rank's own traceback names the exception; torchrun's launcher report does not.
_RANK_TRACEBACK = re.compile(r"\b(ValueError|RewardError|RunAborted|FileNotFoundError|KeyError)\b")


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


# --- the wiring: a few refusals through torchrun -----------------------------------
# Every other input refused before an engine starts is checked in-process, through
# the same parser, config and preflight (tests/test_preflight.py).


@pytest.mark.parametrize("kind", [
    "missing",      # preflight, on every rank alike
    "nan_weights",  # found by the trainer as it loads rows: only rank 1 reads the NaN
])
def test_bad_model_folder(model_dir, tmp_path, kind) -> None:
    out = tmp_path / "run"
    proc = _train(bad_model(kind, model_dir, tmp_path), out)
    _assert_one_error(proc, out, EXPECTED[kind])
    assert not out.exists()  # failed before writing anything


@pytest.mark.parametrize(("args", "expected"), [
    (["--train.lrr=1e-4"], "did you mean 'train.lr'"),               # the overrides' parser
    (["--rollout.tensor_parallel_size=3"], "must divide the world size 2"),  # torchrun's world
])
def test_bad_config(model_dir, tmp_path, args, expected) -> None:
    out = tmp_path / "run"
    _assert_one_error(_train(model_dir, out, *args), out, expected)
    assert not out.exists()


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
