"""Bad input to `hybrid-engine train --nproc 2` (torchrun under the project's
launcher): on stderr one clear `error:` line (from rank 0, once), then one line
naming the file that holds torchrun's report; no traceback at all, exit code 2,
nothing half-written.

The first group proves the wiring with a few inputs refused before any engine
starts (the rest of them are checked in-process: tests/test_preflight.py); the
second needs the engine running (rewards, prompts, NaNs): the same job on 2
ranks forked by `run_job` (the launcher's part is the first group's)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hybrid_engine.testing import run_cli, run_job
from tests.bad_models import EXPECTED, bad_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

_REPORT_LINE = re.compile(r"^\(torchrun: rank \d exited with code 2; its report: (\S+); "
                          r"--verbose prints it here\)$")


def _argv(model: Path | str, out: Path, *extra: str) -> list[str]:
    return ["train", "--recipe=tiny_grpo_debug", "--no-progress", f"--model.path={model}",
            f"--output_dir={out}", "--eval.num_prompts=4", "--rollout.max_tokens=8",
            "--sync.verify=false", *extra]


def _train(model: Path | str, out: Path, *extra: str):  # noqa: ANN202
    return run_cli(["train", "--nproc", "2", *_argv(model, out, *extra)[1:]], timeout=300)


def _job(model: Path | str, out: Path, *extra: str):  # noqa: ANN202
    return run_job(_argv(model, out, *extra), 2, timeout=300, check=False)


def _assert_one_error(proc, out: Path, expected: str | list[str], *,  # noqa: ANN001
                      launched: bool = True, earlier_final: bool = False) -> str:
    """Exit code 2; on stderr exactly one error line (rank 0's) holding expected,
    the report line last (if the launcher started the ranks), and no traceback
    anywhere (torchrun's is in the report); no half-written checkpoint or final
    model. A `run_job` has the ranks' stdout and stderr together. Returns the error line."""
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    job = proc.args[0] == "hybrid-engine"  # run_job's
    errors = [ln for ln in (text if job else proc.stderr).splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: "), text[-3000:]
    for part in [expected] if isinstance(expected, str) else expected:
        assert part in errors[0], errors[0]
    assert "Traceback" not in text, text[-3000:]
    assert job or not [ln for ln in proc.stdout.splitlines() if ln.startswith("error")], text[-3000:]
    if launched and not job:
        report = _REPORT_LINE.match(proc.stderr.splitlines()[-1])
        assert report, proc.stderr[-3000:]
        assert "ChildFailedError" in Path(report.group(1)).read_text()
        Path(report.group(1)).unlink()
    elif not job:  # refused before any rank started: the error line is all
        assert proc.stderr.splitlines() == errors, proc.stderr[-3000:]
    assert not list(out.glob("checkpoints/*.tmp-*")) and not list(out.glob("final.tmp-*"))
    assert earlier_final or not (out / "final").exists()
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


@pytest.mark.parametrize(("args", "expected", "launched"), [
    (["--train.lrr=1e-4"], "did you mean 'train.lr'", False),       # the overrides' parser
    (["--rollout.tensor_parallel_size=3"], "must divide the world size 2", True),  # the world
])
def test_bad_config(model_dir, tmp_path, args, expected, launched) -> None:
    out = tmp_path / "run"
    _assert_one_error(_train(model_dir, out, *args), out, expected, launched=launched)
    assert not out.exists()


def _late_inputs(model_dir: Path, tmp: Path) -> dict[str, tuple[list[str], str]]:
    """The inputs found only after the engine had started (15-40 s in), each
    (extra args, expected in the error line); a 'run' folder holds a full run's
    step-1 checkpoint record, with a final/ of its own."""
    import shutil

    from hybrid_engine.checkpoint import COMPLETE_MARKER, step_checkpoint_path
    from hybrid_engine.checkpoint.origin import run_origin

    (tmp / "sig.py").write_text("def reward(prompt, completion):\n    return 0.0\n")
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(1200)]
    rows[1100] = {"prompt": [{"role": "robot", "content": "beep"}], "answer": "1"}
    (tmp / "roles.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    from hybrid_engine.envs.bank import is_held_out

    held = [q for q in (f"Q{i}:" for i in range(400)) if is_held_out(q)][:3]
    (tmp / "three.jsonl").write_text("".join(json.dumps({"prompt": q, "answer": "1"}) + "\n"
                                             for q in held))
    ckpt = step_checkpoint_path(tmp / "full" / "checkpoints", 1)
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 1, "extra": {"step": 1},
                                                "origin": run_origin(str(model_dir), 0)}))
    (ckpt / COMPLETE_MARKER).write_text("ok\n")
    shutil.copytree(model_dir, tmp / "full" / "final")
    return {
        "weight": (["--env.rewards=math:abc"], "the weight of 'math' must be a number"),
        "missing file": ([f"--env.rewards={tmp / 'none.py'}:fn"], "does not exist"),
        "signature": ([f"--env.reward_fn={tmp / 'sig.py'}:reward"], "cannot be called as a reward"),
        "all held out": ([f"--env.dataset_path={tmp / 'three.jsonl'}"], "held out"),
        "lora onto full": (["--model.lora_rank=4", "--resume"], "trained the full model"),
        "role past row 1000": ([f"--env.dataset_path={tmp / 'roles.jsonl'}"], "row 1100"),
    }


def test_inputs_that_need_no_engine_are_refused_before_one(model_dir, tmp_path) -> None:
    """Each is one error line from the preflight of 2 ranks under the launcher: no
    traceback, no /dev/shm entry or process left, the earlier run's checkpoint and
    final/ untouched. The time from launch to exit is logged (the issue's bound:
    8 s on the 2-core machine), not asserted."""
    import time

    from hybrid_engine.testing import processes_mentioning

    shm_before = set(Path("/dev/shm").iterdir())
    times = {}
    for name, (extra, expected) in _late_inputs(model_dir, tmp_path).items():
        out = tmp_path / "full" if "--resume" in extra else tmp_path / name.replace(" ", "_")
        before = sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in out.rglob("*"))
        t0 = time.monotonic()
        proc = _train(model_dir, out, *extra)
        times[name] = time.monotonic() - t0
        _assert_one_error(proc, out, expected, earlier_final="--resume" in extra)
        assert sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in out.rglob("*")) \
            == before, name  # nothing made, nothing of the earlier run touched
        assert not processes_mentioning(str(out)), name
    assert set(Path("/dev/shm").iterdir()) <= shm_before
    print("launch to the error line, 2 ranks: "
          + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))


def test_verbose_shows_torchruns_report(model_dir, tmp_path) -> None:
    """--verbose: torchrun's log and its ChildFailedError traceback on stderr, as
    torchrun writes them (exit code 1, torchrun's own), and no report file."""
    proc = _train(model_dir, tmp_path / "run", "--rollout.tensor_parallel_size=3", "--verbose")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "must divide the world size 2" in proc.stderr
    assert "ChildFailedError" in proc.stderr and "its report:" not in proc.stderr


# --- with the engine running ------------------------------------------------------

_REWARDS = {
    "raises": "def reward(prompt, completion, answer):\n"
              "    if len(completion) > 2:\n        return 1 / 0\n    return 0.0\n",
}


@pytest.mark.parametrize(("kind", "expected"), [
    ("raises", ["env.rewards term 'reward'", "raised ZeroDivisionError", "reward.py:reward",
                "sample with prompt '"]),
])
def test_bad_reward(model_dir, tmp_path, kind, expected) -> None:
    """A raising reward inside a job, scored on one rank's share: one error line
    naming the sample (from rank 0, whichever rank scored it), no checkpoint. Exits,
    non-finite and non-numeric values are the same RewardError and a hanging call is
    killed at its timeout (tests/envs/test_rewards.py, tests/envs/test_real_task.py)."""
    (tmp_path / "reward.py").write_text(_REWARDS[kind])
    out = tmp_path / "run"
    proc = _job(model_dir, out, f"--env.reward_fn={tmp_path / 'reward.py'}:reward",
                "--env.reward_timeout_s=2")
    _assert_one_error(proc, out, expected)
    assert not (out / "checkpoints").exists()  # failed in step 1, before any save


_UNGUARDED_SCRIPT = """
from hybrid_engine.cli import main
print("the script's body ran", flush=True)
main({argv!r})
"""


def test_an_unguarded_script_with_a_hanging_reward_under_torchrun(model_dir, tmp_path) -> None:
    """A script that starts a job at module level (no __main__ guard) under torchrun
    with 2 ranks, and a reward function that never returns (2 s timeout): the reward
    workers do not run the script again, and each step of 16 samples costs about two
    timeouts, not one per sample (96-99 s for this run, one by one). The wall time is
    logged, not asserted (the issue's bound: under 30 s)."""
    import time

    from hybrid_engine.testing import run_torchrun

    (tmp_path / "reward.py").write_text("import time\n\ndef reward(prompt, completion, answer):"
                                        "\n    time.sleep(3600)\n")
    out = tmp_path / "run"
    script = tmp_path / "embed.py"
    script.write_text(_UNGUARDED_SCRIPT.format(argv=_argv(
        model_dir, out, f"--env.reward_fn={tmp_path / 'reward.py'}:reward",
        "--env.reward_timeout_s=2", "--train.num_steps=2", "--checkpoint_every=0")))
    t0 = time.monotonic()
    proc = run_torchrun([str(script)], 2, timeout=240, check=False)
    print(f"an unguarded script, 2 ranks, 2 steps of 16 samples, hanging reward: "
          f"{time.monotonic() - t0:.1f} s from launch to exit")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert proc.stdout.count("the script's body ran") == 2, proc.stdout[-3000:]  # once per rank
    assert proc.stdout.count("had a reward call time out") == 1, proc.stdout[-3000:]
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/timeouts"] for r in rows if r["step"] > 0] == [16.0, 16.0]
    assert (out / "final" / "config.json").is_file()


def test_a_failed_final_evaluation_keeps_final_and_the_last_checkpoint(model_dir, tmp_path) -> None:
    """A reward that raises only once the 2 training steps are scored (its 9th call
    in each rank's worker: 8 samples per rank per step) fails the final evaluation:
    one error line, and the trained policy is kept: final/ and step 2's checkpoint
    (checkpoint_every=3 would not have saved it)."""
    (tmp_path / "reward.py").write_text(
        "calls = 0\n\ndef reward(prompt, completion, answer):\n    global calls\n"
        "    calls += 1\n    if calls > 16:\n        raise ValueError('eval set broke me')\n"
        "    return float(len(completion) % 2)\n")
    out = tmp_path / "run"
    proc = _job(model_dir, out, f"--env.reward_fn={tmp_path / 'reward.py'}:reward",
                "--train.num_steps=2", "--checkpoint_every=3", "--eval.at_end=true")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    errors = [ln for ln in text.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and "the final evaluation failed" in errors[0], text[-3000:]
    assert "eval set broke me" in errors[0] and "final is written" in errors[0], errors
    assert "Traceback" not in text, text[-3000:]
    assert (out / "final" / "config.json").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]


def test_a_prompt_too_long_is_truncated_and_counted(model_dir, tmp_path) -> None:
    """With rollout.prompt_too_long=truncate (reject's refusals: tests/test_preflight.py
    before any engine, tests/rollout/test_engine.py as it samples)."""
    long_prompt = "+".join(["1"] * 80) + "="  # 161 tokens > max_model_len 128 - max_tokens 8
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]
    rows.append({"prompt": long_prompt, "answer": "80"})
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "truncate"
    proc = _job(model_dir, out, f"--env.dataset_path={data}", "--train.prompts_per_step=41",
                "--train.num_steps=1", "--checkpoint_every=0",
                "--rollout.prompt_too_long=truncate")
    assert proc.returncode == 0, proc.stdout[-3000:]
    step = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert step["prompts_truncated"] == 1.0


def test_nonfinite_steps_are_skipped_then_abort(model_dir, tmp_path) -> None:
    """Steps 1-2 train normally; from step 3 the rewards are 0 or 1e30 (finite,
    so accepted; Dr.GRPO does not divide by their std), which makes the
    gradient norm overflow: each such step is skipped and counted, the second
    in a row aborts, before its checkpoint."""
    # prompts_per_step x K of tiny_grpo_debug (no eval), scored once over the 2 ranks:
    # each rank's one reward worker sees half of a step's samples.
    per_step = 4 * 4 // 2
    (tmp_path / "reward.py").write_text(
        "import zlib\ncalls = 0\n\n"
        "def reward(prompt, completion, answer):\n"
        "    global calls\n    calls += 1\n"
        f"    if calls <= {2 * per_step}:\n"
        "        return float(zlib.crc32(completion.encode()) % 2)\n"
        "    return 1e30 * (zlib.crc32(completion.encode()) % 2)\n")
    out = tmp_path / "run"
    proc = _job(model_dir, out, f"--env.reward_fn={tmp_path / 'reward.py'}:reward",
                "--algorithm.advantage=drgrpo", "--train.num_steps=6", "--checkpoint_every=1",
                "--keep_checkpoints=5", "--guards.max_nonfinite_in_a_row=2")
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
