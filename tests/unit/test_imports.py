"""The package's modules import each other without a cycle, and without function-local imports."""
from __future__ import annotations

import ast
from pathlib import Path

import kombu_events

PACKAGE = Path(kombu_events.__file__).parent


def _local_imports(tree: ast.Module, *, top_level: bool) -> set[str]:
    """Sibling modules a module imports (at top level, or inside functions and classes)."""
    found: set[str] = set()
    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    nodes = tree.body if top_level else [n for node in tree.body if isinstance(node, scopes) for n in ast.walk(node)]
    for node in nodes:
        if isinstance(node, ast.If) and top_level:  # `if TYPE_CHECKING:` imports never run
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {path.stem: ast.parse(path.read_text()) for path in PACKAGE.glob("*.py") if path.stem != "__init__"}
    return {name: _local_imports(tree, top_level=True) & modules.keys() for name, tree in modules.items()}


def test_no_module_imports_a_sibling_inside_a_function():
    offenders = {path.stem: sorted(_local_imports(ast.parse(path.read_text()), top_level=False))
                 for path in PACKAGE.glob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join((*path, name))}"
        if name in done:
            return
        for dependency in sorted(graph[name]):
            visit(dependency, (*path, name))
        done.add(name)

    for module in sorted(graph):
        visit(module, ())
    assert {"registry", "events", "bootstep", "consumer", "runner"} <= done


def test_the_registry_sits_at_the_bottom():
    graph = _graph()
    assert "events" not in graph["registry"] and "bootstep" not in graph["registry"]
    assert "events" not in graph["bootstep"] and "events" not in graph["runner"]
