"""mypy over every Python example of README.md and docs/, as a user's code: ``tox -e type`` runs this.

tests/doc_examples.py reads the blocks from the Markdown as they are written; this writes each
page's modules (a complete block with its continuations, at the paths they name) and each fragment
into a temporary directory, then runs mypy (tests/typing/mypy.ini) over them, from there, so that
``kombu_events`` is the installed package, ``py.typed`` and all, as a user's mypy sees it. Each block
keeps its page's line numbers, and each message names the page: ``README.md:27: error: ...``.

A fragment is checked with ``app`` (a Celery app) and ``events`` (an ``Events``) declared, and any
other name it leaves undefined, or module it imports that is not installed, taken as ``Any``. Pages
that define the same module (``proj.events``) are checked in separate runs of mypy.

    python tests/typing/check_doc_examples.py [MYPY OPTIONS]      # exit status: mypy's
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.doc_examples, which imports no kombu_events

from tests.doc_examples import FRAGMENT, ROOT, blocks, padded, pages, slug, write_page

HERE = Path(__file__).resolve().parent

CONTEXT = '''"""What a fragment of the docs takes as given."""
from celery import Celery

from kombu_events import Events

__all__ = ["app", "events"]

app: Celery
events: Events
'''
#: A fragment's first two lines (its page has its fence and more above it): the names it leaves undefined
#: and the modules that are not installed (another library's, in a migration guide) are Any, and so are
#: the decorators they make; ``app`` and ``events`` are what CONTEXT says.
FRAGMENT_HEAD = ('# mypy: disable-error-code="name-defined, import-not-found, import-untyped, no-redef, '
                 'untyped-decorator"\n'
                 "from _doc_context import *  # noqa: F403\n")


def write(into: Path) -> list[tuple[dict[str, str], list[Path]]]:
    """Write every page under ``into``; return the groups to check, each (file -> page, page roots)."""
    groups: list[tuple[dict[str, str], list[Path], set[str]]] = []
    for page in pages():
        found = blocks(page)
        if not found:
            continue
        name = page.relative_to(ROOT).as_posix()
        root = into / slug(name)
        root.mkdir(parents=True)
        files = {}
        for module in write_page(found, root):
            files[str(root / module.path)] = module.blocks[0].included or name
        for block in found:
            if block.kind == FRAGMENT:
                path = root / f"fragment_{slug(name)}_{block.line}.py"
                path.write_text(padded([block], head=FRAGMENT_HEAD), encoding="utf-8")
                files[str(path)] = name
        names = {_module_name(root, Path(f)) for f in files}
        group = next((g for g in groups if not g[2] & names), None)
        if group is None:
            groups.append(({}, [], set()))
            group = groups[-1]
        group[0].update(files)
        group[1].append(root)
        group[2].update(names)
    return [(files, roots) for files, roots, _names in groups]


def _module_name(root: Path, file: Path) -> str:
    return ".".join(file.relative_to(root).with_suffix("").parts)


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="doc-examples-") as tmp:
        into = Path(tmp)
        context = into / "_context"
        context.mkdir()
        (context / "_doc_context.py").write_text(CONTEXT, encoding="utf-8")
        status = 0
        for files, roots in write(into / "pages"):
            env = {**os.environ, "MYPYPATH": os.pathsep.join(str(p) for p in [*roots, context])}
            command = [sys.executable, "-m", "mypy", "--config-file", str(HERE / "mypy.ini"),
                       "--cache-dir", str(HERE / ".mypy_cache"), *argv, *sorted(files)]
            result = subprocess.run(command, cwd=into, env=env, capture_output=True, text=True)
            out = result.stdout + result.stderr
            for file, page in sorted(files.items(), key=lambda item: -len(item[0])):
                out = out.replace(os.path.relpath(file, into), page).replace(file, page)
            out = re.sub(r"^Success: .*\n", "", out, flags=re.MULTILINE)
            sys.stdout.write(out)
            status = max(status, result.returncode)
        count = sum(len(blocks(page)) for page in pages())
        print(("Success: " if status == 0 else "Failed: ") + f"mypy over the {count} Python blocks of README.md "
              "and docs/")
        return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

