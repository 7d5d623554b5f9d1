"""A user's function named in the config, for the envs/ callers.

Job: re-export `load_function`; the importer lives in `hybrid_engine.user_code`
(below envs/ and tools/, which both load user code).
"""

from __future__ import annotations

from hybrid_engine.user_code import load_function

__all__ = ["load_function"]
