"""hybrid_engine: a colocated FSDP2 + vLLM actor runtime for RL post-training.

Importing the package loads the native kernels (hybrid_engine._C) when they
were built; it never fails without them (the ops fall back to their pure-torch
references, see hybrid_engine.reshard.ops).
"""

from hybrid_engine import _native

__version__ = "0.1.0"
__all__ = ["__version__"]

_native.load()
