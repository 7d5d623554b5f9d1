"""Module boundaries the package keeps (checked on the source, by AST):

- vLLM is touched in one place: only `rollout/engine.py` imports vllm or reaches
  into its engine internals (llm_engine, engine_core, model_executor, ...), so a vLLM
  upgrade is one file's review;
- production code never imports the test harness `hybrid_engine.testing`.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hybrid_engine"
VLLM_OWNERS = {"rollout/engine.py"}
VLLM_INTERNALS = {"llm_engine", "engine_core", "model_executor", "driver_worker", "model_runner",
                  "kv_caches"}


def _modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(PACKAGE)): ast.parse(p.read_text(), str(p))
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


def test_only_the_rollout_module_touches_vllm() -> None:
    offenders = {}
    for name, tree in _modules().items():
        if name in VLLM_OWNERS:
            continue
        vllm = sorted(m for m in _imports(tree) if m == "vllm" or m.startswith("vllm."))
        internals = sorted({n.attr for n in ast.walk(tree)
                            if isinstance(n, ast.Attribute) and n.attr in VLLM_INTERNALS})
        if vllm or internals:
            offenders[name] = vllm + internals
    assert offenders == {}, offenders
    owner = _modules()["rollout/engine.py"]  # the check looks at the right names
    assert any(m.startswith("vllm") for m in _imports(owner))
    assert any(isinstance(n, ast.Attribute) and n.attr == "llm_engine" for n in ast.walk(owner))


def test_production_code_never_imports_the_test_harness() -> None:
    offenders = sorted(name for name, tree in _modules().items()
                       if not name.startswith("testing/") and any(
                           m == "hybrid_engine.testing" or m.startswith("hybrid_engine.testing.")
                           for m in _imports(tree)))
    assert offenders == []
