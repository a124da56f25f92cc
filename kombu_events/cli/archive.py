"""The ``archive`` command group, for the messages whose handler gave up: ``list`` and ``show`` read them
(they stay in the archive), ``replay`` puts them back into their queue with the attempt counter reset
(in transactions: each sent once or kept; exit 1 when some stay archived, or an ``--id`` matches none) and
``purge`` deletes them for good (only with ``--yes``; ``--dry-run`` shows what would go).

``list``, ``replay`` and ``purge`` select alike (:func:`_selection`): the archive's messages in order, those
of ``--queue`` and ``--routing-key`` (a key, or a topic pattern matched as RabbitMQ matches a binding), at most
``--limit`` of them; the dry runs read exactly what the real runs would take."""
from __future__ import annotations

import json
from typing import Any, Callable, Iterable

import click

from ..core.topic import matches
from ..errors import KombuEventsError
from ..ops.archive import ArchivedMessage, purge, purge_all, read, replay
from .common import Context, emit_json, examples, failed, guarded, json_option


@click.group()
def archive() -> None:
    """Inspect, replay and purge archived messages."""


examples(archive,
         "kombu-events -A proj.events archive list --queue billing.audit",
         "kombu-events -A proj.events archive replay --queue billing.audit --dry-run")


def _selection(queue: str | None, routing_key: str | None) -> Callable[[ArchivedMessage], bool]:
    """The messages of ``queue`` (exactly) whose routing key matches ``routing_key`` (a key or a topic pattern)."""
    return lambda m: (queue is None or m.queue == queue) and (routing_key is None
                                                             or matches(routing_key, m.routing_key))


def _selecting(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The options that select archived messages, as ``list``, ``replay`` and ``purge`` share them."""
    fn = click.option("--routing-key", metavar="PATTERN",
                      help="Only messages with this routing key, or whose key matches this topic pattern "
                           "('*' one word, '#' zero or more).")(fn)
    return click.option("--queue", help="Only messages that failed in this queue.")(fn)


def _entry(message: ArchivedMessage, outcome: str, why: str | None = None) -> dict[str, Any]:
    """One message in the JSON of ``replay`` and ``purge``: which, and what became of it."""
    return {"id": message.id, "queue": message.queue, "routing_key": message.routing_key,
            "archived_at": message.archived_at, "reason": message.reason, "outcome": outcome, "why": why}


@archive.command("list")
@_selecting
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True, help="Show at most this many.")
@json_option("archive-list", "JSON Lines on stdout instead, one JSON object per message")
@click.pass_obj
@guarded
def archive_list(obj: Context, queue: str | None, routing_key: str | None, limit: int, as_json: bool) -> None:
    """What is in the archive and why (messages stay in the archive)."""
    with obj.connection() as conn:
        found = read(conn, obj.events.topology(), _selection(queue, routing_key), limit)
    for m in found:
        if as_json:
            click.echo(json.dumps(m.summary()))
        else:
            click.echo(f"{m.id}  {m.archived_at}  queue={m.queue} key={m.routing_key} "
                       f"attempts={m.attempts}  {m.reason}")
    if not as_json:
        click.echo(f"{len(found)} message(s) shown", err=True)


examples(archive_list,
         "kombu-events -A proj.events archive list",
         "kombu-events -A proj.events archive list --routing-key 'orders.*.created' --json")


@archive.command("show")
@click.argument("message_id")
@json_option("archive-show", "its JSON object on stdout, as without --json")
@click.pass_obj
@guarded
def archive_show(obj: Context, message_id: str, as_json: bool) -> None:
    """Everything about one archived message, as JSON (it stays in the archive)."""
    with obj.connection() as conn:
        found = read(conn, obj.events.topology(), lambda m: m.id == message_id, 1)
    if not found:
        raise KombuEventsError(f"no archived message with id {message_id!r}")
    emit_json(found[0].summary())


examples(archive_show,
         "kombu-events -A proj.events archive show 4fbcc4187f8e49a687d3721b2007dc15")


@archive.command("replay")
@_selecting
@click.option("--id", "ids", multiple=True, metavar="ID",
              help="Only the message with this id, as archive list shows it (repeat for several); an id that "
                   "matches no archived message is reported, and the command exits 1.")
@click.option("--limit", type=click.IntRange(min=1), help="Replay at most this many.")
@click.option("--dry-run", is_flag=True, help="Show what would be replayed; change nothing.")
@json_option("archive-replay")
@click.pass_obj
@guarded
def archive_replay(obj: Context, queue: str | None, routing_key: str | None, ids: tuple[str, ...],
                   limit: int | None, dry_run: bool, as_json: bool) -> None:
    """Put archived messages back into their queue, attempt counter reset (in transactions: sent once, or kept)."""
    match = _with_ids(_selection(queue, routing_key), ids)
    with obj.connection() as conn:
        if dry_run:
            chosen = read(conn, obj.events.topology(), match, limit)
            missing = _not_found(ids, chosen)
            if as_json:
                emit_json({"dry_run": True, "matched": len(chosen), "replayed": 0, "kept": 0,
                           "messages": [_entry(m, "would_replay") for m in chosen] + _not_found_entries(missing)})
            else:
                for m in chosen:
                    click.echo(f"would replay {m.id} to {m.queue} (key {m.routing_key})")
            _report_not_found(missing)
            return
        replayed, kept = replay(conn, obj.events.topology(), match, limit)
    missing = _not_found(ids, replayed + [m for m, _ in kept])
    if as_json:
        emit_json({"dry_run": False, "matched": len(replayed) + len(kept), "replayed": len(replayed),
                   "kept": len(kept), "messages": [_entry(m, "replayed") for m in replayed]
                   + [_entry(m, "kept", why) for m, why in kept] + _not_found_entries(missing)})
    else:
        for m in replayed:
            click.echo(f"replayed {m.id} to {m.queue}")
    for m, why in kept:
        click.echo(f"kept {m.id} in the archive: {why}", err=True)
    if not as_json:
        click.echo(f"{len(replayed)} replayed, {len(kept)} kept"
                   + (f", {len(missing)} not found" if missing else ""), err=True)
    _report_not_found(missing, exit_now=not kept)
    if kept:
        failed()


def _with_ids(match: Callable[[ArchivedMessage], bool], ids: tuple[str, ...]) -> Callable[[ArchivedMessage], bool]:
    """``match``, narrowed to the messages of ``ids`` when any are given."""
    if not ids:
        return match
    wanted = set(ids)
    return lambda m: m.id in wanted and match(m)


def _not_found(ids: Iterable[str], found: Iterable[ArchivedMessage]) -> list[str]:
    """The ``ids`` asked for that none of ``found`` has, in the order given, each once."""
    seen = {m.id for m in found}
    return [i for i in dict.fromkeys(ids) if i not in seen]


def _not_found_entries(missing: list[str]) -> list[dict[str, Any]]:
    """``missing`` ids in the JSON of ``replay``: outcome ``not_found``, nothing else known of them."""
    return [{"id": i, "queue": "", "routing_key": "", "archived_at": "", "reason": "", "outcome": "not_found",
             "why": "no archived message has this id (replayed or purged since, or mistyped)"} for i in missing]


def _report_not_found(missing: list[str], *, exit_now: bool = True) -> None:
    """One line on stderr per id that matched nothing (``repr``: a stray newline or space shows), then exit 1."""
    for i in missing:
        click.echo(f"not found: no archived message with id {i!r}", err=True)
    if missing and exit_now:
        failed()


examples(archive_replay,
         "kombu-events -A proj.events archive replay --queue billing.audit --dry-run   # what would go back",
         "kombu-events -A proj.events archive replay --id 4fbcc4187f8e49a687d3721b2007dc15",
         "kombu-events -A proj.events archive replay --queue billing.audit --limit 100")


@archive.command("purge")
@_selecting
@click.option("--limit", type=click.IntRange(min=1), help="Delete at most this many (the oldest first).")
@click.option("--dry-run", is_flag=True, help="Show what would be deleted; delete nothing (no --yes needed).")
@click.option("--yes", is_flag=True, help="Really delete them.")
@json_option("archive-purge")
@click.pass_obj
@guarded
def archive_purge(obj: Context, queue: str | None, routing_key: str | None, limit: int | None, dry_run: bool,
                  yes: bool, as_json: bool) -> None:
    """Delete archived messages for good (those selected; never one that is not)."""
    if not (yes or dry_run):
        raise click.UsageError("purge deletes archived messages for good: add --yes to confirm "
                               "(or --dry-run to see what would go)")
    selective = queue is not None or routing_key is not None or limit is not None
    with obj.connection() as conn:
        topology = obj.events.topology()
        if dry_run:
            chosen = read(conn, topology, _selection(queue, routing_key), limit)
            if as_json:
                emit_json({"dry_run": True, "matched": len(chosen), "purged": 0,
                           "messages": [_entry(m, "would_purge") for m in chosen]})
                return
            for m in chosen:
                click.echo(f"would purge {m.id} from {m.queue} (key {m.routing_key})")
            click.echo(f"{len(chosen)} message(s) would be purged", err=True)
            return
        if selective:
            removed = purge(conn, topology, _selection(queue, routing_key), limit)
            count, messages = len(removed), [_entry(m, "purged") for m in removed]
        else:  # everything: one queue.purge, no message read
            count, messages = purge_all(conn, topology), None
    if as_json:
        emit_json({"dry_run": False, "matched": count, "purged": count, "messages": messages})
    else:
        click.echo(f"purged {count} message(s)")


examples(archive_purge,
         "kombu-events -A proj.events archive purge --queue billing.audit --yes",
         "kombu-events -A proj.events archive purge --routing-key 'orders.#' --limit 10 --dry-run   # what would go")
