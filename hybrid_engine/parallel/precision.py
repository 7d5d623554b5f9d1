"""model.compute_dtype=auto and model.rollout_dtype=auto: bf16 where the device
multiplies bf16 matrices in hardware, fp32 elsewhere. torch's bf16 GEMM on a CPU
without AVX512-BF16 or AMX (an AVX2 CPU) runs about 90x below its fp32 one
(1024^3 on one AMD EPYC Zen 3 core: 0.97 against 89 GFLOP/s), so bf16 there would
slow training, not speed it; vLLM-CPU's bf16 linear layers fall back to torch's
there too (53-55 tokens/s against 263 in fp32, 180M preset on such a CPU).

model.attention=auto: eager attention where the trained models compute in bf16
on a CPU and no row is longer than EAGER_MAX_LEN tokens, else SDPA. SDPA's CPU
kernel is slow in bf16 on short rows: one layer's attention of the 180M preset,
forward and backward, about 2100 tokens in packed rows on one AMX Xeon core:

    row width    88     128    192    256    512 (tokens)
    SDPA, ms     118    111    85     85     112
    eager, ms    37     62     97     98     268

(fp32 SDPA at 88 tokens: 53 ms.)"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hybrid_engine.config import RunConfig

log = logging.getLogger(__name__)

__all__ = ["EAGER_MAX_LEN", "eager_is_faster", "native_bf16", "resolve_attention", "resolve_compute_dtype",
           "resolve_rollout_dtype", "with_device_choices", "with_rollout_dtype"]

EAGER_MAX_LEN = 128

_logged: set[tuple[str, str, str]] = set()


def native_bf16(device_type: str) -> bool:
    """Whether a device of this type computes bf16 matrix products in hardware:
    CUDA with bf16 (Ampere and later), a CPU with AVX512-BF16 or AMX."""
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_compute_dtype(name: str, device_type: str) -> str:
    """model.compute_dtype as the trainer runs it: "auto" becomes "bfloat16" where
    `native_bf16`, else "float32" (logged once per device type); others unchanged."""
    return _resolve("model.compute_dtype", name, device_type)


def resolve_rollout_dtype(name: str, device_type: str) -> str:
    """model.rollout_dtype as the engine holds its weights (and the sync moves them):
    "auto" as for `resolve_compute_dtype`; others unchanged."""
    return _resolve("model.rollout_dtype", name, device_type)


def with_rollout_dtype(cfg: RunConfig, device_type: str) -> RunConfig:
    """cfg with model.rollout_dtype resolved (`resolve_rollout_dtype`): what the
    policies build their engine, sync and estimates from."""
    dtype = resolve_rollout_dtype(cfg.model.rollout_dtype, device_type)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, rollout_dtype=dtype))


def resolve_attention(cfg: RunConfig, device_type: str) -> str:
    """model.attention as the trained models run it: "auto" as in the module
    docstring (logged once per choice); others unchanged."""
    if cfg.model.attention != "auto":
        return cfg.model.attention
    compute = resolve_compute_dtype(cfg.model.compute_dtype, device_type)
    max_len = cfg.rollout.max_model_len
    choice = "eager" if eager_is_faster(device_type, compute, max_len) else "sdpa"
    key = ("model.attention", device_type, choice)
    if key not in _logged:
        _logged.add(key)
        log.info("model.attention=auto: %s (%s on %s, rollout.max_model_len=%d)", choice,
                 compute, device_type, max_len)
    return choice


def eager_is_faster(device_type: str, compute_dtype: str, max_len: int) -> bool:
    """The rule of the module docstring: a CPU computing in bf16, rows of at most
    EAGER_MAX_LEN tokens."""
    return device_type == "cpu" and compute_dtype == "bfloat16" and max_len <= EAGER_MAX_LEN


def with_device_choices(cfg: RunConfig, device_type: str) -> RunConfig:
    """cfg with model.rollout_dtype and model.attention resolved for the device:
    what the policies build their models, engine, sync and estimates from."""
    cfg = with_rollout_dtype(cfg, device_type)
    return dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, attention=resolve_attention(cfg, device_type)))


def _resolve(key: str, name: str, device_type: str) -> str:
    if name != "auto":
        return name
    dtype = "bfloat16" if native_bf16(device_type) else "float32"
    if (key, device_type, dtype) not in _logged:
        _logged.add((key, device_type, dtype))
        why = "" if dtype == "bfloat16" else {
            "cpu": " (this CPU has neither AVX512-BF16 nor AMX)"}.get(device_type, " (no bf16)")
        log.info("%s=auto: %s on %s%s", key, dtype, device_type, why)
    return dtype
