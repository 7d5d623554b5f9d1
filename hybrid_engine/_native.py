"""Loads the native extension hybrid_engine._C and reports what it provides.

Invariant: importing hybrid_engine never fails because _C is missing or broken;
the reason is kept and shown by `hybrid-engine env`.
"""

from __future__ import annotations

import importlib

import torch

_load_error: str | None = None
_loaded = False


def load() -> bool:
    """Imports hybrid_engine._C once (its static initializers register the ops)."""
    global _load_error, _loaded
    if _loaded or _load_error is not None:
        return _loaded
    try:
        importlib.import_module("hybrid_engine._C")
        _loaded = True
    except ImportError as e:  # not built, or built against another torch
        _load_error = str(e)
    return _loaded


def load_error() -> str | None:
    """Why _C could not be imported, or None."""
    return _load_error


def has_kernel(op: str, backend: str) -> bool:
    """Whether torch.ops.hybrid_engine.<op> has a kernel for backend ("CPU", "CUDA")."""
    if not load():
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"hybrid_engine::{op}", backend)
