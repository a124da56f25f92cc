"""The Python examples of README.md and docs/, read from the Markdown as they are written.

Every ```` ```python ```` block of README.md and of the pages under docs/ (``docs/*.md``,
``docs/howto/``, ``docs/migrating/``), and every Python file a page shows with
``{literalinclude}``, is one :class:`Block`. What its test does with it depends on how
the Markdown marks it, visibly, after the language:

- ```` ```python ```` -- a **complete** example: it runs as it is, as a module of its
  own. If its first line names a file (``# proj/events.py``), that is the module's
  path, and other blocks of the page may import it (``from proj.events import events``).
- ```` ```python continued ```` -- a **continuation**: it runs in the module of the
  page's previous complete block, after it (README's periodic event adds to
  ``proj/events.py``).
- ```` ```python fragment ```` -- a **fragment**: a snippet that needs context it does
  not show (an ``app``, a ``payments`` client, a writable directory). It is compiled,
  and type-checked with ``app`` and ``events`` declared and other missing names taken
  as ``Any``; it is not run.

A ``{code-block} python`` directive (the side-by-side comparisons of the migration
guides) says the same with its ``:class:`` option: ``:class: fragment`` or
``:class: continued``. A block of another library's code is a fragment.

This module only reads the pages and writes the blocks out as files: the unit test
(tests/unit/test_doc_examples.py) compiles and runs them against the test kit's stub,
and ``tox -e type`` (tests/typing/check_doc_examples.py) type-checks them with mypy. It
imports nothing of kombu_events, so that the type check's process does not either.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]

COMPLETE, CONTINUED, FRAGMENT = "complete", "continued", "fragment"
MARKERS = (CONTINUED, FRAGMENT)

#: ``# proj/events.py`` (then a space, or nothing) on a block's first line: the file it is.
_FILE_HEADER = re.compile(r"#\s*([\w./-]+\.py)(?=[\s;,:]|$)")
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


def pages() -> list[Path]:
    """README.md, then every page of the documentation site's sources, in a fixed order."""
    docs = ROOT / "docs"
    return [ROOT / "README.md", *sorted(docs.glob("*.md")), *sorted(docs.glob("howto/*.md")),
            *sorted(docs.glob("migrating/*.md"))]


@dataclass(frozen=True)
class Block:
    """One Python example: where it is, what it says, and how it is marked."""

    page: str                 # relative to the repository: README.md, docs/tutorial.md
    line: int                 # the page's line of the code's first line (1-based)
    code: str
    kind: str                 # COMPLETE, CONTINUED or FRAGMENT
    markers: tuple[str, ...] = ()   # the words after ``python`` (or of ``:class:``), as written
    included: str | None = None     # the file of a {literalinclude}, relative to the repository

    @property
    def where(self) -> str:
        return f"{self.included or self.page}:{self.line}"

    @property
    def file(self) -> str | None:
        """The path its first line names (``proj/events.py``), or an included file's name."""
        if self.included is not None:
            return Path(self.included).name
        first = self.code.split("\n", 1)[0]
        found = _FILE_HEADER.fullmatch(first) or _FILE_HEADER.match(first)
        return found.group(1) if found else None


@dataclass
class Module:
    """A complete block and its continuations: one module, written to ``path`` and imported as ``name``."""

    page: str
    name: str
    path: str                                 # relative to the page's root directory
    blocks: list[Block] = field(default_factory=list)

    @property
    def where(self) -> str:
        return self.blocks[0].where

    @property
    def source(self) -> str:
        """The blocks one after the other, each on the lines it has on its page (blank lines between),
        so that a line number in a traceback or a mypy message is the page's; an included file as it is."""
        return padded(self.blocks)


def padded(some: list[Block], *, head: str = "") -> str:
    """``some`` blocks of one page, each starting on its page line, ``head`` on the first lines."""
    if len(some) == 1 and some[0].included:
        return some[0].code
    text = head
    for block in some:
        used = text.count("\n")
        if used > block.line - 1:
            raise ValueError(f"{block.where}: no room for the lines before it ({used} used)")
        text += "\n" * (block.line - 1 - used) + block.code
    return text


def blocks(page: Path) -> list[Block]:
    """The Python blocks of ``page``, in order."""
    return list(_blocks(page))


def _blocks(page: Path) -> Iterator[Block]:
    relative = page.relative_to(ROOT).as_posix()
    lines = page.read_text(encoding="utf-8").split("\n")
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence, info = opening["indent"], opening["fence"], opening["info"].strip()
        end = i + 1
        while end < len(lines) and not re.fullmatch(
                re.escape(indent) + re.escape(fence[0]) + f"{{{len(fence)},}}\\s*", lines[end]):
            end += 1
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end]]
        words = info.split()
        if words[:1] == ["python"]:
            yield _block(relative, i + 2, "\n".join(body) + "\n", tuple(words[1:]))
        elif words[:2] == ["{code-block}", "python"]:
            options, first = _directive_options(body)
            markers = tuple(options.get("class", "").split())
            yield _block(relative, i + 2 + first, "\n".join(body[first:]) + "\n", markers)
        elif words[:1] == ["{literalinclude}"] and len(words) == 2 and words[1].endswith(".py"):
            included = (page.parent / words[1]).resolve().relative_to(ROOT).as_posix()
            code = (ROOT / included).read_text(encoding="utf-8")
            yield Block(relative, 1, code, COMPLETE, (), included)
        i = end + 1


def _directive_options(body: list[str]) -> tuple[dict[str, str], int]:
    """A MyST directive's ``:name: value`` lines at the top of ``body``; the index of its first content line."""
    options: dict[str, str] = {}
    n = 0
    while n < len(body) and (found := re.fullmatch(r":([\w-]+):\s*(.*)", body[n].strip())):
        options[found.group(1)] = found.group(2)
        n += 1
    while n < len(body) and not body[n].strip():
        n += 1
    return options, n


def _block(page: str, line: int, code: str, markers: tuple[str, ...]) -> Block:
    kinds = [m for m in markers if m in MARKERS]
    return Block(page, line, code, kinds[0] if len(kinds) == 1 else COMPLETE, markers)


def bad_markers(block: Block) -> str | None:
    """Why the block's markers are not what this module understands, or None."""
    unknown = [m for m in block.markers if m not in MARKERS]
    if unknown:
        return f"{block.where}: unknown marker(s) {unknown} after python: use one of {list(MARKERS)}"
    if len(block.markers) > 1:
        return f"{block.where}: several markers {list(block.markers)}: use one of {list(MARKERS)}"
    return None


def slug(page: str) -> str:
    """A module-name-safe name for a page: docs/howto/pools.md -> docs_howto_pools."""
    return re.sub(r"\W", "_", page[:-3] if page.endswith(".md") else page).lower()


def modules(page_blocks: list[Block]) -> list[Module]:
    """The page's runnable modules: each complete block with the continuations after it.

    A block that names its file (``# proj/events.py``) is written there and imported by
    that name (``proj.events``), the page's modules side by side. A file of the repository
    (``# docs/examples/billing.py``, which docs/testing.md shows in full) is a project of
    its own, run from its directory: it is imported by its name there (``billing``), as is
    an included file. Other complete blocks become ``example_<page>_<line>``. Raises
    ValueError for a continuation with nothing before it to continue.
    """
    found: list[Module] = []
    for block in page_blocks:
        if block.kind == FRAGMENT:
            continue
        if block.kind == CONTINUED:
            if not found:
                raise ValueError(f"{block.where}: a continued block with no complete block before it on its page")
            found[-1].blocks.append(block)
            continue
        file = block.file
        if file and (block.included or (ROOT / file).is_file()):
            path = Path(file).name
        elif file:
            path = file
        else:
            path = f"example_{slug(block.page)}_{block.line}.py"
        found.append(Module(block.page, path[:-3].replace("/", "."), path, [block]))
    return found


def write_page(page_blocks: list[Block], into: Path) -> list[Module]:
    """Write the page's modules (and the packages they sit in) under ``into``; return them."""
    found = modules(page_blocks)
    for module in found:
        target = into / module.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(module.source, encoding="utf-8")
    return found


#: ``kombu-events -A proj.events publish orders.42.created '{"order_id": 42}'`` in a shell block.
_PUBLISH = re.compile(r"kombu-events\s+(?:-A|--app)[ =](\S+)\s+publish\s")


def shell_lines(page: Path) -> list[tuple[int, str]]:
    """The commands of the page's ``shell`` blocks: (line, command), comments and prompts left out."""
    found = []
    lines = page.read_text(encoding="utf-8").split("\n")
    inside = False
    for number, line in enumerate(lines, 1):
        opening = _FENCE.match(line)
        if opening is not None:
            inside = not inside and opening["info"].strip().split()[:1] in (["shell"], ["console"], ["bash"])
            continue
        if inside and line.strip() and not line.lstrip().startswith("#"):
            found.append((number, line.strip().removeprefix("$ ")))
    return found


@dataclass(frozen=True)
class ShellPublish:
    """``kombu-events -A APP publish KEY JSON`` as a page shows it."""

    where: str
    app: str
    routing_key: str
    body: str


def shell_publishes(page: Path) -> list[ShellPublish]:
    """Every ``kombu-events -A APP publish KEY JSON`` of the page's shell blocks."""
    relative = page.relative_to(ROOT).as_posix()
    found = []
    for number, command in shell_lines(page):
        if _PUBLISH.search(command) is None:
            continue
        words = shlex.split(command, comments=True)
        start = words.index("kombu-events")
        words = words[start:]
        app = words[words.index("-A") + 1] if "-A" in words else words[words.index("--app") + 1]
        rest = words[words.index("publish") + 1:]
        positional = [w for w in rest if not w.startswith("-")]
        found.append(ShellPublish(f"{relative}:{number}", app, positional[0], positional[1]))
    return found


def app_options(page: Path) -> list[tuple[str, str]]:
    """(``page:line``, APP) of every ``celery -A APP`` and ``kombu-events -A APP`` of the page, in code
    blocks and in the prose's code spans alike."""
    relative = page.relative_to(ROOT).as_posix()
    found = []
    for number, line in enumerate(page.read_text(encoding="utf-8").split("\n"), 1):
        for match in re.finditer(r"\b(?:celery|kombu-events)(?:\s+worker)?\s+(?:-A|--app)[ =]([^\s`'\")]+)", line):
            found.append((f"{relative}:{number}", match.group(1)))
    return found
