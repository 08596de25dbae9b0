"""The project's modules import each other without cycles and only downwards, counting imports inside functions
too: a cycle makes the import order matter, and an upward import hides which layer depends on which."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO_ROOT

PACKAGES = ("app", "core", "models", "datamodules")
# the packages each package may import besides itself: core at the bottom, data and models beside each other, app on top
ALLOWED_IMPORTS = {"core": set(), "datamodules": {"core"}, "models": {"core"}, "app": {"core", "datamodules", "models"}}


def project_modules() -> dict[str, Path]:
    return {".".join(path.relative_to(REPO_ROOT).with_suffix("").parts): path
            for package in PACKAGES for path in sorted((REPO_ROOT / package).glob("*.py"))}


def imported_project_modules(path: Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports anywhere in it (``from app import comm`` counts as ``app.comm``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found & modules


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search)."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        for imported in sorted(graph[module]):
            if cycle := visit(imported, [*path, module]):
                return cycle
        done.add(module)
        return None

    return next(filter(None, (visit(module, []) for module in sorted(graph))), None)


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles() -> None:
    modules = project_modules()
    assert "app.cli" in modules and "models.gpt" in modules
    graph = {name: imported_project_modules(path, set(modules)) - {name} for name, path in modules.items()}
    assert "app.cli" in graph["app.__main__"]  # the walk sees imports at all
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_layers_import_only_downwards() -> None:
    modules = project_modules()
    upward = [f"{name} imports {imported}" for name, path in modules.items()
              for imported in sorted(imported_project_modules(path, set(modules)))
              if imported.split(".")[0] not in ALLOWED_IMPORTS[name.split(".")[0]] | {name.split(".")[0]}]
    assert not upward, f"imports against the layering: {upward}"
