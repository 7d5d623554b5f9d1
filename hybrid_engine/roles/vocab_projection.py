"""The vocabulary step, fused: log-prob and entropy of each token from its hidden
state, with a hand-written backward that recomputes one chunk at a time.

Job: the one place that materialises [tokens, vocabulary] logits. Autograd
(even checkpointed per chunk) keeps four to six fp32 [C, V] tensors alive in a
chunk's backward: the matmul output, its float copy, the tempered logits,
softmax, their product. Here a chunk's forward holds its fp32 logits and one
temporary; its backward holds the fp32 logits, which become the gradient in
place, one more fp32 [C, V] buffer only when the entropy has a gradient or
the logits are soft-capped, and the gradient's copy in the matmul dtype.
Only h, W, targets and two floats per token (log-sum-exp, entropy) are saved
for backward.

The gradient of z (tempered logits) with p = softmax(z), log p = z - lse and
H = -sum p log p:
    d logp[t] / dz = onehot(t) - p,    dH / dz = -p * (log p + H).

Shape legend: N tokens, H hidden size, V vocabulary, C tokens of one chunk.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["vocab_logprobs"]


def _logits(h_CH: Tensor, w_VH: Tensor, temperature: float, softcap: float | None) -> Tensor:
    """fp32 tempered logits of one chunk (h and W already in the matmul dtype)."""
    z_CV = (h_CH @ w_VH.t()).float()
    if softcap is not None:  # before the temperature, as HF's forward and vLLM's logits
        z_CV.div_(softcap).tanh_().mul_(softcap)
    if temperature != 1.0:
        z_CV.div_(temperature)
    return z_CV


def _chunk_forward(z_CV: Tensor, targets_C: Tensor, entropy_every: int) -> tuple[Tensor, Tensor, Tensor]:
    """(logp_C, lse_C, entropy_C) of one chunk; entropy NaN off the sampled rows."""
    lse_C = z_CV.logsumexp(-1)
    logp_C = z_CV.gather(1, targets_C[:, None]).squeeze(1) - lse_C
    entropy_C = torch.full_like(lse_C, float("nan"))
    if entropy_every > 0:
        # -sum p log p, not lse - sum p z: the latter loses digits to cancellation.
        logp_SV = z_CV[::entropy_every].sub_(lse_C[::entropy_every, None])  # z is spent
        entropy_C[::entropy_every] = logp_SV.exp().mul_(logp_SV).sum(-1).neg_()
    return logp_C, lse_C, entropy_C


def _chunk_grad(z_CV: Tensor, targets_C: Tensor, lse_C: Tensor, entropy_C: Tensor,
                g_logp_C: Tensor, g_entropy_C: Tensor | None, temperature: float,
                softcap: float | None) -> Tensor:
    """d loss / d (untempered, uncapped) logits of one chunk, built in z_CV's storage."""
    dcap_CV = None
    if softcap is not None:  # d(c tanh(x / c)) / dx = 1 - tanh^2, with tanh = z T / c
        dcap_CV = (z_CV * (temperature / softcap)).square_().neg_().add_(1.0)
    if g_entropy_C is None:  # -p * g_logp
        g_CV = z_CV.sub_(lse_C[:, None]).exp_().mul_(-g_logp_C[:, None])
    else:  # -p * (g_logp + g_H * (log p + H))
        p_CV = (z_CV - lse_C[:, None]).exp_()
        g_CV = (z_CV.sub_(lse_C[:, None]).add_(entropy_C[:, None]).mul_(g_entropy_C[:, None])
                .add_(g_logp_C[:, None]).mul_(p_CV).neg_())
        del p_CV
    g_CV.scatter_add_(1, targets_C[:, None], g_logp_C[:, None])
    if dcap_CV is not None:
        g_CV.mul_(dcap_CV)
    if temperature != 1.0:
        g_CV.div_(temperature)
    return g_CV


def _forward(h_NH: Tensor, w_VH: Tensor, targets_N: Tensor, chunk: int, temperature: float,
             softcap: float | None, entropy_every: int,
             dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    n = h_NH.shape[0]
    logp_N, lse_N, entropy_N = (h_NH.new_empty(n, dtype=torch.float32) for _ in range(3))
    w = w_VH.to(dtype)
    for s in range(0, n, chunk):
        z_CV = _logits(h_NH[s : s + chunk].to(dtype), w, temperature, softcap)
        logp_N[s : s + chunk], lse_N[s : s + chunk], entropy_N[s : s + chunk] = _chunk_forward(
            z_CV, targets_N[s : s + chunk], entropy_every)
        del z_CV
    return logp_N, lse_N, entropy_N


class _VocabLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_NH, w_VH, targets_N, chunk, temperature, softcap, entropy_every,  # noqa: ANN001, ANN205
                entropy_grad, dtype):
        logp_N, lse_N, entropy_N = _forward(h_NH, w_VH, targets_N, chunk, temperature, softcap,
                                            entropy_every, dtype)
        ctx.save_for_backward(h_NH, w_VH, targets_N, lse_N, entropy_N)
        ctx.opts = (chunk, temperature, softcap, entropy_grad, dtype)
        ctx.set_materialize_grads(False)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy_N)
        return logp_N, entropy_N

    @staticmethod
    def backward(ctx, g_logp_N, g_entropy_N):  # noqa: ANN001, ANN205
        h_NH, w_VH, targets_N, lse_N, entropy_N = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[:2]
        if g_logp_N is None and g_entropy_N is None or not (want_h or want_w):
            return (None,) * 9
        if g_logp_N is None:
            g_logp_N = torch.zeros_like(lse_N)
        with torch.autocast(h_NH.device.type, enabled=False):
            return _backward(h_NH, w_VH, targets_N, lse_N, entropy_N, g_logp_N, g_entropy_N,
                             ctx.opts, want_h, want_w)


def _backward(h_NH: Tensor, w_VH: Tensor, targets_N: Tensor, lse_N: Tensor, entropy_N: Tensor,
              g_logp_N: Tensor, g_entropy_N: Tensor | None, opts: tuple, want_h: bool,
              want_w: bool) -> tuple:
    chunk, temperature, softcap, _, dtype = opts
    w = w_VH.to(dtype)
    grad_h = torch.empty_like(h_NH) if want_h else None
    grad_w = torch.zeros_like(w_VH) if want_w else None
    for s in range(0, h_NH.shape[0], chunk):
        h_CH, sl = h_NH[s : s + chunk].to(dtype), slice(s, s + chunk)
        g_CV = _chunk_grad(_logits(h_CH, w, temperature, softcap), targets_N[sl], lse_N[sl],
                           entropy_N[sl], g_logp_N[sl],
                           None if g_entropy_N is None else g_entropy_N[sl],
                           temperature, softcap).to(dtype)
        if want_h:
            grad_h[sl] = g_CV @ w
        if want_w and grad_w.dtype == dtype:
            grad_w.addmm_(g_CV.t(), h_CH)
        elif want_w:  # an fp32 master under autocast: accumulate in fp32
            grad_w.add_(g_CV.t() @ h_CH)
        del g_CV
    return grad_h, grad_w, *(None,) * 7


def vocab_logprobs(
    hidden_NH: Tensor, weight_VH: Tensor, targets_N: Tensor, *, chunk_tokens: int,
    temperature: float = 1.0, softcap: float | None = None, entropy_every: int = 1,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor]:
    """log softmax(z)[target] and the entropy of softmax(z), z = cap(h W^T) / temperature.

    The matmul runs in the autocast dtype if autocast is on for hidden_NH's
    device, else in the weight's dtype; everything after it in float32.
    Arguments as `logprobs.token_logprobs` (which validates them).

    Returns:
        (logp_N, entropy_N), float32; entropy NaN off the sampled rows
        (entropy_every k: rows 0, k, 2k, ... of each chunk; 0: none).
    """
    device_type = hidden_NH.device.type
    dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
             else weight_VH.dtype)
    chunk = max(chunk_tokens, 1)
    with torch.autocast(device_type, enabled=False):
        if torch.is_grad_enabled() and (hidden_NH.requires_grad or weight_VH.requires_grad):
            return _VocabLogprobs.apply(hidden_NH, weight_VH, targets_N, chunk, temperature,
                                        softcap, entropy_every, entropy_grad, dtype)
        logp_N, _, entropy_N = _forward(hidden_NH, weight_VH, targets_N, chunk, temperature,
                                        softcap, entropy_every, dtype)
        return logp_N, entropy_N
