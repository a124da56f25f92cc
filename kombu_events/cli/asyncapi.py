"""The ``asyncapi`` command: the service's AsyncAPI 3.0 document (what it receives and sends), as YAML or
JSON, on stdout or into a file; it connects to nothing."""
from __future__ import annotations

from pathlib import Path

import click

from ..errors import KombuEventsError
from ..ops.asyncapi import FORMATS, document, render
from .common import Context, examples, guarded


@click.command("asyncapi")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="yaml", show_default=True,
              help="YAML (written by kombu-events itself, no PyYAML needed) or JSON.")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the document to this file (replaced) instead of stdout.")
@click.option("--api-version", default="1.0.0", show_default=True,
              help="The document's info.version: the version of the service's events.")
@click.pass_obj
@guarded
def asyncapi(obj: Context, fmt: str, output: Path | None, api_version: str) -> None:
    """Print the service's AsyncAPI 3.0 document: its handlers, publications and payload schemas.

    Built from the code alone: nothing is declared, no broker is contacted. The
    broker's user name and password are left out. The same service always gives the
    same text, so a committed document diffs cleanly.
    """
    text = render(document(obj.events, broker_url=obj.broker, version=api_version), fmt)
    if output is None:
        click.echo(text, nl=False)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise KombuEventsError(f"cannot write the AsyncAPI document to {output}: {exc.strerror or exc}") from exc


examples(asyncapi,
         "kombu-events -A proj.events asyncapi                      # YAML on stdout",
         "kombu-events -A proj.events asyncapi --format json -o asyncapi.json",
         "kombu-events -A proj.events asyncapi -o asyncapi.yaml   # commit it: it diffs cleanly",
         "kombu-events -A proj.events asyncapi --api-version 2.1.0   # info.version")
