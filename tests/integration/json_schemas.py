"""Validate a command's ``--json`` output against its JSON Schema (kombu_events/cli/schemas/<name>.json)."""
from __future__ import annotations

import json
from typing import Any

from jsonschema import Draft202012Validator

from kombu_events.cli.common import schema


def assert_valid(name: str, document: Any) -> Any:
    """``document`` if it validates against schema ``name``, else fail with every error, located."""
    errors = sorted(Draft202012Validator(schema(name)).iter_errors(document), key=str)
    assert not errors, f"{name}.json: " + "; ".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)
    return document


def one_document(name: str, stdout: str) -> Any:
    """The one JSON document that is the whole of ``stdout``, validated against schema ``name``."""
    return assert_valid(name, json.loads(stdout))


def json_lines(name: str, stdout: str) -> list[Any]:
    """Each line of ``stdout`` (JSON Lines), each validated against schema ``name``."""
    return [assert_valid(name, json.loads(line)) for line in stdout.splitlines()]
