"""Write the documentation page of the tutorial's AsyncAPI document, generated at build time.

    .venv/bin/python docs/_tools/asyncapi_page.py OUT_DIR     # writes OUT_DIR/asyncapi.md

docs/conf.py calls :func:`write` before the pages are read. It runs the real CLI, ``kombu-events -A shop
asyncapi``, in ``docs/_examples`` (the tutorial's service ``shop``, as ``declare --dry-run --format dot`` is run
for the topology picture), without ``RABBIT_URL`` so that the page is the same on every machine, and writes a
MyST page: what it is, the channels and operations as tables, then the whole document as YAML.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[1]
EXAMPLES = DOCS / "_examples"
PAGE = "asyncapi.md"


def write(out_dir: Path) -> Path:
    """Run ``kombu-events -A shop asyncapi`` (JSON for the tables, YAML for the listing); write the page."""
    doc = json.loads(_cli("--format", "json"))
    listing = _cli("--format", "yaml")
    out_dir.mkdir(parents=True, exist_ok=True)
    page = out_dir / PAGE
    here = out_dir.resolve()
    page.write_text(render(doc, listing, link=lambda name: Path(os.path.relpath(DOCS / name, here)).as_posix()),
                    encoding="utf-8")
    return page


def _cli(*args: str) -> str:
    """What ``kombu-events -A shop asyncapi ARGS`` prints, run from ``docs/_examples`` with this checkout."""
    command = [sys.executable, "-c", "from kombu_events.cli import main; main()", "-A", "shop", "asyncapi", *args]
    env = {key: value for key, value in os.environ.items() if key != "RABBIT_URL"}
    env["PYTHONPATH"] = os.pathsep.join([str(DOCS.parent), env.get("PYTHONPATH", "")])
    result = subprocess.run(command, cwd=EXAMPLES, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"kombu-events {' '.join(command[3:])} failed ({result.returncode}):\n{result.stderr}")
    return result.stdout


def render(doc: dict[str, Any], listing: str, *, link: Any = str) -> str:
    """The page: a title, where it comes from, the channels and operations as tables, the YAML listing.

    ``link(page)`` is the path from the page to another page of docs/ (``tutorial.md``).
    """
    service = doc["info"]["title"]
    lines = [
        f"# The AsyncAPI document of `{service}`",
        "",
        (f"This page is generated when the documentation is built: `kombu-events -A {service} asyncapi` ran on the "
         f"[tutorial]({link('tutorial.md')})'s service `{service}` (`docs/_examples/shop.py`) and wrote the "
         f"[AsyncAPI 3.0](https://www.asyncapi.com/docs/reference/specification/v3.0.0) document below, from the "
         f"code alone. Run it on yours: `kombu-events -A proj.events asyncapi -o asyncapi.yaml` "
         f"([the command]({link('cli.md')})). Each handler is a `receive` operation on a channel of its own, "
         f"its queue, with a message for each form an event may arrive in: bare JSON, or a CloudEvent in "
         f"structured or binary mode ([envelopes]({link('contracts.md')}#the-envelopes-other-ecosystems-send)); "
         f"each publication the service declares is a `send` operation on the events exchange."),
        "",
        "## Channels",
        "",
        *_channels(doc),
        "",
        "## Operations",
        "",
        *_operations(doc),
        "",
        "## The document",
        "",
        "```yaml",
        listing.rstrip("\n"),
        "```",
        "",
    ]
    return "\n".join(lines)


def _channels(doc: dict[str, Any]) -> list[str]:
    rows = ["| channel | address | AMQP | binding keys | messages |", "|---|---|---|---|---|"]
    for key, channel in doc["channels"].items():
        amqp = channel["bindings"]["amqp"]
        entity = amqp.get("queue") or amqp.get("exchange") or {}
        kind = (f"queue `{entity.get('name')}`" if amqp["is"] == "queue"
                else f"routing key on {entity.get('type')} exchange `{entity.get('name')}`")
        keys = [b["routingKey"] for b in channel.get("x-kombu-events-bindings", [])]
        address = "(each event's own key)" if channel["address"] is None else _code(channel["address"])
        rows.append(_row(_code(key), address, kind, ", ".join(map(_code, keys)) or "—",
                         ", ".join(map(_code, channel["messages"])) or "—"))
    return rows


def _operations(doc: dict[str, Any]) -> list[str]:
    rows = ["| operation | action | channel | payload | retries | summary |", "|---|---|---|---|---|---|"]
    for key, operation in doc["operations"].items():
        channel = operation["channel"]["$ref"].rsplit("/", 1)[-1]
        payloads = dict.fromkeys(_payload(doc, ref["$ref"]) for ref in operation["messages"])  # once each
        retries = _retries(operation.get("x-kombu-events-retry"))
        rows.append(_row(_code(key), operation["action"], _code(channel), ", ".join(payloads), retries,
                         operation.get("summary", "")))
    return rows


def _retries(retry: dict[str, Any] | None) -> str:
    """``2, after 1 s, 2 s``; ``none`` (max_retries=0); ``—`` for a send operation."""
    if retry is None:
        return "—"
    if not retry["maxRetries"]:
        return "none"
    return f"{retry['maxRetries']}, after " + ", ".join(f"{ms / 1000:g} s" for ms in retry["delaysMs"])


def _payload(doc: dict[str, Any], message_ref: str) -> str:
    """The schema a message's payload refers to, ``any JSON`` for an untyped one, ``bytes`` for none (a CloudEvent
    in structured mode: its ``data``'s)."""
    channel, _, name = message_ref.removeprefix("#/channels/").partition("/messages/")
    message = doc["components"]["messages"][doc["channels"][channel]["messages"][name]["$ref"].rsplit("/", 1)[-1]]
    payload = message.get("payload")
    if message.get("x-kombu-events-envelope") == "cloudevents-structured":
        payload = payload["properties"]["data"]
    if payload is None:
        return "bytes"
    return _code(payload["$ref"].rsplit("/", 1)[-1]) if "$ref" in payload else "any JSON"


def _code(text: str) -> str:
    return f"`{text}`"


def _row(*cells: str) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in cells) + " |"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR")
    print(write(Path(sys.argv[1])))
