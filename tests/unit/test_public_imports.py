"""What the README and the docs tell users to import comes from ``kombu_events`` or a documented subpackage,
never from an internal folder (core, worker, broker, ops, integrations...), which may move."""
from __future__ import annotations

import ast
import importlib

import pytest

from tests.doc_examples import blocks, pages

#: The public surface below ``kombu_events`` itself (docs/api.md).
PUBLIC = {"kombu_events", "kombu_events.testing", "kombu_events.tracing", "kombu_events.metrics",
          "kombu_events.django", "kombu_events.database", "kombu_events.console", "kombu_events.signals"}


def imports_of(code: str) -> list[str]:
    """The kombu_events modules a block imports from (``from kombu_events.x import y`` -> ``kombu_events.x``)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []  # a fragment with `...`: test_doc_examples checks it compiles where it must
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kombu_events":
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "kombu_events"]
    return found


def internal(module: str) -> bool:
    return not any(module == public or (module.startswith(public + ".") and public != "kombu_events")
                   for public in PUBLIC)


def test_no_page_imports_from_an_internal_folder():
    found = [f"{block.where}: {module}" for page in pages() for block in blocks(page)
             for module in imports_of(block.code) if internal(module)]
    assert found == []


@pytest.mark.parametrize("code, bad", [
    ("from kombu_events.core.settlement import Step", ["kombu_events.core.settlement"]),
    ("import kombu_events.worker.runner", ["kombu_events.worker.runner"]),
    ("from kombu_events import Step\nfrom kombu_events.testing import running_worker", []),
    ("from kombu_events.database import Inbox", []),
])
def test_an_internal_import_is_found(code, bad):
    assert [m for m in imports_of(code) if internal(m)] == bad


@pytest.mark.parametrize("name", ["Step", "DEFERRED", "CircuitBreaker", "InvalidPayload", "Outcome"])
def test_what_the_docs_import_is_exported_at_the_top(name):
    assert name in importlib.import_module("kombu_events").__all__
