"""A user's code named in the config: 'path/to/file.py:function' or 'module:function'.

Job: `load_function(spec, key)` imports the file or module and returns the
callable, for every config key that names user code (`env.reward_fn`,
`env.preprocess`, the tools of `hybrid_engine.tools`); `load_module(where, key,
spec)` is its import half, for a caller that takes several names from one
file. Errors name the key, never a bare traceback.

Invariant: light (the standard library only), and below every package that
names user code, so envs/ and tools/ share one importer.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["function_of", "load_function", "load_module"]


def load_module(where: str, key: str, spec: str) -> ModuleType:
    """The module of a file ('path/to/file.py') or a dotted name ('package.module').

    Args:
        where: the part of the spec before ':'.
        key: the config key, for messages ("env.reward_fn").
        spec: the whole config value, for messages.

    Raises:
        ValueError: missing file or module, or a module that fails to import
            (its error is quoted).
    """
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise ValueError(f"{key}={spec!r}: file {where!r} does not exist")
            mod_name = f"_hybrid_engine_user_{abs(hash(str(path.resolve())))}"
            module_spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[mod_name] = module
            module_spec.loader.exec_module(module)
            return module
        return importlib.import_module(where)
    except ValueError:
        raise
    except Exception as exc:  # the user's module: say what broke, not a traceback
        raise ValueError(f"{key}={spec!r}: importing {where!r} failed: "
                         f"{type(exc).__name__}: {exc}") from exc


def function_of(module: ModuleType, name: str, where: str, key: str,
                spec: str) -> Callable[..., Any]:
    """module.name, which must be callable (ValueError naming the key otherwise)."""
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{key}={spec!r}: {where!r} has no function {name!r}")
    return fn


def load_function(spec: str, key: str) -> Callable[..., Any]:
    """The callable named by 'file.py:function' or 'module:function'.

    Args:
        spec: the config value.
        key: the config key, for messages ("env.reward_fn").

    Raises:
        ValueError: malformed spec, missing file or module, a module that
            fails to import (its error is quoted), or no callable of that name.
    """
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ValueError(f"{key}={spec!r} must look like 'path/to/file.py:function' "
                         "or 'package.module:function'")
    return function_of(load_module(where, key, spec), name, where, key, spec)
