"""The engine's CUDA backend: sleep/wake with tags, a memory budget from free memory.

Job: what vLLM's CUDA build needs that the engine (`rollout/engine.py`) does
not know about.
- Budget: the trainer is built first, so the engine may only use what is
  left. `gpu_memory_utilization` is derived from the memory free when the
  engine is built, less what the trainer will still allocate
  (`reserve_bytes`: AdamW's moments are created at the first step), times
  `memory.gpu_memory_fraction`. vLLM's cumem allocator (sleep mode) refuses
  `expandable_segments`, so that setting is a clear error here and in preflight.
- Release: sleep level 2 drops the KV cache and the weights (weights lost);
  an engine serving LoRA adapters (`keep_weights`) sleeps at level 1, which
  keeps its base weights in host memory and maps them back on wake.
  Wake: the weights first, once per step, before the sync writes them;
  the KV cache before generation. `empty_cache()` before every wake: cumem maps
  physical pages, the caching allocator must give its cached blocks back.
- Accounting: bytes released and regrown are the change of
  `torch.cuda.mem_get_info`'s free memory, the only counter that sees cumem's
  unmapping (`memory_reserved` does not).

Invariant: the weights are mapped before anything writes or reads them;
`release` reports them lost (the engine's `weights_valid` turns False).
Written for vLLM 0.32; run on H100 and H200 with vLLM 0.26.0's CUDA build
(real level-2 sleep, whole 1-GPU jobs: docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import os

import torch

from hybrid_engine.config import MemoryConfig

__all__ = ["CudaBackend", "check_allocator_conf", "engine_budget"]

_log = logging.getLogger(__name__)


def check_allocator_conf(environ: dict | None = None) -> None:
    """Raises when PyTorch's allocator is configured with expandable segments,
    which vLLM's sleep-mode allocator (cumem) cannot work beside."""
    env = os.environ if environ is None else environ
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if "expandable_segments:true" in env.get(key, "").replace(" ", "").lower():
            raise ValueError(
                f"{key}={env[key]!r}: expandable_segments cannot be used with vLLM's sleep mode "
                "(its cumem allocator maps physical pages itself); unset it")


def engine_budget(free: int, total: int, reserve: int, fraction: float) -> float:
    """vLLM's gpu_memory_utilization for an engine built beside a trainer.

    Args:
        free: bytes free on the device now (the trainer's parameters allocated).
        total: the device's bytes.
        reserve: bytes the trainer will still allocate while the engine is awake.
        fraction: memory.gpu_memory_fraction.

    Returns:
        fraction * (free - reserve) / total, the share of the whole device vLLM
        checks against the free memory at start and sizes its KV cache from.
    """
    usable = free - reserve
    if usable <= 0 or total <= 0:
        raise ValueError(
            f"no GPU memory left for the rollout engine: {free / 2**30:.2f} GiB free, the trainer "
            f"still needs {reserve / 2**30:.2f} GiB (optimizer state); use a smaller model, more "
            "ranks (FSDP shards the state), or memory.offload_optimizer=true")
    return fraction * usable / total


class CudaBackend:
    """vLLM-CUDA sleep/wake and memory budget for one engine (see the module doc).

    Args:
        memory: the memory settings (gpu_memory_fraction).
        reserve_bytes: what the trainer will still allocate while the engine is
            awake (0 when the optimizer state is offloaded).
    """

    name = "cuda"

    def __init__(self, memory: MemoryConfig, *, reserve_bytes: int = 0) -> None:
        check_allocator_conf()
        self.memory = memory
        self.reserve_bytes = reserve_bytes
        self._weights_asleep = False
        self.keep_weights = False  # release at sleep level 1 (the engine sets it)

    def engine_kwargs(self) -> dict:
        free, total = torch.cuda.mem_get_info()
        util = engine_budget(free, total, self.reserve_bytes, self.memory.gpu_memory_fraction)
        _log.info("rollout engine budget: gpu_memory_utilization=%.3f (%.2f GiB of %.2f GiB free, "
                  "%.2f GiB kept for the trainer's optimizer state)", util, util * total / 2**30,
                  free / 2**30, self.reserve_bytes / 2**30)
        return {"gpu_memory_utilization": util, "enable_sleep_mode": True}

    @staticmethod
    def _free() -> int:
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    def release(self, llm) -> tuple[int, bool]:  # noqa: ANN001
        """Sleep level 2: KV cache and weights dropped; level 1 with keep_weights
        (the weights wait in host memory). Returns (bytes freed, weights lost)."""
        before = self._free()
        level = 1 if self.keep_weights else 2
        llm.sleep(level=level)
        torch.cuda.empty_cache()
        self._weights_asleep = True
        freed = max(0, self._free() - before)
        _log.info("rollout released %.1f MiB (vLLM sleep level %d: weights %s + KV cache)",
                  freed / 2**20, level, "to host memory" if level == 1 else "dropped")
        return freed, level == 2

    def weight_bytes(self, model: torch.nn.Module) -> int:
        """The engine's weights on this device (0 while asleep: level 1 moved them
        to host memory, level 2 dropped them)."""
        if self._weights_asleep:
            return 0
        return sum(p.nbytes for p in model.parameters())

    def wake_weights(self, llm) -> None:  # noqa: ANN001
        """Maps the weights again before a sync writes them (their contents are
        still lost); a no-op when awake, so a step wakes them once."""
        if self._weights_asleep:
            torch.cuda.empty_cache()  # cumem maps physical pages: give back cached blocks
            llm.wake_up(tags=["weights"])
            self._weights_asleep = False

    def restore(self, llm) -> int:  # noqa: ANN001
        """Wakes the weights if no sync woke them (their contents stay invalid:
        the engine's weights_valid says so), then the KV cache. Returns bytes."""
        self.wake_weights(llm)
        torch.cuda.empty_cache()
        before = self._free()
        llm.wake_up(tags=["kv_cache"])
        return max(0, before - self._free())

    def install(self, layer: torch.nn.Module, staged: torch.Tensor) -> None:
        raise RuntimeError(f"vLLM-CUDA weight of {type(layer).__name__} has another size than "
                           "its HF tensor: packed layouts are a CPU-only case")

    def packs(self, name: str) -> bool:  # noqa: ARG002
        """vLLM-CUDA's unquantized experts and linears stay in the loaded layout."""
        return False

    def install_experts(self, layer: torch.nn.Module, staged: dict[str, torch.Tensor]) -> None:
        raise RuntimeError(f"{type(layer).__name__}: staged experts are a CPU-only case")

    def refresh_packed(self, model: torch.nn.Module) -> float:  # noqa: ARG002
        """vLLM-CUDA keeps no packed copies of plain weights: nothing to do."""
        return 0.0

    def shutdown(self) -> None:
        """Nothing of its own to clean up."""
