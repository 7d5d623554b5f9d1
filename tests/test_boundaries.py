"""Module boundaries the package keeps (checked on the source, by AST):

- vLLM is touched in one folder: only modules under `rollout/` import vllm, and
  only `rollout/vllm_compat.py` reaches into its private attributes (llm_engine,
  engine_core, model_executor, ...) or patches it, so a vLLM upgrade is one
  file's review;
- production code never imports the test harness `hybrid_engine.testing`;
- layers: a module imports only from its own layer or those below (`LAYERS`),
  lazy imports inside functions and TYPE_CHECKING imports included;
- no import cycles between modules (the same imports);
- groups are passed, not found: no module-level process group, and no object
  sets a hook (`before_*`, `after_*`, `between_*`, `on_*`) on another;
- model families live in `models/`: no module of `reshard/`, `parallel/` or
  `rollout/` names one (the registered families' names, code and prose alike).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.test_sizes import parse_source

PACKAGE = Path(__file__).resolve().parents[1] / "hybrid_engine"
VLLM_FOLDER = "rollout/"
VLLM_COMPAT = "rollout/vllm_compat.py"
VLLM_INTERNALS = {"llm_engine", "engine_core", "model_executor", "driver_worker", "model_runner",
                  "kv_caches"}


def _modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(PACKAGE)): parse_source(p.read_text())
            for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(tree: ast.Module) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _internals(tree: ast.Module) -> list[str]:
    return sorted({n.attr for n in ast.walk(tree)
                   if isinstance(n, ast.Attribute) and n.attr in VLLM_INTERNALS})


def test_only_the_rollout_folder_imports_vllm_and_only_compat_reaches_inside() -> None:
    offenders = {}
    for name, tree in _modules().items():
        vllm = [] if name.startswith(VLLM_FOLDER) else sorted(
            m for m in _imports(tree) if m == "vllm" or m.startswith("vllm."))
        internals = [] if name == VLLM_COMPAT else _internals(tree)
        if vllm or internals:
            offenders[name] = vllm + internals
    assert offenders == {}, offenders
    compat = _modules()[VLLM_COMPAT]  # the check looks at the right names
    assert any(m.startswith("vllm") for m in _imports(compat))
    assert {"llm_engine", "model_runner", "kv_caches"} <= set(_internals(compat))


def test_production_code_never_imports_the_test_harness() -> None:
    offenders = sorted(name for name, tree in _modules().items()
                       if not name.startswith("testing/") and any(
                           m == "hybrid_engine.testing" or m.startswith("hybrid_engine.testing.")
                           for m in _imports(tree)))
    assert offenders == []


@pytest.mark.parametrize("version, warns", [("0.32.0", False), ("0.26.0", False),
                                            ("0.27.1", True)])
def test_the_compat_layer_warns_on_a_vllm_it_was_not_checked_on(monkeypatch, caplog, version,
                                                                warns) -> None:
    vllm = pytest.importorskip("vllm")
    from hybrid_engine.rollout import vllm_compat

    monkeypatch.setattr(vllm, "__version__", version)
    monkeypatch.setattr(vllm_compat, "_checked", False)
    with caplog.at_level("WARNING", logger=vllm_compat.__name__):
        vllm_compat.check_version()
    assert ("review it" in caplog.text) == warns


# Bottom to top. A package or top-level module not listed fails the test: place it.
LAYERS = (
    {"_native", "config", "models", "algorithms", "trajectory", "guards", "console", "tracking",
     "tools", "user_code", "names"},
    {"parallel", "reshard", "rollout"},
    {"roles", "envs", "checkpoint", "metrics", "output_dir"},
    {"policy", "preflight", "evaluation", "eval_samples"},
    {"controller", "job"},
    {"cli", "demo", "launch", "scale", "testing"},
)


def _layer(module: str) -> int:
    """The layer of a hybrid_engine.* module (by its first name under the package)."""
    top = module.split(".")[1] if "." in module else ""
    found = [i for i, names in enumerate(LAYERS) if top in names]
    assert found, f"{module}: put {top!r} in a layer of tests/test_boundaries.py::LAYERS"
    return found[0]


def _module_name(path: str) -> str:
    parts = ["hybrid_engine", *Path(path).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def upward_imports(modules: dict[str, ast.Module]) -> list[str]:
    """'importer -> imported' for every import of a higher layer."""
    out = []
    for path, tree in modules.items():
        name = _module_name(path)
        if name == "hybrid_engine":
            continue
        for imported in sorted(_imports(tree)):
            if imported.startswith("hybrid_engine.") and _layer(imported) > _layer(name):
                out.append(f"{name} -> {imported}")
    return out


def import_cycles(modules: dict[str, ast.Module]) -> list[list[str]]:
    """Groups of modules that import each other, directly or around a loop."""
    names = {_module_name(path): tree for path, tree in modules.items()}
    graph = {}
    for name, tree in names.items():
        targets = set()
        for imported in _imports(tree):
            while imported and imported not in names:
                imported = imported.rpartition(".")[0]
            if imported not in ("", name, "hybrid_engine"):
                targets.add(imported)
        graph[name] = targets
    cycles, done = [], set()
    for start in graph:  # the modules that reach start and that start reaches
        if start in done:
            continue
        reach = _reachable(graph, start)
        group = {m for m in reach if start in _reachable(graph, m)} | {start}
        done |= group
        if len(group) > 1:
            cycles.append(sorted(group))
    return cycles


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_every_import_goes_down_the_layers_or_stays_level() -> None:
    assert upward_imports(_modules()) == []


def test_no_import_cycles() -> None:
    assert import_cycles(_modules()) == []


def test_an_upward_import_or_a_cycle_added_on_purpose_is_caught() -> None:
    modules = dict(_modules())
    modules["parallel/bad.py"] = ast.parse("def f():\n    from hybrid_engine.policy import colocated\n")
    modules["config/bad.py"] = ast.parse("from hybrid_engine.config import bad_too\n")
    modules["config/bad_too.py"] = ast.parse("import hybrid_engine.config.bad\n")
    assert upward_imports(modules) == ["hybrid_engine.parallel.bad -> hybrid_engine.policy",
                                       "hybrid_engine.parallel.bad -> hybrid_engine.policy.colocated"]
    assert import_cycles(modules) == [["hybrid_engine.config.bad", "hybrid_engine.config.bad_too"]]


HOOK_NAMES = ("before_", "after_", "between_", "on_")


def placement_leaks(modules: dict[str, ast.Module]) -> list[str]:
    """'path:line what' for state that belongs to the placement found elsewhere:
    a module-level name bound to a process group (groups are passed, not found),
    and a hook set on another object (`a.b.before_x = ...`: the owner passes a
    callback where it calls, instead)."""
    out = []
    for path, tree in modules.items():
        for node in tree.body:
            if isinstance(node, ast.AnnAssign) and "ProcessGroup" in ast.unparse(node.annotation):
                out.append(f"{path}:{node.lineno} module-level process group "
                           f"{ast.unparse(node.target)}")
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for t in targets:
                if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute)
                        and t.attr.startswith(HOOK_NAMES)):
                    out.append(f"{path}:{node.lineno} hook set on another object "
                               f"{ast.unparse(t)}")
    return out


def test_groups_are_passed_and_no_object_sets_a_hook_on_another() -> None:
    assert placement_leaks(_modules()) == []
    bad = {"parallel/bad.py": ast.parse(
        "import torch.distributed as dist\n_G: dist.ProcessGroup | None = None\n"
        "class P:\n    def f(self):\n        self.trainer.before_step = self.wait\n")}
    assert placement_leaks(bad) == [
        "parallel/bad.py:2 module-level process group _G",
        "parallel/bad.py:5 hook set on another object self.trainer.before_step"]


FAMILY_FREE = ("reshard", "parallel", "rollout")


def test_no_family_is_named_outside_models() -> None:
    """Every registered family's name stem ("qwen", "gemma", "phi", ...), before
    a non-letter, and its architecture appear nowhere in reshard/, parallel/ or
    rollout/: what differs between families is read from their spec."""
    import re

    from hybrid_engine.models.spec import MODEL_SPECS, supported

    specs = [MODEL_SPECS.get(a) for a in supported()]
    stems = sorted({re.match(r"[a-z]+", s.name.lower()).group() for s in specs})
    pattern = re.compile(rf"\b({'|'.join(stems)})(?![a-z])|{'|'.join(s.architecture for s in specs)}",
                         re.IGNORECASE)
    found = [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
             for folder in FAMILY_FREE for path in sorted((PACKAGE / folder).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert len(stems) >= 6 and not found, "\n".join(found)
