"""Sphinx configuration of the kombu-events documentation site (``tox -e docs``).

The Markdown pages are read by MyST as they are; the API reference comes from the
docstrings; the topology picture is generated at build time by the real CLI,
``kombu-events -A shop declare --dry-run --format dot``, from the tutorial's example
service in ``_examples/shop.py``, and drawn by Graphviz's ``dot``. The architecture
picture is generated at build time too: the rows are the layers of import-linter's
contract in ``setup.cfg``, the arrows the imports the package's source has (read with
``ast``), so it changes when either does.
"""
from __future__ import annotations

import ast
import configparser
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.util.nodes import make_refnode

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # autodoc imports the package from this checkout

import kombu_events  # noqa: E402

project = "kombu-events"
author = "the kombu-events developers"
copyright = "the kombu-events developers"  # noqa: A001 (Sphinx's name)
release = version = kombu_events.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.graphviz",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_examples", "_generated", ".venv"]

# The pages link to each other as files (``[operations.md](operations.md)``) so that
# they read on GitHub too; MyST turns those links and their ``#anchors`` into references.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# Defaults as the source writes them (``rand=random.random``, not ``<built-in method random of
# Random object at 0x…>``, which is no Python: the signature's parser then splits it at every comma).
autodoc_preserve_defaults = True
# The metrics extra (kombu-events[prometheus]) is not installed to build the site.
autodoc_mock_imports: list[str] = ["prometheus_client"]

# `-n` (tox -e docs): every reference must resolve. No intersphinx (the build has no network), so the
# few objects of the standard library and of other packages that signatures name are listed here;
# everything of kombu_events is documented in api.md instead.
nitpick_ignore = [
    ("py:class", "os.PathLike"),  # Backlog(path: str | PathLike[str])
    ("py:class", "datetime.datetime"),  # Retry(at=...), Events.periodic(start=...)
    ("py:class", "datetime.timedelta"),  # Events.periodic(every=..., retire_after=...)
    ("py:class", "contextlib.AbstractContextManager"),  # the Middleware.handling() hook's return type
    ("py:class", "kombu.entity.Exchange"),  # Topology's entities are kombu's, unbound
    ("py:class", "kombu.entity.Queue"),
    ("py:class", "amqp.basic_message.Message"),  # BacklogPublisher.publish_or_store(message=...)
    ("py:class", "opentelemetry.trace.TracerProvider"),  # TracingMiddleware(tracer_provider=...)
    ("py:class", "CollectorRegistry"),  # PrometheusMetrics(registry=...): prometheus_client's, mocked
    ("py:class", "AbstractContextManager"),  # contextlib's, named bare by Middleware.handling (see below)
    ("py:class", "P"),  # Event(Generic[P]): the payload's type variable, Event[Model]
    # The database's internal protocols and status tuple, named by the signatures api.md documents
    # (kombu_events.database's functions and classes); users never build them.
    ("py:class", "Backend"),
    ("py:class", "kombu_events.database.backends.Backend"),
    ("py:class", "kombu_events.database.backends.Transaction"),
    ("py:class", "kombu_events.database.outbox.OutboxStatus"),
    # An ordered handler's options as the Handler keeps them (docs/ordering.md documents the options).
    ("py:class", "kombu_events.core.ordering.Ordering"),
]

graphviz_output_format = "svg"
# Every picture laid out at most 7.5 in (720 px) wide, the text column at 1280 px: ``ratio=compress``
# packs the layout into that width instead of scaling it down, so labels keep their size. (One that
# cannot be packed is scaled down: check_site.py fails if its labels get under 11 px on screen.)
graphviz_dot_args = ["-Gratio=compress", "-Gsize=7.5,100"]

html_theme = "furo"
html_title = f"kombu-events {release}"
html_static_path = ["_static"]
html_css_files = ["site.css"]
html_show_sourcelink = False
pygments_style = "friendly"
pygments_dark_style = "monokai"


def _topology_dot() -> None:
    """Write ``_generated/shop-topology.dot`` with the CLI, as a user would run it."""
    out = HERE / "_generated" / "shop-topology.dot"
    out.parent.mkdir(exist_ok=True)
    command = [sys.executable, "-c", "from kombu_events.cli import main; main()",
               "-A", "shop", "declare", "--dry-run", "--format", "dot"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(command, cwd=HERE / "_examples", env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[3:])} failed ({result.returncode}):\n{result.stderr}")
    out.write_text(result.stdout)


PACKAGE = HERE.parent / "kombu_events"
ROOT = "__init__"  # the package's own __init__.py, which imports the public names: in no layer


def _layers() -> list[tuple[list[str], bool]]:
    """The rows of setup.cfg's layers contract on ``kombu_events``, top to bottom: (names, independent)."""
    config = configparser.ConfigParser(interpolation=None)
    config.read(HERE.parent / "setup.cfg", encoding="utf-8")
    for section in config.sections():
        contract = config[section]
        if (section.startswith("importlinter:contract:") and contract.get("type") == "layers"
                and contract.get("containers", "").split() == ["kombu_events"]):
            rows = [row.strip() for row in contract["layers"].splitlines() if row.strip()]
            return [([name.strip().strip("()") for name in re.split(r"[|:]", row)], ":" not in row) for row in rows]
    raise RuntimeError("setup.cfg has no import-linter layers contract with containers = kombu_events")


def _folder_imports() -> dict[tuple[str, str], list[str]]:
    """Every import between two of the package's top-level modules and folders (or its ``__init__``),
    wherever it sits (module level, ``if TYPE_CHECKING:``, a function), with the file:line of each."""
    tops = {path.stem if path.suffix == ".py" else path.name for path in PACKAGE.iterdir()
            if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").is_file()}
    arrows: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ["kombu_events", *path.relative_to(PACKAGE).with_suffix("").parts]
        package = module[:-1]  # what `from .` means in it (for an __init__.py, its own package)
        importer = module[1] if len(module) > 2 or module[-1] != "__init__" else ROOT
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                source = ".".join([*base, *([node.module] if node.module else [])])
                names = [f"{source}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] != "kombu_events":
                    continue
                imported = parts[1] if len(parts) > 1 and parts[1] in tops else ROOT  # `from .. import __version__`
                where = f"{path.relative_to(PACKAGE).as_posix()}:{node.lineno}"
                if imported != importer and where not in arrows.setdefault((importer, imported), []):
                    arrows[importer, imported].append(where)
    return arrows


def _summary(name: str) -> str:
    """The first sentence of a top-level module's or folder's docstring, as plain text (the node's tooltip)."""
    path = PACKAGE / ("__init__.py" if name == ROOT else f"{name}/__init__.py")
    if not path.is_file():
        path = PACKAGE / f"{name}.py"
    text = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    text = " ".join(text.split("\n\n")[0].split())
    text = re.sub(r":\w+:`~?([^`]*)`", r"\1", text).replace("``", "")
    return text.split(". ")[0].rstrip(".") + "."


def _label(name: str) -> str:
    if name == ROOT:
        return "kombu_events/__init__.py"
    return f"{name}/" if (PACKAGE / name).is_dir() else f"{name}.py"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _architecture() -> None:
    """Write ``_generated/architecture.dot`` and ``_generated/architecture-imports.md``.

    The picture: setup.cfg's layers as rows, top to bottom (the package's ``__init__``, in no
    layer, just above the highest row it imports), and the imports between top-level modules and
    folders as arrows. An arrow that others imply (a -> b -> c makes a -> c) is left out; an
    import the layers forbid is red, with its file:line. The table: every import, none left out.
    """
    rows = _layers()
    arrows = _folder_imports()
    independent = {name: flag for names, flag in rows for name in names}
    rank = {name: index for index, (names, _) in enumerate(rows) for name in names}
    under_root = min((rank[b] for a, b in arrows if a == ROOT and b in rank), default=len(rows))
    rows.insert(under_root, ([ROOT], True))
    rank = {name: index for index, (names, _) in enumerate(rows) for name in names}
    stray = sorted({name for arrow in arrows for name in arrow} - set(rank))  # no layer: the contract fails too
    if stray:
        rows.append((stray, True))
        rank.update(dict.fromkeys(stray, len(rows) - 1))

    def allowed(a: str, b: str) -> bool:
        if a in stray or b in stray:
            return False
        return rank[b] > rank[a] or (rank[a] == rank[b] and not independent.get(a, True))

    downward = {arrow for arrow in arrows if allowed(*arrow)}
    broken = sorted(set(arrows) - downward)

    def implied(a: str, b: str) -> bool:  # b is reached from a by other downward arrows
        todo, seen = [a], {a}
        while todo:
            here = todo.pop()
            for x, y in downward:
                if x == here and (x, y) != (a, b) and y not in seen:
                    if y == b:
                        return True
                    seen.add(y)
                    todo.append(y)
        return False

    number = 0
    lines = [
        "digraph architecture {",
        '  graph [rankdir=TB, newrank=true, ranksep=0.32, nodesep=0.3, fontname="Helvetica", bgcolor="transparent"];',
        '  node [shape=box, style="rounded,filled", fillcolor="#eef3fb", color="#4a6fa5", fontname="Helvetica",'
        ' fontsize=13, height=0.34, margin="0.14,0.04"];',
        '  edge [color="#7d8799", arrowsize=0.6, fontname="Helvetica"];',
    ]
    for index, (names, _) in enumerate(rows):
        if names == [ROOT]:
            row_label = "package"
        elif names == stray:
            row_label = "no layer"
        else:
            number += 1
            row_label = f"layer {number}"
        lines.append(f'  row{index} [shape=plaintext, style="", fontsize=11, fontcolor="#7d8799",'
                     f" label={_quote(row_label)}];")
        for name in names:
            colours = ('"#fde8e8", color="#c0392b"' if name in stray else
                       '"#f4f4f4", color="#999999"' if name == ROOT else '"#eef3fb", color="#4a6fa5"')
            lines.append(f"  {_quote(name)} [label={_quote(_label(name))}, tooltip={_quote(_summary(name))},"
                         f" fillcolor={colours}];")
        lines.append(f"  {{ rank=same; row{index}; {'; '.join(_quote(name) for name in names)}; }}")
    lines += [f"  row{index} -> row{index + 1} [style=invis];" for index in range(len(rows) - 1)]
    for a, b in sorted(downward):
        if not implied(a, b):
            lines.append(f"  {_quote(a)} -> {_quote(b)} [tooltip={_quote(', '.join(arrows[a, b]))}];")
    for a, b in broken:
        lines.append(f'  {_quote(a)} -> {_quote(b)} [color="#c0392b", fontcolor="#c0392b", penwidth=1.6,'
                     f" constraint=false, fontsize=11, label={_quote(' ' + ', '.join(arrows[a, b]))},"
                     f" tooltip={_quote(', '.join(arrows[a, b]))}];")
    lines.append("}")

    table = ["| layer | module or folder | imports, today |", "|---|---|---|"]
    number = 0
    for names, _ in rows:
        if names == [ROOT]:
            row_label = "(package)"
        elif names == stray:
            row_label = "(none)"
        else:
            number += 1
            row_label = str(number)
        for name in names:
            imported = [f"`{_label(b)}`" for a, b in sorted(downward, key=lambda arrow: rank[arrow[1]]) if a == name]
            imported += [f"**`{_label(b)}`, against the layers: {', '.join(arrows[a, b])}**"
                         for a, b in broken if a == name]
            table.append(f"| {row_label} | `{_label(name)}` | {', '.join(imported) or '—'} |")

    out = HERE / "_generated"
    out.mkdir(exist_ok=True)
    (out / "architecture.dot").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "architecture-imports.md").write_text("\n".join(table) + "\n", encoding="utf-8")


def _unqualified_names(app: Sphinx, env: object, node: addnodes.pending_xref,
                       contnode: nodes.Element) -> nodes.reference | None:
    """Resolve a bare class name that names exactly one documented object (``Control`` is
    :class:`kombu_events.middleware.control.Control`).

    Such names come from annotations autodoc cannot evaluate: a signature that names a class
    the module imports only under ``if TYPE_CHECKING:`` (``control: Control``) is left as its
    source text, every annotation of it a bare name. (``autodoc_type_aliases`` would name them,
    but Sphinx 9 prints an alias inside a generic as ``TypeAliasForwardRef('...')``.)
    """
    target = node.get("reftarget", "")
    if node.get("refdomain") != "py" or node.get("reftype") not in ("class", "obj") or "." in target:
        return None
    objects = app.env.get_domain("py").objects  # type: ignore[attr-defined]
    found = [name for name in objects if name.rsplit(".", 1)[-1] == target]
    if len(found) != 1:
        return None
    entry = objects[found[0]]
    return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, found[0])


def _dataclass_defaults(app: object, what: str, name: str, obj: object, options: object,
                        signature: str | None, return_annotation: str | None) -> tuple[str | None, str | None] | None:
    """Defaults that ``autodoc_preserve_defaults`` cannot take from the source (a dataclass's
    ``__init__`` has none), as Python: ``<class 'Exception'>`` is ``Exception``, a field's
    ``<factory>`` is ``dict()`` (its ``default_factory`` called), any other ``<...>`` repr is ``...``.
    The signature's parser fails on such reprs, and then splits the signature at every comma,
    brackets included."""
    if not signature or "<" not in signature:
        return None
    factories = [f"{field.default_factory.__qualname__}()" if isinstance(field.default_factory, type) else "..."
                 for field in getattr(obj, "__dataclass_fields__", {}).values()
                 if field.init and field.default_factory is not dataclasses.MISSING]
    signature = re.sub(r"<class '([\w.]+)'>", r"\1", signature)
    signature = re.sub(r"(=\s*)<factory>", lambda m: m[1] + (factories.pop(0) if factories else "..."), signature)
    return re.sub(r"(=\s*)<(?:[^<>]|<[^<>]*>)*>", r"\1...", signature), return_annotation


# Box-drawing characters and arrows: a literal block drawn with them is a text diagram.
_DIAGRAM = re.compile("[\u2500-\u257f\u25b2-\u25c4]")


def _mark_text_diagrams(app: object, doctree: nodes.document) -> None:
    """Give each text diagram the classes ``text-diagram`` and ``diagram-cols-N`` (its longest line,
    rounded up to a multiple of 8): site.css draws it in a font size at which it fits the column
    when 11 px or more allows that, and lets it scroll inside its box otherwise."""
    for block in doctree.findall(nodes.literal_block):
        text = block.astext()
        if block.get("language", "default") not in ("default", "none", "text") or not _DIAGRAM.search(text):
            continue
        columns = max(len(line.rstrip()) for line in text.splitlines())
        block["classes"] += ["text-diagram", f"diagram-cols-{min(160, max(64, -(-columns // 8) * 8))}"]


def _mark_text_columns(app: object, doctree: nodes.document) -> None:
    """Give the cells of a table's prose columns (40 characters or more on average) the class
    ``text-column``: on a narrow screen, site.css keeps them 12 em wide at least, so that where the
    table scrolls anyway a sentence is not squeezed into a column one word wide."""
    for group in doctree.findall(nodes.tgroup):
        rows = [[entry for entry in row.children if isinstance(entry, nodes.entry)]
                for body in group.children if isinstance(body, nodes.tbody) for row in body.children]
        if not rows or any(len(row) != group["cols"] or any(entry.get("morecols") for entry in row) for row in rows):
            continue  # spanned cells: the columns are not those of the rows
        for column in range(group["cols"]):
            if sum(len(row[column].astext()) for row in rows) >= 40 * len(rows):
                for row in rows:
                    row[column]["classes"].append("text-column")


_BACKLINK = re.compile(r'(<div class="viewcode-block" id="([^"]+)">\s*<a class="viewcode-back" href=")'
                       r'([^"#]*)#([^"]*)"')


def _viewcode_backlinks(app: Sphinx, pagename: str, templatename: str, context: dict[str, Any],
                        doctree: object) -> None:
    """Point each ``[docs]`` link of a highlighted source page at the object as it is documented.

    viewcode keeps one module name per source file (the first it met: ``kombu_events`` for
    errors.py, whose ``Retry`` api.md documents as ``kombu_events.Retry``) and builds every
    back-link of the file with it, so ``KombuEventsError``, documented by ``automodule::
    kombu_events.errors``, got ``api.html#kombu_events.KombuEventsError``: no such anchor. A
    back-link whose anchor names no documented object is pointed at ``<module>.<name>`` instead.
    """
    if not pagename.startswith("_modules/") or "body" not in context:
        return
    module = pagename.removeprefix("_modules/").replace("/", ".")
    objects = app.env.get_domain("py").objects  # type: ignore[attr-defined]

    def fix(match: re.Match[str]) -> str:
        if match[4] in objects:
            return match[0]
        entry = objects.get(f"{module}.{match[2]}")
        if entry is None:
            return match[0]  # check_site.py reports it
        return f'{match[1]}{app.builder.get_relative_uri(pagename, entry.docname)}#{entry.node_id}"'

    context["body"] = _BACKLINK.sub(fix, context["body"])


def _asyncapi_page() -> None:
    """Write ``asyncapi.md``: the tutorial's service as ``kombu-events -A shop asyncapi`` prints it."""
    sys.path.insert(0, str(HERE / "_tools"))
    from asyncapi_page import write

    write(HERE)


def setup(app: Sphinx) -> None:
    """Generate the topology and architecture pictures before the pages are read; the hooks above."""
    _topology_dot()
    _architecture()
    _asyncapi_page()
    app.connect("autodoc-process-signature", _dataclass_defaults)
    app.connect("doctree-read", _mark_text_diagrams)
    app.connect("doctree-read", _mark_text_columns)
    app.connect("html-page-context", _viewcode_backlinks)
    app.connect("missing-reference", _unqualified_names)
