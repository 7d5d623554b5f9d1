"""Module boundaries the package keeps (checked on the source, by AST):

- vLLM is touched in one folder: only modules under `rollout/` import vllm, and
  only `rollout/vllm_compat.py` reaches into its private attributes (llm_engine,
  engine_core, model_executor, ...) or patches it, so a vLLM upgrade is one
  file's review;
- production code never imports the test harness `hybrid_engine.testing`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hybrid_engine"
VLLM_FOLDER = "rollout/"
VLLM_COMPAT = "rollout/vllm_compat.py"
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
