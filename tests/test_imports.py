"""The project's modules import each other without cycles and only downwards, counting imports inside functions
too: a cycle makes the import order matter, and an upward import hides which layer depends on which."""

from __future__ import annotations

import ast
from fnmatch import fnmatch
from pathlib import Path

from tests.helpers import REPO_ROOT

PACKAGES = ("app", "core", "models", "datamodules")
# What each layer may import besides itself, lowest first. core at the bottom; the data and the models beside each
# other; then app's sub-packages: observability measures and reports and knows no strategy (a strategy announces what
# it does to whoever listens); safety keeps runs correct and recoverable; strategies are how ranks train together,
# and may checkpoint and be monitored; the command line builds runs from all of them; the tools are commands beside
# training (doctor reuses the command line's parsing); app/__main__.py dispatches to both.
BELOW_APP = {"core", "datamodules", "models"}
ALLOWED_IMPORTS = {
    "core": set(),
    "datamodules": {"core"},
    "models": {"core"},
    "app.observability": BELOW_APP,
    "app.safety": BELOW_APP | {"app.observability"},
    "app.strategies": BELOW_APP | {"app.observability", "app.safety"},
    "app.cli": BELOW_APP | {"app.observability", "app.safety", "app.strategies"},
    "app.tools": BELOW_APP | {"app.observability", "app.safety", "app.strategies", "app.cli"},
    "app": BELOW_APP | {"app.observability", "app.safety", "app.strategies", "app.cli", "app.tools"},
}


def layer_of(module: str) -> str:
    """The layer a module belongs to: the longest key of ALLOWED_IMPORTS that it is, or sits in."""
    return max((layer for layer in ALLOWED_IMPORTS if module == layer or module.startswith(layer + ".")), key=len)


def project_modules() -> dict[str, Path]:
    return {".".join(path.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__"): path
            for package in PACKAGES for path in sorted((REPO_ROOT / package).rglob("*.py"))}


def imported_project_modules(path: Path, modules: set[str], at_run_time: bool = False) -> set[str]:
    """The project modules ``path`` imports anywhere in it (``from app.tools import comm`` counts as
    ``app.tools.comm``); ``at_run_time``: without those under ``if TYPE_CHECKING:``, which only a type checker
    reads (a type a module names only in its hints)."""
    tree = ast.parse(path.read_text())
    if at_run_time:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                node.body = []
    found = set()
    for node in ast.walk(tree):
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
    assert "app.cli.lightning_cli" in modules and "models.gpt.network" in modules
    graph = {name: imported_project_modules(path, set(modules), at_run_time=True) - {name}
             for name, path in modules.items()}
    assert "app.cli.lightning_cli" in graph["app.__main__"]  # the walk sees imports at all
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_no_import_cycles_in_app_even_for_a_type_checker() -> None:
    """In app/ not even the imports only a type checker reads go round in a circle: such a circle is a helper that
    reads its settings off the object that owns it (a launcher off its strategy), where it should take a settings
    record."""
    modules = {name: path for name, path in project_modules().items() if layer_of(name).startswith("app")}
    graph = {name: imported_project_modules(path, set(modules)) - {name} for name, path in modules.items()}
    assert "app.strategies.fault_tolerance.job" in graph["app.strategies.fault_tolerance.strategy"]
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_every_module_sits_in_a_layer() -> None:
    assert {layer_of(name) for name in project_modules()} == set(ALLOWED_IMPORTS)
    assert layer_of("app.strategies.parameter_server.server") == "app.strategies" and layer_of("app.__main__") == "app"


def test_layers_import_only_downwards() -> None:
    modules = project_modules()
    upward = [f"{name} imports {imported}" for name, path in modules.items()
              for imported in sorted(imported_project_modules(path, set(modules)))
              if layer_of(imported) not in ALLOWED_IMPORTS[layer_of(name)] | {layer_of(name)}]
    assert not upward, f"imports against the layering: {upward}"


# the plain networks (each family's network.py, and the pieces they share): nn.Module code that knows nothing of
# processes, devices or sharding
NETWORK_PIECES = ("models.bert.masking", "models.sampling", "models.named_configs")
PARALLELISM = "models.parallel"
# the family classes and the bases they share, which build a network and parallelise it
FAMILY_CLASSES = ("models.module", "models.causal_language_model", "models.*.family")


def test_networks_know_nothing_of_parallelism() -> None:
    """Parallelism (models/parallel/) is applied to a network from outside: no network imports it, directly or
    through another project module, and in models/ only the family classes and their shared bases do."""
    modules = project_modules()
    networks = sorted(name for name in modules if fnmatch(name, "models.*.network")) + list(NETWORK_PIECES)
    assert len(networks) >= 6 and f"{PARALLELISM}.parallelize" in modules
    graph = {name: imported_project_modules(path, set(modules)) - {name} for name, path in modules.items()}

    def is_parallelism(module: str) -> bool:
        return module == PARALLELISM or module.startswith(PARALLELISM + ".")

    def reached(module: str, seen: set[str]) -> set[str]:
        for imported in graph[module] - seen:
            seen.add(imported)
            reached(imported, seen)
        return seen

    parallel = {network: sorted(filter(is_parallelism, reached(network, set()))) for network in networks}
    assert not any(parallel.values()), f"networks that import parallelism: {parallel}"
    importers = sorted(name for name, imported in graph.items() if layer_of(name) == "models"
                       and not is_parallelism(name) and any(map(is_parallelism, imported)))
    assert importers and all(any(fnmatch(name, pattern) for pattern in FAMILY_CLASSES) for name in importers), importers


MOST_LINES_IN_APP = 400  # a file one reads in one sitting; past it, a file has grown a second concern to split off


def test_no_file_in_app_is_over_400_lines() -> None:
    lengths = {path.relative_to(REPO_ROOT).as_posix(): len(path.read_text().splitlines())
               for path in sorted((REPO_ROOT / "app").rglob("*")) if path.is_file() and "__pycache__" not in path.parts}
    assert "app/cli/lightning_cli.py" in lengths
    too_long = {path: lines for path, lines in lengths.items() if lines > MOST_LINES_IN_APP}
    assert not too_long, f"files in app/ over {MOST_LINES_IN_APP} lines (split them by concern): {too_long}"
