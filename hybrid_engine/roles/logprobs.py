"""Per-token log-probabilities and entropy, chunked over positions x vocabulary.

Job: the forward half every model role shares (trainer, reference, critic's
batching): never hold full-vocab logits for a whole micro-batch. The final
hidden states are projected onto the vocabulary `logits_chunk_tokens` rows at
a time (`token_logprobs`, fused in `vocab_projection`), and with autograd on
each chunk is recomputed in backward, so peak logits memory is one chunk, not
B x T x V.

The entropy costs two more passes over each chunk's [C, V] logits, and its
gradient two in backward. The train step computes it for every
token only when a loss term needs it (entropy_coef != 0); as a metric it
takes every ENTROPY_METRIC_EVERY-th token (NaN elsewhere), and the
reference computes none.

Shape legend: B sequences, T positions, H hidden size, V vocabulary,
N selected (loss) positions, C positions of one chunk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from hybrid_engine.parallel.fsdp import compute_autocast, default_device
from hybrid_engine.parallel.params import reshard_all
from hybrid_engine.roles.packing import pack
from hybrid_engine.roles.vocab_projection import vocab_logprobs

if TYPE_CHECKING:
    from hybrid_engine.trajectory import TrainBatch

__all__ = ["ENTROPY_METRIC_EVERY", "batch_logprobs", "comm_device", "micro_batch_logprobs",
           "num_micro_batches", "token_logprobs"]

ENTROPY_METRIC_EVERY = 16  # the entropy metric's sample: every 16th token of each chunk


def token_logprobs(
    hidden_NH: Tensor,
    weight_VH: Tensor,
    targets_N: Tensor,
    *,
    chunk_tokens: int,
    temperature: float = 1.0,
    entropy_grad: bool = False,
    softcap: float | None = None,
    entropy_every: int = 1,
) -> tuple[Tensor, Tensor]:
    """log softmax(h W^T / temperature)[target] and the entropy, chunk_tokens rows at a time.

    The matmul runs in the compute dtype (autocast's, else the weight's) and
    the rest in float32, fused (`vocab_projection.vocab_logprobs`): only h, W
    and two floats per row are saved, and backward recomputes each chunk's
    logits, so neither pass ever holds more than one chunk of them.

    Args:
        hidden_NH: [N, H] final hidden states at the positions that predict the targets.
        weight_VH: [V, H] output embedding (the unsharded lm_head weight).
        targets_N: [N] int64 target ids.
        chunk_tokens: rows per chunk (C).
        temperature: logits are divided by it (the rollout's sampling temperature).
        entropy_grad: keep the entropy in the graph (entropy bonus); else detached.
        softcap: the model's final logit cap (Gemma 2): logits -> softcap *
            tanh(logits / softcap), before the temperature.
        entropy_every: 1 = the entropy of every row; k > 1 = of every k-th row
            of each chunk (no gradient), NaN on the others; 0 = none (all NaN).
            entropy_grad needs 1.

    Returns:
        (logp_N, entropy_N), float32.
    """
    if entropy_grad and entropy_every != 1:
        raise ValueError("entropy_grad needs the entropy of every row (entropy_every=1)")
    return vocab_logprobs(hidden_NH, weight_VH, targets_N, chunk_tokens=chunk_tokens,
                          temperature=temperature, softcap=softcap, entropy_every=entropy_every,
                          entropy_grad=entropy_grad)


def micro_batch_logprobs(
    module: FSDPModule,
    mb: TrainBatch,
    device: torch.device,
    *,
    chunk_tokens: int,
    temperature: float = 1.0,
    entropy_grad: bool = False,
    entropy_every: int = 1,
    packing: bool = False,
) -> tuple[Tensor, Tensor]:
    """One forward of a micro-batch: log-prob and entropy of every loss token.

    Only loss positions are projected onto the vocabulary, and the model
    returns hidden states only from the first position any row needs
    (`logits_to_keep`), so prompt and padding cost nothing past the decoder.

    Args:
        module: a model from `fsdp.build_fsdp_model` (forward returns hidden states).
        mb: the micro-batch (CPU or device tensors).
        device: where the model lives.
        chunk_tokens, temperature, entropy_grad, entropy_every: see `token_logprobs`.
        packing: the sequences packed into as few rows as fit (`packing.pack`).

    Returns:
        (logp_BT, entropy_BT): float32 on device, logp_BT[b, t] = log
        p(tokens[b, t] | tokens[b, :t]); both 0 outside loss_mask_BT.
    """
    autocast = compute_autocast(module)
    with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
        return _micro_batch_logprobs(module, mb, device, chunk_tokens, temperature, entropy_grad,
                                     entropy_every, packing)


def _micro_batch_logprobs(module: torch.nn.Module, mb: TrainBatch, device: torch.device,
                          chunk_tokens: int, temperature: float, entropy_grad: bool,
                          entropy_every: int, packing: bool = False) -> tuple[Tensor, Tensor]:
    tokens_BT = mb.tokens_BT.to(device)
    rows_N, cols_N = mb.loss_mask_BT.to(device).nonzero(as_tuple=True)
    # Target at column t is predicted by the output at t - 1 (t = 0 is never a target).
    if packing:
        packed = pack(tokens_BT, mb.position_ids_BT.to(device), mb.seq_lens_B)
        hidden_PTH = module(input_ids=packed.tokens_PT, position_ids=packed.position_ids_PT,
                            use_cache=False).logits  # no mask: the position ids delimit
        at_P, at_T = packed.index(rows_N, cols_N - 1)
        hidden_NH = hidden_PTH[at_P, at_T]
    else:
        first = int(cols_N.min()) - 1 if cols_N.numel() else 0
        keep_K = torch.arange(first, tokens_BT.shape[1] - 1, device=device)
        hidden_NH = module(
            input_ids=tokens_BT,
            attention_mask=mb.attention_mask_BT.to(device),
            position_ids=mb.position_ids_BT.to(device),
            use_cache=False,
            logits_to_keep=keep_K,
        ).logits[rows_N, cols_N - 1 - first]
    logp_N, entropy_N = token_logprobs(
        hidden_NH, module.lm_head.weight, tokens_BT[rows_N, cols_N],
        chunk_tokens=chunk_tokens, temperature=temperature, entropy_grad=entropy_grad,
        softcap=getattr(module, "final_logit_softcap", None),  # `fsdp._build_meta_model`
        entropy_every=entropy_every,
    )
    zeros_BT = torch.zeros(tokens_BT.shape, dtype=torch.float32, device=device)
    return (zeros_BT.index_put((rows_N, cols_N), logp_N),
            zeros_BT.index_put((rows_N, cols_N), entropy_N))


def num_micro_batches(batch: TrainBatch, mesh: DeviceMesh) -> int:
    """The most micro-batches any rank has: every rank runs that many forwards
    (FSDP2 collectives must match), padding with loss-free ones."""
    n = torch.tensor([len(batch.bounds)], device=comm_device(mesh))
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=mesh.get_group())
    return int(n)


def comm_device(mesh: DeviceMesh) -> torch.device:
    return default_device() if mesh.device_type == "cuda" else torch.device("cpu")


@torch.no_grad()
def batch_logprobs(
    module: FSDPModule, batch: TrainBatch, mesh: DeviceMesh, *, chunk_tokens: int,
    temperature: float = 1.0, entropy_every: int = 1, packing: bool = False,
) -> tuple[Tensor, Tensor]:
    """Log-probs and entropy of a whole batch, micro-batch by micro-batch, no grad
    (entropy_every: see `token_logprobs`, 0 = none, NaN; packing: see
    `micro_batch_logprobs`).

    Collective: every rank of mesh must call it (with its own batch). Ends
    with `reshard_all(module)` (see the module docstring).

    Returns:
        (logp_BT, entropy_BT): float32 on the batch's device, 0 outside loss_mask_BT.
    """
    device = comm_device(mesh)
    logp_BT = torch.zeros(batch.tokens_BT.shape, dtype=torch.float32)
    entropy_BT = torch.zeros_like(logp_BT)
    try:
        for i in range(num_micro_batches(batch, mesh)):
            if i >= len(batch.bounds):
                micro_batch_logprobs(module, batch.empty_like(), device, chunk_tokens=chunk_tokens)
                continue
            start, end = batch.bounds[i]
            mb = batch.rows(start, end)
            lp, ent = micro_batch_logprobs(
                module, mb, device, chunk_tokens=chunk_tokens, temperature=temperature,
                entropy_every=entropy_every, packing=packing)
            width = mb.tokens_BT.shape[1]
            logp_BT[start:end, :width] = lp.cpu()
            entropy_BT[start:end, :width] = ent.cpu()
    finally:
        # The guard: a forward without backward leaves the FSDP root unsharded.
        reshard_all(module)
    return logp_BT.to(batch.tokens_BT.device), entropy_BT.to(batch.tokens_BT.device)
