"""Every replay form of the console starts as a dry run: its "dry run" box is ticked, on the event page as on the
failures page, so that a click shows what would be sent where before anything is (the integration test
test_replay_not_found.py reads the event page as served)."""
from __future__ import annotations

import re
from importlib import resources


def test_every_dry_run_box_of_the_console_is_ticked():
    templates = resources.files("kombu_events.console").joinpath("templates")
    boxes = {entry.name: re.findall(r'<input type="checkbox" name="dry_run"[^>]*>', entry.read_text(encoding="utf-8"))
             for entry in templates.iterdir() if entry.name.endswith(".html")}
    assert {"event.html", "failures.html"} <= {name for name, found in boxes.items() if found}
    unticked = {name: found for name, found in boxes.items() for box in found if not re.search(r"\bchecked\b", box)}
    assert not unticked, f"dry run boxes not ticked: {unticked}"
