"""`hybrid-engine train --model.lora_rank --sync.lora=adapter` on 2 ranks
(colocated, TP 2, GPU sleep emulated): the engine serves the file's base with
the trainer's adapters, the KL reference is the base, the checkpoint holds the
adapters only (with the base's digest), and with export.merge_lora=false the
run leaves final_adapter/ (a PEFT folder) and no final/. (The merged sync and
both exports, exactly: tests/roles/test_lora.py.)"""

from __future__ import annotations

import json

import pytest

from tests.policy.runs import rows, train

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_lora_with_adapter_sync_trains_checkpoints_and_exports_the_adapter(
        model_dir, reward_file, tmp_path) -> None:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from hybrid_engine.checkpoint import step_checkpoints
    from hybrid_engine.checkpoint.state import weights_digest
    from hybrid_engine.config.sections import LORA_TARGETS
    from hybrid_engine.reshard.adapters import LoraDims
    from hybrid_engine.reshard.layouts import model_dims
    from tests.reshard.test_adapters import min_elements

    out = tmp_path / "run"
    args = ("--model.lora_rank=4", "--model.lora_alpha=8", "--algorithm.kl_coef=0.05",
            "--sync.verify=true", "--sync.lora=adapter", "--export.merge_lora=false")
    proc = train(model_dir, reward_file, out, 2, *args)
    first = rows(out)
    assert [r["step"] for r in first] == [0, 1, 2, 3]
    trained = [r for r in first[1:] if not r["skipped_degenerate"]]
    assert trained and all(r["kl"] >= 0 for r in trained)
    assert first[1]["kl"] == 0  # the adapters start at B = 0: the policy is the base
    assert any(r["kl"] > 0 for r in trained[1:])  # then the reference stays the base
    # fp32: every verified sync installed the adapters, whose model the engine samples
    # (its weights kept through every release), and only adapter bytes moved: none, as
    # train.sharding=auto replicates (the reference, the base under the trainer's own
    # adapters, scores before any training forward builds DDP's buckets).
    assert "train.sharding=auto chose replicate" in proc.stdout
    assert all(r["mismatch_abs_max"] < 1e-4 for r in first[1:])
    dims = model_dims(AutoConfig.from_pretrained(model_dir))
    least = 4 * min_elements(dims, LoraDims(4, LORA_TARGETS), 2, 2, 1, 0)  # fp32, TP 2, replicas
    assert [r["sync_bytes_received"] for r in trained] == [least] * len(trained)
    (step, ckpt), = step_checkpoints(out / "checkpoints")
    saved = dcp.FileSystemReader(ckpt / "dcp").read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys[:3]
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["lora_base"] == {"path": model_dir, "sha256": weights_digest(model_dir)}
    assert not (out / "final").exists()
    summary = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith('{"steps"')))
    assert summary["final_model"] == str((out / "final_adapter").resolve())
    config = json.loads((out / "final_adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (
        4, 8, model_dir)
    adapters = load_file(str(out / "final_adapter" / "adapter_model.safetensors"))
    assert len(adapters) == 2 * 7 * AutoConfig.from_pretrained(model_dir).num_hidden_layers
    assert all(n.startswith("base_model.model.model.layers.") for n in adapters)
    assert any(n.endswith("lora_B.weight") and bool(t.abs().max() > 0)
               for n, t in adapters.items())  # trained off B's zero init
    assert step == 2  # (its exact resume: tests/roles/test_lora.py, in-process)
