"""docs/testing.md shows the example project of docs/examples/ as it is (which an integration test runs)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "testing.md"
EXAMPLES = ROOT / "docs" / "examples"
BLOCKS = re.findall(r"```python[^\n]*\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)  # fragments too
MARK = "# docs/examples/"


def test_the_page_shows_every_file_of_the_example_in_full():
    shown = {block.splitlines()[0][len(MARK):]: block.split("\n", 1)[1]
             for block in BLOCKS if block.startswith(MARK)}
    assert sorted(shown) == sorted(p.name for p in EXAMPLES.glob("*.py"))
    for name, text in shown.items():
        assert text == (EXAMPLES / name).read_text(), f"docs/testing.md shows another {name}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if not b.startswith(MARK)])
def test_every_excerpt_is_taken_from_the_example(block):
    """An excerpt may leave lines out where it says ``...``; what it shows is in the example."""
    sources = "\n".join(p.read_text() for p in EXAMPLES.glob("*.py"))
    for part in re.split(r"^ *\.\.\.\n", block, flags=re.MULTILINE):
        assert part.strip("\n") in sources, part
