"""The ``archive`` command group, for the messages whose handler gave up: ``list`` and ``show`` read them
(a read changes nothing: the archive is a stream), ``replay`` puts copies back into their queue with the attempt
counter reset (each confirmed by the broker, then settled; exit 1 when some stay archived, or a ``--key``/``--id``
matches none) and ``purge`` settles them as purged (only with ``--yes``; ``--dry-run`` shows what would go;
``--for-good`` rewrites the stream without them).

``list``, ``replay`` and ``purge`` select alike (:func:`_selection`): the copies still archived in order, those of
``--queue`` and ``--routing-key`` (a key, or a topic pattern matched as RabbitMQ matches a binding), of ``--key``
(archive keys: exactly those copies) or ``--id`` (message ids: every copy with one), at or before ``--through``
(an archive offset), at most ``--limit`` of them; the dry runs read exactly what the real runs would take, and
print the offset they read through with the command line that acts on exactly the copies they showed (a copy
archived later has a greater offset)."""
from __future__ import annotations

import json
import shlex
from typing import Any, Callable, Iterable

import click

from ..core.logs import escape_controls, safe_text, safe_url
from ..core.topic import matches
from ..errors import KombuEventsError
from ..ops.archive import ArchivedMessage, purge, purge_note, read, replay_reconnecting, selected
from ..ops.archive_rewrite import rewrite
from .common import Context, emit_json, examples, failed, guarded, json_option

#: A replay whose connection goes once it has begun connects again this many times, waiting a little longer each
#: time (this many seconds more, up to 5 s).
REPLAY_RECONNECTS = 30
REPLAY_RECONNECT_DELAY_S = 0.5


@click.group()
def archive() -> None:
    """Inspect, replay and purge archived messages."""


examples(archive,
         "kombu-events -A proj.events archive list --queue billing.audit",
         "kombu-events -A proj.events archive replay --queue billing.audit --dry-run")


def _selection(queue: str | None, routing_key: str | None, keys: tuple[str, ...] = (),
               ids: tuple[str, ...] = (), through: int | None = None) -> Callable[[ArchivedMessage], bool]:
    """The copies of ``queue`` (exactly) whose routing key matches ``routing_key`` (a key or a topic pattern),
    narrowed to the archive ``keys`` and the message ``ids`` when any are given, and to the offsets up to
    ``through``."""
    wanted_keys, wanted_ids = set(keys), set(ids)
    return lambda m: ((queue is None or m.queue == queue)
                      and (routing_key is None or matches(routing_key, m.routing_key))
                      and (not wanted_keys or m.key in wanted_keys) and (not wanted_ids or m.id in wanted_ids)
                      and (through is None or m.offset <= through))


def _selecting(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The options that select archived messages, as ``list``, ``replay`` and ``purge`` share them."""
    fn = click.option("--through", type=click.IntRange(min=0), metavar="OFFSET",
                      help="Only copies at or before this archive offset: exactly those a dry run showed (it "
                           "prints the offset and the command line to use), none archived since.")(fn)
    fn = click.option("--id", "ids", multiple=True, metavar="ID",
                      help="Only copies with this message id (several copies may share one; repeat for several "
                           "ids). An id that matches none is reported and the command exits 1.")(fn)
    fn = click.option("--key", "keys", multiple=True, metavar="KEY",
                      help="Only the archived copy with this archive key, as `archive list` shows it (unique per "
                           "copy; repeat for several). A key that matches none is reported and the command "
                           "exits 1.")(fn)
    fn = click.option("--routing-key", metavar="PATTERN",
                      help="Only messages with this routing key, or whose key matches this topic pattern "
                           "('*' one word, '#' zero or more).")(fn)
    return click.option("--queue", help="Only messages that failed in this queue.")(fn)


def _entry(message: ArchivedMessage, outcome: str, why: str | None = None) -> dict[str, Any]:
    """One message in the JSON of ``replay`` and ``purge``: which, and what became of it."""
    return {"key": message.key, "id": message.id, "queue": message.queue, "routing_key": message.routing_key,
            "archived_at": message.archived_at, "reason": message.reason, "outcome": outcome, "why": why}


@archive.command("list")
@_selecting
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True, help="Show at most this many.")
@json_option("archive-list", "JSON Lines on stdout instead, one JSON object per message")
@click.pass_obj
@guarded
def archive_list(obj: Context, queue: str | None, routing_key: str | None, keys: tuple[str, ...],
                 ids: tuple[str, ...], through: int | None, limit: int, as_json: bool) -> None:
    """What is in the archive and why (a read changes nothing in the archive)."""
    with obj.connection() as conn:
        found = read(conn, obj.events.topology(), _selection(queue, routing_key, keys, ids, through), limit,
                     bodies=as_json)
    for m in found:
        if as_json:
            click.echo(json.dumps(m.summary()))
        else:
            click.echo(f"{m.key}  {m.archived_at}  id={escape_controls(m.id)} queue={m.queue} "
                       f"key={escape_controls(m.routing_key)} attempts={m.attempts}  {escape_controls(m.reason)}")
    if not as_json:
        click.echo(f"{len(found)} message(s) shown", err=True)


examples(archive_list,
         "kombu-events -A proj.events archive list",
         "kombu-events -A proj.events archive list --routing-key 'orders.*.created' --json")


@archive.command("show")
@click.argument("key")
@json_option("archive-show", "its JSON object on stdout, as without --json")
@click.pass_obj
@guarded
def archive_show(obj: Context, key: str, as_json: bool) -> None:
    """Everything about one archived copy, by archive key (or by message id when one copy has it), as JSON."""
    with obj.connection() as conn:
        topology = obj.events.topology()
        found = read(conn, topology, lambda m: m.key == key, 1)
        if not found:
            by_id = read(conn, topology, lambda m: m.id == key, bodies=False)
            if len(by_id) > 1:
                raise KombuEventsError(f"{len(by_id)} archived copies have message id {key!r}: show one by its "
                                       f"archive key ({', '.join(m.key for m in by_id[:10])})")
            found = read(conn, topology, lambda m: m.key == by_id[0].key, 1) if by_id else []
    if not found:
        raise KombuEventsError(f"no archived copy with key or id {key!r}")
    emit_json(found[0].summary())


examples(archive_show,
         "kombu-events -A proj.events archive show 3f9c2a7b81d04e6a9b1c")


@archive.command("replay")
@_selecting
@click.option("--limit", type=click.IntRange(min=1), help="Replay at most this many.")
@click.option("--dry-run", is_flag=True, help="Show what would be replayed, and the command line that replays "
                                              "exactly that (--through); change nothing.")
@json_option("archive-replay")
@click.pass_obj
@guarded
def archive_replay(obj: Context, queue: str | None, routing_key: str | None, keys: tuple[str, ...],
                   ids: tuple[str, ...], through: int | None, limit: int | None, dry_run: bool,
                   as_json: bool) -> None:
    """Put archived copies back into their queue, attempt counter reset (each confirmed, then settled)."""
    match = _selection(queue, routing_key, keys, ids, through)
    with obj.connection() as conn:
        if dry_run:
            chosen, read_through = selected(conn, obj.events.topology(), match, limit)
            _replay_dry_run(chosen, _pin(through, read_through), _not_found(keys, ids, chosen), as_json)
            return
    replayed, kept = _replay_reconnecting(obj, match, limit, as_json)
    missing = _not_found(keys, ids, replayed + [m for m, _ in kept])
    if as_json:
        emit_json({"dry_run": False, "matched": len(replayed) + len(kept), "replayed": len(replayed),
                   "kept": len(kept), "messages": [_entry(m, "replayed") for m in replayed]
                   + [_entry(m, "kept", why) for m, why in kept] + _not_found_entries(missing),
                   "through": through, "command": None})
    for m, why in kept:
        click.echo(f"kept {m.key} (id {escape_controls(m.id)}) in the archive: {why}", err=True)
    if not as_json:
        click.echo(f"{len(replayed)} replayed, {len(kept)} kept"
                   + (f", {len(missing)} not found" if missing else ""), err=True)
    _report_not_found(missing, exit_now=not kept)
    if kept:
        failed()


def _replay_reconnecting(obj: Context, match: Callable[[ArchivedMessage], bool], limit: int | None, as_json: bool,
                         ) -> tuple[list[ArchivedMessage], list[tuple[ArchivedMessage, str]]]:
    """``replay_reconnecting``, each window's copies printed once settled, each lost connection said on stderr."""
    def settled(copies: list[ArchivedMessage]) -> None:
        if not as_json:
            for m in copies:
                click.echo(f"replayed {m.key} (id {escape_controls(m.id)}) to {m.queue}")

    def lost(count: int, exc: BaseException, done: int) -> None:
        click.echo(safe_text(f"connection lost ({type(exc).__name__}: {exc}) with {done} replayed and settled; "
                             f"connecting again ({count} of {REPLAY_RECONNECTS})"), err=True)

    return replay_reconnecting(obj.connection, obj.events.topology(), match, limit, on_window=settled, on_lost=lost,
                               reconnects=REPLAY_RECONNECTS, delay_s=REPLAY_RECONNECT_DELAY_S)


def _replay_dry_run(chosen: list[ArchivedMessage], through: int | None, missing: list[tuple[str, str]],
                    as_json: bool) -> None:
    """What ``replay --dry-run`` prints: the copies it would replay, and how to replay exactly those."""
    command = _pinned("replay", through)
    if as_json:
        emit_json({"dry_run": True, "matched": len(chosen), "replayed": 0, "kept": 0,
                   "messages": [_entry(m, "would_replay") for m in chosen] + _not_found_entries(missing),
                   "through": through, "command": command})
    else:
        for m in chosen:
            click.echo(f"would replay {m.key} (id {escape_controls(m.id)}) to {m.queue} "
                       f"(key {escape_controls(m.routing_key)})")
        if not chosen:
            click.echo("nothing to replay: no archived copy matches", err=True)
        _report_pinned("replay", len(chosen), through, command)
    _report_not_found(missing)


def _pin(asked: int | None, read_through: int | None) -> int | None:
    """The ``--through`` of a dry run's report: the offset it read through, no further than the one ``asked``."""
    if asked is None or read_through is None:
        return read_through if asked is None else asked
    return min(asked, read_through)


def _pinned(verb: str, through: int | None) -> str | None:
    """The command line that acts on exactly what this dry run selected: its options and ``--through``, run for
    real (a password in ``--broker`` is shown as ``**``)."""
    if through is None:
        return None
    ctx = click.get_current_context()
    obj, given = ctx.find_object(Context), ctx.params
    words = ["kombu-events"]
    for flag, value in (("-A", obj and obj.app_name), ("--broker", obj and obj.broker and safe_url(obj.broker)),
                        ("--service", obj and obj.service_name)):
        words += [flag, str(value)] if value else []
    words += ["archive", verb]
    for flag, name in (("--queue", "queue"), ("--routing-key", "routing_key"), ("--limit", "limit")):
        words += [flag, str(given[name])] if given.get(name) is not None else []
    for flag, name in (("--key", "keys"), ("--id", "ids")):
        for value in given.get(name) or ():
            words += [flag, value]
    words += ["--through", str(through)]
    if verb == "purge":
        words += ["--for-good", "--yes"] if given.get("for_good") else ["--yes"]
    return " ".join(_shell_word(word) for word in words)


def _shell_word(word: str) -> str:
    """``word`` quoted for a POSIX shell, on one line: one with a control character (an id may hold a newline) in
    bash's ``$'...'`` form, its control characters as ``\\xNN``."""
    if not any(ord(c) < 0x20 or ord(c) == 0x7F for c in word):
        return shlex.quote(word)
    escaped = "".join(f"\\x{ord(c):02x}" if ord(c) < 0x20 or ord(c) == 0x7F else "\\" + c if c in "\\'" else c
                      for c in word)
    return f"$'{escaped}'"


def _report_pinned(verb: str, count: int, through: int | None, command: str | None) -> None:
    """On stderr: the offset a dry run read through, and the command line that acts on exactly its copies (not
    for a selection by archive keys alone, which is exact already)."""
    given = click.get_current_context().params
    by_keys_alone = given.get("keys") and not any(given.get(name) for name in ("queue", "routing_key", "ids"))
    if count and command is not None and not by_keys_alone:
        these = "this one" if count == 1 else f"these {count}"
        click.echo(f"read through archive offset {through}; to {verb} exactly {these}, none archived since: "
                   f"{command}", err=True)


def _not_found(keys: Iterable[str], ids: Iterable[str], found: Iterable[ArchivedMessage]) -> list[tuple[str, str]]:
    """The archive ``keys`` and message ``ids`` asked for that none of ``found`` has: (what, value), in order."""
    found = list(found)
    seen_keys, seen_ids = {m.key for m in found}, {m.id for m in found}
    return ([("key", k) for k in dict.fromkeys(keys) if k not in seen_keys]
            + [("id", i) for i in dict.fromkeys(ids) if i not in seen_ids])


def _not_found_entries(missing: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """``missing`` keys and ids in the JSON of ``replay``: outcome ``not_found``, nothing else known of them."""
    return [{"key": value if what == "key" else "", "id": value if what == "id" else "", "queue": "",
             "routing_key": "", "archived_at": "", "reason": "", "outcome": "not_found",
             "why": f"no archived copy has this {'archive key' if what == 'key' else 'message id'} "
                    "(replayed or purged since, or mistyped)"} for what, value in missing]


def _report_not_found(missing: list[tuple[str, str]], *, exit_now: bool = True) -> None:
    """One line on stderr per key or id that matched nothing (``repr``: a stray newline or space shows), then
    exit 1."""
    for what, value in missing:
        click.echo(f"not found: no archived copy with {'archive key' if what == 'key' else 'id'} {value!r}",
                   err=True)
    if missing and exit_now:
        failed()


examples(archive_replay,
         "kombu-events -A proj.events archive replay --queue billing.audit --dry-run   # what would go back",
         "kombu-events -A proj.events archive replay --queue billing.audit --through 1042   # exactly what it showed",
         "kombu-events -A proj.events archive replay --key 3f9c2a7b81d04e6a9b1c",
         "kombu-events -A proj.events archive replay --queue billing.audit --limit 100")


@archive.command("purge")
@_selecting
@click.option("--limit", type=click.IntRange(min=1), help="Purge at most this many (the oldest first).")
@click.option("--dry-run", is_flag=True, help="Show what would be purged, and the command line that purges "
                                              "exactly that (--through); change nothing (no --yes needed).")
@click.option("--yes", is_flag=True, help="Really purge them.")
@click.option("--for-good", is_flag=True,
              help="Then rewrite the archive stream without every purged copy, so that their bodies are gone "
                   "from the broker (personal data); without it a purged copy is hidden at once and stays in the "
                   "stream until retention removes it.")
@json_option("archive-purge")
@click.pass_obj
@guarded
def archive_purge(obj: Context, queue: str | None, routing_key: str | None, keys: tuple[str, ...],
                  ids: tuple[str, ...], through: int | None, limit: int | None, dry_run: bool, yes: bool,
                  for_good: bool, as_json: bool) -> None:
    """Purge archived copies: hidden from every read at once, in the stream until retention (or --for-good)."""
    if not (yes or dry_run):
        raise click.UsageError("purge removes archived messages from the archive: add --yes to confirm "
                               "(or --dry-run to see what would go)")
    match = _selection(queue, routing_key, keys, ids, through)
    with obj.connection() as conn:
        topology = obj.events.topology()
        if dry_run:
            chosen, read_through = selected(conn, topology, match, limit)
            _purge_dry_run(chosen, _pin(through, read_through), for_good, as_json)
            _report_not_found(_not_found(keys, ids, chosen))
            return
        removed = purge(conn, topology, match, limit)
        erased = _rewrite(conn, topology) if for_good else 0
    missing = _not_found(keys, ids, removed)
    if as_json:
        emit_json({"dry_run": False, "matched": len(removed), "purged": len(removed), "erased": erased,
                   "messages": [_entry(m, "purged") for m in removed], "through": through, "command": None,
                   "hidden_until_retention": not for_good, "note": purge_note(for_good=for_good)})
    else:
        for m in removed:
            click.echo(f"purged {m.key} (id {escape_controls(m.id)}) from {m.queue}")
        click.echo(f"purged {len(removed)} message(s)" + (
            f"; the archive was rewritten without {erased} purged cop{'y' if erased == 1 else 'ies'}" if for_good
            else "; they stay in the stream, hidden, until retention removes them (--for-good: now)"), err=True)
    _report_not_found(missing)


def _purge_dry_run(chosen: list[ArchivedMessage], through: int | None, for_good: bool, as_json: bool) -> None:
    """What ``purge --dry-run`` prints: the copies it would purge, and how to purge exactly those."""
    command = _pinned("purge", through)
    if as_json:
        emit_json({"dry_run": True, "matched": len(chosen), "purged": 0, "erased": 0,
                   "messages": [_entry(m, "would_purge") for m in chosen], "through": through, "command": command,
                   "hidden_until_retention": not for_good, "note": purge_note(for_good=for_good)})
        return
    for m in chosen:
        click.echo(f"would purge {m.key} (id {escape_controls(m.id)}) from {m.queue} "
                   f"(key {escape_controls(m.routing_key)})")
    click.echo(f"{len(chosen)} message(s) would be purged", err=True)
    _report_pinned("purge", len(chosen), through, command)


def _rewrite(conn: Any, topology: Any) -> int:
    """Rewrite the archive without its purged copies; how many were removed for good."""
    return int(rewrite(conn, topology)["erased"])


examples(archive_purge,
         "kombu-events -A proj.events archive purge --queue billing.audit --yes",
         "kombu-events -A proj.events archive purge --key 3f9c2a7b81d04e6a9b1c --yes --for-good   # personal data",
         "kombu-events -A proj.events archive purge --routing-key 'orders.#' --limit 10 --dry-run   # what would go")


@archive.command("rewrite")
@json_option("archive-rewrite")
@click.pass_obj
@guarded
def archive_rewrite(obj: Context, as_json: bool) -> None:
    """Make the archive stream again: its records, the settings' retention, no purged copy (keys kept)."""
    with obj.connection() as conn:
        counts = rewrite(conn, obj.events.topology(), always=True)
    if as_json:
        emit_json(counts)
        return
    erased = counts["erased"]
    click.echo(f"archive rewritten: {counts['records']} record(s) kept; {erased} purged "
               f"cop{'y' if erased == 1 else 'ies'} removed for good")


examples(archive_rewrite,
         "kombu-events -A proj.events archive rewrite   # after changing archive_ttl_ms or archive_max_bytes")
