"""Reference role: frozen log-probs of the initial policy, for the KL term.

Job: hold a frozen copy of the initial policy in the same FSDP2 layout as the
trainer (every parameter a Shard(0) DTensor, so its memory is 1/N of the
model per rank, with no gradients and no optimizer state) and score batches
through the trainer's code path (`logprobs.batch_logprobs`), so reference and
policy log-probs are computed identically and differ only by the weights.

Invariant: the reference never changes. Its parameters have
requires_grad=False, it owns no optimizer, and scoring runs under no_grad
and ends with the root resharded. A LoRA policy's reference is the policy's
own model with its adapters bypassed: its base never trains. It is built only when the algorithm uses a
KL to the reference (`Algorithm.needs_reference`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import Tensor, nn

from hybrid_engine.parallel.fsdp import build_fsdp_model, dp_mesh
from hybrid_engine.parallel.lora import adapters_disabled
from hybrid_engine.parallel.params import sharded_named_parameters
from hybrid_engine.roles.logprobs import batch_logprobs

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from hybrid_engine.config import ModelConfig
    from hybrid_engine.trajectory import TrainBatch

__all__ = ["Reference"]


class Reference:
    """Frozen FSDP2 copy of the initial policy; `score(batch) -> ref_logp_BT`.

    Collective: `score` must be called by every rank of the mesh.

    Attributes:
        module: the root FSDPModule, every parameter frozen.
        mesh: the 1-D data-parallel mesh.
        load_stats: what this rank read from the checkpoint.
    """

    def __init__(
        self,
        model_path: str,
        model_cfg: ModelConfig,
        mesh: DeviceMesh | None = None,
        *,
        logits_chunk_tokens: int = 1024,
        temperature: float = 1.0,
        adapted: nn.Module | None = None,
    ) -> None:
        """Builds the frozen sharded model from the policy's initial checkpoint.

        Args:
            model_path: HF folder or id of the initial policy.
            model_cfg: master_dtype (storage), compute_dtype (forward) and attention
                (the trainer's, as for `Trainer`).
            mesh: 1-D data-parallel mesh; None = the whole default group.
            logits_chunk_tokens: positions per vocabulary-projection chunk.
            temperature: the sampling temperature (the same as the trainer's).
            adapted: a LoRA policy's model (the trainer's module, on mesh): the
                reference is then that model with its adapters bypassed -- its
                frozen base, exactly the initial policy -- and no copy is loaded.
        """
        self.mesh = mesh if mesh is not None else dp_mesh()
        self.chunk_tokens, self.temperature = logits_chunk_tokens, temperature
        self.adapted = adapted is not None
        if adapted is not None:
            self.module, self.load_stats = adapted, None
            return
        self.module, self.load_stats = build_fsdp_model(
            model_path, self.mesh, master_dtype=model_cfg.master_dtype,
            compute_dtype=model_cfg.compute_dtype, requires_grad=False,
            trust_remote_code=model_cfg.trust_remote_code, attention=model_cfg.attention,
        )

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group of its mesh: the ranks it is sharded over."""
        return self.mesh.get_group()

    def score(self, batch: TrainBatch) -> Tensor:
        """Reference log-probs of the batch's loss tokens (no grad).

        Returns:
            ref_logp_BT: float32 like batch.tokens_BT, 0 outside loss_mask_BT;
            ref_logp_BT[b, t] = log p_ref(tokens[b, t] | tokens[b, :t]).
        """
        with adapters_disabled(self.module) if self.adapted else contextlib.nullcontext():
            logp_BT, _ = batch_logprobs(
                self.module, batch, self.mesh, chunk_tokens=self.chunk_tokens,
                temperature=self.temperature, entropy_every=0,  # the KL needs no entropy
            )
        return logp_BT

    def state_dict_shards(self) -> dict[str, DTensor]:
        """Checkpoint name -> this rank's Shard(0) DTensor parameter (no copy)."""
        return dict(sharded_named_parameters(self.module))
