"""model.compute_dtype=auto and model.rollout_dtype=auto (parallel/precision.py): bf16
where the device has bf16 GEMMs (CUDA with bf16, a CPU with AVX512-BF16 or AMX), fp32
elsewhere; the trainer's layouts, the policies' engine and sync, preflight and the
memory estimate use the resolved dtype. (A job with rollout_dtype=auto on a CPU
reported without bf16: tests/test_controller.py's 1-rank GRPO case.)"""

from __future__ import annotations

import pytest
import torch

from hybrid_engine.parallel import precision
from hybrid_engine.testing import run_ranks


def _cpu(monkeypatch, avx512_bf16: bool, amx: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)


@pytest.mark.parametrize("avx512_bf16,amx,want", [(True, False, "bfloat16"),
                                                  (False, True, "bfloat16"),
                                                  (False, False, "float32")])
def test_auto_follows_the_cpus_bf16_instructions(monkeypatch, avx512_bf16, amx, want) -> None:
    _cpu(monkeypatch, avx512_bf16, amx)
    assert precision.resolve_compute_dtype("auto", "cpu") == want
    for name in ("bfloat16", "float32"):  # a dtype asked for is kept, whatever the CPU
        assert precision.resolve_compute_dtype(name, "cpu") == name


def test_auto_on_cuda_asks_torch_for_bf16(monkeypatch) -> None:
    _cpu(monkeypatch, False, False)
    for supported, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda s=supported: s)
        assert precision.resolve_compute_dtype("auto", "cuda") == want
        assert precision.resolve_rollout_dtype("auto", "cuda") == want


@pytest.mark.parametrize("avx512_bf16,amx,want", [(True, False, "bfloat16"),
                                                  (False, True, "bfloat16"),
                                                  (False, False, "float32")])
def test_rollout_auto_follows_the_cpus_bf16_instructions(monkeypatch, caplog, avx512_bf16, amx,
                                                         want) -> None:
    """vLLM-CPU's bf16 linear layers fall back to torch's bf16 GEMM on a CPU without
    bf16 instructions (5x slower than fp32 there): the rollout weights follow the
    CPU's kind, logged once; a dtype asked for is kept."""
    from hybrid_engine.config import RunConfig

    _cpu(monkeypatch, avx512_bf16, amx)
    monkeypatch.setattr(precision, "_logged", set())
    with caplog.at_level("INFO", logger=precision.__name__):
        cfg = precision.with_rollout_dtype(RunConfig(), "cpu")
    assert RunConfig().model.rollout_dtype == "auto" and cfg.model.rollout_dtype == want
    assert f"model.rollout_dtype=auto: {want} on cpu" in caplog.text
    for name in ("bfloat16", "float32"):
        assert precision.resolve_rollout_dtype(name, "cpu") == name


def test_the_estimate_and_preflight_hold_the_resolved_rollout_dtype(monkeypatch, model_dir,
                                                                    tmp_path) -> None:
    """The engine's resident weights in the memory estimate, and preflight's KV cache
    check (the rollout dtype's bytes per token), follow model.rollout_dtype=auto."""
    from hybrid_engine.config import RunConfig, apply_overrides
    from hybrid_engine.config.recipes import get_recipe
    from hybrid_engine.models.tiny import PRESETS, hf_config
    from hybrid_engine.parallel.sharding import estimate
    from hybrid_engine.policy.placements import rank_map
    from hybrid_engine.preflight import preflight
    from hybrid_engine.reshard.layouts import model_dims

    dims = model_dims(hf_config(PRESETS["tiny"]))
    cfg = apply_overrides(RunConfig(), {"memory.release": "true"})  # no KV cache counted
    resident = {}
    for native in (True, False):
        _cpu(monkeypatch, native, False)
        resident[native] = estimate("full", dims, cfg, 2, colocated=True, cuda=False).resident
    assert resident[False] == 2 * resident[True]  # fp32 weights: twice bf16's
    run = apply_overrides(get_recipe("tiny_grpo_debug"), {
        "model.path": model_dir, "output_dir": str(tmp_path / "run"), "model.rollout_dtype": "auto",
        "memory.kv_cache_gib": 0.00012})  # fits a sequence of 128 tokens in bf16, not in fp32
    for native, fits in ((True, True), (False, False)):
        _cpu(monkeypatch, native, False)
        if fits:
            preflight(run, rank_map=rank_map, world_size=2, local_world_size=2, resume=False,
                      overwrite=False)
        else:
            with pytest.raises(ValueError, match="in float32"):
                preflight(run, rank_map=rank_map, world_size=2, local_world_size=2,
                          resume=False, overwrite=False)


def test_the_estimate_counts_the_resolved_dtype(monkeypatch) -> None:
    from hybrid_engine.config import RunConfig
    from hybrid_engine.models.tiny import PRESETS, hf_config
    from hybrid_engine.parallel.sharding import estimate
    from hybrid_engine.reshard.layouts import model_dims

    dims, cfg = model_dims(hf_config(PRESETS["tiny"])), RunConfig()
    gathered = {}
    for native in (True, False):
        _cpu(monkeypatch, native, False)
        gathered[native] = estimate("replicate", dims, cfg, 2, colocated=True,
                                    cuda=False).gathered
    assert gathered[False] == 2 * gathered[True]  # fp32 compute copies: twice bf16's


def _built(root: str, native: bool) -> dict:
    """The compute dtype of each layout built with compute_dtype=auto on a CPU
    with (native) or without bf16 instructions: replicate's autocast, FSDP2's
    gathered weights as a forward sees them."""
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model
    from hybrid_engine.parallel.fsdp import build_fsdp_model, compute_autocast, dp_mesh

    torch.cpu._is_avx512_bf16_supported = lambda: native
    torch.cpu._is_amx_tile_supported = lambda: False
    path = write_tiny_model(f"{root}/tiny", PRESETS["tiny"])
    mesh = dp_mesh()
    rep, _ = build_fsdp_model(str(path), mesh, compute_dtype="auto", sharding="replicate")
    full, _ = build_fsdp_model(str(path), mesh, compute_dtype="auto", sharding="full")
    seen = []
    layer = full.model.layers[0].self_attn.q_proj
    layer.register_forward_pre_hook(lambda m, _: seen.append(m.weight.dtype))
    full(input_ids=torch.tensor([[1, 2, 3]]))
    return {"replicate": compute_autocast(rep), "full": seen[0]}


@pytest.mark.parametrize("native", [True, False])
def test_the_trainer_layouts_compute_in_the_resolved_dtype(tmp_path, native) -> None:
    (out,) = run_ranks(_built, 1, str(tmp_path), native)
    if native:
        assert out == {"replicate": torch.bfloat16, "full": torch.bfloat16}
    else:  # fp32 master weights computed in fp32: no autocast at all
        assert out == {"replicate": None, "full": torch.float32}


@pytest.mark.parametrize("device,native,max_len,want", [
    ("cpu", True, 128, "eager"),    # SDPA's bf16 CPU kernel is slow on short rows
    ("cpu", True, 129, "sdpa"),
    ("cpu", False, 128, "sdpa"),    # fp32 compute: SDPA is as fast
    ("cuda", True, 128, "sdpa"),
])
def test_attention_auto_is_eager_only_for_short_bf16_rows_on_a_cpu(monkeypatch, caplog, device,
                                                                   native, max_len, want) -> None:
    import dataclasses

    from hybrid_engine.config import RunConfig

    _cpu(monkeypatch, native, False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: native)
    monkeypatch.setattr(precision, "_logged", set())
    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_model_len=max_len,
                                                               max_tokens=64))
    with caplog.at_level("INFO", logger=precision.__name__):
        got = precision.with_device_choices(cfg, device)
    assert cfg.model.attention == "auto" and got.model.attention == want
    assert f"model.attention=auto: {want}" in caplog.text
    for name in ("sdpa", "eager"):  # an implementation asked for is kept
        asked = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention=name))
        assert precision.resolve_attention(asked, device) == name


def _attention_built(root: str) -> dict:
    """The attention each role's model runs under model.attention, and the policy's
    outputs under both (the same numbers, to fp32 rounding)."""
    from hybrid_engine.config import ModelConfig, TrainConfig
    from hybrid_engine.models.tiny import PRESETS, TinyModelSpec, write_tiny_model
    from hybrid_engine.parallel.fsdp import build_fsdp_model, dp_mesh
    from hybrid_engine.roles.critic import Critic
    from hybrid_engine.roles.trainer import Trainer

    path = str(write_tiny_model(f"{root}/tiny", PRESETS["tiny"]))
    capped = str(write_tiny_model(f"{root}/gemma2", TinyModelSpec(arch="gemma2", tie_word_embeddings=True,
                                                                 attn_softcap=5.0)))
    out, hidden = {}, {}
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    for name in ("sdpa", "eager"):
        model_cfg = ModelConfig(compute_dtype="float32", attention=name)
        trainer = Trainer(path, TrainConfig(sharding="full"), model_cfg)
        critic = Critic(path, TrainConfig(), model_cfg)
        out[name] = (trainer.module.config._attn_implementation,
                     critic.module.model.config._attn_implementation)
        hidden[name] = trainer.module(input_ids=ids).logits.detach()
    capped_model, _ = build_fsdp_model(capped, dp_mesh(), attention="sdpa")
    return {"roles": out, "max_diff": float((hidden["sdpa"] - hidden["eager"]).abs().max()),
            "capped": capped_model.config._attn_implementation}


def test_the_trained_models_run_the_attention_asked_for(tmp_path) -> None:
    (out,) = run_ranks(_attention_built, 1, str(tmp_path))
    assert out["roles"] == {"sdpa": ("sdpa", "sdpa"), "eager": ("eager", "eager")}
    assert out["max_diff"] < 1e-5
    assert out["capped"] == "eager"  # soft-capped attention logits: eager whatever was asked
