"""Generic machinery for frozen, nested, documented dataclass configs.

Job: everything about configs that does not depend on which sections exist.
It converts values to a field's annotation (Literal, `X | None`, tuples, bool
words), checks the numeric bounds kept in field metadata, walks dotted keys
(`train.lr`), suggests the closest key for a typo, flattens and loads YAML,
parses CLI argv, maps renamed keys to their new names (with a one-line
notice), and implements from_dict for any root dataclass passed in (listing.py
describes one). `hybrid_engine.config` declares the sections and
re-exports the public functions.

Invariant: a value reaches a config only through `_convert` (typed per the
field's annotation) and the bound checks of `validate_fields`, and an override
never mutates a config: it is rebuilt with `dataclasses.replace`, so each
section's `__post_init__` (and thus its cross-field rules) runs again. This
module knows no section: roots and prefixes are passed in, and it never
imports `hybrid_engine.config` (no import cycle).
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import os
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import field, fields, is_dataclass, replace
from typing import Any, Literal, TypeVar

import yaml

from hybrid_engine.names import closest, did_you_mean

__all__ = [
    "apply_overrides",
    "deprecated",
    "register_renamed",
    "doc_field",
    "flatten",
    "from_dict",
    "load_yaml",
    "parse_cli_overrides",
    "section_prefixes",
    "validate_fields",
]

T = TypeVar("T")
log = logging.getLogger(__name__)

BOUNDS = {
    "gt": (">", operator.gt),
    "ge": (">=", operator.ge),
    "lt": ("<", operator.lt),
    "le": ("<=", operator.le),
}
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_NONE = ("none", "null")


def doc_field(default: Any, doc: str, *, registry: str | None = None, **bounds: float) -> Any:
    """A dataclass field carrying its doc and numeric bounds (gt/ge/lt/le).

    A dataclass type as `default` makes a nested section (default_factory).
    Bounds are skipped when the value is None (optional fields).
    registry: "module:NAME" of the `Registry` a str field names an entry of. The
    field stays open (anything registered before the run is built is valid);
    `check_registered` validates it, `help_text` lists the registered names.
    """
    assert doc.strip(), "every config field needs a doc"
    assert set(bounds) <= set(BOUNDS), f"unknown bound in {sorted(bounds)}"
    metadata = {"doc": doc, **bounds}
    if registry is not None:
        metadata["registry"] = registry
    if isinstance(default, type) and is_dataclass(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


# --------------------------------------------------------------------------
# Section tree and generic field validation
# --------------------------------------------------------------------------


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and is_dataclass(tp)


def _walk_sections(cls: type, prefix: str = "") -> Iterator[tuple[str, type]]:
    """Yields (dotted prefix, section class) for cls and its nested sections."""
    yield prefix, cls
    hints = _hints(cls)
    for f in fields(cls):
        tp = hints[f.name]
        if _is_section(tp):
            yield from _walk_sections(tp, f"{prefix}{f.name}.")


@functools.cache
def section_prefixes(root: type) -> dict[type, str]:
    """Section class -> its dotted prefix under root ('train.'), for error messages."""
    prefixes: dict[type, str] = {}
    for prefix, cls in _walk_sections(root):
        # One class per position keeps messages unambiguous; a second use of a
        # section class (e.g. a critic ModelConfig) needs a prefix per instance.
        assert cls not in prefixes, f"{cls.__name__} appears twice in {root.__name__}"
        prefixes[cls] = prefix
    return prefixes


def validate_fields(obj: Any, prefix: str) -> None:
    """Type-checks every field of a section against its annotation, then its bounds.

    Normalizes in place what JSON/YAML cannot express (int -> float, list -> tuple).

    Args:
        obj: a (frozen) dataclass instance, typically from its __post_init__.
        prefix: dotted prefix of obj's section ('train.'), used in messages.

    Raises:
        ValueError: wrong type or a bound violated; names the dotted key.
    """
    hints = _hints(type(obj))
    for f in fields(obj):
        key = prefix + f.name
        value = getattr(obj, f.name)
        converted = _convert(value, hints[f.name], key, parse_str=False)
        if converted is not value:
            object.__setattr__(obj, f.name, converted)
        if converted is None or isinstance(converted, str):  # bounds are numbers
            continue
        for bound, (op, holds) in BOUNDS.items():
            limit = f.metadata.get(bound)
            if limit is not None and not holds(converted, limit):
                raise ValueError(f"{key} must be {op} {limit}, got {converted!r}")


# --------------------------------------------------------------------------
# Value conversion (driven by the annotations)
# --------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else _type_name(a) for a in args)
    if origin is tuple:
        return f"tuple[{', '.join('...' if a is Ellipsis else _type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def _type_error(key: str, tp: Any, value: Any) -> ValueError:
    return ValueError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def _convert(value: Any, tp: Any, key: str, *, parse_str: bool) -> Any:
    """Returns value as an instance of annotation tp, or raises ValueError naming key.

    parse_str=True (overrides) parses strings per tp: "1e-6" -> float,
    "true"/"0" -> bool, "none"/"null" -> None for optional fields,
    "0.9,0.95" -> tuple. parse_str=False (construction) accepts only values
    already of the right kind, widening int -> float and list -> tuple.
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (
            value is None or (parse_str and isinstance(value, str) and value.lower() in _NONE)
        ):
            return None
        for inner in (a for a in args if a is not type(None)):  # the first that takes it
            try:
                return _convert(value, inner, key, parse_str=parse_str)
            except ValueError:
                pass
        raise _type_error(key, tp, value)
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        if isinstance(value, bool) and str(value).lower() in args:  # "true"/"false" literals
            return str(value).lower()
        if parse_str and isinstance(value, str) and value.lower() in ("true", "false") \
                and value.lower() in args:
            return value.lower()
        raise ValueError(f"{key} must be one of {', '.join(map(repr, args))}, got {value!r}")
    if origin is tuple:
        return _convert_tuple(value, args, tp, key, parse_str=parse_str)
    if _is_section(tp):
        if isinstance(value, tp):
            return value
        raise _type_error(key, tp, value)
    if tp in (bool, int, float, str):
        return _convert_scalar(value, tp, key, parse_str=parse_str)
    raise AssertionError(f"{key}: unsupported annotation {tp!r}; extend _convert")


def _convert_scalar(value: Any, tp: type, key: str, *, parse_str: bool) -> Any:
    if parse_str and isinstance(value, str) and tp is not str:
        value = _parse_scalar(value.strip(), tp, key)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = value if type(value) is float else float(value)
        if not math.isfinite(value):
            raise ValueError(f"{key} must be finite, got {value!r}")
    # bool is a subclass of int: True is not an int setting.
    if not isinstance(value, tp) or (tp is not bool and isinstance(value, bool)):
        raise _type_error(key, tp, value)
    return value


def _parse_scalar(text: str, tp: type, key: str) -> Any:
    if tp is bool:
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise _type_error(key, tp, text)
    try:
        return tp(text)
    except ValueError:
        raise _type_error(key, tp, text) from None


def _convert_tuple(value: Any, args: tuple, tp: Any, key: str, *, parse_str: bool) -> tuple:
    if isinstance(value, str) and parse_str:
        text = value.strip().strip("()[]")
        items: list[Any] = text.split(",") if text else []
    elif isinstance(value, (tuple, list)):
        items = list(value)
    else:
        raise _type_error(key, tp, value)
    if len(args) == 2 and args[1] is Ellipsis:
        elem_types = [args[0]] * len(items)
    elif len(items) == len(args):
        elem_types = list(args)
    else:
        raise _type_error(key, tp, value)
    try:
        return tuple(_convert(v, t, key, parse_str=parse_str) for v, t in zip(items, elem_types))
    except ValueError:
        raise _type_error(key, tp, value) from None


# --------------------------------------------------------------------------
# Introspection: keys, docs, dict round trip
# --------------------------------------------------------------------------


@functools.cache
def _leaf_types(cls: type) -> dict[str, Any]:
    """Dotted key -> annotation for every leaf (non-section) field of cls."""
    leaves: dict[str, Any] = {}
    for prefix, section in _walk_sections(cls):
        hints = _hints(section)
        for f in fields(section):
            tp = hints[f.name]
            if not _is_section(tp):
                leaves[prefix + f.name] = tp
    return leaves


def from_dict(root: type[T], d: Mapping[str, Any]) -> T:
    """Inverse of to_dict for a root config class; also accepts dotted keys.

    Args:
        root: the config class to build (constructible with no arguments).
        d: nested and/or dotted {key: value}; missing keys keep their defaults.

    Raises:
        ValueError: unknown key (with suggestions) or invalid value.
    """
    return apply_overrides(root(), flatten(d))


# --------------------------------------------------------------------------
# Overrides: dotted keys from YAML files and the command line
# --------------------------------------------------------------------------


def _unknown_key_error(key: str, leaves: Mapping[str, Any]) -> ValueError:
    """ValueError naming key, with the closest valid keys (section or field typos)."""
    sections = sorted({k.rsplit(".", 1)[0] for k in leaves if "." in k})
    if key in sections:
        example = next(k for k in leaves if k.startswith(key + "."))
        return ValueError(f"{key!r} is a section, not a field; set e.g. {example!r}")
    matches = closest(key, leaves, n=3, cutoff=0.6)
    if not matches:
        # e.g. 'lr' (section forgotten): match on the field name alone.
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in leaves}
        matches = [by_leaf[m] for m in closest(leaf, by_leaf, n=3, cutoff=0.6)]
    hint = (did_you_mean(matches).rstrip() if matches
            else f"sections are {', '.join(sections)}; describe() lists every key")
    return ValueError(f"unknown config key {key!r}; {hint}")


_RENAMED: dict[type, dict[str, str]] = {}
_NOTICED: set[str] = set()


def register_renamed(root: type, renamed: Mapping[str, str]) -> None:
    """Old dotted keys of root's configs that still work, {old: new}: each is
    read as its new key, with a one-line deprecation notice (once per process)."""
    _RENAMED[root] = dict(renamed)


def deprecated(key: str, use: str) -> None:
    """The one-line deprecation notice of config key `key` (once per process)."""
    if key not in _NOTICED:
        _NOTICED.add(key)
        log.warning("config key %r is deprecated: use %s", key, use)


def _current_key(root: type, key: str) -> str:
    new = _RENAMED.get(root, {}).get(key)
    if new is None:
        return key
    deprecated(key, repr(new))
    return new


def _split_assignment(item: str) -> tuple[str, str]:
    key, sep, value = item.removeprefix("--").partition("=")
    if not sep or not key:
        raise ValueError(f"override {item!r} must look like key=value (e.g. train.lr=1e-6)")
    return key.strip(), value


def apply_overrides(cfg: T, overrides: Mapping[str, Any] | list[str]) -> T:
    """Returns cfg with dotted-key overrides applied via dataclasses.replace.

    Args:
        cfg: the base config (e.g. a recipe).
        overrides: {"train.lr": 1e-6} (values typed, or strings to parse) or
            ["train.lr=1e-6", ...] (later entries win). Strings are parsed per
            the field's annotation; see _convert.

    Each section is rebuilt once with all its changes, so cross-field rules
    (e.g. max_model_len > max_tokens) see the final values, not an order.

    Raises:
        ValueError: unknown key (with suggestions), wrong type, or a value the
            section rejects; the message names the dotted key.
    """
    if isinstance(overrides, Mapping):
        pairs = list(overrides.items())
    else:
        pairs = [_split_assignment(item) for item in overrides]
    leaves = _leaf_types(type(cfg))
    changes: dict[str, Any] = {}
    for key, raw in pairs:
        key = _current_key(type(cfg), key)
        if key not in leaves:
            raise _unknown_key_error(key, leaves)
        node = changes
        *path, name = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[name] = _convert(raw, leaves[key], key, parse_str=True)
    return _replace_nested(cfg, changes)


def _replace_nested(obj: Any, changes: Mapping[str, Any]) -> Any:
    if not changes:
        return obj
    kwargs = {
        name: _replace_nested(getattr(obj, name), value)
        if is_dataclass(getattr(obj, name))
        else value
        for name, value in changes.items()
    }
    return replace(obj, **kwargs)


def flatten(d: Mapping[str, Any], *, source: str = "config") -> dict[str, Any]:
    """Flattens nested mappings into dotted keys: {"train": {"lr": 1}} -> {"train.lr": 1}.

    Nested sections and dotted keys may be mixed; a key given twice raises
    ValueError naming source.
    """
    out: dict[str, Any] = {}

    def visit(node: Mapping[Any, Any], prefix: str) -> None:
        for k, v in node.items():
            if not isinstance(k, str):
                raise ValueError(f"{source}: keys must be strings, got {k!r} under {prefix!r}")
            key = prefix + k
            if isinstance(v, Mapping):
                visit(v, key + ".")
            elif key in out:
                raise ValueError(f"{source}: key {key!r} is set twice")
            else:
                out[key] = v

    visit(d, "")
    return out


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads a YAML file of overrides into a flat {dotted key: value} dict.

    Raises:
        ValueError: the file is missing or unreadable, is not valid YAML (with
            line) or its top level is not a mapping; the message names the file.
    """
    try:
        fh = open(path, encoding="utf-8")  # noqa: SIM115 -- closed by the with below
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the config file ({exc.strerror})") from None
    with fh:
        try:
            data = yaml.safe_load(fh)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f":{mark.line + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ValueError(f"{path}{where}: invalid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(
            f"{path}: top level must be a mapping of config keys, got {type(data).__name__}"
        )
    return flatten(data, source=str(path))


def parse_cli_overrides(argv: list[str]) -> list[str]:
    """Turns ["--train.lr=1e-6", "--seed", "3"] into ["train.lr=1e-6", "seed=3"].

    Values may start with a single '-' (negative numbers) but not with '--'.

    Raises:
        ValueError: a bare argument, or a flag without a value.
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ValueError(f"unexpected argument {arg!r}; overrides look like --train.lr=1e-6")
        if "=" in arg:
            out.append(arg[2:])
            i += 1
            continue
        if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
            raise ValueError(f"{arg} needs a value ({arg}=VALUE or {arg} VALUE)")
        out.append(f"{arg[2:]}={argv[i + 1]}")
        i += 2
    return out
