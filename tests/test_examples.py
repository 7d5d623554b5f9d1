"""examples/custom_loop.py: a host-written REINFORCE loop on HybridActor, launched
the ways host trainers are (torchrun on 2 ranks; accelerate launch)."""

from __future__ import annotations

import json
import os
import subprocess
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybrid_engine.testing import processes_mentioning, run_torchrun

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_loop.py"


def _steps(stdout: str) -> list[dict]:
    return [json.loads(ln) for ln in stdout.splitlines() if ln.startswith('{"step"')]


def _max_change(model_dir: str, trained_dir: Path) -> float:
    before = load_file(str(Path(model_dir) / "model.safetensors"))
    after = load_file(str(trained_dir / "model.safetensors"))
    assert before.keys() == after.keys()
    return max(float((after[k].float() - before[k].float()).abs().max()) for k in before)


def test_example_is_short() -> None:
    assert len(EXAMPLE.read_text().splitlines()) < 60


def test_custom_loop_under_torchrun_on_2_ranks(model_dir, tmp_path) -> None:
    out = tmp_path / "policy"
    proc = run_torchrun([str(EXAMPLE), model_dir, "--tp", "2", "--steps", "2", "--out", str(out)],
                        2, timeout=300, cwd=tmp_path)
    steps = _steps(proc.stdout)
    assert [s["step"] for s in steps] == [0, 1]  # rank 0 prints, once per step
    assert all(torch.isfinite(torch.tensor([s["loss"], s["grad_norm"]])).all() for s in steps)
    assert (out / "COMPLETE").is_file()
    assert _max_change(model_dir, out) > 0  # the loop's updates reached the exported policy


def test_custom_loop_under_accelerate_launch(model_dir, tmp_path) -> None:
    """On CPU, accelerate's multi-process launcher needs MPI; one process under it
    must work (the actor then makes its own one-rank group)."""
    out = tmp_path / "policy"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           str(EXAMPLE), model_dir, "--steps", "1", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [s["step"] for s in _steps(proc.stdout)] == [0]
    assert (out / "COMPLETE").is_file()


_ARMED = '''
import os, runpy, signal, sys, time
from pathlib import Path

from hybrid_engine.policy.colocated import HybridActor

original, calls = HybridActor.train_step, [0]


def armed(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] == 2 and os.environ["RANK"] == "1":  # SIGKILL to torchrun mid-run
        Path(os.environ["HE_STAMP"]).write_text(repr(time.time()))
        os.kill(os.getppid(), signal.SIGKILL)
    return original(self, *args, **kwargs)


HybridActor.train_step = armed
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def test_custom_loop_ranks_exit_when_torchrun_dies(model_dir, tmp_path) -> None:
    """An embedding trainer has no `hybrid-engine` CLI: the actor's watchdog must
    watch the launcher itself. SIGKILL to torchrun at the loop's 2nd train step:
    both ranks leave within seconds, with one error line, and nothing is left."""
    wrapper, stamp, out = tmp_path / "armed.py", tmp_path / "killed_at", tmp_path / "policy"
    wrapper.write_text(_ARMED)
    proc = run_torchrun([str(wrapper), str(EXAMPLE), model_dir, "--tp", "2", "--steps", "50",
                         "--out", str(out)], 2, timeout=300, cwd=tmp_path, check=False,
                        env={"HE_STAMP": str(stamp)})
    down_after = time.time() - float(stamp.read_text())
    print(f"custom loop ranks down {down_after:.1f} s after SIGKILL to torchrun")
    # A line the dying torchrun still relayed carries its "[rankN]: " prefix.
    errors = [ln for ln in proc.stdout.splitlines() if re.match(r"(\[rank\d\]: )?error", ln)]
    assert len(errors) == 1 and "the launcher (torchrun, pid" in errors[0], proc.stdout[-3000:]
    assert down_after < 20 and not (out / "COMPLETE").exists(), proc.stdout[-3000:]
    assert processes_mentioning(str(wrapper)) == []
