"""tests/unit mirrors the package: the tests of ``kombu_events/<folder>/<name>.py`` are in
``tests/unit/<folder>/test_<name>.py`` (docs/architecture.md, "Where a change goes").

Tests of a top-level module (``events.py``, ``errors.py``...) or of the whole package sit in tests/unit itself;
any other test file sits in a folder the package has, so that a folder of tests never names code that is not
there (after a move or a rename in the package, its tests follow). Each folder is a package (``__init__.py``):
test modules of the same name in two folders stay apart, and relative imports between them work.
"""
from __future__ import annotations

from pathlib import Path

import kombu_events

TESTS = Path(__file__).resolve().parent
PACKAGE = Path(kombu_events.__file__).resolve().parent


def misplaced(tests: Path, package: Path) -> list[str]:
    """The test files under ``tests`` whose folder is no package folder (with ``__init__.py``) of ``package``."""
    return sorted(path.relative_to(tests).as_posix() for path in tests.rglob("test_*.py")
                  if path.parent != tests
                  and not (package / path.parent.relative_to(tests) / "__init__.py").is_file())


def without_init(tests: Path) -> list[str]:
    """The folders under ``tests`` that hold Python files but no ``__init__.py``."""
    return sorted({path.parent.relative_to(tests).as_posix() for path in tests.rglob("*.py")
                   if not (path.parent / "__init__.py").is_file()})


def test_every_folder_of_tests_is_a_folder_of_the_package():
    assert misplaced(TESTS, PACKAGE) == [], f"tests/unit/<folder>/ must name a folder of {PACKAGE.name}/"


def test_every_folder_of_tests_is_a_package():
    assert without_init(TESTS) == []


def test_a_planted_folder_is_found(tmp_path):
    package, tests = tmp_path / "pkg", tmp_path / "tests"
    for name in ("pkg/__init__.py", "pkg/core/__init__.py", "pkg/console/static/app.js", "tests/test_events.py",
                 "tests/core/test_codec.py", "tests/foo/test_bar.py", "tests/core/deep/test_x.py",
                 "tests/console/static/test_js.py", "tests/core/helpers.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert misplaced(tests, package) == ["console/static/test_js.py", "core/deep/test_x.py", "foo/test_bar.py"]
    assert without_init(tests) == [".", "console/static", "core", "core/deep", "foo"]
