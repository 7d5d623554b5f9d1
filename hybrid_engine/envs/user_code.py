"""A user's function named in the config: 'path/to/file.py:function' or 'module:function'.

Job: `load_function(spec, key)` imports the file or module and returns the
callable, for every config key that names user code (`env.reward_fn`,
`env.preprocess`). Errors name the key, never a bare traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["load_function"]


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
        else:
            module = importlib.import_module(where)
    except ValueError:
        raise
    except Exception as exc:  # the user's module: say what broke, not a traceback
        raise ValueError(f"{key}={spec!r}: importing {where!r} failed: "
                         f"{type(exc).__name__}: {exc}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{key}={spec!r}: {where!r} has no function {name!r}")
    return fn
