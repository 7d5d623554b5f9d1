"""Broken copies of a tiny model folder, one per way a user's folder goes wrong
(shared by the in-process preflight tests and the launches that prove the CLI)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# What the train command says about each broken folder.
EXPECTED = {
    "missing": "does not exist",
    "no_config": "has no config.json",
    "adapter_folder": ["is a PEFT adapter folder over '/base/model'", "export.merge_lora=true"],
    "corrupt_config": "config.json is unreadable",
    "unsupported_arch": ["unsupported architecture 'GPT2LMHeadModel'", "Qwen2ForCausalLM",
                         "LlamaForCausalLM", "Qwen3ForCausalLM"],
    "shared_experts": ["Qwen2MoeForCausalLM: a Mixture-of-Experts with shared experts is not "
                       "supported", "Qwen3MoeForCausalLM"],
    "no_weights": "no *.safetensors weights",
    "vocab_mismatch": ["the tokenizer has", "vocab_size is 64"],
    "zero_byte": "is 0 bytes: not a safetensors file",
    "truncated": "truncated or padded",
    "corrupt_header": "corrupt safetensors header",
    "no_tokenizer": "has no tokenizer",
    "nan_weights": ["model.layers.1.mlp.up_proj.weight holds NaN or inf", "meaningless"],
}


def edit_config(src: Path | str, dst: Path, **changes: object) -> Path:
    """A copy of src whose config.json has changes applied."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _damage_weights(kind: str, weights: Path) -> None:
    data = weights.read_bytes()
    if kind == "zero_byte":
        weights.write_bytes(b"")
    elif kind == "truncated":
        weights.write_bytes(data[: len(data) - 1000])
    elif kind == "corrupt_header":
        weights.write_bytes(data[:8] + b"\x00garbage" + data[17:])
    else:  # nan_weights: one NaN in the last rows, which only the last of 2 ranks reads
        from safetensors.torch import load_file, save_file

        tensors = load_file(weights)
        tensors["model.layers.1.mlp.up_proj.weight"][-1, 3] = float("nan")
        save_file(tensors, weights)


def bad_model(kind: str, model_dir: Path | str, tmp: Path) -> Path:
    """A folder under tmp that is model_dir broken the way `kind` (a key of EXPECTED) says."""
    if kind == "missing":
        return tmp / "no" / "such-model"
    if kind == "no_config":
        (tmp / "empty").mkdir()
        return tmp / "empty"
    if kind == "adapter_folder":  # what export.merge_lora=false leaves as final_adapter/
        (tmp / "adapter").mkdir()
        (tmp / "adapter" / "adapter_config.json").write_text(
            '{"base_model_name_or_path": "/base/model", "r": 8}')
        return tmp / "adapter"
    if kind == "corrupt_config":
        bad = edit_config(model_dir, tmp / "corrupt")
        (bad / "config.json").write_text("{not json")
        return bad
    if kind == "unsupported_arch":
        return edit_config(model_dir, tmp / "gpt2", architectures=["GPT2LMHeadModel"])
    if kind == "shared_experts":  # a Qwen2-MoE folder: routed experts beside a shared one
        return edit_config(model_dir, tmp / "qwen2moe", architectures=["Qwen2MoeForCausalLM"],
                           model_type="qwen2_moe", num_experts=4, shared_expert_intermediate_size=64)
    if kind == "no_weights":
        shutil.copytree(model_dir, tmp / "noweights", ignore=shutil.ignore_patterns("*.safetensors"))
        return tmp / "noweights"
    if kind == "vocab_mismatch":
        return edit_config(model_dir, tmp / "smallvocab", vocab_size=64)
    if kind in ("zero_byte", "truncated", "corrupt_header", "nan_weights"):
        bad = edit_config(model_dir, tmp / kind)
        _damage_weights(kind, bad / "model.safetensors")
        return bad
    if kind == "no_tokenizer":
        return Path(shutil.copytree(model_dir, tmp / "notok",
                                    ignore=shutil.ignore_patterns("tokenizer*")))
    raise AssertionError(kind)
