"""`hybrid-engine train` under torchrun on 2 ranks: outputs, resume errors, and a
clean stop on SIGINT/SIGTERM (the step finishes, a complete checkpoint is written)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybrid_engine.checkpoint import step_checkpoints
from hybrid_engine.testing import RankError, run_job, run_torchrun

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _args(model_dir: str, out: Path, *extra: str) -> list[str]:
    return ["-m", "hybrid_engine.cli", "train", "--recipe=tiny_grpo_debug", "--no-progress",
            f"--model.path={model_dir}", f"--output_dir={out}", "--eval.num_prompts=4",
            "--rollout.max_tokens=8", *extra]


def _summary(stdout: str) -> dict:
    """The JSON summary rank 0 prints last (torchrun may log after it)."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith('{"steps"')]
    assert len(lines) == 1, stdout[-3000:]
    return json.loads(lines[0])


# What the libraries print unless --verbose: vLLM's INFO and WARNING lines, its
# weight-loading bar, torch's C++ and Python notices, deprecation warnings.
NOISE = re.compile(r"^\(MainProcess|^(INFO|WARNING) \d\d-\d\d |Loading safetensors|"
                   r"^\[rank\d\]:\[?W|Warning:|FutureWarning|DeprecationWarning|"
                   r"^\d\d:\d\d:\d\d vllm\.", re.MULTILINE)


TRACKERS = bool(importlib.util.find_spec("wandb") and importlib.util.find_spec("mlflow"))


@pytest.fixture(scope="module")
def written(model_dir, tmp_path_factory):  # noqa: ANN201
    """One 2-step run with a samples table every step (and W&B offline and MLflow,
    when the trackers extra is installed): (its output, its folder)."""
    out = tmp_path_factory.mktemp("written") / "run"
    trackers = ["--log.trackers=jsonl,tensorboard,wandb,mlflow"] if TRACKERS else []
    proc = run_torchrun(_args(model_dir, out, "--train.num_steps=2", "--eval.every=2",
                              "--eval.at_start=true", "--log.samples_every=1",
                              "--log.samples_per_table=3", "--rollout.async_scheduling=true",
                              *trackers), 2,
                        timeout=300, env={"WANDB_MODE": "offline"})
    return proc, out


def test_train_writes_every_output(written) -> None:
    proc, out = written
    assert not NOISE.findall(proc.stdout), proc.stdout[-3000:]  # a quiet console by default
    summary = _summary(proc.stdout)
    assert summary["steps"] == 2 and summary["stop_reason"] == "num_steps"
    assert {"acc_start", "acc_end", "wall_s", "output_dir"} <= summary.keys()
    # One log line per step, from rank 0 only.
    lines = [ln for ln in proc.stdout.splitlines() if "hybrid_engine.train: step " in ln]
    assert [ln.split("step ")[1].split(":")[0] for ln in lines] == ["0", "1", "2"]
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert {"generate_s", "score_s", "mem_generate_bytes", "reward_mean"} <= rows[1].keys()
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert (out / "metrics.png").stat().st_size > 0
    assert (out / "final" / "COMPLETE").is_file() and (out / "config.yaml").is_file()
    # What vLLM resolved is on record; the CPU platform turns async scheduling off, said once.
    engine = json.loads((out / "engine.json").read_text())
    assert engine["vllm"] and engine["model_runner"] and engine["attention_backend"]
    assert engine["async_scheduling"] is False and engine["max_num_seqs"] > 0
    assert proc.stdout.count("rollout.async_scheduling=true: vLLM turned it off") == 1
    assert [s for s, _ in step_checkpoints(out / "checkpoints")] == [2]  # keep_checkpoints=1
    # The samples tables: the first 3 samples of each step (one prompt group), decoded.
    samples = [json.loads(ln) for ln in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in samples] == [1, 1, 1, 2, 2, 2]
    assert all(re.fullmatch(r"\d+\+\d+=", r["prompt"]) for r in samples)
    assert {"completion", "reward", "reward/correct", "advantage", "length",
            "policy_version"} <= samples[0].keys()
    assert [r["policy_version"] for r in samples] == [0, 0, 0, 1, 1, 1]


@pytest.mark.skipif(not TRACKERS, reason="the trackers extra is not installed "
                                          "(pip install 'hybrid_engine[trackers]')")
def test_wandb_and_mlflow_get_the_runs_metrics_and_samples(written) -> None:
    from tests.test_tracking import mlflow_run, mlflow_samples, wandb_history, wandb_table

    _, out = written
    rows = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    samples = [json.loads(ln) for ln in (out / "samples.jsonl").read_text().splitlines()]
    config, history, name = wandb_history(out)
    assert name == "run" and config["train.num_steps"] == 2 and config["log.samples_every"] == 1
    assert history[0]["eval/accuracy"] == rows[0]["eval/accuracy"]
    assert history[2]["reward_mean"] == rows[2]["reward_mean"]
    assert [r[3] for r in wandb_table(out, 2)["data"]] == [r["completion"] for r in samples[3:]]
    client, run = mlflow_run(out)
    assert run.info.run_name == "run"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "reward_mean")] == \
        [rows[1]["reward_mean"], rows[2]["reward_mean"]]
    assert [r["completion"] for r in mlflow_samples(run)] == [r["completion"] for r in samples]


def test_resume_without_checkpoint_is_a_clear_error(model_dir, tmp_path) -> None:
    with pytest.raises(RankError, match="no complete checkpoint under"):
        run_job(_args(model_dir, tmp_path / "empty", "--resume")[2:], 2, timeout=300)


def _ctrl_c_after_two_steps(cmd: list[str], out: Path, env: dict | None):  # noqa: ANN202
    """Starts cmd in its own session, SIGINTs its process group (what Ctrl-C does in a
    terminal) once metrics.jsonl holds 2 rows; returns (process, merged output)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "run did not start"
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc, stdout


def test_sigint_finishes_the_step_and_checkpoints(model_dir, tmp_path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *_args(model_dir, out, "--train.num_steps=1000", "--checkpoint_every=1000")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Ctrl-C: SIGINT to the foreground group, here torchrun, which passes it to its ranks.
    proc, stdout = _ctrl_c_after_two_steps(cmd, out, env)
    summary = _summary(stdout)
    assert summary["stop_reason"] == "signal", stdout[-3000:]
    steps = [s for s, _ in step_checkpoints(out / "checkpoints")]
    assert steps == [summary["steps"]]  # the finished steps were saved, completely
    assert not list((out / "checkpoints").glob("*.tmp-*"))
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == summary["steps"]


def test_train_nproc_stops_on_ctrl_c_with_exit_0(model_dir, tmp_path) -> None:
    """`hybrid-engine train --nproc 2` launches through hybrid_engine.launch: Ctrl-C
    (SIGINT to the terminal's foreground group: the launcher alone, torchrun runs in
    its own group) reaches the ranks, which finish the step and save; torchrun and
    the command then exit 0 with no traceback (plain torchrun: exit 1)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hybrid_engine.cli", "train", "--nproc", "2",
           *_args(model_dir, out, "--train.num_steps=1000", "--checkpoint_every=1000")[3:]]
    proc, stdout = _ctrl_c_after_two_steps(cmd, out, None)
    assert proc.returncode == 0 and "Traceback" not in stdout, stdout[-3000:]
    assert "rank 0 got SIGINT" in stdout and "rank 1 got SIGINT" in stdout, stdout[-3000:]
    summary = _summary(stdout)
    assert summary["stop_reason"] == "signal", stdout[-3000:]
    assert [s for s, _ in step_checkpoints(out / "checkpoints")] == [summary["steps"]]
    assert (out / "final" / "COMPLETE").is_file()


def test_single_process_without_torchrun_and_verbose(model_dir, tmp_path) -> None:
    """One process, no torchrun; --verbose brings back every library's log."""
    out = tmp_path / "run"
    cmd = [sys.executable, *_args(model_dir, out, "--train.num_steps=1", "--verbose",
                                  "--rollout.tensor_parallel_size=1", "--checkpoint_every=0")]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert re.search(r"INFO \d\d-\d\d .*Initializing a V1 LLM engine", proc.stdout + proc.stderr)
    summary = _summary(proc.stdout)
    assert summary["steps"] == 1 and (out / "final" / "COMPLETE").is_file()
