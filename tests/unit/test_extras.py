"""The extras a new user installs bring what the docs then use: ``pip install '.[sqlalchemy]'`` brings psycopg 3, the
driver of every ``postgresql+psycopg://`` URL of the docs (its binary wheel: no libpq, no compiler); and
docs/install.md's table of extras lists exactly the requirements setup.cfg gives each extra."""
from __future__ import annotations

import configparser
import re
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def extras() -> dict[str, list[Requirement]]:
    """setup.cfg's ``[options.extras_require]``, each requirement parsed."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg", encoding="utf-8")
    return {name: [Requirement(line) for line in value.strip().splitlines() if line.strip()]
            for name, value in config["options.extras_require"].items()}


def names(requirements: list[Requirement]) -> dict[str, Requirement]:
    return {r.name.lower(): r for r in requirements}


def test_the_sqlalchemy_extra_brings_the_postgresql_driver_the_docs_use():
    sqlalchemy = names(extras()["sqlalchemy"])
    assert set(sqlalchemy) == {"sqlalchemy", "psycopg"}
    assert sqlalchemy["psycopg"].extras == {"binary"} and str(sqlalchemy["psycopg"].specifier) == ">=3.1"
    used = {page.relative_to(ROOT).as_posix() for page in [ROOT / "README.md", *ROOT.glob("docs/**/*.md")]
            if "postgresql+psycopg://" in page.read_text(encoding="utf-8")}
    assert "docs/effectively-once.md" in used  # what the extra is for


def test_the_django_extra_brings_no_driver_the_project_has_its_own():
    assert set(names(extras()["django"])) == {"django"}
    rows = (ROOT / "docs" / "install.md").read_text().splitlines()
    row = next(line for line in rows if line.startswith("| `django`"))
    assert "No database driver" in row


def test_the_install_page_lists_what_each_extra_brings():
    table = {}
    for line in (ROOT / "docs" / "install.md").read_text(encoding="utf-8").splitlines():
        found = re.match(r"\| `([\w-]+)` \| (.*?) \|", line)
        if found and found.group(1) in extras():
            table[found.group(1)] = re.findall(r"`([^`]+)`", found.group(2))
    for extra, requirements in extras().items():
        if extra == "test":
            continue  # "the list is in setup.cfg"
        assert sorted(table.get(extra, [])) == sorted(str(r) for r in requirements), \
            f"docs/install.md's row of the {extra!r} extra: {table.get(extra)}"
