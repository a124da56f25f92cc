"""Sphinx configuration of the kombu-events documentation site (``tox -e docs``).

The Markdown pages are read by MyST as they are; the API reference comes from the
docstrings; the topology picture is generated at build time by the real CLI,
``kombu-events -A shop declare --dry-run --format dot``, from the tutorial's example
service in ``_examples/shop.py``, and drawn by Graphviz's ``dot``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
# The metrics extra (kombu-events[prometheus]) is not installed to build the site.
autodoc_mock_imports: list[str] = ["prometheus_client"]

graphviz_output_format = "svg"

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


def setup(app: object) -> None:
    """Generate the topology picture before the pages are read."""
    _topology_dot()
