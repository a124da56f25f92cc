"""core/ does no I/O: no module of it imports the standard library's sockets, processes or HTTP clients.

import-linter's ``core-does-no-io`` contract (setup.cfg) forbids the third-party clients (amqp, celery,
sqlalchemy...), but it does not see the standard library: this reads every core module's imports.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[3] / "kombu_events" / "core"

#: Standard library modules that open sockets, files of other processes or connections.
FORBIDDEN = ("socket", "ssl", "select", "selectors", "subprocess", "multiprocessing", "http", "urllib.request",
             "sqlite3", "asyncio", "threading")


def imported(source: str) -> set[str]:
    """Every module a Python source imports (``from x import y`` counts as ``x``), relative ones left out."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return found


def forbidden_in(source: str) -> set[str]:
    return {name for name in imported(source)
            if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN)}


@pytest.mark.parametrize("module", sorted(CORE.glob("*.py")), ids=lambda path: path.name)
def test_no_core_module_imports_a_standard_library_io_module(module):
    assert forbidden_in(module.read_text()) == set()


@pytest.mark.parametrize("planted, found", [
    ("import socket", {"socket"}),
    ("from urllib.request import urlopen", {"urllib.request"}),
    ("def f():\n    import subprocess", {"subprocess"}),  # inside a function too
    ("from urllib.parse import quote", set()),  # parsing is pure
])
def test_a_planted_import_is_found(planted, found):
    source = (CORE / "ladder.py").read_text() + "\n" + planted + "\n"
    assert forbidden_in(source) == found
