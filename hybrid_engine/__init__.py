"""hybrid_engine: a colocated FSDP2 + vLLM actor runtime for RL post-training.

Importing the package is light (no torch): the native kernels (hybrid_engine._C)
are loaded by the module that calls them (hybrid_engine.reshard.ops, through
hybrid_engine._native), and it never fails without them (the ops fall back to
their pure-torch references).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
