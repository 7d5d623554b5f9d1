"""The hybrid-engine console script, run as a user would (fresh processes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hybrid_engine.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_env_reports_versions_and_kernels():
    out = _cli("env", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout.strip().splitlines()[-1])
    import torch

    assert info["torch"] == torch.__version__
    assert info["kernels_cpu"] is True and info["native_error"] is None
    assert info["kernels_cuda"] == (torch.cuda.is_available() and torch.version.cuda is not None)
    assert info["vllm"] is not None and info["transformers"] is not None
    assert info["world_size"] is None  # not launched


def test_config_applies_overrides_and_rejects_typos(tmp_path):
    yaml_file = tmp_path / "o.yaml"
    yaml_file.write_text("train:\n  lr: 3.0e-5\nrollout.temperature: 0.5\n")
    out = _cli("config", "--recipe", "tiny_grpo_debug", "--config", str(yaml_file),
               "--train.lr=1e-6", "--rollout.max_tokens", "8")
    assert out.returncode == 0, out.stderr
    import yaml

    cfg = yaml.safe_load(out.stdout)
    assert cfg["train"]["lr"] == 1e-6  # CLI beats YAML
    assert cfg["rollout"]["temperature"] == 0.5 and cfg["rollout"]["max_tokens"] == 8
    bad = _cli("config", "--trian.lr=1e-6")
    assert bad.returncode != 0 and "train" in bad.stderr and "Traceback" not in bad.stderr


def test_config_keys_lists_documented_fields_grouped_by_concern():
    out = _cli("config", "--keys")
    assert out.returncode == 0, out.stderr
    blocks = {b.splitlines()[0]: b.splitlines()[1:] for b in out.stdout.strip().split("\n\n")}
    heads = [h.split(":")[0] for h in blocks]
    assert heads == ["# model", "# rollout", "# train", "# algorithm", "# sync", "# env",
                     "# async_rollout", "# memory", "# guards", "# eval", "# log", "# export",
                     "# top level"]
    for head, lines in blocks.items():
        section = head[2:].split(":")[0]
        assert lines and all(ln.startswith(f"--{section}.") for ln in lines) or \
            section == "top level" and all("." not in ln.split("=")[0] for ln in lines), head
    memory = next(lines for head, lines in blocks.items() if head.startswith("# memory"))
    assert [ln.split("=")[0] for ln in memory] == [
        "--memory.release", "--memory.budget", "--memory.kv_cache_gib",
        "--memory.gpu_memory_fraction", "--memory.offload_optimizer", "--memory.emulate_gpu_sleep"]


def test_tiny_model_writes_a_loadable_folder(tmp_path):
    out = _cli("tiny-model", str(tmp_path / "m"), "--arch", "mistral", "--tie")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["arch"] == "mistral" and info["tie_word_embeddings"] is True
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tmp_path / "m").model_type == "mistral"


def test_tiny_model_writes_a_mixture_of_experts(tmp_path):
    import contextlib
    import io

    from hybrid_engine import cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):  # in-process: the same parser and command
        args = cli._parser().parse_args(["tiny-model", str(tmp_path / "m"), "--arch", "mixtral",
                                         "--experts", "3"])
        assert cli._cmd_tiny_model(args) == 0
    info = json.loads(buf.getvalue().strip().splitlines()[-1])
    assert info["arch"] == "mixtral" and info["num_experts"] == 3
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 3


@pytest.mark.parametrize(("argv", "message"), [
    (["--preset", "huge"], "unknown preset 'huge'"),
    (["--arch", "mixtral", "--experts", "1"], "--experts=1: need 1 <= experts_per_token"),
])
def test_bad_tiny_model_flags_are_one_error_line(tmp_path, capsys, argv, message):
    from hybrid_engine import cli

    # The command itself (cli.main would also quieten the libraries through this
    # process's environment, which later tests' subprocesses inherit).
    args = cli._parser().parse_args(["tiny-model", str(tmp_path / "m"), *argv])
    assert cli._cmd_tiny_model(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "m").exists()
