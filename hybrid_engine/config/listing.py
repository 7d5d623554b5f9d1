"""Listing a config: its keys with values and docs, its registry names, plain dicts.

Job: what `hybrid-engine config` prints and a run writes: `describe` (every
leaf key, its value and doc), `help_text` (the same as `--key=value  doc`
lines, grouped by section, with each registry's names), `check_registered`
(registry-named keys name a registered entry) and `to_dict`. Like
overrides.py it knows no section: the config is passed in.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from typing import Any

__all__ = ["check_registered", "describe", "help_text", "to_dict"]


def describe(cfg: Any) -> list[tuple[str, str, str]]:
    """Lists every leaf field of a config as (dotted key, repr(value), doc).

    Args:
        cfg: a RunConfig (or any section); values shown are cfg's, so
            describe(RunConfig()) gives the defaults and describe(recipe) the
            recipe's settings.
    """
    rows: list[tuple[str, str, str]] = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if is_dataclass(value):
            rows += [(f"{f.name}.{k}", v, d) for k, v, d in describe(value)]
        else:
            rows.append((f.name, repr(value), f.metadata.get("doc", "")))
    return rows


def _registry(spec: str) -> Any:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def _registry_fields(cfg: Any, prefix: str = "") -> Iterator[tuple[str, Any, str]]:
    """(dotted key, value, registry spec) of every registry-named field of cfg."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if is_dataclass(value):
            yield from _registry_fields(value, f"{prefix}{f.name}.")
        elif "registry" in f.metadata:
            yield prefix + f.name, value, f.metadata["registry"]


def check_registered(cfg: Any) -> None:
    """Every registry-named field of cfg names a registered entry (at build time:
    entries a user registers before building the run count).

    Raises:
        ValueError: names the key, the registered names and the closest one.
    """
    for key, value, spec in _registry_fields(cfg):
        try:
            _registry(spec).get(value)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None


def help_text(cfg: Any) -> str:
    """describe(cfg) as aligned `--key=value  doc` lines for a CLI's help, under a
    `# section: doc` line per section (top-level keys last); a registry-named
    field lists what is registered now."""
    names = {key: _registry(spec).names() for key, _, spec in _registry_fields(cfg)}
    rows = [(k, v, f"{d} Registered: {', '.join(names[k])}." if k in names else d)
            for k, v, d in describe(cfg)]
    width = max(len(k) + len(v) for k, v, _ in rows) + 4
    docs = {f.name: f.metadata.get("doc", "") for f in fields(cfg)}
    groups: dict[str, list[str]] = {}
    for k, v, d in rows:
        groups.setdefault(k.split(".")[0] if "." in k else "", []).append(
            f"--{k}={v}".ljust(width) + f"  {d}")
    top = groups.pop("", [])
    out = [[f"# {name}: {docs[name]}", *lines] for name, lines in groups.items()]
    out += [["# top level", *top]] if top else []
    return "\n\n".join("\n".join(block) for block in out)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Nested dict of plain values (tuples as lists), safe for yaml.safe_dump / json."""
    out: dict[str, Any] = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if is_dataclass(value):
            value = to_dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out
