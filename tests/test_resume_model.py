"""--resume refuses a run made from another model, in the preflight (no ranks).

A checkpoint's meta.json records what its run was made from (`run_origin`, the
same call a save makes): architecture, weight-shaping config, weights sha256,
LoRA rank. Each case runs `hybrid-engine train --resume`'s own parser, config
and `preflight` in this process on a run folder whose newest checkpoint holds
that record. The save writing it: tests/test_checkpoint.py; the command's one
`error:` line under real ranks: tests/test_faults.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from hybrid_engine.checkpoint import COMPLETE_MARKER, step_checkpoint_path
from hybrid_engine.checkpoint.origin import run_origin, weights_digest
from hybrid_engine.preflight import preflight
from hybrid_engine.policy.placements import rank_map

ORIGIN_LOG = "hybrid_engine.checkpoint.origin"


@pytest.fixture(scope="module")
def models(model_dir, tmp_path_factory) -> dict[str, Path]:
    """The tiny Qwen2 (model_dir), a Llama of the same tensor shapes (no q/k/v
    biases), a copy of the Qwen2 with one weight changed, and a plain copy."""
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    root = tmp_path_factory.mktemp("models")
    llama = write_tiny_model(root / "llama", dataclasses.replace(PRESETS["tiny"], arch="llama"))
    changed = Path(shutil.copytree(model_dir, root / "changed"))
    w = load_file(changed / "model.safetensors")
    w["model.norm.weight"] += 1
    save_file(w, changed / "model.safetensors", metadata={"format": "pt"})
    return {"qwen2": Path(model_dir), "llama": llama, "changed": changed,
            "copy": Path(shutil.copytree(model_dir, root / "copy"))}


def _run_made_from(tmp_path: Path, model: Path, lora_rank: int = 0, *,
                   recorded: bool = True) -> Path:
    """A run folder whose newest complete checkpoint records model (as a save does)."""
    out = tmp_path / "run"
    for step in (1, 2):
        ckpt = step_checkpoint_path(out / "checkpoints", step)
        ckpt.mkdir(parents=True)
        meta = {"step": step, "extra": {"step": step}}
        if recorded:
            meta["origin"] = run_origin(str(model), lora_rank)
        (ckpt / "meta.json").write_text(json.dumps(meta))
        (ckpt / COMPLETE_MARKER).write_text("ok\n")
    return out


def _resume(model: Path, out: Path, *extra: str) -> None:
    """`hybrid-engine train --resume` on 2 ranks, up to the end of its preflight."""
    from hybrid_engine import cli

    args, rest = cli._parser().parse_known_args(
        ["train", "--recipe=tiny_grpo_debug", "--no-progress", f"--model.path={model}",
         f"--output_dir={out}", "--eval.num_prompts=4", "--rollout.max_tokens=8",
         "--sync.verify=false", "--resume", *extra])
    preflight(cli.train_config(args, rest), rank_map=rank_map, world_size=2, local_world_size=2,
              resume=args.resume, overwrite=args.overwrite,
              allow_model_change=args.allow_model_change)


def test_another_architecture_of_the_same_shapes_is_refused(models, tmp_path) -> None:
    out = _run_made_from(tmp_path, models["qwen2"])
    with pytest.raises(ValueError) as e:
        _resume(models["llama"], out)
    sha = weights_digest(str(models["qwen2"]))[:12]
    assert str(e.value) == (
        f"--resume: the run in {out} was made from a Qwen2ForCausalLM (model.path="
        f"{str(models['qwen2'])!r}, weights sha256 {sha}), not the LlamaForCausalLM at "
        f"model.path={str(models['llama'])!r} (another architecture): resume with its model, "
        "or pass --allow-model-change to continue with this one on purpose")


def test_other_weights_are_refused_and_a_copy_passes(models, tmp_path) -> None:
    out = _run_made_from(tmp_path, models["qwen2"])
    with pytest.raises(ValueError, match=r"not the Qwen2ForCausalLM at .*changed'.* \(its "
                                         r"weights have sha256 [0-9a-f]{12}\): resume with its"):
        _resume(models["changed"], out)
    _resume(models["copy"], out)  # another folder, the same bytes: hashed, equal


def test_the_same_model_passes_without_hashing_it(models, tmp_path) -> None:
    out = _run_made_from(tmp_path, models["qwen2"])
    weights_digest.cache_clear()
    _resume(models["qwen2"], out)
    assert weights_digest.cache_info().currsize == 0  # same folder, same files: recorded digest


def test_allow_model_change_warns_once_and_passes(models, tmp_path, caplog) -> None:
    out = _run_made_from(tmp_path, models["qwen2"])
    with caplog.at_level(logging.WARNING, logger=ORIGIN_LOG):
        _resume(models["llama"], out, "--allow-model-change")
    warned = [r.getMessage() for r in caplog.records if r.name == ORIGIN_LOG]
    assert len(warned) == 1 and warned[0].startswith(
        f"--allow-model-change: the run in {out} was made from a Qwen2ForCausalLM"), warned
    assert "not the LlamaForCausalLM" in warned[0]


def test_lora_onto_a_full_run_and_back_are_refused_even_when_allowed(models, tmp_path) -> None:
    full = _run_made_from(tmp_path / "full", models["qwen2"])
    with pytest.raises(ValueError, match=r"trained the full model, but this run has "
                                         r"model.lora_rank=4: resume with model.lora_rank=0"):
        _resume(models["qwen2"], full, "--model.lora_rank=4", "--allow-model-change")
    lora = _run_made_from(tmp_path / "lora", models["qwen2"], lora_rank=4)
    with pytest.raises(ValueError, match=r"trained LoRA adapters \(model.lora_rank=4\), but "
                                         r"this run has model.lora_rank=0: resume with "
                                         r"--model.lora_rank=4"):
        _resume(models["qwen2"], lora, "--allow-model-change")
    with pytest.raises(ValueError, match=r"adapters of rank 4, but this run has "
                                         r"model.lora_rank=8: resume with --model.lora_rank=4"):
        _resume(models["qwen2"], lora, "--model.lora_rank=8")


def test_lora_adapters_do_not_move_to_another_base(models, tmp_path) -> None:
    lora = _run_made_from(tmp_path, models["qwen2"], lora_rank=4)
    with pytest.raises(ValueError, match=r"\(its weights have sha256 [0-9a-f]{12}\): its LoRA "
                                         r"adapters belong to that base model"):
        _resume(models["changed"], lora, "--model.lora_rank=4", "--allow-model-change")


def test_a_checkpoint_without_a_record_resumes_with_a_warning(models, tmp_path, caplog) -> None:
    out = _run_made_from(tmp_path, models["qwen2"], recorded=False)
    with caplog.at_level(logging.WARNING, logger=ORIGIN_LOG):
        _resume(models["llama"], out)
    warned = [r.getMessage() for r in caplog.records if r.name == ORIGIN_LOG]
    assert len(warned) == 1 and "does not record the model it was made from" in warned[0]
