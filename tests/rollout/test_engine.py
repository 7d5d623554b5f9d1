"""vLLM rollout role in SPMD mode on real gloo ranks, against transformers."""

from __future__ import annotations

import math

import pytest

from hybrid_engine.testing import run_ranks

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = ["12+35=", "7+8=", "100-1="]
TEMPERATURE = 0.7


def _sample(model_dir: str, tp: int, max_tokens: int) -> dict:
    import torch.distributed as dist

    from hybrid_engine.config import MemoryConfig, RolloutConfig
    from hybrid_engine.rollout.engine import VLLMRollout

    cfg = RolloutConfig(tensor_parallel_size=tp, num_samples_per_prompt=2, max_tokens=max_tokens,
                        max_model_len=64, temperature=TEMPERATURE, enforce_eager=True, seed=3)
    rollout = VLLMRollout(model_dir, cfg, memory=MemoryConfig(kv_cache_gib=1.0), dtype="float32")
    stopped = _stop_check(rollout)
    first = rollout.generate(PROMPTS, seed=11)
    again = rollout.generate(PROMPTS, seed=11)
    other = rollout.generate(PROMPTS, seed=12)
    rollout.logprob_samples = 1  # log-probs for the first completion of each group only
    sample = rollout.generate(PROMPTS, seed=11)
    rollout.logprob_samples = None
    # 300 prompts of 44 tokens: more than one engine step's token budget (4096 per
    # TP rank), so prompts wait for a later step; each keeps its own seeded draws.
    many = [f"{i:03d}" + "+1" * 20 + "=" for i in range(300)]
    big_batch_same = (rollout.generate(many, seed=11).token_ids[:6]
                      == rollout.generate(many[:3], seed=11).token_ids)
    errors = {}
    try:
        rollout.generate(["1" * 70])
    except ValueError as e:
        errors["reject"] = str(e)
    out = {
        "rank": dist.get_rank(),
        "prompt_ids": first.prompt_ids, "token_ids": first.token_ids, "logprobs": first.logprobs,
        "repeat_equal": again.token_ids == first.token_ids and again.logprobs == first.logprobs,
        "other_seed_differs": other.token_ids != first.token_ids, "errors": errors,
        "sample_same": sample.token_ids == first.token_ids and all(
            lp == first.logprobs[i] if i % 2 == 0 else all(math.isnan(x) for x in lp)
            for i, lp in enumerate(sample.logprobs)),
        "big_batch_same": big_batch_same,
        "stopped": stopped,
    }
    rollout.shutdown()
    return out


def _stop_check(rollout) -> bool:
    """A stop token id ends completions right before it: rerun with the 3rd
    sampled token as a stop id and compare (same seeds, same draws)."""
    from dataclasses import replace

    base = rollout.generate(PROMPTS[:1], num_samples=1, seed=5).token_ids[0]
    cfg = rollout.cfg
    rollout.cfg = replace(cfg, stop_token_ids=(base[2],))
    try:
        cut = rollout.generate(PROMPTS[:1], num_samples=1, seed=5).token_ids[0]
    finally:
        rollout.cfg = cfg
    first = base.index(base[2])
    return cut == base[: first + 1]  # vLLM keeps the stop token itself in token_ids


def _reference_logprobs(model_dir: str, prompt_ids, token_ids, k: int) -> float:
    """Max |vLLM - transformers| over sampled tokens, temperature applied."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst = 0.0
    for i, (toks, lps) in enumerate(token_ids):
        ids = torch.tensor([prompt_ids[i // k] + toks])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt_ids[i // k]) - 1 : -1] / TEMPERATURE
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(toks)[:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(lps)).abs().max().item())
    return worst


@pytest.mark.parametrize("world_size,tp", [(2, 2), (2, 1)])
def test_spmd_sampling_matches_transformers(tmp_path, world_size, tp):
    from transformers import AutoTokenizer

    from hybrid_engine.models.tiny import TinyModelSpec, write_tiny_model

    model_dir = str(write_tiny_model(tmp_path / "m", TinyModelSpec(arch="qwen2", seed=5)))
    outs = run_ranks(_sample, world_size, model_dir, tp, 12, timeout=240)
    ref = outs[0]
    for o in outs[1:]:  # TP groups agree, and replicas' slices are gathered everywhere
        assert o["token_ids"] == ref["token_ids"] and o["logprobs"] == ref["logprobs"]
    if tp == 1:  # replicas of TP 1 compute exactly what one process computes
        single = run_ranks(_sample, 1, model_dir, 1, 12, timeout=240)[0]
        assert single["token_ids"] == ref["token_ids"] and single["logprobs"] == ref["logprobs"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert ref["prompt_ids"] == [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    for o in outs:
        assert len(o["token_ids"]) == len(PROMPTS) * 2
        assert o["repeat_equal"] and o["other_seed_differs"] and o["stopped"]
        assert o["sample_same"]  # asking fewer log-probs samples the same tokens
        assert o["big_batch_same"]
        assert "more than rollout.max_model_len" in o["errors"]["reject"]
        diff = _reference_logprobs(model_dir, o["prompt_ids"],
                                   list(zip(o["token_ids"], o["logprobs"])), 2)
        assert diff < 1e-4, f"rank {o['rank']}: max |logprob diff| {diff}"


def _release_regrow(model_dir: str) -> dict:
    import psutil

    from hybrid_engine.config import MemoryConfig, RolloutConfig
    from hybrid_engine.rollout.engine import VLLMRollout

    cfg = RolloutConfig(tensor_parallel_size=1, num_samples_per_prompt=2, max_tokens=12,
                        max_model_len=64, enforce_eager=True)
    rollout = VLLMRollout(model_dir, cfg, memory=MemoryConfig(kv_cache_gib=1.0), dtype="float32")
    first = rollout.generate(PROMPTS, seed=4)
    rss0 = psutil.Process().memory_info().rss
    released = rollout.release_memory()
    rss_released = psutil.Process().memory_info().rss
    try:
        rollout.generate(PROMPTS)
        guarded = False
    except RuntimeError:
        guarded = True
    regrown = rollout.restore_memory()
    rss_regrown = psutil.Process().memory_info().rss
    second = rollout.generate(PROMPTS, seed=4)
    emulated = _emulated_sleep_cycle(rollout, model_dir, first)
    rollout.shutdown()
    return {"released": released, "regrown": regrown, "rss_drop": rss0 - rss_released,
            "rss_back": rss_regrown - rss_released, "guarded": guarded,
            "same": first.token_ids == second.token_ids and first.logprobs == second.logprobs,
            **emulated}


def _emulated_sleep_cycle(rollout, model_dir: str, first) -> dict:  # noqa: ANN001
    """The same engine with GPU sleep emulated (the knob memory.emulate_gpu_sleep sets
    at build time, switched on here to reuse the engine): a release loses the weights,
    restore_memory brings back only the KV cache, the engine refuses to sample until
    the weights are rewritten, and then samples exactly as before."""
    from safetensors.torch import load_file

    rollout.backend.emulate_sleep = True
    rollout.release_memory()
    lost = not rollout.weights_valid
    rollout.restore_memory()
    try:
        rollout.generate(PROMPTS, seed=4)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    rollout.load_full_weights(load_file(f"{model_dir}/model.safetensors").items())
    rollout.mark_weights_written()
    third = rollout.generate(PROMPTS, seed=4)
    return {"emulated_lost": lost, "emulated_refused": refused,
            "emulated_same": first.token_ids == third.token_ids and first.logprobs == third.logprobs}


def test_kv_cache_release_and_regrow_keeps_generation_identical(tmp_path):
    from hybrid_engine.models.tiny import TinyModelSpec, write_tiny_model
    from hybrid_engine.testing import run_in_subprocess

    model_dir = str(write_tiny_model(tmp_path / "m", TinyModelSpec(arch="llama")))
    out = run_in_subprocess(_release_regrow, model_dir, timeout=240)
    gib = 1 << 30
    assert out["released"] >= 0.9 * gib and out["regrown"] == out["released"]
    # The release is real: the process's resident memory drops by about that much.
    assert out["rss_drop"] >= 0.8 * gib and out["rss_back"] >= 0.8 * gib, out
    assert out["guarded"] and out["same"]
    assert out["emulated_lost"] and "discarded weights" in out["emulated_refused"]
    assert out["emulated_same"]


def _gpu_sleep_cycle(model_dir: str) -> dict:
    """Real level-2 sleep on vLLM's CUDA build: release loses the weights (the
    engine refuses to sample), restore maps the KV cache back, a sync-like
    reload rewrites the weights and sampling repeats exactly."""
    from safetensors.torch import load_file

    from hybrid_engine.config import MemoryConfig, RolloutConfig
    from hybrid_engine.metrics import _memory_bytes
    from hybrid_engine.rollout.engine import VLLMRollout

    cfg = RolloutConfig(tensor_parallel_size=1, num_samples_per_prompt=2, max_tokens=12,
                        max_model_len=64, enforce_eager=True)
    rollout = VLLMRollout(model_dir, cfg, memory=MemoryConfig(gpu_memory_fraction=0.3),
                          dtype="float32")
    first = rollout.generate(PROMPTS, seed=4)
    awake = _memory_bytes()
    released = rollout.release_memory()
    asleep = _memory_bytes()
    lost = not rollout.weights_valid
    regrown = rollout.restore_memory()
    try:
        rollout.generate(PROMPTS, seed=4)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    rollout.load_full_weights(load_file(f"{model_dir}/model.safetensors").items())
    rollout.mark_weights_written()
    again = rollout.generate(PROMPTS, seed=4)
    rollout.shutdown()
    return {"released": released, "regrown": regrown, "lost": lost, "refused": refused,
            "same": first.token_ids == again.token_ids and first.logprobs == again.logprobs,
            "metric_drop": awake - asleep}


@pytest.mark.gpu
def test_real_gpu_sleep_loses_weights_and_a_rewrite_restores_them(tmp_path):
    from hybrid_engine.models.tiny import TinyModelSpec, write_tiny_model
    from hybrid_engine.testing import run_in_subprocess

    try:
        from vllm.platforms import current_platform
    except ImportError as e:
        pytest.skip(f"gpu: vLLM is not importable here ({e})")
    if current_platform.is_cpu():
        pytest.skip("gpu: the installed vLLM is the CPU build (no sleep mode)")
    model_dir = str(write_tiny_model(tmp_path / "m", TinyModelSpec(arch="llama")))
    out = run_in_subprocess(_gpu_sleep_cycle, model_dir, timeout=300)
    assert out["released"] > 0 and out["regrown"] > 0, out
    assert out["lost"] and "discarded weights" in out["refused"]
    assert out["same"]
    # The phase memory metric sees the release (torch's allocator stats would not).
    assert out["metric_drop"] >= 0.9 * out["released"], out
