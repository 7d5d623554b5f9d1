"""README.md and docs/*.md stay true to the repository.

- The config reference in docs/configuration.md is generated from the config
  dataclasses (`describe(RunConfig())`); `.venv/bin/python -m tests.test_docs`
  rewrites it.
- Every backticked path names something that exists. The rule:
  * a token made of letters, digits, `_ . - /` that contains "/" and ends in a
    known extension (or in "/", a directory) is a path relative to the
    repository root or to `hybrid_engine/`. Absolute paths (/dev/shm) and what
    a run writes (`runs/`, `.cache/`, `output_dir/` and its `final/`, `tb/`,
    `checkpoints/`) are not repository paths and are skipped;
  * `hybrid_engine.a.b` is a module, or a module followed by attribute names
    that appear in the module's source;
  * `a.b` whose first part is a module or package of hybrid_engine (and which
    is not a config key such as `async_rollout.max_staleness`, or a renamed
    one) is read as
    `hybrid_engine.a.b`;
  * tokens with `*`, `<` or `{` are patterns or placeholders and are skipped.
  Fenced code blocks are not scanned (commands, not references).
- Relative markdown link targets exist inside the repository, and their
  #anchors name a heading of the target page.
- The docs state what is true now: no issue numbers, review tags or history.

Offline and fast: only hybrid_engine packages are imported (never vLLM).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "hybrid_engine"
README = REPO / "README.md"
CONFIG_DOC = REPO / "docs" / "configuration.md"
BEGIN = "<!-- generated: config reference -->"
END = "<!-- end generated -->"
REGENERATE = ".venv/bin/python -m tests.test_docs"

EXTENSIONS = (".py", ".md", ".cpp", ".cu", ".h", ".txt", ".png", ".yaml", ".yml", ".json",
              ".toml", ".sh", ".cfg")
# What a run writes, not repository paths: run folders, caches, and the entries of
# an output_dir (`final/`, `final_adapter/`, `tb/`, `checkpoints/`, the trackers' `wandb/`
# and `mlruns/`).
OUTPUT_ROOTS = ("runs/", ".cache/", "output_dir/", "final/", "final_adapter/", "tb/",
                "checkpoints/", "wandb/", "mlruns/")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
BACKTICK = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATHLIKE = re.compile(r"[\w.\-/]+")
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
TAGS = re.compile(r"issue [0-9]+|\bG[0-9]{1,2}\b|found in[ ]review")
HISTORY = re.compile(r"until this change|since then|the run before it|used to be|no longer"
                     r"|\bshared/|DESIGN\.md", re.I)


def doc_files() -> list[Path]:
    return [README, *sorted((REPO / "docs").glob("*.md"))]


# --------------------------------------------------------------------------
# The generated config reference
# --------------------------------------------------------------------------


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def config_reference() -> str:
    """Markdown for every config key of RunConfig(), grouped by section."""
    from hybrid_engine.config import RunConfig
    from hybrid_engine.config import describe

    sections: dict[str, list[tuple[str, str, str]]] = {}
    for key, value, doc in describe(RunConfig()):
        section = key.split(".", 1)[0] if "." in key else ""
        sections.setdefault(section, []).append((key, value, doc))
    out = [f"Generated from the dataclasses in `hybrid_engine/config/sections.py` by "
           f"`{REGENERATE}`; defaults are `RunConfig()`'s (a recipe sets its own).", ""]
    for section, rows in sections.items():
        out += [f"### `{section}`" if section else "### Top level", "",
                "| key | default | doc |", "|---|---|---|"]
        out += [f"| `{k}` | `{_cell(v)}` | {_cell(d)} |" for k, v, d in rows]
        out.append("")
    return "\n".join(out)


def test_every_renamed_key_is_listed() -> None:
    from hybrid_engine.config import RENAMED_KEYS

    text = CONFIG_DOC.read_text(encoding="utf-8")
    missing = [o for o, n in RENAMED_KEYS.items() if f"| `{o}` | `{n}` |" not in text]
    assert missing == [], f"{CONFIG_DOC.relative_to(REPO)}: renamed keys not listed: {missing}"


def _split_generated(text: str) -> tuple[str, str, str]:
    assert BEGIN in text and END in text, f"{CONFIG_DOC} needs the markers {BEGIN} ... {END}"
    head, rest = text.split(BEGIN, 1)
    body, tail = rest.split(END, 1)
    return head, body, tail


def regenerate() -> bool:
    """Rewrites the generated section; returns whether the file changed."""
    text = CONFIG_DOC.read_text(encoding="utf-8")
    head, _, tail = _split_generated(text)
    new = f"{head}{BEGIN}\n{config_reference()}\n{END}{tail}"
    if new != text:
        CONFIG_DOC.write_text(new, encoding="utf-8")
    return new != text


def test_config_reference_is_generated_from_the_dataclasses() -> None:
    _, body, _ = _split_generated(CONFIG_DOC.read_text(encoding="utf-8"))
    assert body == f"\n{config_reference()}\n", (
        f"{CONFIG_DOC.relative_to(REPO)}: the config reference is out of date with "
        f"hybrid_engine/config; regenerate it with `{REGENERATE}`")


# --------------------------------------------------------------------------
# Paths, modules and links
# --------------------------------------------------------------------------


@cache
def config_keys() -> frozenset[str]:
    from hybrid_engine.config import RENAMED_KEYS, RunConfig, describe

    return frozenset(k for k, _, _ in describe(RunConfig())) | frozenset(RENAMED_KEYS)


@cache
def module_roots() -> frozenset[str]:
    """Names of hybrid_engine's top-level modules and subpackages."""
    names = {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"}
    names |= {p.parent.name for p in PKG.glob("*/__init__.py")}
    return frozenset(names)


def _find_spec(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, AttributeError, ValueError):
        return None


def dotted_exists(name: str) -> bool:
    """hybrid_engine.a.b[.attr...]: the longest module prefix exists and every
    remaining name appears in its source. Only packages are imported on the way
    (find_spec imports a name's parent), never a module such as the engine's."""
    parts = name.split(".")
    spec, i = _find_spec(parts[0]), 1
    if spec is None:
        return False
    while i < len(parts) and spec.submodule_search_locations is not None:
        nxt = _find_spec(".".join(parts[:i + 1]))
        if nxt is None:
            break
        spec, i = nxt, i + 1
    rest = parts[i:]
    if not rest:
        return True
    origin = spec.origin or ""
    source = Path(origin).read_text(encoding="utf-8") if origin.endswith(".py") else ""
    return all(re.search(rf"\b{re.escape(r)}\b", source) for r in rest)


def path_exists(token: str) -> bool:
    token = token.removeprefix("./")
    return (REPO / token).exists() or (PKG / token).exists()


def check_token(token: str) -> str | None:
    """None if token is fine (or not a reference), else why it is not."""
    if any(c in token for c in "*<{"):
        return None
    if (PATHLIKE.fullmatch(token) and "/" in token
            and (token.endswith(EXTENSIONS) or token.endswith("/"))):
        if token.startswith("/") or token.startswith(OUTPUT_ROOTS):
            return None
        return None if path_exists(token) else "no such file or directory"
    if not DOTTED.fullmatch(token) or token.endswith(tuple(EXTENSIONS)):
        return None
    if token.startswith("hybrid_engine."):
        return None if dotted_exists(token) else "no such module or attribute"
    first = token.split(".", 1)[0]
    if first in module_roots() and token not in config_keys():
        return None if dotted_exists(f"hybrid_engine.{token}") else \
            f"no such module or attribute (read as hybrid_engine.{token})"
    return None


def backticked(text: str) -> list[tuple[int, str]]:
    """(line number, token) of every inline code span outside fenced blocks."""
    blanked = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return [(blanked.count("\n", 0, m.start()) + 1, m.group(1).strip())
            for m in BACKTICK.finditer(blanked)]


def test_backticked_paths_and_modules_exist() -> None:
    had_vllm = "vllm" in sys.modules
    bad = []
    for doc in doc_files():
        for line, token in backticked(doc.read_text(encoding="utf-8")):
            why = check_token(token)
            if why:
                bad.append(f"{doc.relative_to(REPO)}:{line}: `{token}`: {why}")
    assert not bad, "stale references:\n" + "\n".join(bad)
    assert had_vllm or "vllm" not in sys.modules, "checking the docs imported vLLM"


def anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file: lower case, punctuation
    dropped, spaces as hyphens."""
    text = FENCE.sub("", doc.read_text(encoding="utf-8"))
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_relative_links_exist() -> None:
    bad = []
    for doc in doc_files():
        text = FENCE.sub("", doc.read_text(encoding="utf-8"))
        for m in LINK.finditer(text):
            target, _, anchor = m.group(1).partition("#")
            if re.match(r"[a-z]+:", target):
                continue
            path = (doc.parent / target).resolve() if target else doc
            if not path.exists() or not path.is_relative_to(REPO):
                bad.append(f"{doc.relative_to(REPO)}: ({m.group(1)}): no such file")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                bad.append(f"{doc.relative_to(REPO)}: ({m.group(1)}): no such heading")
    assert not bad, "broken links:\n" + "\n".join(bad)


# --------------------------------------------------------------------------
# Shape and tone
# --------------------------------------------------------------------------


def test_docs_state_the_present() -> None:
    bad = []
    for doc in doc_files():
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            if m := TAGS.search(line) or HISTORY.search(line):
                bad.append(f"{doc.relative_to(REPO)}:{n}: {m.group(0)!r}")
    assert not bad, "history, tags or outside references (history goes in commits):\n" + \
        "\n".join(bad)


def test_readme_is_a_front_page() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150, "README.md is the front page: at most 150 lines"
    for needed in ("make test", "make demo", ".ci/run"):
        assert needed in text, f"README.md must mention {needed}"
    arch = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert len(arch.splitlines()) <= 400, "docs/architecture.md: at most 400 lines"


def test_the_path_rule_catches_stale_references() -> None:
    assert check_token("policy/colocated.py") is None
    assert check_token("benchmarks/results/chaos_cpu_202611.md") is None
    assert check_token("hybrid_engine.launch.launch_local") is None
    assert check_token("hybrid_engine._C") is None
    assert check_token("async_rollout.max_staleness") is None  # a config key
    assert check_token("benchmarks/results/<topic>_<device>_<yyyymm>.md") is None
    assert check_token("roles.vllm_rollout") is not None
    assert check_token("policy.no_such_module") is not None
    assert check_token("hybrid_engine.policy.colocated.NoSuchThing") is not None
    assert check_token("docs/no_such_page.md") is not None


if __name__ == "__main__":
    changed = regenerate()
    print(f"{CONFIG_DOC.relative_to(REPO)}: " + ("config reference rewritten" if changed
                                                 else "already up to date"))
