"""Every module of the package reads in one sitting: none over 400 lines, no function or method over 50
(STYLE.md, habit 10, with room to spare). Counted from the source with ``ast``: a module's lines as the file
holds them; a function's from its ``def`` to its last line (``end_lineno - lineno + 1``, its docstring in,
its decorators out), methods and nested functions each on their own. Each failure names every offender."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import kombu_events

PACKAGE = Path(kombu_events.__file__).parent

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 50


class Function(NamedTuple):
    """One function or method: its dotted name within its module, its first line and its length in lines."""

    name: str
    line: int
    length: int


def module_paths() -> list[Path]:
    """Every module of the package, at any depth."""
    return sorted(PACKAGE.rglob("*.py"))


def shown(path: Path) -> str:
    """``kombu_events/ops/archive.py``: a module as the failure names it."""
    return path.relative_to(PACKAGE.parent).as_posix()


def functions(tree: ast.AST, prefix: str = "") -> list[Function]:
    """Every function of ``tree``, methods (``Class.method``) and nested functions (``outer.inner``) too."""
    found: list[Function] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno is not None
            found.append(Function(prefix + node.name, node.lineno, node.end_lineno - node.lineno + 1))
            found.extend(functions(node, f"{prefix}{node.name}."))
        elif isinstance(node, ast.ClassDef):
            found.extend(functions(node, f"{prefix}{node.name}."))
        else:
            found.extend(functions(node, prefix))
    return found


def test_no_module_is_over_400_lines():
    offenders = []
    for path in module_paths():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_MODULE_LINES:
            offenders.append(f"{shown(path)}: {lines} lines")
    assert not offenders, (f"modules over {MAX_MODULE_LINES} lines (split each by what it does):\n  "
                           + "\n  ".join(offenders))


def test_no_function_is_over_50_lines():
    offenders = []
    for path in module_paths():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        offenders.extend(f"{shown(path)}:{f.line} {f.name}: {f.length} lines" for f in functions(tree)
                         if f.length > MAX_FUNCTION_LINES)
    assert not offenders, (f"functions over {MAX_FUNCTION_LINES} lines (split the work they do):\n  "
                           + "\n  ".join(offenders))


def test_a_function_is_counted_from_its_def_to_its_last_line_methods_and_nested_ones_apart():
    body = "\n".join(f"        x{i} = {i}" for i in range(3))
    source = (f"class A:\n    @property\n    def long(self):\n        '''Doc.'''\n{body}\n\n"
              "    async def short(self):\n        def inner():\n            pass\n")
    assert functions(ast.parse(source)) == [Function("A.long", 3, 5), Function("A.short", 9, 3),
                                            Function("A.short.inner", 10, 2)]
