"""The import graph of `opd_trainer/` and `api/`, read from the source with `ast` (nothing is imported).

Only imports that run when a module is imported count: those at module level or in a class body,
including under `try:`/`if`, but not inside a function and not under `if TYPE_CHECKING:`. For
`from x import y`, the edge goes to the submodule `x.y` when it is one, else to `x`.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("opd_trainer", "api")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "__pycache__" not in path.parts:
                found[_module_name(path)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _imports(tree: ast.Module, *, in_functions: bool) -> list[ast.Import | ast.ImportFrom]:
    """Import statements outside `if TYPE_CHECKING:`: those that run when the module is imported
    (module level, class bodies, under `try:`/`if`/`with`), and with `in_functions` also those inside
    functions, which run later but still make one file depend on another."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if in_functions:
                    visit(node.body)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.ClassDef):
                visit(node.body)
            elif isinstance(node, (ast.Try, ast.TryStar)):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, (ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
            elif isinstance(node, ast.Match):
                for case in node.cases:
                    visit(case.body)

    visit(tree.body)
    return found


def _all_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, wherever it sits (in functions, under `if TYPE_CHECKING:`)."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _graph(kind: str = "import_time") -> dict[str, set[str]]:
    """Module -> the modules of `opd_trainer/` and `api/` it imports. `kind`: "import_time" (what runs
    on import), "runtime" (also imports inside functions), "all" (also `if TYPE_CHECKING:`)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        statements = _all_imports(tree) if kind == "all" else _imports(tree, in_functions=kind == "runtime")
        for node in statements:
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                source = _resolve(name, path, node)
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    targets.append(submodule if submodule in modules else source)
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(graph, white)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = grey
        stack.append(node)
        for target in sorted(graph[node]):
            if colour[target] == grey:
                return [*stack[stack.index(target) :], target]
            if colour[target] == white:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        colour[node] = black
        return None

    for node in sorted(graph):
        if colour[node] == white:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_graph_sees_the_packages() -> None:
    graph = _graph()
    assert "opd_trainer.cli.main" in graph and "api.main" in graph
    assert any(graph.values()), "no import edge found: the parser reads nothing"


def test_no_import_cycle_between_files() -> None:
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle at import time: " + " -> ".join(cycle or [])


def test_no_cycle_hidden_in_a_function() -> None:
    # A cycle broken only by moving one import into a function is still two files that need each
    # other: the shared piece belongs to one of them (or to a third).
    cycle = _find_cycle(_graph("runtime"))
    assert cycle is None, "import cycle through a function-local import: " + " -> ".join(cycle or [])


def _unit(module: str, packages: set[str]) -> str:
    """The part of the code a module belongs to: its subpackage of `opd_trainer`/`api` (`opd_trainer.engine`)
    when it sits in one, else the module itself (`opd_trainer.records`, `api.settings`)."""
    parts = module.split(".")
    top = ".".join(parts[:2])
    return top if top in packages else module


def _package_graph(kind: str = "all") -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]:
    """Subpackage (or top-level module) -> those it imports, and for each edge the module imports behind
    it. `kind` as `_graph`'s; by default every import counts, lazy and type-checking ones included."""
    modules = _modules()
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    behind: dict[tuple[str, str], list[str]] = {}
    for name, targets in _graph(kind).items():
        source = _unit(name, packages)
        graph.setdefault(source, set())
        for target in targets:
            unit = _unit(target, packages)
            if unit != source:
                graph[source].add(unit)
                behind.setdefault((source, unit), []).append(f"{name} -> {target}")
    return graph, behind


def test_no_loop_between_packages() -> None:
    # Packages sit in layers: no import of any kind (lazy, or for type checkers) may lead from a
    # package back to itself through another. A module-level graph without cycles can still hide one
    # (learner.a -> engine.b -> learner.c), and then neither package can be read, tested or moved alone.
    graph, behind = _package_graph()
    assert {"opd_trainer.engine", "opd_trainer.jobspec", "api.services"} <= set(graph), "units not found"
    cycle = _find_cycle(graph)
    if cycle:
        edges = [f"{a} -> {b} ({'; '.join(behind[(a, b)][:3])})" for a, b in itertools.pairwise(cycle)]
        raise AssertionError("package loop: " + " | ".join(edges))


def test_the_package_loop_check_sees_a_loop() -> None:
    # One import from the spec up to the driver (which reads the spec) is a loop the check must name.
    graph, _ = _package_graph()
    assert "opd_trainer.jobspec" in graph["opd_trainer.driver"]
    graph["opd_trainer.jobspec"].add("opd_trainer.driver")
    cycle = _find_cycle(graph)
    assert cycle is not None and {"opd_trainer.jobspec", "opd_trainer.driver"} <= set(cycle)


def test_client_imports_nothing_from_the_server() -> None:
    # Every import counts here, lazy ones and those for type checkers included.
    bad = [
        f"{name} -> {target}"
        for name, targets in _graph("all").items()
        if name.startswith("opd_trainer.client")
        for target in targets
        if target == "api" or target.startswith("api.")
    ]
    assert not bad, "the client imports the server: " + ", ".join(bad)


def test_only_the_cli_imports_the_cli() -> None:
    # Every import counts here, lazy ones and those for type checkers included.
    bad = [
        f"{name} -> {target}"
        for name, targets in _graph("all").items()
        if name.startswith("opd_trainer.") and not name.startswith("opd_trainer.cli")
        for target in targets
        if target.startswith("opd_trainer.cli")
    ]
    assert not bad, "a library module imports the CLI: " + ", ".join(bad)


def test_weight_sync_sits_below_engine_learner_and_driver() -> None:
    # Every import counts here, lazy ones and those for type checkers included: the transports own
    # both halves, so the engine and the learner import them, never the other way round.
    above = ("opd_trainer.engine", "opd_trainer.learner", "opd_trainer.driver")
    bad = [
        f"{name} -> {target}"
        for name, targets in _graph("all").items()
        if name == "opd_trainer.weight_sync" or name.startswith("opd_trainer.weight_sync.")
        for target in targets
        if any(target == package or target.startswith(package + ".") for package in above)
    ]
    assert "opd_trainer.weight_sync.transports" in _graph("all"), "the package is not where the test looks"
    assert not bad, "weight_sync imports a package above it: " + ", ".join(bad)
