"""What a new user reads is complete: the README names every capability in one line with its link and lists
every keyword argument of ``Events.handler`` in its handler table; docs/cli.md has a section for every command
and sub-command of the click CLI, naming each of its options; the visible index of the documentation site links
every page of its (hidden) tables of contents; and every relative link of README.md and docs/ reaches a file of
the repository, and a heading of it when it names one."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import click
import pytest

from kombu_events import Events
from tests.doc_examples import pages

from .cli.test_cli_help import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CLI_PAGE = ROOT / "docs" / "cli.md"
INDEX = ROOT / "docs" / "index.md"

#: Each capability a new user must be able to find from the README, and words its line must contain.
CAPABILITIES = {
    "effectively once": ("once=True", "docs/effectively-once.md"),
    "the outbox": ("outbox=True", "docs/effectively-once.md#the-outbox-outboxtrue"),
    "typed contracts": ("Typed contracts", "docs/contracts.md"),
    "envelopes": ("CloudEvents, MassTransit, NServiceBus and Spring", "docs/contracts.md#the-envelopes-other"),
    "the console": ("console", "docs/console.md"),
    "AsyncAPI": ("AsyncAPI", "docs/contracts.md#asyncapi"),
    "periodic events": ("Periodic events", "docs/scheduling.md"),
    "the publisher backlog": ("backlog", "docs/publishing.md"),
    "metrics and health": ("/metrics", "docs/operations.md#metrics"),
}

#: Pages of the site that only the build writes (docs/conf.py): no file to link to, reached by the navigation.
GENERATED = {"asyncapi"}


def _section(text: str, heading: str) -> str:
    """The lines of ``text`` under ``heading`` (a whole heading line), up to the next heading of its level or above."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.split("\n")
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if re.match(rf"#{{1,{level}}} ", lines[i])), len(lines))
    return "\n".join(lines[start:end])


def _outside_code(text: str) -> str:
    """``text`` without its fenced code blocks (a ``#`` comment in a shell block is no heading)."""
    return re.sub(r"^(`{3,}|~{3,})[^\n]*\n.*?^\1\s*$", "", text, flags=re.MULTILINE | re.DOTALL)


# -- README ---------------------------------------------------------------------------------------------------------

def test_the_readme_names_every_capability_in_one_line_with_its_link():
    lines = [line for line in _section(README.read_text(), "## What it does, one line each").split("\n")
             if line.startswith("- ")]
    for capability, (words, link) in CAPABILITIES.items():
        found = [line for line in lines if words in line and f"]({link}" in line]
        assert len(found) == 1, (f"README: no one line of 'What it does' names {capability} ({words!r}) "
                                 f"with a link to {link}")
    assert all(re.search(r"\]\([^)]+\)$", line) for line in lines), "each line ends with its link"


def test_the_readme_handler_table_has_every_keyword_argument_of_events_handler():
    parameters = [p for name, p in inspect.signature(Events.handler).parameters.items() if name != "self"]
    table = _section(README.read_text(), "## Handlers").split("\n\n| option | meaning |", 1)[1].split("\n\n", 1)[0]
    options = {name.strip("` ") for row in table.split("\n") if row.startswith("| `")
               for name in row.split("|")[1].split(" / ")}
    missing = [p.name for p in parameters if p.name not in options]
    assert not missing, f"README's handler table lacks {missing} (Events.handler takes them)"
    signature = re.search(r"`@events\.handler\((.*?)\)`", README.read_text(), flags=re.DOTALL)
    assert signature is not None
    shown = [part.strip().split("=")[0].lstrip("*") for part in signature.group(1).split(",")]
    assert shown == [p.name for p in parameters], "the signature above the table, in order"


# -- docs/cli.md ------------------------------------------------------------------------------------------------------

LEAVES = {path: command for path, command in COMMANDS.items() if path and not isinstance(command, click.Group)}


def _cli_sections() -> dict[str, str]:
    text = CLI_PAGE.read_text()
    commands = _section(text, "## Commands")
    return {m.group(1): _section(commands, m.group(0)) for m in re.finditer(r"^### `([^`]+)`$", commands, re.M)}


def test_the_cli_page_has_a_section_for_every_command_and_no_other():
    documented = set(_cli_sections())
    real = {" ".join(path) for path in LEAVES}
    assert real - documented == set(), "commands docs/cli.md does not describe (### `command` under ## Commands)"
    assert documented - real == set(), "sections of docs/cli.md for commands the CLI does not have"


@pytest.mark.parametrize("path", sorted(LEAVES), ids=" ".join)
def test_the_cli_page_names_every_option_of_the_command_in_its_section(path):
    section = _cli_sections()[" ".join(path)]
    params = [param for param in LEAVES[path].params if isinstance(param, click.Option)]
    options = [opt for param in params for opt in param.opts if opt.startswith("--")]
    missing = [opt for opt in options if not re.search(rf"`[^`]*{re.escape(opt)}\b", section)]
    assert not missing, f"docs/cli.md, `{' '.join(path)}`: options not named in its section: {missing}"
    usage = section.strip().split("\n```\n", 1)[0]
    assert usage.startswith("```\nkombu-events ") and " ".join(path) in usage, "a usage line first"
    for param in params:  # by one of its names (`-o FILE` for --output)
        assert any(re.search(rf"{re.escape(opt)}\b", usage) for opt in param.opts), \
            f"{param.opts} not in the usage line of `{' '.join(path)}`"


# -- docs/index.md -----------------------------------------------------------------------------------------------------

def test_the_visible_index_links_every_page_of_its_tables_of_contents():
    text = INDEX.read_text()
    trees = re.findall(r"^```\{toctree\}\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    entries = [line.strip() for tree in trees for line in tree.split("\n")
               if line.strip() and not line.startswith(":")]
    visible = re.sub(r"^```\{toctree\}\n.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    linked = set(re.findall(r"\]\(([^)#\s]+?)\.md(?:#[^)\s]*)?\)", visible))
    assert "effectively-once" in entries and "effectively-once" in linked
    hidden = [entry for entry in entries if entry not in linked and entry not in GENERATED]
    assert not hidden, f"docs/index.md: pages only its hidden tables of contents reach: {hidden}"


# -- links --------------------------------------------------------------------------------------------------------

def slug(heading: str) -> str:
    """A heading's anchor as MyST (myst_heading_anchors) and GitHub make it."""
    text = re.sub(r"[`*]|\[([^]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text))


def anchors(page: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", _outside_code(page.read_text()), re.MULTILINE)}


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_reaches_a_file_and_its_heading(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _outside_code(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_slug():
    assert slug("The outbox: `outbox=True`") == "the-outbox-outboxtrue"
    assert slug("Delayed publishing: one ladder per events exchange") == \
        "delayed-publishing-one-ladder-per-events-exchange"
    assert slug("Prefork, and `PROMETHEUS_MULTIPROC_DIR`") == "prefork-and-prometheus_multiproc_dir"
