"""Every command's --help ends with examples, and every example names real commands and options."""
from __future__ import annotations

import shlex
from typing import Iterator

import click
import pytest
from click.testing import CliRunner

from kombu_events.cli import cli


def walk(command: click.Command, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    """``command`` and every sub-command under it, each with its path of names."""
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            yield from walk(sub, (*path, name))


COMMANDS = dict(walk(cli))
PATHS = list(COMMANDS)


def help_of(path: tuple[str, ...]) -> str:
    result = CliRunner().invoke(cli, [*path, "--help"], prog_name="kombu-events")
    assert result.exit_code == 0, result.output
    return result.output


def examples(text: str) -> list[str]:
    return [line.strip() for line in text.split("Examples:", 1)[-1].splitlines() if line.strip()]


def test_the_walk_finds_every_command():
    assert {" ".join(p) for p in PATHS} >= {"", "declare", "status", "archive", "archive list", "archive show",
                                           "archive replay", "archive purge", "publish", "schedules", "health",
                                           "migrate", "backlog", "backlog status", "backlog flush"}


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "kombu-events")
def test_every_help_ends_with_examples_of_the_command(path):
    text = help_of(path)
    assert "Examples:" in text
    lines = examples(text)
    assert lines and all(line.startswith("kombu-events ") for line in lines), lines
    assert not path or all(f" {' '.join(path)} " in f"{line} " for line in lines), lines


@pytest.mark.parametrize("line", sorted({line for c in COMMANDS.values() for line in examples(c.epilog or "")}))
def test_every_example_parses(line):
    """Misspelt commands and options fail the parse that runs before --help (arguments are not checked)."""
    args = shlex.split(line, comments=True)[1:]
    result = CliRunner().invoke(cli, [*args, "--help"], prog_name="kombu-events")
    assert result.exit_code == 0 and result.output.startswith("Usage: kombu-events"), result.output
