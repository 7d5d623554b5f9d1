"""A LoRA adapter loaded into vLLM from tensors in memory (`VLLMRollout.set_adapter`):
on 2 ranks, one TP=2 engine and then two TP=1 replicas, vLLM's fp32 log-probs of
sampled and scored tokens equal a transformers forward of the merged model, and a
second adapter version replaces the first."""

from __future__ import annotations

import pytest

from hybrid_engine.testing import run_ranks

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LORA = dict(lora_rank=4, lora_alpha=8.0, lora_target_modules=("q_proj", "k_proj", "v_proj",
                                                              "o_proj", "gate_proj", "down_proj"))


def _adapted(path: str, seed: int):  # noqa: ANN202
    """A transformers model with adapters whose B is random (not the zero init)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hybrid_engine.config import ModelConfig
    from hybrid_engine.parallel.lora import add_adapters, init_adapters

    model = add_adapters(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                         ModelConfig(**LORA), torch.float32)
    init_adapters(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _merged(path: str, adapted):  # noqa: ANN001, ANN202
    import torch
    from transformers import AutoModelForCausalLM

    from hybrid_engine.parallel.lora import merged_parameters
    from hybrid_engine.parallel.params import sharded_named_parameters

    merged = {n: p.detach() for n, p in merged_parameters(adapted,
                                                          sharded_named_parameters(adapted))}
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref.load_state_dict(merged, strict=False)
    return ref


def _engine_case(path: str, tp: int) -> dict:
    from hybrid_engine.config import MemoryConfig, ModelConfig, RolloutConfig
    from hybrid_engine.parallel.lora import adapter_state_dict, lora_config
    from hybrid_engine.rollout.engine import VLLMRollout
    from tests.roles.test_sync import _greedy, _max_logprob_diff

    rollout = VLLMRollout(path, RolloutConfig(tensor_parallel_size=tp, max_model_len=64,
                                              max_tokens=8, enforce_eager=True),
                          memory=MemoryConfig(kv_cache_gib=0.5), dtype="float32",
                          lora_rank=LORA["lora_rank"])
    config = lora_config(ModelConfig(**LORA)).to_dict()
    base = _greedy(rollout, 8)
    out = {}
    for version, seed in ((1, 0), (2, 1)):
        adapted = _adapted(path, seed)
        rollout.set_adapter(adapter_state_dict(adapted), config)
        sampled = _greedy(rollout, 8)
        ref = _merged(path, adapted)
        scored = rollout.score([p + t for p, t in zip(
            [sampled.prompt_ids[i // sampled.num_samples] for i in range(len(sampled.token_ids))],
            sampled.token_ids)], [len(sampled.prompt_ids[i // sampled.num_samples])
                                  for i in range(len(sampled.token_ids))])
        out[version] = dict(sampled=_max_logprob_diff(ref, sampled),
                            scored=max(abs(a - b) for s, lp in zip(scored, sampled.logprobs)
                                       for a, b in zip(s, lp)),
                            changed=sampled.token_ids != base.token_ids
                            or sampled.logprobs != base.logprobs)
    rollout.shutdown()
    return out


def _cases(path: str) -> list:
    import torch.distributed as dist

    from hybrid_engine.models.tiny import TinyModelSpec, write_tiny_model

    if dist.get_rank() == 0:
        write_tiny_model(path, TinyModelSpec(arch="qwen2", vocab_size=1000, norm_std=0.1))
    dist.barrier()
    return [_engine_case(path, tp) for tp in (2, 1)]


def test_an_adapter_from_memory_gives_the_merged_models_logprobs(tmp_path) -> None:
    for per_rank in run_ranks(_cases, 2, str(tmp_path / "m"), timeout=420):
        for case in per_rank:  # TP=2, then TP=1 (2 replicas)
            for version in (1, 2):
                o = case[version]
                assert o["changed"] and o["sampled"] < 1e-5 and o["scored"] < 1e-5, (version, o)
