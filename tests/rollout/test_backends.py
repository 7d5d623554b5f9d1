"""The CUDA backend's pure parts, on any machine: the engine's memory budget
(memory.gpu_memory_fraction) and the allocator check (expandable_segments
cannot work beside vLLM's sleep-mode allocator). The backend's sleep/wake runs
only where vLLM's CUDA build is (tests/rollout/test_engine.py, gpu marker). The
CPU backend's patch of two compiled vLLM helpers, in-process."""

from __future__ import annotations

import pytest
import torch

from hybrid_engine.config import MemoryConfig
from hybrid_engine.preflight import check_gpu
from hybrid_engine.rollout.cuda import CudaBackend, check_allocator_conf, engine_budget

GIB = 2**30


def test_budget_is_the_fraction_of_what_the_trainer_leaves() -> None:
    # 80 GiB device, 60 free after the trainer's parameters, 20 for AdamW's moments still to come
    util = engine_budget(60 * GIB, 80 * GIB, 20 * GIB, 0.9)
    assert util == pytest.approx(0.9 * 40 / 80)
    assert engine_budget(60 * GIB, 80 * GIB, 0, 0.5) == pytest.approx(0.5 * 60 / 80)
    with pytest.raises(ValueError, match="no GPU memory left.*offload_optimizer"):
        engine_budget(10 * GIB, 80 * GIB, 12 * GIB, 0.9)


def test_gpu_memory_fraction_reaches_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The knob decides vLLM's gpu_memory_utilization (free memory read from the device)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (60 * GIB, 80 * GIB))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    got = {f: CudaBackend(MemoryConfig(gpu_memory_fraction=f), reserve_bytes=20 * GIB)
           .engine_kwargs() for f in (0.9, 0.45)}
    assert got[0.9] == {"gpu_memory_utilization": pytest.approx(0.45), "enable_sleep_mode": True}
    assert got[0.45]["gpu_memory_utilization"] == pytest.approx(0.225)


@pytest.mark.parametrize("conf", ["expandable_segments:True", "max_split_size_mb:64, expandable_segments: true"])
def test_expandable_segments_is_refused(conf: str) -> None:
    with pytest.raises(ValueError, match="expandable_segments cannot be used with vLLM's sleep"):
        check_allocator_conf({"PYTORCH_CUDA_ALLOC_CONF": conf})
    check_allocator_conf({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    check_allocator_conf({})


def test_preflight_gpu_check_is_silent_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check is exercised by the GPU runs")
    check_gpu(64, environ={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})


def test_the_cpu_backend_runs_two_compiled_vllm_helpers_eagerly() -> None:
    """vLLM compiles its tensor-parallel vocabulary mask and the sampled token's
    rank with inductor (~1.8 s of start-up per process on CPU); after the patch
    both are the plain functions, and they give the same integers."""
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe
    from vllm.v1.sample import sampler

    from hybrid_engine.rollout import vllm_compat

    vllm_compat.eager_cpu_helpers()
    mask_fn, rank_fn = vpe.get_masked_input_and_mask, sampler.batched_count_greater_than
    assert not hasattr(mask_fn, "_torchdynamo_orig_callable")
    assert not hasattr(rank_fn, "_torchdynamo_orig_callable")
    # This rank holds token ids [4, 12) of the vocabulary, with no added tokens.
    ids, masked = mask_fn(torch.tensor([0, 4, 11, 12, 15]), 4, 12, 0, 12, 12)
    assert ids.tolist() == [0, 0, 7, 0, 0] and masked.tolist() == [True, False, False, True, True]
    logprobs = torch.tensor([[-0.1, -2.0, -0.5], [-3.0, -1.0, -1.0]])
    assert rank_fn(logprobs, torch.tensor([[-0.5], [-1.0]])).tolist() == [2, 2]


def test_async_scheduling_reaches_the_engine_keywords() -> None:
    """rollout.async_scheduling decides vLLM's async_scheduling ('auto': vLLM's own
    choice). vLLM's CPU platform turns it off whatever it is asked, so the running
    engine's record (engine.json, tests/test_train_cli.py) cannot show it here."""
    from hybrid_engine.config import RolloutConfig
    from hybrid_engine.rollout.engine import scheduling_kwargs

    assert scheduling_kwargs(RolloutConfig()) == {}
    assert scheduling_kwargs(RolloutConfig(async_scheduling="true")) == {"async_scheduling": True}
    assert scheduling_kwargs(RolloutConfig(async_scheduling="false")) == {"async_scheduling": False}
