"""The package as a user installs it without this source tree: `python -m build`
makes an sdist and a wheel (built from the unpacked sdist, so the sdist is
complete), the wheel installs into a fresh venv beside this environment's CPU
torch and vLLM, and from it, in a folder outside the tree, `hybrid-engine env`
loads the compiled kernels and one tiny training step trains."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path, timeout: float = 600) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (cmd, done.stdout[-3000:], done.stderr[-3000:])
    return done.stdout + done.stderr


def test_the_wheel_installs_into_a_fresh_venv_and_trains(tmp_path) -> None:
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(REPO)],
         cwd=REPO)
    [wheel], [sdist] = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    assert sdist.name == "hybrid_engine-0.1.0.tar.gz"
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("hybrid_engine/_C") and n.endswith(".so") for n in names)
    assert "hybrid_engine/cli.py" in names and not any(n.startswith("tests/") for n in names)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    # Beside the CPU torch and vLLM of this environment (a .pth line adds its
    # site-packages after the venv's own: the wheel's package comes first).
    site = Path(_run([str(venv / "bin" / "python"), "-c",
                      "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).strip())
    (site / "base_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
          str(wheel)], cwd=tmp_path)

    work = tmp_path / "work"
    work.mkdir()
    cli = str(venv / "bin" / "hybrid-engine")
    where = _run([str(venv / "bin" / "python"), "-c",
                  "import hybrid_engine; print(hybrid_engine.__file__)"], work)
    assert where.strip().startswith(str(site)), where
    env = _run([cli, "env"], work)
    assert "kernels_cpu       True" in env and "native_error      None" in env, env
    _run([cli, "tiny-model", "m", "--preset", "tiny"], work)
    (work / "r.py").write_text("def by_length(prompt, completion, answer):\n"
                               "    return float(len(completion) % 3)\n")
    out = _run([cli, "train", "--recipe=tiny_grpo_debug", "--model.path=m", "--no-progress",
                "--rollout.tensor_parallel_size=1", "--train.num_steps=1",
                "--env.reward_fn=r.py:by_length", "--eval.at_start=false",
                "--eval.at_end=false", "--output_dir=run"], work)
    summary = json.loads([ln for ln in out.splitlines() if ln.startswith('{"steps"')][-1])
    assert summary["steps"] == 1 and (work / "run" / "final" / "config.json").is_file()
    step = json.loads((work / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert step["step"] == 1 and "train_s" in step and step["skipped_degenerate"] == 0.0, step
