"""model.compute_dtype=auto: bf16 where the device multiplies bf16 matrices in
hardware, fp32 elsewhere. torch's bf16 GEMM on a CPU without AVX512-BF16 or AMX
(an AVX2 CPU) runs about 90x below its fp32 one (1024^3 on one AMD EPYC Zen 3
core: 0.97 against 89 GFLOP/s), so bf16 there would slow training, not speed it."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

__all__ = ["native_bf16", "resolve_compute_dtype"]

_logged: set[tuple[str, str]] = set()


def native_bf16(device_type: str) -> bool:
    """Whether a device of this type computes bf16 matrix products in hardware:
    CUDA with bf16 (Ampere and later), a CPU with AVX512-BF16 or AMX."""
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_compute_dtype(name: str, device_type: str) -> str:
    """model.compute_dtype as the trainer runs it: "auto" becomes "bfloat16" where
    `native_bf16`, else "float32" (logged once per device type); others unchanged."""
    if name != "auto":
        return name
    dtype = "bfloat16" if native_bf16(device_type) else "float32"
    if (device_type, dtype) not in _logged:
        _logged.add((device_type, dtype))
        why = "" if dtype == "bfloat16" else {
            "cpu": " (this CPU has neither AVX512-BF16 nor AMX)"}.get(device_type, " (no bf16)")
        log.info("model.compute_dtype=auto: %s on %s%s", dtype, device_type, why)
    return dtype
