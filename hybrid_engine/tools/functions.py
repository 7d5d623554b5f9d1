"""Tools are Python functions: load them from the config, check a call, run it.

Job: `load_tools(spec, key)` turns 'path/to/file.py:fn1,fn2' (or
'package.module:fn', a built-in name such as `python`, or several such specs
joined by ',') into `Tool`s whose schema is what
`transformers.utils.get_json_schema` makes of the function (type hints plus a
Google-style docstring with an 'Args:' line per argument): the dict a chat
template receives as `tools=[...]`. `validate_arguments` checks a parsed call's
arguments against that schema; `call_tool` runs it and returns the text that
goes back to the model.

A tool's settings are arguments the run passes, not the model: a parameter
named like one of `load_tools`' settings (`sandbox`: the run's
`tools.sandbox.Sandbox`) is left out of the schema and given that value on
every call.

Invariant: a `Tool`'s schema is exactly get_json_schema(fn) less its settings,
its name is the schema's function name, unique within one `load_tools` result,
and its spec loads the same function in another process; every loading error
is one ValueError naming the config key and the function.
"""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybrid_engine.user_code import function_of, load_module

__all__ = ["BUILTIN_TOOLS", "Tool", "call_tool", "default_settings", "load_tools", "make_tool",
           "validate_arguments", "validate_call"]

BUILTIN_TOOLS = {"python": "hybrid_engine.tools.python:python",
                 "calculator": "hybrid_engine.tools.calculator:calculator"}
"""Tools named by a bare name in a spec: name -> 'module:function'."""

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call.

    Fields:
        name: the function's name, as the model writes it in a call.
        fn: the function; called with the call's arguments as keywords.
        schema: `get_json_schema(fn)`: {"type": "function", "function":
            {"name", "description", "parameters": {"type": "object",
            "properties", "required"}, ...}}; pass it to a chat template.
        spec: 'file.py:name' (the path made absolute) or 'module:name', which
            `hybrid_engine.user_code.load_function` loads again in another
            process (a worker that runs the tool).
        settings: keyword arguments every call gets from the run (not in the
            schema; picklable, for a worker process).
    """

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    spec: str
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON schema of the arguments object."""
        return self.schema["function"].get("parameters", {"type": "object", "properties": {}})


def default_settings() -> dict[str, Any]:
    """The settings `load_tools` passes unless told otherwise: a local sandbox."""
    from hybrid_engine.tools.sandbox import Sandbox

    return {"sandbox": Sandbox()}


def make_tool(fn: Callable[..., Any], key: str = "env.tools", spec: str | None = None,
              settings: Mapping[str, Any] | None = None) -> Tool:
    """The Tool of one function; spec defaults to 'fn.__module__:fn.__name__'.

    Args:
        settings: arguments the run passes (None: `default_settings()`); those fn
            takes (by name) become the Tool's settings and stay out of its schema.

    Raises:
        ValueError: get_json_schema refuses the function (a missing type hint
            or docstring line); its reason is quoted.
    """
    from transformers.utils import get_json_schema

    name = getattr(fn, "__name__", repr(fn))
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    settings = default_settings() if settings is None else settings
    bound = {k: v for k, v in settings.items() if k in params}
    try:
        schema = get_json_schema(_without(fn, bound) if bound else fn)
    except Exception as exc:  # TypeHint/DocstringParsingException, or a user type it can't map
        raise ValueError(f"{key}: function {name!r} cannot be a tool ({exc}); give every "
                         "argument a type hint and a line under 'Args:' in its docstring") from exc
    return Tool(name=schema["function"]["name"], fn=fn, schema=schema,
                spec=spec or f"{getattr(fn, '__module__', '')}:{name}", settings=bound)


def _without(fn: Callable[..., Any], names: Mapping[str, Any]) -> Callable[..., Any]:
    """A stand-in for fn whose signature, hints and name get_json_schema reads,
    less the parameters in names."""
    sig, hints = inspect.signature(fn), typing.get_type_hints(fn)

    def stand_in() -> None: ...

    stand_in.__name__, stand_in.__doc__ = fn.__name__, fn.__doc__
    stand_in.__signature__ = sig.replace(
        parameters=[p for p in sig.parameters.values() if p.name not in names])
    stand_in.__annotations__ = {k: v for k, v in hints.items() if k not in names}
    return stand_in


def _named_functions(spec: str, key: str) -> list[tuple[str, str]]:
    """[(where, name)] of 'a.py:f,g,b.mod:h,python' (a bare name continues the last
    module, unless it is a built-in tool's)."""
    out: list[tuple[str, str]] = []
    for item in (s.strip() for s in spec.split(",")):
        if item in BUILTIN_TOOLS:
            out.append(tuple(BUILTIN_TOOLS[item].split(":")))
            continue
        where, sep, name = item.rpartition(":")
        if not sep and out:
            where = out[-1][0]
        if not where or not name.isidentifier():
            raise ValueError(f"{key}={spec!r}: {item!r} must look like 'path/to/file.py:fn1,fn2', "
                             f"'package.module:fn' or a built-in name ({', '.join(BUILTIN_TOOLS)})")
        out.append((where, name))
    return out


def load_tools(spec: str, key: str = "env.tools",
               settings: Mapping[str, Any] | None = None) -> list[Tool]:
    """The tools named by spec, in its order.

    Args:
        spec: 'path/to/file.py:fn1,fn2', 'package.module:fn', a built-in name
            (`BUILTIN_TOOLS`: python, calculator), or several joined by ',' ('a.py:f,python');
            each file or module is imported once.
        key: the config key, for messages.
        settings: arguments the run passes to the tools that take them, by name
            (None: `default_settings()`).

    Raises:
        ValueError: malformed spec, missing file or module, a module that fails
            to import, a missing function, a function get_json_schema refuses,
            or two tools with one name.
    """
    modules: dict[str, Any] = {}
    tools: list[Tool] = []
    for where, name in _named_functions(spec, key):
        if where not in modules:
            modules[where] = load_module(where, key, spec)
        fn = function_of(modules[where], name, where, key, spec)
        path = str(Path(where).resolve()) if where.endswith(".py") else where
        tool = make_tool(fn, key, spec=f"{path}:{name}", settings=settings)
        if any(t.name == tool.name for t in tools):
            raise ValueError(f"{key}={spec!r}: two tools are named {tool.name!r}; "
                             "a model calls a tool by its name, so each must be unique")
        tools.append(tool)
    return tools


def _json_type(value: Any) -> str:
    return next((t for t in ("boolean", "integer", "number", "string", "array", "object", "null")
                 if _JSON_TYPES[t](value)), type(value).__name__)


def _value_error(value: Any, schema: dict[str, Any], where: str) -> str | None:
    """Why value does not fit schema (type, enum, items, values), or None."""
    types = schema.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    if value is None and (schema.get("nullable") or "null" in types):
        return None
    if types and not any(_JSON_TYPES.get(t, lambda v: True)(value) for t in types):
        return f"{where} must be {' or '.join(types)}, got {_json_type(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {json.dumps(schema['enum'])}, got {json.dumps(value)}"
    inner: list[tuple[Any, dict[str, Any], str]] = []
    if isinstance(value, list):
        prefix = schema.get("prefixItems")
        if prefix is not None and len(prefix) != len(value):
            return f"{where} must have {len(prefix)} items, got {len(value)}"
        inner = [(v, prefix[i] if prefix else schema.get("items") or {}, f"{where}[{i}]")
                 for i, v in enumerate(value)]
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        inner = [(v, schema["additionalProperties"], f"{where}[{k!r}]") for k, v in value.items()]
    return next((e for e in (_value_error(*i) for i in inner) if e), None)


def validate_arguments(tool: Tool, arguments: dict[str, Any]) -> str | None:
    """Why a call's arguments do not fit the tool's schema, or None when they do.

    Checks: arguments is an object, every required name is present, no unknown
    name, and each value's JSON type (string, integer, number, boolean, array,
    object; null where the hint is Optional), enum (Literal), array items and
    dict values. The text names the tool and the argument, for the model.
    """
    if not isinstance(arguments, dict):
        return f"{tool.name}: arguments must be a JSON object, got {_json_type(arguments)}"
    params = tool.parameters
    props: dict[str, Any] = params.get("properties", {})
    missing = [n for n in params.get("required", []) if n not in arguments]
    if missing:
        return f"{tool.name}: missing required argument {', '.join(map(repr, missing))}"
    unknown = [n for n in arguments if n not in props]
    if unknown:
        return (f"{tool.name}: unknown argument {', '.join(map(repr, unknown))}; "
                f"it takes {', '.join(map(repr, props)) or 'no arguments'}")
    errors = (_value_error(v, props[n], f"argument {n!r}") for n, v in arguments.items())
    return next((f"{tool.name}: {e}" for e in errors if e), None)


def validate_call(tools: Sequence[Tool], name: str, arguments: dict[str, Any]) -> str | None:
    """Why a call to name cannot run (no such tool, or `validate_arguments`), or None."""
    tool = next((t for t in tools if t.name == name), None)
    if tool is None:
        return (f"unknown tool {name!r}; available: "
                f"{', '.join(t.name for t in tools) or 'none'}")
    return validate_arguments(tool, arguments)


def call_tool(tool: Tool, arguments: dict[str, Any]) -> str:
    """The tool's result as text: a str as is, anything else as JSON.

    The tool's settings are passed with the arguments. Exceptions of the
    function (and a result json.dumps cannot encode) are not caught: the caller,
    which runs tools in its worker pool, reports them. Validate the arguments
    first (`validate_arguments`).
    """
    result = tool.fn(**arguments, **tool.settings)
    return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)

