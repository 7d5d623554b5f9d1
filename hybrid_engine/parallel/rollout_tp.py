"""rollout.tensor_parallel_size=auto: the vLLM TP size of a colocated run's engines.

Job: among the sizes the model and the ranks allow (t divides the ranks of a host
and `reshard.layouts.check_model` holds), keep those whose engine fits a rank's
memory budget (its weights / t + the KV cache), and take
- on CUDA the smallest;
- on CPU the one with the shortest predicted decode step, from a cost model
  calibrated on the ranks at start:

      step(t) = read(t) + 2 x layers x allreduce(t)      (allreduce(1) = 0)

  read(t): one rank's pass over its 1/t of the weights for the b_t sequences its
  engine decodes at once (measured: one `F.linear` in the rollout dtype with the
  rank's threads over min(that share, 128 MiB) of weights, scaled to the share).
  allreduce(t): the all-reduce of [b_t, hidden] over t ranks that vLLM-CPU's TP
  layers run twice per layer per decoded token (its shared-memory one; gloo's
  where the build has none, as vLLM's AVX2 build). b_t: a training step's
  prompts x K x t / ranks sequences, at most vLLM-CPU's max_num_seqs (256 x t;
  more take several waves, each counted).

Every rank measures at once (as they decode at once) and the means over the ranks
decide, so all take the same size. The choice and its reason are logged on rank 0.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybrid_engine.parallel.fsdp import DTYPES
from hybrid_engine.parallel.sharding import budget_bytes
from hybrid_engine.reshard.layouts import ModelDims, check_model, hf_shapes, model_dims

if TYPE_CHECKING:
    from hybrid_engine.config import RunConfig

__all__ = ["Costs", "calibrate", "candidates", "choose", "pick", "resolve", "with_rollout_tp"]

log = logging.getLogger(__name__)

SEQS_PER_RANK = 256  # vLLM-CPU's default max_num_seqs: 256 x the engine's TP size
_READ_BYTES = 128 * 2**20  # measured per size: past any last-level cache of these CPUs
_REPEATS = 5


@dataclass(frozen=True)
class Costs:
    """Measured seconds of one decode step of a batch (`batch_rows`), per TP size;
    `waves`: the batches a step's sequences take (1 unless above max_num_seqs)."""

    read: dict[int, float]
    allreduce: dict[int, float]
    waves: dict[int, int] | None = None

    def step(self, t: int, layers: int) -> float:
        one = self.read[t] + (2 * layers * self.allreduce[t] if t > 1 else 0.0)
        return one * (self.waves or {}).get(t, 1)


def candidates(dims: ModelDims, hf: object, ranks: int, local_ranks: int) -> list[int]:
    """TP sizes the rollout ranks and the model allow: t divides the ranks and a
    host's ranks, and the model's contract holds for t."""
    sizes = []
    for t in range(1, ranks + 1):
        if ranks % t or local_ranks % t:
            continue
        try:
            check_model(hf, t)
        except ValueError:
            continue
        sizes.append(t)
    return sizes


def engine_bytes(dims: ModelDims, t: int, itemsize: int, kv_bytes: int) -> int:
    """One rank's engine at TP t: its share of the weights and its KV cache."""
    return sum(r * c for r, c in hf_shapes(dims).values()) * itemsize // t + kv_bytes


def batch_rows(cfg: RunConfig, t: int, ranks: int) -> tuple[int, int]:
    """(rows, waves): the sequences of a training step one engine at TP t decodes at
    once (at most vLLM-CPU's max_num_seqs), and how many such batches they make."""
    seqs = max(1, -(-cfg.train.prompts_per_step * cfg.rollout.num_samples_per_prompt * t
                    // ranks))
    cap = SEQS_PER_RANK * t
    return min(seqs, cap), -(-seqs // cap)


def choose(sizes: Sequence[int], fits: Callable[[int], bool], costs: Costs | None,
           layers: int) -> tuple[int, str]:
    """(size, reason): the smallest fitting size without costs (CUDA), else the
    fitting size of the shortest predicted step (ties: the smaller)."""
    fitting = [t for t in sizes if fits(t)]
    if not fitting:
        return sizes[-1], f"no size fits the memory budget; the largest, {sizes[-1]}"
    if costs is None:
        return fitting[0], f"the smallest that fits the memory budget (of {list(sizes)})"
    best = min(fitting, key=lambda t: (costs.step(t, layers), t))
    parts = [f"TP {t} {1e3 * costs.step(t, layers):.2f} ms (weights {1e3 * costs.read[t]:.2f}"
             + (f" + {2 * layers} all-reduces x {1e6 * costs.allreduce[t]:.0f} us)" if t > 1
                else ")") for t in fitting]
    unfit = [t for t in sizes if t not in fitting]
    tail = f"; {unfit} do not fit the memory budget" if unfit else ""
    return best, "predicted decode step per token: " + ", ".join(parts) + tail


def measure_read(dims: ModelDims, t: int, rows: int, dtype: torch.dtype) -> float:
    """Seconds for one rank to run its 1/t of the model's linear layers on `rows`
    sequences: one `F.linear` over min(that share, _READ_BYTES) of weights (past a
    cache, as the engine's are), scaled to the share."""
    share = sum(r * c for r, c in hf_shapes(dims).values()) / t
    item = torch.empty(0, dtype=dtype).element_size()
    width = max(1, int(min(share * item, _READ_BYTES) // (dims.hidden * item)))
    w = torch.randn(width, dims.hidden, dtype=dtype)
    x = torch.randn(rows, dims.hidden, dtype=dtype)
    times = []
    for i in range(_REPEATS + 2):
        t0 = time.perf_counter()
        F.linear(x, w)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * share / (width * dims.hidden)


def measure_allreduce(group: dist.ProcessGroup, rows: int, hidden: int,
                      dtype: torch.dtype) -> float:
    """Median seconds of the all-reduce vLLM-CPU's TP layers run, of [rows, hidden]
    over `group`: its shared-memory one, or torch.distributed's where the build has
    none (vLLM's AVX2 build). Collective over `group`."""
    from hybrid_engine.rollout import vllm_compat

    x = torch.randn(rows, hidden, dtype=dtype)
    if vllm_compat.has_shm_allreduce():
        from hybrid_engine.rollout.shm_allreduce import manager

        handle = manager(group, "tpcal")

        def reduce() -> None:
            vllm_compat.shm_allreduce(handle, x)
    else:
        def reduce() -> None:
            dist.all_reduce(x, group=group)
    times = []
    for i in range(4 * _REPEATS + 2):
        t0 = time.perf_counter()
        reduce()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _groups_of(sizes: Sequence[int], group: dist.ProcessGroup | None,
               timeout_s: float) -> tuple[dict[int, object], list]:
    """({t: this rank's group of t consecutive ranks of `group`} for each t > 1, the
    groups made here). Every rank makes every group, in the same order."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(
        range(dist.get_world_size()))
    mine, made = {}, []
    for t in sizes:
        if t == 1:
            continue
        if t == len(ranks):
            mine[t] = group if group is not None else dist.group.WORLD
            continue
        for start in range(0, len(ranks), t):
            made.append(dist.new_group(ranks[start:start + t],
                                       timeout=datetime.timedelta(seconds=timeout_s)))
            if ranks.index(dist.get_rank()) // t == start // t:
                mine[t] = made[-1]
    return mine, made


def calibrate(cfg: RunConfig, dims: ModelDims, sizes: Sequence[int],
              group: dist.ProcessGroup | None) -> Costs:
    """Measured read and all-reduce times per size, averaged over the ranks of `group`
    (collective over it)."""
    dtype = DTYPES[cfg.model.rollout_dtype]
    ranks = dist.get_world_size(group) if dist.is_initialized() else 1
    groups, made = (_groups_of(sizes, group, cfg.collective_timeout_s)
                    if dist.is_initialized() else ({}, []))
    batch = {t: batch_rows(cfg, t, ranks) for t in sizes}
    read, ar = {}, {}
    for t in sizes:  # every rank reads its share of the same size at once
        if dist.is_initialized():
            dist.barrier(group=group)
        read[t] = measure_read(dims, t, batch[t][0], dtype)
    for t in (t for t in sizes if t > 1):
        ar[t] = measure_allreduce(groups[t], batch[t][0], dims.hidden, dtype)
    for sub in made:
        if sub in groups.values():  # this rank's; the others are not members here
            dist.destroy_process_group(sub)
    box = torch.tensor([read[t] for t in sizes] + [ar.get(t, 0.0) for t in sizes],
                       dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(box, group=group)
        box /= ranks
    n = len(sizes)
    return Costs(dict(zip(sizes, box[:n].tolist())), dict(zip(sizes, box[n:].tolist())),
                 {t: batch[t][1] for t in sizes})


def resolve(cfg: RunConfig, dims: ModelDims, hf: object, device: torch.device,
            group: dist.ProcessGroup | None = None) -> tuple[int, str]:
    """(size, reason) for rollout.tensor_parallel_size=auto over the ranks of `group`
    (None: the world). Collective over it."""
    ranks = dist.get_world_size(group) if dist.is_initialized() else 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
    budget = budget_bytes(cfg.memory.budget, device, local)
    if dist.is_initialized() and ranks > 1:  # the smallest host and budget decide, alike
        box = torch.tensor([budget, local], dtype=torch.int64,
                           device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=group)
        budget, local = int(box[0]), int(box[1])
    sizes = candidates(dims, hf, ranks, min(local, ranks)) or [1]  # none: the model check says why

    def measure() -> Costs | None:  # ranks on several hosts: no shared-memory all-reduce
        return calibrate(cfg, dims, sizes, group) if _one_host(group) else None

    return pick(cfg, dims, sizes, budget, device.type, measure)


def pick(cfg: RunConfig, dims: ModelDims, sizes: Sequence[int], budget: int, device_type: str,
         measure: Callable[[], Costs | None]) -> tuple[int, str]:
    """`choose` over `sizes` for a rank's memory `budget` (bytes) on `device_type`;
    `measure` gives the costs (called on CPU, with a choice to make)."""
    item = DTYPES[cfg.model.rollout_dtype].itemsize
    kv = 0 if device_type == "cuda" else int(cfg.memory.kv_cache_gib * 2**30)

    def fits(t: int) -> bool:
        return engine_bytes(dims, t, item, kv) <= budget

    costs = measure() if device_type == "cpu" and len([t for t in sizes if fits(t)]) > 1 else None
    return choose(sizes, fits, costs, dims.num_layers)


def _one_host(group: dist.ProcessGroup | None) -> bool:
    if not dist.is_initialized():
        return True
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return len(set(hosts)) == 1


def with_rollout_tp(cfg: RunConfig, model_path: str, device: torch.device,
                    group: dist.ProcessGroup | None = None) -> RunConfig:
    """cfg with rollout.tensor_parallel_size=auto resolved over the ranks of `group`
    (`resolve`; logged on its first rank); other values unchanged. Collective over
    `group` for auto. Needs model.rollout_dtype resolved."""
    if cfg.rollout.tensor_parallel_size != "auto":
        return cfg
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_path)
    t0 = time.perf_counter()
    size, why = resolve(cfg, model_dims(hf), hf, device, group)
    if not dist.is_initialized() or dist.get_rank(group) == 0:
        log.info("rollout.tensor_parallel_size=auto chose %d in %.2f s: %s", size,
                 time.perf_counter() - t0, why)
    return replace(cfg, rollout=replace(cfg.rollout, tensor_parallel_size=size))
