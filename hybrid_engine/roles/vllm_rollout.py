"""Rollout role on vLLM, in SPMD mode: one engine per process for the whole job.

Job: sample K completions per prompt and return their token ids and the
sampled tokens' logprobs. Under torchrun every process builds the engine with
`distributed_executor_backend="external_launcher"` over the world that
torchrun made; all ranks of a tensor-parallel group must call `generate` with
identical arguments (vLLM's SPMD contract).

Invariant: this is the only module that touches vLLM internals, and it never
creates or destroys the caller's process group (vLLM destroys the default
group when the engine is deleted, so the engine lives as long as the process).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybrid_engine.config import RolloutConfig

if TYPE_CHECKING:
    from vllm import LLM

__all__ = ["Completions", "VLLMRollout"]


@dataclass(frozen=True, slots=True)
class Completions:
    """K completions for each prompt, flattened prompt-major (index = p * K + k).

    Fields:
        prompt_ids: per prompt, its token ids (after any truncation).
        token_ids: per completion, the sampled token ids.
        logprobs: per completion, the logprob of each sampled token under the
            sampling distribution (temperature applied).
        num_samples: K.
    """

    prompt_ids: list[list[int]]
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    num_samples: int

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


def _prepare_process_env(cfg: RolloutConfig) -> None:
    """Env vars vLLM reads at import/engine time; set before importing vllm."""
    # In-process engine: required by external_launcher, and much faster on CPU.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(cfg.kv_cache_gib))))


def _isolate_cpu_shm_names() -> None:
    """Makes vLLM-CPU's shared-memory segment names unique per job.

    Under external_launcher vLLM derives the name from the init method
    "env://", the same for every job: two jobs on one machine (or a leftover
    segment from a killed job) collide with "create shm in SHMManager failed.
    errno: 17". MASTER_PORT is unique per live job, so it is prefixed.
    """
    try:
        from vllm.distributed.device_communicators import cpu_communicator as cc
    except ImportError:  # a vLLM build without the CPU communicator (CUDA)
        return
    shm = cc._CPUSHMDistributed
    if getattr(shm, "_hybrid_engine_patched", False):
        return
    original = shm.make_group_name

    def make_group_name(communicator) -> str:  # noqa: ANN001
        job = os.environ.get("MASTER_PORT", str(os.getpid()))
        # shm_open names take no "/" past the first; vLLM's own has "//".
        return f"he{job}-" + original(communicator).replace("/", "")

    shm.make_group_name = staticmethod(make_group_name)
    shm._hybrid_engine_patched = True


class VLLMRollout:
    """A vLLM engine colocated with the trainer in this process.

    Args:
        model_path: HF model folder.
        cfg: sampling and engine settings.
        dtype: dtype of vLLM's weights ("float32", "bfloat16").
    """

    def __init__(self, model_path: str, cfg: RolloutConfig, *, dtype: str = "bfloat16") -> None:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        if world % cfg.tensor_parallel_size != 0:
            raise ValueError(
                f"rollout.tensor_parallel_size={cfg.tensor_parallel_size} must divide "
                f"the world size {world}"
            )
        self.cfg = cfg
        _prepare_process_env(cfg)
        _isolate_cpu_shm_names()
        from vllm import LLM

        kwargs = {}
        if dist.is_initialized():
            kwargs["distributed_executor_backend"] = "external_launcher"
        self.llm: LLM = LLM(
            model=model_path,
            dtype=dtype,
            tensor_parallel_size=cfg.tensor_parallel_size,
            max_model_len=cfg.max_model_len,
            enforce_eager=cfg.enforce_eager,
            seed=cfg.seed,
            logprobs_mode="processed_logprobs",
            **kwargs,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self._max_prompt_len = cfg.max_model_len - cfg.max_tokens
        self.num_truncated = 0

    def _prompt_ids(self, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
        out = []
        for i, p in enumerate(prompts):
            ids = self.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p)
            if len(ids) > self._max_prompt_len:
                if self.cfg.prompt_too_long == "reject":
                    raise ValueError(
                        f"prompt {i} has {len(ids)} tokens, more than rollout.max_model_len - "
                        f"rollout.max_tokens = {self._max_prompt_len} (set "
                        f"rollout.prompt_too_long=truncate to keep its last tokens)"
                    )
                ids = ids[-self._max_prompt_len :]
                self.num_truncated += 1
            out.append(ids)
        return out

    def generate(
        self, prompts: Sequence[str | Sequence[int]], *, num_samples: int | None = None,
        seed: int = 0,
    ) -> Completions:
        """Samples K completions per prompt.

        Args:
            prompts: texts or token id lists.
            num_samples: K; rollout.num_samples_per_prompt when None.
            seed: per-call seed; completion j of prompt p uses seed
                (cfg.seed, seed, p, j), so runs repeat whatever the batching.

        Returns:
            Completions, prompt-major.
        """
        from vllm import SamplingParams, TokensPrompt

        k = num_samples or self.cfg.num_samples_per_prompt
        prompt_ids = self._prompt_ids(prompts)
        requests, params = [], []
        for p, ids in enumerate(prompt_ids):
            for j in range(k):
                requests.append(TokensPrompt(prompt_token_ids=ids))
                params.append(SamplingParams(
                    n=1, temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                    top_k=self.cfg.top_k, max_tokens=self.cfg.max_tokens, logprobs=0,
                    seed=hash((self.cfg.seed, seed, p, j)) & 0x7FFFFFFF,
                ))
        outs = self.llm.generate(requests, params, use_tqdm=False)
        token_ids, logprobs = [], []
        for out in outs:
            comp = out.outputs[0]
            token_ids.append(list(comp.token_ids))
            logprobs.append([lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs, strict=True)])
        return Completions(prompt_ids, token_ids, logprobs, k)

    def shutdown(self) -> None:
        """Tears the engine down; idempotent.

        vLLM's teardown destroys its model-parallel groups AND the default
        process group, so call this after the job's last collective. Without
        it, the same teardown runs at interpreter exit and fails if the caller
        already destroyed the default group.
        """
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
