"""Trainer role: FSDP2 forward/backward/step.

Job: own the training layout (`fsdp.build_fsdp_model`), the AdamW optimizer
and LR schedule, and run one optimizer step per `train_step(batch, loss_fn)`
(several per RL step: `roles.updates`):
micro-batches with gradient accumulation, the loss normalised by the TRUE
count of the whole step over all data-parallel ranks (the trainer knows no
formula: `algorithms.losses` documents the contract), gradient clipping on
DTensor gradients. `compute_logprobs` gives per-token log-probs and entropy
through `roles/logprobs.py` (chunked over the vocabulary projection).
With train.tensor_parallel_size=t the model is split over TP groups of t
ranks (`parallel.tensor_parallel`) and FSDP2-sharded across them: the ranks
of a TP group take the same rows of the batch (the data-parallel ranks are
`mesh`, the ranks of one TP rank), every rank of the model is `group`.

Invariant (FSDP2 root-unshard guard): the optimizer is built in __init__
over the sharded DTensor parameters, before any forward, and every forward
without backward ends with `reshard_all(module)`. FSDP2 keeps the root group
(embed, final norm, lm_head) unsharded from its forward until the end of
backward; without a backward it stays unsharded, `parameters()` then returns
plain full tensors, and an optimizer, weight sync or checkpoint built from
them silently misses those parameters. `train_step` reshards and asserts
that the module's parameters are exactly the optimizer's DTensors.
(train.sharding=replicate has no FSDP: plain parameters under DDP (on one
rank no wrapper at all), bf16
compute by torch.autocast around each micro-batch's forward and its
vocabulary projection, `fsdp.compute_autocast`.)

Profiling (benchmarks): `HYBRID_ENGINE_PROFILE_TRAIN=<n>:<dir>` profiles the
n-th `train_step` call (`roles/profile.py`).

Shape legend: B sequences, T positions, H hidden size, V vocabulary,
N selected (loss) positions, C positions of one chunk.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate

from hybrid_engine.algorithms.aggregation import loss_normalizer
from hybrid_engine.algorithms.losses import (ADDITIVE_METRICS, LossFn, LossInputs, combine_metrics,
                                             metric_weight)
from hybrid_engine.parallel import replicas
from hybrid_engine.parallel.fsdp import build_fsdp_model, dp_mesh, tp_mesh
from hybrid_engine.parallel.lora import dropout_active
from hybrid_engine.parallel.params import assert_sharded, reshard_all, sharded_named_parameters
from hybrid_engine.parallel.sharding import resolve_alone
from hybrid_engine.parallel.tensor_parallel import (clip_grad_norm, partial_grad_names,
                                                    sum_partial_grads)
from hybrid_engine.roles.logprobs import (ENTROPY_METRIC_EVERY, batch_logprobs, comm_device,
                                          micro_batch_logprobs, num_micro_batches)
from hybrid_engine.roles.profile import OPTIMIZER_RANGE, maybe_profile
from hybrid_engine.rollout import shm_allreduce

if TYPE_CHECKING:
    from hybrid_engine.config import ModelConfig, TrainConfig
    from hybrid_engine.trajectory import TrainBatch

__all__ = ["Trainer", "build_optimizer", "check_replicas", "clip_and_step", "lr_lambda",
           "micro_batch_comm"]

_FUSED_ADAMW_DEVICES = ("cpu", "cuda")


# --------------------------------------------------------------------------
# Schedule and metrics
# --------------------------------------------------------------------------


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """LambdaLR factor: linear warmup (step + 1) / (warmup + 1), then constant or
    cosine decaying to 0 at cfg.num_steps."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = (step - cfg.warmup_steps) / max(1, cfg.num_steps - cfg.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def _reduce_metrics(local: dict[str, Tensor], mesh: DeviceMesh) -> dict[str, float]:
    """Combines per-rank step metrics like `combine_metrics` does micro-batches:
    additive keys summed, _max/_min extremes, the rest means weighted by
    num_tokens (or their subset's count, `metric_weight`)."""
    device = comm_device(mesh)
    keys = sorted(local)
    weight = {k: local[metric_weight(k)].float() for k in keys}
    sums = [local[k] if k in ADDITIVE_METRICS else local[k] * weight[k] for k in keys]
    sum_t = torch.stack([s.float() for s in sums]).to(device)
    ext_keys = [k for k in keys if k.endswith("_max") or k.endswith("_min")]
    # Min as max of the negation; a rank without the metric's tokens has no extreme (-inf).
    ext = []
    for k in ext_keys:
        v = (local[k] if k.endswith("_max") else -local[k]).float()
        ext.append(torch.where(weight[k] > 0, v, torch.full_like(v, -math.inf)))
    ext_t = torch.stack(ext).to(device) if ext else torch.zeros(1, device=device)
    dist.all_reduce(sum_t, group=mesh.get_group())
    dist.all_reduce(ext_t, op=dist.ReduceOp.MAX, group=mesh.get_group())
    totals = dict(zip(keys, sum_t.tolist()))  # the weights are additive: their totals
    out = {k: v if k in ADDITIVE_METRICS else v / max(totals[metric_weight(k)], 1.0)
           for k, v in totals.items()}
    for k, v in zip(ext_keys, ext_t.tolist()):
        out[k] = 0.0 if math.isinf(v) else (v if k.endswith("_max") else -v)
    return out


# --------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------


def build_optimizer(
    module: torch.nn.Module, train_cfg: TrainConfig, *, fused: bool = True,
) -> tuple[frozenset[int], torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over a module's trainable sharded parameters (no weight decay on 1-D ones;
    torch's fused implementation on CPU and CUDA unless fused=False: torch's
    per-tensor loop, whose rounding differs) and its LR schedule. Returns (ids of the optimized parameters, optimizer,
    scheduler). Call before any forward (FSDP2 root-unshard guard)."""
    params = [p for _, p in sharded_named_parameters(module) if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2]},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=train_cfg.lr, betas=train_cfg.betas, weight_decay=train_cfg.weight_decay,
        # torch's fused kernel: one pass over each tensor (CPU: 3x faster than the
        # default per-tensor loop on 1 thread, measured on 98M elements; foreach is slower)
        fused=fused and bool(params) and params[0].device.type in _FUSED_ADAMW_DEVICES,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(train_cfg))
    return frozenset(id(p) for p in params), optimizer, scheduler


def clip_and_step(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
    grad_clip: float, *, advance_lr: bool = True,
) -> tuple[float, float, bool]:
    """Clips the (DTensor) gradients to grad_clip, steps the optimizer (and the
    schedule, if advance_lr) unless the norm is not finite, zeroes the gradients.

    Returns:
        (grad_norm before clipping, lr used, skipped).
    """
    with torch.profiler.record_function(OPTIMIZER_RANGE):  # free unless profiled
        params = [p for g in optimizer.param_groups for p in g["params"]]
        in_kernel = _clips_in_kernel(optimizer, params)
        if in_kernel:
            total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        elif len({p.device_mesh for p in params if isinstance(p, DTensor)}) > 1:  # TP x FSDP2
            total = clip_grad_norm(params, grad_clip)
        else:
            total = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        grad_norm = float(total.full_tensor() if isinstance(total, DTensor) else total)
        lr = scheduler.get_last_lr()[0]
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            if in_kernel:
                # clip_grad_norm_'s coefficient, min(1, clip / (norm + 1e-6)), applied
                # by the fused kernel as it reads each gradient (it divides by grad_scale)
                coef = grad_clip / (grad_norm + 1e-6)
                optimizer.grad_scale = (torch.tensor(1.0 / coef, device=params[0].device)
                                        if coef < 1.0 else None)
            optimizer.step()
            optimizer.grad_scale = None
            if advance_lr:
                scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr, skipped


def _clips_in_kernel(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> bool:
    """True when clipping can ride on the optimizer's own pass over the
    gradients: torch's fused AdamW over plain tensors, whose `grad_scale`
    divides every gradient as the kernel reads it. It saves clip_grad_norm_'s
    separate read-modify-write of every gradient (on CPU one of the few passes
    over the whole model per step). FSDP2's DTensors keep clip_grad_norm_."""
    return (bool(optimizer.defaults.get("fused")) and bool(params)
            and not any(isinstance(p, DTensor) for p in params))



def check_replicas(module: torch.nn.Module, mesh: DeviceMesh, sharding: str,
                   shard_group_size: int, *, every: int, step: int, skipped: bool,
                   key: str = "train.sharding") -> None:
    """Every `every` optimizer steps (0: never): the replicas of each rank's
    weights under sharding (replicate, hybrid; chosen by config key `key`) are
    bitwise identical, else ReplicaDrift (`parallel.replicas`)."""
    if skipped or not every or step % every:
        return
    size = replicas.replica_group_size(sharding, shard_group_size, mesh.size())
    replicas.check(list(module.parameters()), mesh.get_group(), size, layout=sharding,
                   step=step, device=comm_device(mesh), key=key)


@contextlib.contextmanager
def micro_batch_comm(module: torch.nn.Module, sharding: str, *, last: bool) -> Iterator[None]:
    """Every sharding but `full`: a micro-batch before the step's last keeps its
    layers gathered after backward and its gradients whole and local (no
    reduction): one all-gather and one reduction per layer per optimizer step
    (replicate: no gather, one all-reduce). `full` reduces every micro-batch
    (its gradients never exist whole)."""
    # replicate: DDP, nothing to reshard; on one rank the plain module, nothing to defer
    defer = sharding != "full" and not last and hasattr(module, "set_requires_gradient_sync")
    fsdp = isinstance(module, FSDPModule)
    if defer:
        module.set_requires_gradient_sync(False)
        if fsdp:
            module.set_reshard_after_backward(False)
    try:
        yield
    finally:
        if defer:
            module.set_requires_gradient_sync(True)
            if fsdp:
                module.set_reshard_after_backward(True)


class Trainer:
    """FSDP2 policy trainer: one optimizer step per `train_step`.

    Collective: every method except `state_dict_shards` must be called by
    every rank of the mesh, each with its own rows of the global batch.

    Attributes:
        module: the root FSDPModule (HF `*ForCausalLM`, lm_head returns hidden states;
            train.sharding=replicate: the same model, plain, under DDP).
        mesh: the 1-D data-parallel mesh (with TP: the ranks of this TP rank).
        group: every rank of the model (`mesh`'s, or with TP all TP groups').
        data_group: the ranks that split the batch (`mesh`'s group).
        optimizer: AdamW over the sharded DTensor parameters (fp32 state).
        scheduler: LambdaLR with `lr_lambda(train_cfg)`.
        step: optimizer steps taken.
        load_stats: what this rank read from the checkpoint (`params.LoadStats`).
    """

    def __init__(
        self,
        model_path: str,
        train_cfg: TrainConfig,
        model_cfg: ModelConfig,
        mesh: DeviceMesh | None = None,
        *,
        logits_chunk_tokens: int = 1024,
        temperature: float = 1.0,
        fused_adamw: bool = True,
    ) -> None:
        """Builds the sharded model, the optimizer and the schedule.

        Args:
            model_path: HF folder or id (usually model_cfg.path).
            train_cfg: optimizer, schedule, clipping, activation checkpointing,
                the layout (sharding='auto': resolved here over the mesh's ranks, as
                for a trainer with no engine beside it).
            model_cfg: master_dtype (parameters, optimizer, gradient reduction),
                compute_dtype (forward/backward) and attention (as resolved by
                `precision.with_device_choices`; an unresolved "auto" runs SDPA).
            mesh: 1-D mesh of the trainer's ranks; None = the whole default group
                (train.tensor_parallel_size > 1 splits it into TP groups).
            logits_chunk_tokens: positions per vocabulary-projection chunk.
            temperature: sampling temperature; logits are divided by it.
            fused_adamw: torch's fused AdamW kernel (CPU/CUDA); False keeps its
                per-tensor loop (slower, rounded differently).
        """
        if logits_chunk_tokens < 1 or temperature <= 0:
            raise ValueError(f"need logits_chunk_tokens >= 1 and temperature > 0, got "
                             f"{logits_chunk_tokens}, {temperature}")
        ranks = mesh if mesh is not None else dp_mesh()
        self.device = comm_device(ranks)
        if train_cfg.sharding == "auto":  # built on its own: the layout that fits
            train_cfg = resolve_alone(model_path, train_cfg, model_cfg, ranks.get_group(),
                                      self.device)
        tp = train_cfg.tensor_parallel_size
        model_mesh = tp_mesh(ranks, tp) if tp > 1 else ranks
        self.mesh = model_mesh["dp"] if tp > 1 else ranks
        self.group = ranks.get_group()
        self.tp_group = model_mesh["tp"].get_group() if tp > 1 else None
        self.train_cfg, self.model_path = train_cfg, model_path
        self.lora = model_cfg.lora_rank > 0  # adapters on a frozen base (`parallel/lora.py`)
        self.chunk_tokens, self.temperature = logits_chunk_tokens, temperature
        self.module, self.load_stats = build_fsdp_model(
            model_path, model_mesh, master_dtype=model_cfg.master_dtype,
            compute_dtype=model_cfg.compute_dtype,
            activation_checkpointing=train_cfg.activation_checkpointing,
            compile_layers=train_cfg.compile, trust_remote_code=model_cfg.trust_remote_code,
            sharding=train_cfg.sharding, shard_group_size=train_cfg.shard_group_size,
            grad_hook=shm_allreduce.install if train_cfg.cpu_shm_allreduce else None,
            lora=model_cfg if model_cfg.lora_rank else None, attention=model_cfg.attention,
        )
        self.lora_dropout = self.lora and model_cfg.lora_dropout > 0
        # Guard, part 1: built before any forward, over the sharded DTensors.
        self._param_ids, self.optimizer, self.scheduler = build_optimizer(
            self.module, train_cfg, fused=fused_adamw)
        self._partial = self._partial_grads()
        self.step = 0
        self._calls = 0  # train_step calls (PROFILE_ENV counts them)

    def _check_sharded(self) -> None:
        """Guard, part 2: the module exposes exactly the optimizer's sharded parameters."""
        reshard_all(self.module)
        assert_sharded(self.module)
        assert {id(p) for p in self.module.parameters() if p.requires_grad} == \
            self._param_ids, "the module's parameters are not the optimizer's sharded DTensors"

    def optimizer_state_bytes(self) -> int:
        """Bytes AdamW's two moments take on this rank (created at the first step):
        what a colocated engine built before that step must leave free."""
        return 2 * sum(p.to_local().nbytes if isinstance(p, DTensor) else p.nbytes
                       for p in self.module.parameters() if p.requires_grad)

    def kept_bytes(self) -> int:
        """Bytes this rank's trainer keeps between phases: its parameters, gradients
        and optimizer state (local shards, each storage once). Replicated over
        ranks, DDP keeps every gradient in its buckets from the first backward
        on, even while the gradients are None: then counted as one gradient per
        trainable parameter."""
        def storage(t: Tensor) -> tuple[int, int]:
            st = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
            return st.data_ptr(), st.nbytes()

        params = list(self.module.parameters())
        buckets = (self.train_cfg.sharding == "replicate" and self.mesh.size() > 1
                   and self._calls > 0)
        tensors = params + [v for state in self.optimizer.state.values()
                            for v in state.values() if isinstance(v, Tensor) and v.dim()]
        if not buckets:
            tensors += [p.grad for p in params if p.grad is not None]
        seen = dict(storage(t) for t in tensors)
        grads = sum(p.nbytes for p in params if p.requires_grad) if buckets else 0
        return sum(seen.values()) + grads

    def state_dict_shards(self) -> dict[str, DTensor]:
        """Checkpoint name -> this rank's sharded DTensor parameter (no copy; tied once)."""
        return dict(sharded_named_parameters(self.module))

    @property
    def data_group(self) -> dist.ProcessGroup:
        """The ranks that split a step's trajectories (the TP ranks of a group take the same)."""
        return self.mesh.get_group()

    def _partial_grads(self) -> list[Tensor]:
        """The parameters whose gradient each TP rank holds only in part (none without TP)."""
        if self.tp_group is None:
            return []
        from hybrid_engine.models.spec import spec_for

        spec = spec_for(self.module.config)
        named = dict(sharded_named_parameters(self.module))
        return [named[n] for n in partial_grad_names(named, spec.tp_plan(spec.dims(
            self.module.config)))]

    def compute_logprobs(self, batch: TrainBatch) -> tuple[Tensor, Tensor]:
        """Per-token log-probs and entropy under the current weights, no grad.

        Returns:
            (logp_BT, entropy_BT) float32 like batch.tokens_BT, 0 outside
            loss_mask_BT; logp_BT[b, t] = log p(tokens[b, t] | tokens[b, :t]).
        """
        return batch_logprobs(self.module, batch, self.mesh, chunk_tokens=self.chunk_tokens,
                              temperature=self.temperature, packing=self.train_cfg.packing)

    def train_step(
        self,
        batch: TrainBatch,
        loss_fn: LossFn,
        *,
        loss_agg: str = "token_mean",
        loss_agg_constant: float | None = None,
        entropy_grad: bool = False,
        advance_lr: bool = True,
        before_update: Callable[[], None] | None = None,
    ) -> dict[str, float]:
        """One optimizer step over this rank's rows of the global batch.

        The micro-batches are `batch.bounds` (chosen by collate_trajectories).
        The normaliser is `loss_normalizer(loss_mask of the whole step,
        loss_agg, constant=loss_agg_constant)` summed over the dp ranks, so
        neither the micro-batch split nor the rank count changes the update.

        Args:
            batch: this rank's rows (old_logp_BT None = on-policy).
            loss_fn: `policy_loss_fn(cfg.algorithm, ...)` or any LossFn.
            loss_agg: the aggregation mode loss_fn was built with.
            loss_agg_constant: its constant (loss_agg="constant").
            entropy_grad: pass entropy with grad (entropy bonus in the loss).
            advance_lr: step the LR schedule after this update (False for all but
                the last update of an RL step: the schedule counts RL steps).
            before_update: called right before the optimizer writes the weights
                (forward and backward only read them): e.g. waiting for a sync
                that still reads them (separate placement, generation ahead).

        Returns:
            Global metrics (floats): loss, grad_norm (before clipping), lr (of
            this step), tokens (real tokens processed), num_micro_batches,
            skipped (1.0 when the gradient was not finite and no step was
            taken), and loss_fn's metrics combined over micro-batches and ranks;
            train_step_s: this rank's seconds in this call (the one local value).
        """
        self._calls += 1
        with maybe_profile(self._calls, dist.get_rank()):
            t0 = time.perf_counter()
            metrics = self._train_step(batch, loss_fn, loss_agg, loss_agg_constant, entropy_grad,
                                       advance_lr, before_update)
            metrics["train_step_s"] = time.perf_counter() - t0  # this rank's; not profiler I/O
        return metrics

    def _train_step(self, batch: TrainBatch, loss_fn: LossFn, loss_agg: str,
                    loss_agg_constant: float | None, entropy_grad: bool,
                    advance_lr: bool, before_update: Callable[[], None] | None,
                    ) -> dict[str, float]:
        self._check_sharded()
        group = self.mesh.get_group()
        norm = loss_normalizer(batch.loss_mask_BT, loss_agg, constant=loss_agg_constant)
        norm = norm.to(self.device)
        dist.all_reduce(norm, group=group)
        num_mb = num_micro_batches(batch, self.mesh)
        self.optimizer.zero_grad(set_to_none=True)
        per_mb = []
        for i in range(num_mb):
            with micro_batch_comm(self.module, self.train_cfg.sharding, last=i == num_mb - 1):
                per_mb.append(self._accumulate(batch, i, loss_fn, norm, entropy_grad))
        if self._partial:
            sum_partial_grads(self._partial, self.tp_group)
        if before_update is not None:
            before_update()
        grad_norm, lr, skipped = clip_and_step(self.optimizer, self.scheduler,
                                               self.train_cfg.grad_clip, advance_lr=advance_lr)
        self.step += not skipped
        self._check_replicas(skipped)
        metrics = _reduce_metrics(combine_metrics(per_mb), self.mesh)
        tokens = torch.tensor(float(batch.attention_mask_BT.sum()), device=self.device)
        dist.all_reduce(tokens, group=group)
        metrics.update(grad_norm=grad_norm, lr=lr, tokens=float(tokens),
                       num_micro_batches=float(num_mb), skipped=float(skipped))
        return metrics

    def _check_replicas(self, skipped: bool) -> None:
        """Every train.replica_check_every optimizer steps: the replicas of each
        rank's weights (replicate, hybrid; with TP the weights no TP rank splits,
        on every rank of a TP group) are bitwise identical, else ReplicaDrift."""
        cfg = self.train_cfg
        check_replicas(self.module, self.mesh, cfg.sharding, cfg.shard_group_size,
                       every=cfg.replica_check_every, step=self.step, skipped=skipped)
        every = cfg.replica_check_every
        if self.tp_group is not None and every and not skipped and self.step % every == 0:
            whole = [p for p in self.module.parameters()  # on "dp" only, or Replicate on "tp"
                     if p.device_mesh.ndim == 1 or p.placements[1] == Replicate()]
            replicas.check(whole, self.tp_group, 1, layout=str(cfg.tensor_parallel_size),
                           step=self.step, device=self.device, key="train.tensor_parallel_size")

    def _accumulate(
        self, batch: TrainBatch, i: int, loss_fn: LossFn, norm: Tensor, entropy_grad: bool
    ) -> dict[str, Tensor]:
        """Forward + backward of micro-batch i (a loss-free one past this rank's last)."""
        mb = batch.rows(*batch.bounds[i]) if i < len(batch.bounds) else batch.empty_like()
        # model.lora_dropout drops in training forwards only
        with dropout_active(self.module) if self.lora_dropout else contextlib.nullcontext():
            logp_BT, entropy_BT = micro_batch_logprobs(
                self.module, mb, self.device, chunk_tokens=self.chunk_tokens,
                temperature=self.temperature, entropy_grad=entropy_grad,
                entropy_every=1 if entropy_grad else ENTROPY_METRIC_EVERY,
                packing=self.train_cfg.packing)

        def dev(x: Tensor | None) -> Tensor | None:
            return None if x is None else x.to(self.device)

        loss, metrics = loss_fn(LossInputs(
            logp_BT=logp_BT, advantages_BT=dev(mb.advantages_BT), mask_BT=dev(mb.loss_mask_BT),
            old_logp_BT=dev(mb.old_logp_BT), ref_logp_BT=dev(mb.ref_logp_BT),
            entropy_BT=entropy_BT, rollout_logp_BT=dev(mb.rollout_logp_BT),
            engine_logp_BT=dev(mb.engine_logp_BT),
        ), norm)
        # Each rank's loss is its share of the global loss; FSDP2 AVERAGES
        # gradients over the dp ranks, so scale by their count to get the
        # gradient of the global loss (exact for power-of-two counts).
        (loss * self.mesh.size()).backward()
        return metrics
