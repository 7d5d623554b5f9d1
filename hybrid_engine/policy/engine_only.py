"""EnginePolicy: the policy's inference layout alone, for evaluating a model folder.

Job: what `hybrid-engine eval` of a HF folder uses and nothing more: this
process's place in the world (`PolicyProcess`) and the vLLM engine, loaded
straight from the folder at model.rollout_dtype. No trainer, no optimizer, no
weight sync: the weights never change, so evaluating them costs the engine's
memory only. A training checkpoint's weights need the trainer to load them
(`HybridActor`).

    policy = EnginePolicy(cfg)                         # collective
    trajs = policy.collect(env, prompts, num_samples=4, seed=0, sampling={...})
    policy.shutdown()

Every method is collective, as `HybridActor`'s are.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from hybrid_engine.config import RunConfig
from hybrid_engine.parallel.fsdp import default_device, resolve_model_path
from hybrid_engine.parallel.precision import with_rollout_dtype
from hybrid_engine.parallel.rollout_tp import with_rollout_tp
from hybrid_engine.policy.process import PolicyProcess
from hybrid_engine.policy.training import sampling_overrides
from hybrid_engine.preflight import check_model_for_run
from hybrid_engine.roles.base import Layout
from hybrid_engine.rollout.engine import VLLMRollout
from hybrid_engine.trajectory import Trajectory

__all__ = ["EnginePolicy"]

log = logging.getLogger(__name__)


class EnginePolicy:
    """The vLLM engine of cfg.model.path on this world; see the module docstring.

    Attributes:
        rollout: the `VLLMRollout`.
        tokenizer: its tokenizer.
        model_path: the resolved model folder.
        engine_facts: what vLLM resolved (`VLLMRollout.facts`).
    """

    def __init__(self, cfg: RunConfig) -> None:
        cfg.validate_for_run()
        self.cfg = cfg = with_rollout_dtype(cfg, default_device().type)  # "auto" resolved
        self._process = PolicyProcess(cfg.collective_timeout_s)
        self.model_path = str(resolve_model_path(cfg.model.path))
        self.cfg = cfg = with_rollout_tp(cfg, self.model_path, default_device())
        check_model_for_run(self.model_path, cfg.rollout.tensor_parallel_size,
                            self._process.world)
        t0 = time.perf_counter()
        log.info("starting the vLLM engine (TP=%d) on %s; no trainer (evaluation only)",
                 cfg.rollout.tensor_parallel_size, self.model_path)
        self.rollout = VLLMRollout(self.model_path, cfg.rollout, memory=cfg.memory,
                                   dtype=cfg.model.rollout_dtype, logprob_samples=0)
        self._process.time_out_own_groups()
        self.tokenizer = self.rollout.tokenizer
        log.info("engine ready in %.1f s", time.perf_counter() - t0)

    @property
    def engine_facts(self) -> dict:
        return self.rollout.facts

    def switch_to(self, layout: Layout) -> None:
        """Nothing to switch: the engine holds the device in every phase (a reward
        model's forward shares it, as in a run that keeps the engine's memory)."""

    def collect(self, env: Any, prompts: Sequence[Sequence[int]], *, num_samples: int,
                seed: int, sampling: Mapping[str, Any] | None = None) -> list[Trajectory]:
        """Trajectories of env for prompts, single- or multi-turn, unscored
        (collective); sampling: RolloutConfig fields replaced for this call."""
        from hybrid_engine.rollout.episodes import collect

        with sampling_overrides(self.rollout, sampling):
            return collect(self.rollout, env, [list(p) for p in prompts],
                           num_samples=num_samples, seed=seed)

    def shutdown(self) -> None:
        """Stops the engine; destroys the process group if this object made it
        (after the job's last collective, as `HybridActor.shutdown`). Idempotent."""
        self._process.stop_watchdog()
        self.rollout.shutdown()
        self._process.leave()
