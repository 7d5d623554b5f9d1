"""vLLM rollout role in SPMD mode on real gloo ranks, against transformers."""

from __future__ import annotations

import pytest

from hybrid_engine.testing import run_ranks

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = ["12+35=", "7+8=", "100-1="]
TEMPERATURE = 0.7


def _sample(model_dir: str, tp: int, max_tokens: int) -> dict:
    import torch.distributed as dist

    from hybrid_engine.config import RolloutConfig
    from hybrid_engine.roles.vllm_rollout import VLLMRollout

    cfg = RolloutConfig(tensor_parallel_size=tp, num_samples_per_prompt=2, max_tokens=max_tokens,
                        max_model_len=64, kv_cache_gib=1.0, temperature=TEMPERATURE,
                        enforce_eager=True, seed=3)
    rollout = VLLMRollout(model_dir, cfg, dtype="float32")
    first = rollout.generate(PROMPTS, seed=11)
    again = rollout.generate(PROMPTS, seed=11)
    other = rollout.generate(PROMPTS, seed=12)
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
    }
    rollout.shutdown()
    return out


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
    if tp == world_size:  # one TP group: every rank sees the same completions
        for o in outs[1:]:
            assert o["token_ids"] == ref["token_ids"] and o["logprobs"] == ref["logprobs"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert ref["prompt_ids"] == [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    for o in outs:
        assert len(o["token_ids"]) == len(PROMPTS) * 2
        assert o["repeat_equal"] and o["other_seed_differs"]
        assert "more than rollout.max_model_len" in o["errors"]["reject"]
        diff = _reference_logprobs(model_dir, o["prompt_ids"],
                                   list(zip(o["token_ids"], o["logprobs"])), 2)
        assert diff < 1e-4, f"rank {o['rank']}: max |logprob diff| {diff}"
