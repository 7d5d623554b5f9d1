"""Docstrings name what exists: every `module.path`, `module.name`, `Class.member`
of this package that a docstring quotes in backticks resolves (checked on the
source, by AST: nothing is imported).

What counts as a reference: a dotted name in backticks (`rollout.engine.VLLMRollout`,
`VLLMRollout.open_run()`, `envs.agent`) whose first part is one of the package's
modules or classes; a config key (`rollout.max_tokens`) is a reference to the
config and must exist there. Anything else in backticks (code, a library's name,
an attribute of an instance in prose) is left alone.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

from tests.test_sizes import parse_source

PACKAGE = Path(__file__).resolve().parents[1] / "hybrid_engine"
_REF = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")


@dataclass
class _Index:
    modules: dict[str, set[str]] = field(default_factory=dict)  # module -> top-level names
    classes: dict[str, set[str]] = field(default_factory=dict)  # class -> members
    bases: dict[str, list[str]] = field(default_factory=dict)  # class -> base names
    where: dict[str, set[str]] = field(default_factory=dict)  # class -> modules defining it

    def members(self, cls: str, seen: frozenset = frozenset()) -> set[str] | None:
        """cls's members with its bases' (None: a base outside the package)."""
        out = set(self.classes[cls])
        for base in self.bases[cls]:
            if base not in self.classes:
                if base not in ("object", "Protocol", "Generic"):
                    return None
                continue
            if base not in seen:
                more = self.members(base, seen | {cls})
                if more is None:
                    return None
                out |= more
        return out


def _class_members(node: ast.ClassDef) -> set[str]:
    """Its methods, class attributes and fields, and the self.<name> its methods set."""
    out = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            out.add(item.target.id)
        elif isinstance(item, ast.Assign):
            out |= {t.id for t in item.targets if isinstance(t, ast.Name)}
    for item in ast.walk(node):
        if isinstance(item, (ast.Assign, ast.AnnAssign)):
            for t in item.targets if isinstance(item, ast.Assign) else [item.target]:
                out |= {sub.attr for sub in ast.walk(t) if isinstance(sub, ast.Attribute)
                        and isinstance(sub.value, ast.Name) and sub.value.id == "self"}
    return out


def _index(trees: dict[str, ast.Module]) -> _Index:
    idx = _Index()
    for module, tree in trees.items():
        names = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        idx.modules[module] = names
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                idx.where.setdefault(node.name, set()).add(module)
                idx.classes.setdefault(node.name, set()).update(_class_members(node))
                idx.bases.setdefault(node.name, []).extend(
                    b.id if isinstance(b, ast.Name) else getattr(b, "attr", "?")
                    for b in node.bases)
    return idx


def _config_keys() -> set[str]:
    from hybrid_engine.config import RunConfig
    from hybrid_engine.config.listing import describe

    keys = {key for key, _, _ in describe(RunConfig())}
    return keys | {k.rsplit(".", 1)[0] for k in keys}


_FILES = {"py", "json", "jsonl", "md", "txt", "yaml", "jinja", "parquet", "safetensors", "csv",
          "sh", "png", "log", "toml", "cfg"}


def _problem(ref: str, idx: _Index, config: set[str], package: str = "") -> str | None:
    """Why ref names nothing (None: it resolves, or is no reference to the package).
    package: the quoting module's package, for a reference relative to it."""
    parts = ref.removeprefix("hybrid_engine.").split(".")
    if ref in config or parts[-1] in _FILES:  # a config key, a file name
        return None
    if package and f"{package}.{parts[0]}" in idx.modules:
        parts = [*package.split("."), *parts]
    for n in range(len(parts), 0, -1):  # the longest module prefix
        module = ".".join(parts[:n])
        if module in idx.modules or module + ".__init__" in idx.modules:
            rest = parts[n:]
            names = idx.modules.get(module) or idx.modules.get(module + ".__init__", set())
            if not rest or rest[0] in names or module + "." + rest[0] in idx.modules:
                if len(rest) >= 2 and rest[0] in idx.classes:
                    members = idx.members(rest[0])
                    if members is not None and rest[1] not in members:
                        return f"{rest[0]} has no {rest[1]}"
                return None
            if any(rest[0] in members for cls, members in idx.classes.items()
                   if any(w.startswith(module) for w in idx.where[cls])):
                return None  # prose: an instance of a class of that module (`policy.collect`)
            return f"module {module} has no {rest[0]}"
    if parts[0] in idx.classes and len(parts) >= 2:
        members = idx.members(parts[0])
        if members is not None and parts[1] not in members:
            return f"{parts[0]} has no {parts[1]}"
    return None


def _docstrings(tree: ast.Module):  # noqa: ANN202
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield getattr(node, "lineno", 1), doc


def test_docstrings_name_modules_and_members_that_exist() -> None:
    trees = {str(p.relative_to(PACKAGE).with_suffix("")).replace("/", "."): parse_source(
        p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}
    idx, config = _index(trees), _config_keys()
    bad = []
    for module, tree in trees.items():
        package = module.removesuffix(".__init__").rpartition(".")[0] if "." in module else ""
        if module.endswith(".__init__"):
            package = module.removesuffix(".__init__")
        for line, doc in _docstrings(tree):
            for ref in _REF.findall(doc):
                why = _problem(ref, idx, config, package)
                if why is not None:
                    bad.append(f"{module}:{line}: `{ref}`: {why}")
    assert bad == []


def test_the_check_finds_a_stale_reference() -> None:
    trees = {"policy.phases": parse_source(
        "class Phases:\n    def trainer_weights_changed(self): ...\n"),
        "roles.__init__": parse_source(""), "roles.base": parse_source("def layout_of(): ...\n")}
    idx, config = _index(trees), {"rollout.max_tokens", "rollout"}
    assert _problem("Phases.trained", idx, config) == "Phases has no trained"
    assert _problem("roles.fsdp", idx, config) == "module roles has no fsdp"
    assert _problem("roles.base.layout_of", idx, config) is None
    assert _problem("rollout.max_tokens", idx, config) is None
    assert _problem("torch.distributed", idx, config) is None
