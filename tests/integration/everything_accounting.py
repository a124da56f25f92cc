"""The accounting of an everything-on run, by message id: pure, from what the run recorded and what it did.

:func:`account` takes the records the service wrote (see ``everything_app``), the archive's
message ids, the final worker's metrics and the worker logs, with the :class:`Ledger`
of what the scenario published and did to it, and returns a :class:`Report`: the
figures, and one line per problem found (no problem: the run passed).
"""
from __future__ import annotations

__all__ = ["Ledger", "Report", "account", "log_blocks", "errors_between", "last_record_before",
           "UNRECOVERABLE"]

import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Iterable

UNRECOVERABLE = "Unrecoverable error"
_RECORD_START = re.compile(r"^\[\d{4}-\d\d-\d\d ")


@dataclass
class Ledger:
    """What the scenario published and did: the ids it expects, and the processes it ended."""

    #: Ids that must be handled (their handler ran to success) at least once, derived events included.
    expected: set[str] = field(default_factory=set)
    #: Ids designed to be archived: in the archive, never handled.
    poison: set[str] = field(default_factory=set)
    #: Events published (by the Node.js publisher), and chunks it had to publish again.
    sent: int = 0
    republished_chunks: int = 0
    #: Faults injected, by kind.
    faults: Counter = field(default_factory=Counter)
    #: Faults that did not have the effect they should have (e.g. a silent connection never noticed).
    fault_problems: list[str] = field(default_factory=list)
    #: Pids killed with -9 by the scenario (worker main processes, their pool children, one pool child).
    killed: set[int] = field(default_factory=set)
    #: Worker main processes that exited on their own (a failure), and their children at the time.
    exited: dict[int, str] = field(default_factory=dict)
    exited_children: set[int] = field(default_factory=set)
    #: Connection faults (broker restart, silent connection) each worker main process lived through.
    connection_faults: Counter = field(default_factory=Counter)
    #: Main pid of the worker stopped warmly at the end (None if it could not be).
    final_pid: int | None = None
    #: time.time() when the last fault ended.
    last_fault_end: float = 0.0
    #: The service's handler queues (the metrics are compared on these).
    handler_queues: set[str] = field(default_factory=set)
    #: The service's queue type: classic queues dead-letter at most once (docs/failures.md).
    queue_type: str = "classic"
    #: (time.time() as the broker began to stop, as it served again) of each broker restart.
    broker_stops: list[tuple[float, float]] = field(default_factory=list)
    #: Id prefix -> the delay (s) of the events handlers publish with that prefix (through the delayed ladder).
    publish_delays: dict[str, float] = field(default_factory=dict)


@dataclass
class Report:
    """Figures of a run and the problems found; ``lines()`` prints both."""

    figures: dict[str, Any]
    problems: list[str]

    def lines(self) -> list[str]:
        out = [f"{name}: {value}" for name, value in self.figures.items()]
        out += [f"PROBLEM: {problem}" for problem in self.problems] or ["no problem found"]
        return out


def log_blocks(text: str, needle: str, *, max_lines: int = 80) -> list[str]:
    """Each log record containing ``needle``, with the traceback lines that follow it."""
    blocks, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if needle in line:
            end = i + 1
            while end < len(lines) and end - i < max_lines and not _RECORD_START.match(lines[end]):
                end += 1
            blocks.append("\n".join(lines[i:end]))
    return blocks


def _stamp(line: str) -> float | None:
    """The time.time() of a Celery log record's first line, else None."""
    try:
        return datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


def last_record_before(text: str, moment: float) -> str:
    """The first line of the last log record stamped before ``moment`` (what the worker did last)."""
    found = ""
    for line in text.splitlines():
        stamp = _stamp(line) if _RECORD_START.match(line) else None
        if stamp is not None:
            if stamp >= moment:
                break
            found = line
    return found[:300]


def errors_between(text: str, start: float, end: float) -> list[str]:
    """Log records with a traceback stamped within [start, end] (time.time()): each as its first line, the
    innermost frame of kombu_events and the exception."""
    found = []
    for block in log_blocks(text, "ERROR/") + log_blocks(text, "CRITICAL/"):
        lines = block.splitlines()
        stamp = _stamp(lines[0])
        if stamp is None or not start <= stamp <= end or not any(line.startswith("Traceback") for line in lines):
            continue
        frames = [line.strip() for line in lines if line.strip().startswith("File ") and "kombu_events" in line]
        exception = next((line for line in reversed(lines) if line.strip().strip("^~ ")), "")
        found.append(" | ".join([lines[0][:300], *frames[-1:], exception.strip()[:300]]))
    return found


def _sample(ids: Iterable[str], n: int = 8) -> list[str]:
    return sorted(ids)[:n]


def account(ledger: Ledger, records: dict[str, list[dict[str, Any]]], archived: list[str],
            metrics: dict[tuple[str, str], float] | None, logs: dict[str, str]) -> Report:
    """Check every guarantee of the run; ``metrics``: {(queue, outcome): count} of the final worker."""
    problems: list[str] = []
    calls, hooks = records.get("calls", []), records.get("hooks", [])
    mine = ledger.expected | ledger.poison
    ok = [c for c in calls if c["ok"] and c["id"] in mine]
    handled = {c["id"] for c in ok}
    lost = ledger.expected - handled
    in_ladder = dead_lettered_at_a_stop(ledger, hooks, lost)
    lost -= set(in_ladder)
    archived_set = set(archived)
    figures: dict[str, Any] = {
        "events sent": ledger.sent, "expected handled (derived events included)": len(ledger.expected),
        "designed to be archived": len(ledger.poison),
        "faults injected": dict(sorted(ledger.faults.items())),
        "handler calls": len([c for c in calls if c["id"] in mine]),
        "handled": len(handled & ledger.expected), "duplicates": len(ok) - len(handled),
        "lost": len(lost) + len(ledger.poison - archived_set),
        "archived": len(archived), "worker exits (own)": len(ledger.exited),
    }
    if ledger.republished_chunks:
        figures["chunks the publisher sent again"] = ledger.republished_chunks
    if in_ladder:
        figures["lost by the broker's dead-lettering at a stop (classic queues, docs/failures.md)"] = \
            f"{len(in_ladder)}: {_sample(set(in_ladder))}"
    if lost:
        problems.append(f"{len(lost)} events never handled: {_sample(lost)}")
        problems += [f"history of {i}: {_history(hooks, calls, i)}" for i in sorted(lost)[:5]]
    if ledger.poison - archived_set:
        problems.append(f"{len(ledger.poison - archived_set)} poison events not in the archive: "
                        f"{_sample(ledger.poison - archived_set)}")
    if archived_set - ledger.poison:
        problems.append(f"{len(archived_set - ledger.poison)} events archived that should not be: "
                        f"{_sample(archived_set - ledger.poison)}")
    if handled & ledger.poison:
        problems.append(f"poison events handled: {_sample(handled & ledger.poison)}")
    for pid, why in ledger.exited.items():
        problems.append(f"the worker's main process {pid} exited on its own: {why}")
    problems += ledger.fault_problems
    unrecoverable = [b for name, text in logs.items() for b in log_blocks(text, UNRECOVERABLE)]
    figures["'Unrecoverable error' lines"] = len(unrecoverable)
    problems += [f"worker log: {block}" for block in unrecoverable]
    problems += _hooks(ledger, hooks, calls, records, mine)
    problems += _periodic(ledger, records.get("runs", []), figures)
    problems += _circuits(records.get("circuits", []), figures)
    if metrics is not None:
        problems += _metrics(ledger, hooks, metrics)
    return Report(figures, problems)


#: Seconds around a broker stop in which a message expiring in a classic delay queue may be dropped.
STOP_MARGIN_S = 1.0


def dead_lettered_at_a_stop(ledger: Ledger, hooks: list[dict[str, Any]], lost: set[str]) -> list[str]:
    """Of ``lost``, the ids the broker itself dropped, as docs/failures.md says classic queues may.

    Only with classic queues, and only an id whose last trace is a confirmed publish into a
    delay ladder -- a republish of a retry or requeue (the ``settled`` hook: confirmed, then
    acked), or a delayed event a handler published (``after_publish`` without an error) --
    that was waiting in the ladder while the broker stopped (give or take ``STOP_MARGIN_S``),
    and that no worker received again. Anything else lost is a bug of ours.
    """
    if ledger.queue_type != "classic" or not ledger.broker_stops:
        return []
    last: dict[str, dict[str, Any]] = {}
    for h in hooks:
        if h.get("id") in lost and h["hook"] in ("received", "settled", "after_publish"):
            last[h["id"]] = h
    found = []
    for message_id, h in sorted(last.items()):
        if h["hook"] == "after_publish" and h.get("error") is None:
            delay_s = next((d for prefix, d in ledger.publish_delays.items() if message_id.startswith(prefix)), None)
            if delay_s is None:
                continue
            waiting = (h["t"], h["t"] + delay_s)
        elif h["hook"] == "settled" and h["action"] in ("retry", "requeue"):
            waiting = (h["t"], h["t"] + (h.get("delay_ms") or 0) / 1000)
        else:
            continue
        if any(waiting[0] <= end + STOP_MARGIN_S and waiting[1] >= start - STOP_MARGIN_S
               for start, end in ledger.broker_stops):
            found.append(message_id)
    return found


def _history(hooks: list[dict[str, Any]], calls: list[dict[str, Any]], message_id: str) -> str:
    """What the records say happened to ``message_id``, in order (for a lost event's report)."""
    rows = sorted((r for rows in (hooks, calls) for r in rows if r.get("id") == message_id), key=lambda r: r["t"])
    return "; ".join(f"{r['t']:.3f} {r.get('hook') or ('ok' if r.get('ok') else 'failed')} pid {r.get('pid')} "
                     f"attempt {r.get('attempt')} {r.get('action', '')} {r.get('delay_ms', '')}".rstrip()
                     for r in rows) or "no trace at all"


def _hooks(ledger: Ledger, hooks: list[dict[str, Any]], calls: list[dict[str, Any]],
           records: dict[str, list[dict[str, Any]]], mine: set[str]) -> list[str]:
    """The middleware's hooks against each other, the handler calls, the spans and the Sentry reports."""
    problems = []
    by_hook: dict[str, list[dict[str, Any]]] = {}
    for h in hooks:
        by_hook.setdefault(h["hook"], []).append(h)
    received = Counter((h["pid"], h["id"], h["queue"], h["attempt"]) for h in by_hook.get("received", []))
    settled = Counter((h["pid"], h["id"], h["queue"], h["attempt"]) for h in by_hook.get("settled", []))
    over = [k for k, n in settled.items() if n > received[k]]
    if over:
        problems.append(f"hooks: settled more often than received for {len(over)} deliveries: {over[:5]}")
    succeeded = {c["id"] for c in calls if c["ok"]}
    acked = {h["id"] for h in by_hook.get("settled", []) if h["action"] == "ack" and h["id"] in mine}
    if acked - succeeded:
        problems.append(f"hooks: acked without a successful handler call: {_sample(acked - succeeded)}")
    # In every process that was not killed, each handler call ran inside `handling`, made one span, and each
    # failure one Sentry report (Archive is the handler's own steering: not reported).
    ended = ledger.killed | set(ledger.exited) | ledger.exited_children

    def per_call(rows: Iterable[dict[str, Any]]) -> Counter:
        return Counter((r["pid"], r["id"], r["attempt"]) for r in rows if r["id"] in mine and r["pid"] not in ended)

    called = per_call(calls)
    views = {"handling hooks": per_call(by_hook.get("handling", [])),
             "handled hooks": per_call(by_hook.get("handled", [])),
             "CONSUMER spans": per_call(s for s in records.get("spans", []) if s["kind"] == "CONSUMER")}
    for name, seen in views.items():
        if seen != called:
            problems.append(f"{name} do not match the handler calls: {_diff(seen, called)}")
    reported = per_call(records.get("sentry", []))
    failed = per_call(c for c in calls if not c["ok"] and c["why"] != "Archive")
    if reported != failed:
        problems.append(f"Sentry reports do not match the failed calls: {_diff(reported, failed)}")
    for pid, (started, stopped) in _lifecycle(by_hook).items():
        if pid == ledger.final_pid and started != stopped:
            problems.append(f"hooks: worker {pid} stopped warmly, yet started {started} and stopped {stopped} times")
        if started < 1 + ledger.connection_faults[pid] and pid not in ledger.exited:
            problems.append(f"hooks: worker {pid} lived through {ledger.connection_faults[pid]} connection faults "
                            f"but started consuming only {started} times")
    return problems


def _lifecycle(by_hook: dict[str, list[dict[str, Any]]]) -> dict[int, tuple[int, int]]:
    started = Counter(h["pid"] for h in by_hook.get("started", []))
    stopped = Counter(h["pid"] for h in by_hook.get("stopped", []))
    return {pid: (started[pid], stopped[pid]) for pid in started | stopped}


def _diff(seen: Counter, expected: Counter) -> str:
    extra, missing = seen - expected, expected - seen
    return f"{sum(missing.values())} missing {list(missing)[:4]}, {sum(extra.values())} extra {list(extra)[:4]}"


def _periodic(ledger: Ledger, runs: list[dict[str, Any]], figures: dict[str, Any]) -> list[str]:
    """No period lost (run, or listed as missed by the run after it), and the schedule goes on after the faults."""
    if not runs:
        return ["periodic: the schedule never ran"]
    periods = Counter(r["period"] for r in runs)
    covered = {p for r in runs for p in (r["period"], *r.get("missed", []))}
    gaps = sorted(set(range(min(covered), max(covered) + 1)) - covered)
    crashes = len(ledger.killed) + len(ledger.exited)
    twice = {p: n for p, n in periods.items() if n > 1}
    figures["periodic runs"] = (f"{len(runs)} ({sum(n - 1 for n in twice.values())} periods run twice, "
                                f"{len(covered) - len(periods)} caught up)")
    problems = []
    if gaps:
        problems.append(f"periodic: periods lost {gaps[:10]}")
    if sum(n - 1 for n in twice.values()) > crashes:
        problems.append(f"periodic: more periods run twice ({twice}) than crashes ({crashes})")
    if max(r["t"] for r in runs) < ledger.last_fault_end:
        problems.append("periodic: no run after the last fault")
    return problems


def _circuits(changes: list[dict[str, Any]], figures: dict[str, Any]) -> list[str]:
    states = [c["state"] for c in changes]
    figures["circuit changes"] = dict(Counter(states))
    if "open" not in states:
        return ["circuit breaker: never tripped"]
    if states[-1] != "closed":
        return [f"circuit breaker: ended {states[-1]}, not closed"]
    return []


def _metrics(ledger: Ledger, hooks: list[dict[str, Any]], metrics: dict[tuple[str, str], float]) -> list[str]:
    """The final worker's kombu_events_messages_total against its own ``settled`` hooks, by queue and action."""
    counted = Counter((h["queue"], h["action"]) for h in hooks if h["hook"] == "settled"
                      and h["pid"] == ledger.final_pid and h["queue"] in ledger.handler_queues)
    scraped = Counter({key: int(value) for key, value in metrics.items() if value})
    if counted != scraped:
        return [(f"metrics: messages_total of worker {ledger.final_pid} does not match its settled hooks: "
                 f"{_diff(scraped, counted)}")]
    return []
