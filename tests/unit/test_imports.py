"""The package's import graph, read from the source with ``ast``: it has no cycle, and the
registry and the worker never reach ``Events``.

The graph has one node per file under ``kombu_events/``, every folder at any depth
(``__init__.py`` is its package), and one arrow per import of the package, whichever its form:
relative (``from ..core import names``) or absolute (``import kombu_events.core.names``,
``from kombu_events.core import names``); ``from . import x`` is an arrow to module ``x`` when
``x`` is a module, else to the package it comes from (``from .. import __version__`` runs
``kombu_events/__init__.py``). Where the import sits does not matter:

- at module level, inside ``try``/``except``, ``if``/``else`` or a class body: it runs at import time;
- under ``if TYPE_CHECKING:``: it never runs, but the module's annotations depend on the other
  module, and a cycle only the type checker sees is still a cycle of the design;
- inside a function: it runs later, but it is still a dependency; deferring an import is how
  code hides a cycle at run time, and counted here, it hides none.

The parents Python imports on the way (``kombu_events/__init__.py`` before any
``kombu_events.x``) are not arrows: every module would then depend on the package's
``__init__``, which imports the public API.

The other rules of the layering (core is pure, nothing imports the CLI or ``testing``, the
layers from top to bottom) are import-linter's contracts in setup.cfg, checked by
``tox -e lint``. This test reads the source with ``ast`` rather than asking grimp (import-linter's
graph library) for cycles: grimp needs Python 3.11 while the unit suite runs on 3.9 too, it would
be a test dependency more, and ``ast`` tells which kind of import each arrow is, for the message.
"""
from __future__ import annotations

import ast
from collections import deque
from pathlib import Path
from typing import NamedTuple

import kombu_events

PACKAGE = Path(kombu_events.__file__).parent

# Modules that may import the package inside a function (see the test of that rule), and why.
FUNCTION_LEVEL_IMPORTS_ALLOWED = {
    # `python -m kombu_events.demo`: it imports the demo's Celery app when main() runs.
    "kombu_events.demo.__main__",
}


class Arrow(NamedTuple):
    """One import of ``target``: its line, and where it sits: ``module``, ``type_checking`` or ``function``."""

    target: str
    line: int
    kind: str


Graph = dict[str, list[Arrow]]


def module_files(package_dir: Path) -> dict[str, Path]:
    """Every module under ``package_dir``, recursively, by dotted name (a package by its ``__init__.py``)."""
    modules: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, modules: set[str]) -> list[str]:
    """The package's modules that one import statement of ``module`` imports."""
    root = module.split(".")[0]

    def known(name: str) -> str:  # the module a dotted name is or is in: pkg.sub.d.thing -> pkg.sub.d
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    if isinstance(node, ast.Import):
        return [known(alias.name) for alias in node.names if alias.name.split(".")[0] == root]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        source = ".".join([*base, node.module] if node.module else base)
    else:
        source = node.module or ""
    if source.split(".")[0] != root:
        return []
    return [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else known(source)
            for alias in node.names]


def _arrows(module: str, path: Path, modules: set[str]) -> list[Arrow]:
    arrows: list[Arrow] = []

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            child_kind = kind
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                child_kind = "function"
            elif isinstance(node, ast.If) and kind == "module" and _is_type_checking(node.test) and child in node.body:
                child_kind = "type_checking"
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                arrows.extend(Arrow(target, child.lineno, child_kind)
                              for target in _targets(module, path.name == "__init__.py", child, modules)
                              if target != module)
            visit(child, child_kind)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), "module")
    return arrows


def import_graph(package_dir: Path) -> Graph:
    """Every module of the package, with its imports of the package (see the module docstring)."""
    files = module_files(package_dir)
    return {module: _arrows(module, path, set(files)) for module, path in files.items()}


def cycles(graph: Graph) -> list[list[str]]:
    """One shortest cycle per strongly connected part of the graph (Tarjan's), each a closed path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    parts: list[set[str]] = []

    def connect(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted({arrow.target for arrow in graph[module]}):
            if target not in index:
                connect(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            part = {stack.pop()}
            while module not in part:
                part.add(stack.pop())
            if len(part) > 1:
                parts.append(part)

    for module in sorted(graph):
        if module not in index:
            connect(module)

    found = []
    for part in parts:  # breadth first, inside the part, from its first module back to it
        start = min(part)
        came_from: dict[str, str] = {}
        queue = deque([start])
        while queue:
            module = queue.popleft()
            targets = sorted({arrow.target for arrow in graph[module]} & part)
            if start in targets:
                path = [module, start]
                while module != start:
                    module = came_from[module]
                    path.insert(0, module)
                found.append(path)
                break
            for target in targets:
                if target not in came_from:
                    came_from[target] = module
                    queue.append(target)
    return sorted(found)


def describe(cycle: list[str], graph: Graph, files: dict[str, Path]) -> str:
    """``a``, then ``-> b [file:line]`` for each step, the kind of import when it is not at module level."""
    base = files[min(files, key=len)].parent.parent  # the folder the package sits in
    lines = [cycle[0]]
    for importer, imported in zip(cycle, cycle[1:]):
        where = ", ".join(sorted({f"{files[importer].relative_to(base).as_posix()}:{arrow.line}"
                                  + ("" if arrow.kind == "module" else f" ({arrow.kind})")
                                  for arrow in graph[importer] if arrow.target == imported}))
        lines.append(f"  -> {imported}  [{where}]")
    return "\n".join(lines)


def reachable(graph: Graph, module: str) -> set[str]:
    """The modules ``module`` imports, directly or not."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for arrow in graph[todo.pop()]:
            if arrow.target not in seen:
                seen.add(arrow.target)
                todo.append(arrow.target)
    return seen


def test_the_import_graph_has_no_cycle():
    graph = import_graph(PACKAGE)
    found = cycles(graph)
    files = module_files(PACKAGE)
    assert not found, f"{len(found)} import cycle(s):\n" + "\n".join(describe(c, graph, files) for c in found)


def test_the_graph_has_every_module_of_every_folder():
    graph = import_graph(PACKAGE)
    assert set(graph) == set(module_files(PACKAGE)) >= {
        "kombu_events", "kombu_events.events", "kombu_events.registry", "kombu_events.core.settlement",
        "kombu_events.worker.bootstep", "kombu_events.worker.runner", "kombu_events.testing"}
    assert "kombu_events.registry" in {arrow.target for arrow in graph["kombu_events.events"]}  # from . import registry


def test_no_module_imports_the_package_inside_a_function():
    """Imports sit at the top of the module, where a reader and import-linter see them first (the
    cycle test counts function-level imports anyway: one cannot hide a cycle)."""
    graph = import_graph(PACKAGE)
    offenders = {module: sorted({f"{arrow.target} (l.{arrow.line})" for arrow in arrows if arrow.kind == "function"})
                 for module, arrows in graph.items() if module not in FUNCTION_LEVEL_IMPORTS_ALLOWED}
    assert {module: found for module, found in offenders.items() if found} == {}


def test_the_registry_and_the_worker_never_reach_events():
    """The registry sits below ``Events``, and so does the worker: the pool's children import the runner
    and the registry, never the registration API (nor ``kombu_events/__init__.py``, which imports it)."""
    graph = import_graph(PACKAGE)
    events = {"kombu_events", "kombu_events.events"}
    worker = {module for module in graph if module.startswith("kombu_events.worker")}
    assert reachable(graph, "kombu_events.registry") & (events | worker) == set()
    assert {module: sorted(reachable(graph, module) & events) for module in worker
            if reachable(graph, module) & events} == {}


# The graph itself, on packages made up for the test.

FAKE = {
    "__init__.py": "from .b import thing\n",
    "a.py": "import os\nfrom . import b, sub\nfrom .b import thing\n",
    "b.py": ("from typing import TYPE_CHECKING\n"
             "if TYPE_CHECKING:\n    from .sub.c import C\n"
             "try:\n    import pkg.sub.d\nexcept ImportError:\n    pass\n"
             "def f():\n    from pkg import a\n"),
    "sub/__init__.py": "from .. import b as _b\nfrom .. import thing\n",
    "sub/c.py": "from pkg.sub import d\nclass C:\n    from ..a import x\n",
    "sub/d.py": "",
}


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    return tmp_path / "pkg"


def test_every_form_and_place_of_an_import_is_an_arrow(tmp_path: Path):
    graph = import_graph(_package(tmp_path, FAKE))
    assert {module: sorted(arrows) for module, arrows in graph.items()} == {
        "pkg": [Arrow("pkg.b", 1, "module")],  # from .b import thing: the module b
        "pkg.a": [Arrow("pkg.b", 2, "module"), Arrow("pkg.b", 3, "module"), Arrow("pkg.sub", 2, "module")],
        "pkg.b": [Arrow("pkg.a", 9, "function"), Arrow("pkg.sub.c", 3, "type_checking"),
                  Arrow("pkg.sub.d", 5, "module")],  # import pkg.sub.d, inside a try
        "pkg.sub": [Arrow("pkg", 2, "module"), Arrow("pkg.b", 1, "module")],  # from .. import thing: the package
        "pkg.sub.c": [Arrow("pkg.a", 3, "module"), Arrow("pkg.sub.d", 1, "module")],  # a class body runs at import
        "pkg.sub.d": [],
    }


def test_a_cycle_is_found_and_told_with_its_lines(tmp_path: Path):
    graph = import_graph(_package(tmp_path, {
        "__init__.py": "",
        "a.py": "from .b import x\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n",
        "c.py": "def f():\n    from . import d\n",
        "d.py": "import pkg.c\n",
        "e.py": "from . import a, c, d\n",
    }))
    found = cycles(graph)
    assert found == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.c", "pkg.d", "pkg.c"]]
    files = module_files(tmp_path / "pkg")
    assert describe(found[0], graph, files).splitlines() == [
        "pkg.a", "  -> pkg.b  [pkg/a.py:1]", "  -> pkg.a  [pkg/b.py:3 (type_checking)]"]
    assert describe(found[1], graph, files).splitlines() == [
        "pkg.c", "  -> pkg.d  [pkg/c.py:2 (function)]", "  -> pkg.c  [pkg/d.py:1]"]


def test_the_shortest_way_round_a_tangle(tmp_path: Path):
    graph = import_graph(_package(tmp_path, {
        "__init__.py": "", "a.py": "from . import b, c\n", "b.py": "from . import c\n", "c.py": "from . import a\n"}))
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.a"]]
    without = _package(tmp_path / "x", {"__init__.py": "", "a.py": "from . import b\n", "b.py": ""})
    assert cycles(import_graph(without)) == []
