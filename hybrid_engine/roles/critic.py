"""Critic role: the value model of PPO (LM backbone + scalar head), trained on its ranks.

Job: build the value model from the policy's HF folder in its own training
layout, train.critic_sharding (`fsdp.lay_out`: FSDP2 full, grad_op or hybrid,
fully_shard per decoder layer and at the root, rows read range by range from
safetensors; or replicate, whole under DDP; no lm_head at all), own its AdamW
optimizer and LR schedule, predict per-token values, and
take one optimizer step per `train_step` on `algorithms.value_loss.value_loss`
(several per RL step: `roles.updates`, old values from before the first),
normalised like the policy loss: by the loss-token count of the WHOLE step
over all data-parallel ranks, so neither the micro-batch split nor the rank
count changes the update.

Invariant: values align with log-probs. values_BT[b, t] is the value of the
state tokens[b, :t], read at the output of position t - 1 (the position
that predicts token t), and is 0 outside loss_mask_BT; `algorithms.gae`
takes them in that layout. Like the trainer, every forward without backward
ends with `reshard_all`, and the optimizer is built over the sharded
parameters before any forward (see `roles.trainer`).

Shape legend: B sequences, T positions, H hidden size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hybrid_engine.algorithms.value_loss import value_loss
from hybrid_engine.parallel.fsdp import (DTYPES, attn_implementation, compute_autocast, dp_mesh,
                                         empty_model, lay_out, resolve_model_path)
from hybrid_engine.parallel.params import reshard_all
from hybrid_engine.parallel.precision import resolve_compute_dtype
from hybrid_engine.roles.logprobs import comm_device, num_micro_batches
from hybrid_engine.roles.trainer import (build_optimizer, check_replicas, clip_and_step,
                                         micro_batch_comm)
from hybrid_engine.rollout import shm_allreduce

if TYPE_CHECKING:
    from hybrid_engine.config import ModelConfig, TrainConfig
    from hybrid_engine.trajectory import TrainBatch

__all__ = ["Critic", "ValueModel", "build_value_model"]


class ValueModel(nn.Module):
    """HF decoder backbone (`AutoModel`: no lm_head) + Linear(H, 1) value head.

    Parameter names are the policy checkpoint's ("model.layers.0...") plus
    "value_head.weight" / "value_head.bias".
    """

    def __init__(self, backbone: nn.Module, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.model = backbone
        self.value_head = nn.Linear(hidden_size, 1, dtype=dtype)

    def forward(self, tokens_BT: Tensor, attention_mask_BT: Tensor,
                position_ids_BT: Tensor) -> Tensor:
        """Returns [B, T] float32 values read at every position."""
        hidden_BTH = self.model(input_ids=tokens_BT, attention_mask=attention_mask_BT,
                                position_ids=position_ids_BT, use_cache=False).last_hidden_state
        return self.value_head(hidden_BTH).squeeze(-1).float()


def build_value_model(
    model_path: str,
    mesh: DeviceMesh,
    *,
    master_dtype: str = "float32",
    compute_dtype: str = "float32",
    activation_checkpointing: bool = False,
    trust_remote_code: bool = False,
    sharding: str = "full",
    shard_group_size: int = 0,
    grad_hook: Callable | None = None,
    attention: str = "sdpa",
) -> nn.Module:
    """The value model in its training layout: backbone rows read from the
    policy's safetensors, head zeros.

    A zero head makes the first values exactly 0 on every rank count; its
    gradient (the hidden state times dL/dV) is not zero, so it learns at once.

    Args:
        model_path: the policy's HF folder (or hub id).
        mesh: 1-D data-parallel mesh.
        master_dtype, compute_dtype, activation_checkpointing, trust_remote_code,
        sharding, shard_group_size, grad_hook, attention: as in `fsdp.build_fsdp_model`
            (the critic's own train.critic_sharding and critic_shard_group_size).

    Returns:
        A ValueModel: the root FSDPModule, every parameter a Shard(0) DTensor;
        sharding="replicate": plain whole parameters under DDP.
    """
    from transformers import AutoConfig, AutoModel

    folder = resolve_model_path(model_path)
    dtype = DTYPES[master_dtype]
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    with empty_model():
        backbone = AutoModel.from_config(config, dtype=dtype,
                                         attn_implementation=attn_implementation(config, attention),
                                         trust_remote_code=trust_remote_code)
        model = ValueModel(backbone, config.hidden_size, dtype)
    model.eval()  # no dropout: values() and train_step() must agree exactly
    compute = DTYPES[resolve_compute_dtype(compute_dtype, mesh.device_type)]
    # The backbone loads through a holder whose names are the checkpoint's ("model.*").
    holder = nn.Module()
    holder.model = model.model

    def zero_head(m: nn.Module) -> None:
        for p in m.value_head.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).zero_()

    model, _ = lay_out(model, folder, mesh, master=dtype, compute=compute, sharding=sharding,
                       shard_group_size=shard_group_size, checkpointing=activation_checkpointing,
                       grad_hook=grad_hook, load_into=holder, init=zero_head)
    return model


class Critic:
    """The value model with its own AdamW: one optimizer step per `train_step`.

    Collective: every method must be called by every rank of the mesh, each
    with its own rows of the global batch.

    Attributes:
        module: the ValueModel in train.critic_sharding's layout (`build_value_model`).
        mesh: the 1-D data-parallel mesh.
        optimizer: AdamW over its parameters (sharded DTensors; replicate: whole).
        scheduler: LambdaLR with `lr_lambda(train_cfg)`.
        step: optimizer steps taken.
    """

    def __init__(
        self,
        model_path: str,
        train_cfg: TrainConfig,
        model_cfg: ModelConfig,
        mesh: DeviceMesh | None = None,
    ) -> None:
        """Builds the sharded value model, the optimizer and the schedule.

        Args:
            model_path: HF folder of the policy (the backbone's initialisation).
            train_cfg: the critic's optimizer, schedule, clipping, micro-batching.
            model_cfg: master_dtype, compute_dtype and attention as for the policy.
            mesh: 1-D data-parallel mesh; None = the whole default group.
        """
        self.train_cfg = train_cfg
        self.mesh = mesh if mesh is not None else dp_mesh()
        self.device = comm_device(self.mesh)
        self.module = build_value_model(
            model_path, self.mesh, master_dtype=model_cfg.master_dtype,
            compute_dtype=model_cfg.compute_dtype,
            activation_checkpointing=train_cfg.activation_checkpointing,
            trust_remote_code=model_cfg.trust_remote_code,
            sharding=train_cfg.critic_sharding,
            shard_group_size=train_cfg.critic_shard_group_size,
            grad_hook=shm_allreduce.install if train_cfg.cpu_shm_allreduce else None,
            attention=model_cfg.attention,
        )
        self._param_ids, self.optimizer, self.scheduler = build_optimizer(self.module, train_cfg)
        self.step = 0

    def _forward(self, mb: TrainBatch) -> Tensor:
        """[B, T] values of a micro-batch on self.device (graph if grad is on)."""
        dev, autocast = self.device, compute_autocast(self.module)
        with torch.autocast(dev.type, dtype=autocast or torch.float32,
                            enabled=autocast is not None):
            out_BT = self.module(mb.tokens_BT.to(dev), mb.attention_mask_BT.to(dev),
                                 mb.position_ids_BT.to(dev))
        # values_BT[:, t] = head(output at t - 1): the state before token t.
        values_BT = torch.cat([torch.zeros_like(out_BT[:, :1]), out_BT[:, :-1]], 1)
        return torch.where(mb.loss_mask_BT.to(dev), values_BT, 0.0)

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group of its mesh: the ranks it is sharded over."""
        return self.mesh.get_group()

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> Tensor:
        """Values of this rank's rows, micro-batch by micro-batch, no grad.

        Returns:
            values_BT: float32 like batch.tokens_BT (on its device), 0 outside
            loss_mask_BT (see the module docstring for the alignment).
        """
        out_BT = torch.zeros(batch.tokens_BT.shape, dtype=torch.float32)
        try:
            for i in range(num_micro_batches(batch, self.mesh)):
                if i >= len(batch.bounds):
                    self._forward(batch.empty_like())
                    continue
                start, end = batch.bounds[i]
                mb = batch.rows(start, end)
                out_BT[start:end, : mb.tokens_BT.shape[1]] = self._forward(mb).cpu()
        finally:
            reshard_all(self.module)  # a forward without backward leaves layers gathered
        return out_BT.to(batch.tokens_BT.device)

    def train_step(
        self,
        batch: TrainBatch,
        returns_BT: Tensor,
        old_values_BT: Tensor,
        *,
        clip: float | None,
        coef: float = 1.0,
        advance_lr: bool = True,
    ) -> dict[str, float]:
        """One optimizer step on coef * value_loss, token-mean over the whole step.

        Args:
            batch: this rank's rows (loss_mask_BT selects the trained positions).
            returns_BT: [B, T] GAE returns aligned with batch rows.
            old_values_BT: [B, T] values when the returns were computed (`values`).
            clip: value clip epsilon (AlgorithmConfig.value_clip), or None.
            coef: loss weight (AlgorithmConfig.value_coef).
            advance_lr: step the LR schedule after this update (see `Trainer.train_step`).

        Returns:
            Global metrics: vf_loss (coef included), vf_clip_frac, values_mean,
            vf_error_mean (token means over all ranks), grad_norm (before
            clipping), lr, num_loss_tokens, skipped (1.0 = gradient not finite).
        """
        reshard_all(self.module)
        assert {id(p) for p in self.module.parameters()} == self._param_ids
        group = self.mesh.get_group()
        norm = batch.loss_mask_BT.sum().float().to(self.device)
        dist.all_reduce(norm, group=group)
        num_mb = num_micro_batches(batch, self.mesh)
        self.optimizer.zero_grad(set_to_none=True)
        # Sums over this rank's tokens: loss (already / norm), clipped, values, err^2.
        sums = torch.zeros(4, dtype=torch.float64)
        for i in range(num_mb):
            with micro_batch_comm(self.module, self.train_cfg.critic_sharding,
                                  last=i == num_mb - 1):
                sums += self._accumulate(batch, returns_BT, old_values_BT, i, norm, clip, coef)
        grad_norm, lr, skipped = clip_and_step(self.optimizer, self.scheduler,
                                               self.train_cfg.grad_clip, advance_lr=advance_lr)
        self.step += not skipped
        cfg = self.train_cfg
        check_replicas(self.module, self.mesh, cfg.critic_sharding, cfg.critic_shard_group_size,
                       every=cfg.replica_check_every, step=self.step, skipped=skipped,
                       key="train.critic_sharding")
        sums = sums.to(self.device)
        dist.all_reduce(sums, group=group)
        n = max(float(norm), 1.0)
        return dict(vf_loss=float(sums[0]), vf_clip_frac=float(sums[1]) / n,
                    values_mean=float(sums[2]) / n, vf_error_mean=float(sums[3]) / n,
                    grad_norm=grad_norm, lr=lr, num_loss_tokens=float(norm),
                    skipped=float(skipped))

    def _accumulate(
        self, batch: TrainBatch, returns_BT: Tensor, old_values_BT: Tensor, i: int,
        norm: Tensor, clip: float | None, coef: float,
    ) -> Tensor:
        """Forward + backward of micro-batch i (a loss-free one past this rank's last).

        Returns float64 [4]: loss share, clipped-token count, value sum, squared-error sum."""
        if i < len(batch.bounds):
            start, end = batch.bounds[i]
            mb = batch.rows(start, end)
            width = mb.tokens_BT.shape[1]
            ret_BT, old_BT = (x[start:end, :width].to(self.device)
                              for x in (returns_BT, old_values_BT))
        else:
            mb = batch.empty_like()
            ret_BT = old_BT = torch.zeros(mb.tokens_BT.shape, device=self.device)
        mask_BT = mb.loss_mask_BT.to(self.device)
        values_BT = self._forward(mb)
        loss_BT, metrics = value_loss(values_BT, old_BT, ret_BT, mask_BT, clip)
        loss = coef * loss_BT.sum() / norm.clamp(min=1.0)
        # FSDP2 averages gradients over the dp ranks: scale by their count so the
        # result is the gradient of the global loss (as the trainer does).
        (loss * self.mesh.size()).backward()
        n = float(mask_BT.sum())
        # The clipped-token count is an integer: round off the float32 mean's error.
        return torch.tensor([float(loss), round(float(metrics["vf_clip_frac"]) * n),
                             float(metrics["values_mean"]) * n,
                             float(metrics["vf_error_mean"]) * n], dtype=torch.float64)
