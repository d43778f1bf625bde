"""The package's shape: one dependency direction, one privacy rule, a deliberate public API.

Read from the source with ``ast`` (no import side effects):
- no module-level import cycle among ``pipeline``'s modules;
- a module never imports another package's private module (``pipeline.x._y`` is for
  ``pipeline.x`` only; the core's private rooms ``pipeline._*`` (the runner, the data model,
  text rendering, the concurrency kit, and a few single modules) are shared by the package);
- every private module lives in a subpackage or the core, every public module is on the list
  of deliberate exceptions;
- every public ``__all__`` equals its snapshot, so an API change is a deliberate edit here.
"""

from __future__ import annotations

import ast
import functools
import importlib
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pipeline"

PUBLIC_MODULES = {
    # package surfaces
    "pipeline", "pipeline.batch", "pipeline.diagnostics", "pipeline.engines",
    "pipeline.judgers", "pipeline.models", "pipeline.observability", "pipeline.proxy",
    "pipeline.ratelimit", "pipeline.stages", "pipeline.tools", "pipeline.integrations",
    "pipeline.distributed", "pipeline.families", "pipeline.multimodal",
    # importing the module is the point: a heavy optional dependency, a command, test helpers
    "pipeline.engines.vllm", "pipeline.engines.transformers", "pipeline.engines.moe",
    "pipeline.cli", "pipeline.cli.__main__", "pipeline.models.tiny",
    "pipeline.models.tiny.__main__",
    "pipeline.testing", "pipeline.judgers.testing", "pipeline.artifacts",
    "pipeline.integrations.verl",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


@functools.cache
def _tree(name: str) -> ast.Module:
    """``name``'s syntax tree, parsed once per run: three rules read every module, and parsing
    is most of their time."""
    return ast.parse(MODULES[name].read_text())


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_level_imports(name: str) -> set[str]:
    """Modules of ``pipeline`` that ``name`` imports when it is imported (not in functions,
    not under ``TYPE_CHECKING``)."""
    tree = _tree(name)
    package = name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if not _is_type_checking(node):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("pipeline"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                    + ([node.module] if node.module else []))
                if not base.startswith("pipeline"):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in MODULES else base)

    visit(tree.body)
    # Importing pipeline.a.b runs pipeline.a's __init__ first, unless the importer is inside
    # pipeline.a (then that package is being initialised already, as the root always is).
    for target in list(found):
        parts = target.split(".")
        found.update(".".join(parts[:i]) for i in range(2, len(parts)))
    return {m for m in found if m in MODULES and m != name and not name.startswith(m + ".")}


def test_no_module_level_import_cycle():
    assert _cycles({name: module_level_imports(name) for name in MODULES}) == []


def test_no_import_cycle_of_any_kind():
    """Counting ``if TYPE_CHECKING:`` and function-level imports too: each pair of modules
    knows the other in one direction only."""
    graph = {name: module_level_imports(name) | _function_imports(name) | _type_imports(name)
             for name in MODULES}
    for name, targets in graph.items():
        targets.discard(name)
        for target in list(targets):  # a package's __init__ re-exports its modules: skip it
            if name.startswith(target + "."):
                targets.discard(target)
    assert _cycles(graph) == []


def _type_imports(name: str) -> set[str]:
    """What ``name`` imports under ``if TYPE_CHECKING:``."""
    tree = _tree(name)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith(
                        "pipeline"):
                    for alias in inner.names:
                        sub = f"{inner.module}.{alias.name}"
                        out.add(sub if sub in MODULES else inner.module or "")
    return {m for m in out if m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    # Tarjan's strongly connected components: any component of more than one module is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in graph:
        if name not in index:
            connect(name)
    return cycles


def _private_owner(target: str) -> str | None:
    """The package a private module or private package of ``target`` belongs to (the part
    before its first ``_``-named component), or None for a public path."""
    parts = target.split(".")
    for i, part in enumerate(parts[1:], 1):
        if part.startswith("_") and part != "__main__":
            return ".".join(parts[:i])
    return None


def test_no_module_imports_another_packages_private_module():
    offenders = []
    for name in MODULES:
        for target in module_level_imports(name) | _function_imports(name):
            owner = _private_owner(target)
            if owner is None or owner == "pipeline":  # public, or the core's private rooms
                continue
            if name != owner and not name.startswith(owner + "."):
                offenders.append(f"{name} -> {target}")
    assert offenders == []


def _function_imports(name: str) -> set[str]:
    tree = _tree(name)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pipeline"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in MODULES else node.module)
    return {m for m in out if m in MODULES}


def test_every_module_follows_the_privacy_rule():
    unexpected = []
    for name in MODULES:
        if _private_owner(name) is not None or name in PUBLIC_MODULES:
            continue
        unexpected.append(name)
    assert unexpected == []


SNAPSHOT = Path(__file__).with_name("public_api.txt")


def current_api() -> str:
    lines = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # (importing a __main__ runs its command)
        for name in sorted(PUBLIC_MODULES - {"pipeline.models.tiny.__main__",
                                             "pipeline.cli.__main__"}):
            module = importlib.import_module(name)
            exported = getattr(module, "__all__", None)
            if exported is None:
                continue
            assert list(exported) == sorted(exported, key=lambda n: (not n.isupper(), n)) or \
                list(exported) == sorted(exported), f"{name}.__all__ is not sorted"
            missing = [n for n in exported if not hasattr(module, n)]
            assert missing == [], f"{name}.__all__ names missing attributes: {missing}"
            lines.extend(f"{name}.{n}" for n in exported)
    return "\n".join(lines) + "\n"


def test_public_api_matches_snapshot():
    """After a deliberate API change, regenerate with ``python tests/test_structure.py``."""
    assert current_api() == SNAPSHOT.read_text()


if __name__ == "__main__":
    SNAPSHOT.write_text(current_api())
    print(f"wrote {SNAPSHOT}")
