"""Run docs/tutorial.md as a reader does, against the real RabbitMQ, and put what the run printed into the page.

    .venv/bin/python docs/_tools/tutorial_run.py            # run the page; rewrite the output blocks that differ
    .venv/bin/python docs/_tools/tutorial_run.py --check    # run the page; exit 1, with a diff, if it shows other

The page is the script. Its ```shell blocks run in order, each with bash, in the directory the previous one
left (the reader's second terminal), with the running Python's environment activated (the reader's
``. .venv/bin/activate``) and HOME a fresh temporary directory (so ``mkdir ~/shop && cd ~/shop`` makes the
service's directory there). Each block must exit 0. A comment ``<!-- run: ... -->`` on the line right above
a block says what the block is when it is not a command to run:

``<!-- run: skip (why) -->``
    a shell block the run leaves out (the clone and install: the run uses the checkout's environment).
``<!-- run: worker -->``
    a shell block for the first terminal: it starts in the background; the run waits for its ``ready.``.
``<!-- run: save as shop.py -->``
    above the ``{literalinclude}``: the included file is saved under that name, in the current directory.
``<!-- run: apply to shop.py -->``
    above a ```diff block: its hunk (context, ``-`` and ``+`` lines) must match the file once, and is applied.
``<!-- run: output[; head N] -->``
    a ```text block: what the shell block above printed (stdout and stderr, as a terminal shows them).
``<!-- run: output of `COMMAND`[; json KEY, KEY ...] -->``
    a ```text block: what COMMAND, which the prose gives, prints (placeholders such as ``<id-2>`` in it are
    put back to what they stand for). ``json``: only those keys of the JSON object it prints.
``<!-- run: worker log; until REGEX[; show REGEX] -->``
    a ```text block: the worker's lines since the previous worker log block, up to the first one matching
    ``until`` (waited for), those matching ``show`` (default: the handlers' prints and ``event outcome=``).

and a comment on a line of its own, followed by prose, is a step the prose asks for:
``<!-- run: restart the worker -->`` (Ctrl-C, which stops the worker, its pool and all, then the same
command again), ``<!-- run: stop the worker -->`` and ``<!-- run: expect no queue or exchange named shop.* -->``
(a check of the clean-up, through the management API). Every ```text block needs a comment: each output
block is tied to the command it shows.

The run happens in a vhost of its own (``RABBIT_URL`` points the service and the CLI there), deleted at the
end with whatever is left in it; the worker is stopped, and the temporary directory removed, come what may.

What differs from run to run is normalised before it is written or compared, to placeholders a reader
understands: message ids become ``<id-1>``, ``<id-2>``, ... in the order they first appear (the same id is the
same placeholder all along the page), archive keys ``<key-1>``, ...; ISO timestamps
``YYYY-MM-DDThh:mm:ss.sss+00:00``; the worker's log-line times ``[…``; ``duration_ms=…``; ``ForkPoolWorker-…``;
the host name ``<host>``; the vhost's URL
the reader's ``amqp://guest:**@127.0.0.1:5672//``; the temporary home ``~``. A traceback keeps its first
line, the frames of the service's own files and its last lines; the frames in between become ``…`` and
Python 3.11's ``^^^`` lines go (so it reads the same on every Python).

The worker consumes the two handler queues at once, so lines of different queues can come in another order
on the next run: a worker log block matches the page when it has the same lines, each queue's ``event
outcome=`` lines in the same order and the worker's other lines in the same order (the handlers' prints,
from the pool, may come anywhere). ``--check`` applies that comparison, and a write leaves a block that
matches this way as it is.

Exit status: 0 the page shows this run; 1 (``--check``) it shows something else; 2 the run failed (a command
exited non-zero, a wait timed out, a comment is not understood); 3 RabbitMQ or its management API cannot be
reached.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from base64 import b64encode
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Union

from kombu_events.errors import BrokerUnavailableError, KombuEventsError
from kombu_events.testing import temporary_vhost

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "tutorial.md"
DEFAULT_BROKER = os.environ.get("KOMBU_EVENTS_TEST_BROKER", "amqp://guest:guest@127.0.0.1:5672//")
READER_URL = "amqp://guest:**@127.0.0.1:5672//"  # what a reader's worker logs: the default vhost

COMMAND_TIMEOUT_S = 120.0
READY_TIMEOUT_S = 60.0
LOG_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
SETTLE_TIMEOUT_S = 15.0

MARKER = re.compile(r"^<!-- run: (.*) -->$")
FENCE = re.compile(r"^(`{3,})(.*)$")
READY = re.compile(r"\bready\.$")
DEFAULT_SHOW = r"WARNING/ForkPoolWorker|event outcome="
OUTCOME_QUEUE = re.compile(r"event outcome=\S+ queue=(\S+)")
ID = re.compile(r"\b[0-9a-f]{32}\b")
KEY = re.compile(r"\b[0-9a-f]{20}\b")  # an archive key
PLACEHOLDER = re.compile(r"<(?:id|key)-\d+>")
ISO_TIME = re.compile(r"\b\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:[+-]\d\d:\d\d|Z)?")
LOG_TIME = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}: ", flags=re.MULTILINE)
CARETS = re.compile(r"^\s*[~^]+\s*$")


class RunError(Exception):
    """The run could not do what the page says (exit 2)."""


# --- the page -----------------------------------------------------------------------------------------------


@dataclass
class Block:
    """A fenced block: its info string, its content lines (``start``..``end`` of the page), its marker."""

    info: str
    start: int  # index of its first content line in the page's lines
    end: int  # index of its closing fence
    lines: list[str]
    marker: str | None
    line_no: int  # 1-based line of the opening fence, for messages

    @property
    def kind(self) -> str:
        return self.info.split()[0] if self.info else ""


@dataclass
class Action:
    """A marker on a line of its own: a step the prose asks for."""

    marker: str
    line_no: int


Item = Union[Block, Action]


def parse(text: str) -> list[Item]:
    """The page's fenced blocks and markers, in order; a marker right above a fence belongs to it."""
    lines = text.split("\n")
    items: list[Item] = []
    pending: tuple[str, int] | None = None  # (marker, its index)
    i = 0
    while i < len(lines):
        marker = MARKER.match(lines[i].strip())
        fence = FENCE.match(lines[i])
        if marker:
            if pending:
                items.append(Action(pending[0], pending[1] + 1))
            pending = (marker.group(1).strip(), i)
        elif fence:
            ticks, info = fence.group(1), fence.group(2).strip()
            j = i + 1
            while j < len(lines) and lines[j].rstrip() != ticks:
                j += 1
            if j == len(lines):
                raise RunError(f"docs/tutorial.md:{i + 1}: the block opened here is never closed")
            own = pending[0] if pending and pending[1] == i - 1 else None
            if pending and own is None:
                items.append(Action(pending[0], pending[1] + 1))
            pending = None
            items.append(Block(info, i + 1, j, lines[i + 1:j], own, i + 1))
            i = j
        i += 1
    if pending:
        items.append(Action(pending[0], pending[1] + 1))
    return items


@dataclass
class Directive:
    """A marker, read: its verb, its argument (a command, a file name) and its options."""

    verb: str
    argument: str = ""
    options: dict[str, str] | None = None

    def option(self, name: str, default: str | None = None) -> str | None:
        return (self.options or {}).get(name, default)


VERBS_OF = {
    "shell": ("skip", "worker"),
    "text": ("output", "output of", "worker log"),
    "diff": ("apply to",),
    "{literalinclude}": ("save as",),
    "": ("restart the worker", "stop the worker", "expect no queue or exchange named"),  # actions
}
OPTIONS_OF = {"output": {"head"}, "output of": {"json"}, "worker log": {"until", "show"}}


def directive(marker: str, where: str) -> Directive:
    """Read ``marker`` (``verb [argument]; option value; ...``); RunError when it is not understood."""
    head, *rest = [part.strip() for part in marker.split(";")]
    command = re.fullmatch(r"output of `(.+)`", head)
    if command:
        verb, argument = "output of", command.group(1)
    elif head.startswith("skip"):
        verb, argument = "skip", head[4:].strip()
    else:
        verbs = [v for vs in VERBS_OF.values() for v in vs if head == v or head.startswith(v + " ")]
        verb = max(verbs, key=len) if verbs else head  # "worker log", not "worker"
        argument = head[len(verb):].strip()
    options = {}
    for part in rest:
        name, _, value = part.partition(" ")
        if name not in OPTIONS_OF.get(verb, set()) or not value.strip():
            raise RunError(f"{where}: option {part!r} is not one of {verb!r}'s ({sorted(OPTIONS_OF.get(verb, ()))})")
        options[name] = value.strip()
    if verb == "worker log" and "until" not in options:
        raise RunError(f"{where}: a worker log block needs `until REGEX` (the line that ends it)")
    return Directive(verb, argument, options)


def read_page(text: str) -> list[tuple[Item, Directive | None]]:
    """Every item with its directive; RunError for a marker in the wrong place or a text block without one."""
    read: list[tuple[Item, Directive | None]] = []
    for item in parse(text):
        where = f"docs/tutorial.md:{item.line_no}"
        if isinstance(item, Action):
            found = directive(item.marker, where)
            if found.verb not in VERBS_OF[""]:
                raise RunError(f"{where}: {item.marker!r} is not a step (one of {VERBS_OF['']}), and no block follows")
            read.append((item, found))
            continue
        if item.marker is None:
            if item.kind == "text":
                raise RunError(f"{where}: this text block is tied to no command: put <!-- run: output -->, "
                               "<!-- run: output of `COMMAND` --> or <!-- run: worker log; until ... --> above it")
            if item.kind == "{literalinclude}":
                raise RunError(f"{where}: say where the run saves the included file: <!-- run: save as NAME -->")
            read.append((item, None))
            continue
        found = directive(item.marker, where)
        if found.verb not in VERBS_OF.get(item.kind, ()):
            raise RunError(f"{where}: {item.marker!r} does not go with a {item.kind or 'plain'} block "
                           f"(it takes {VERBS_OF.get(item.kind, ())})")
        read.append((item, found))
    return read


# --- normalising ---------------------------------------------------------------------------------------------


class Normaliser:
    """What varies from run to run, as stable placeholders; message ids numbered as they first appear."""

    def __init__(self, home: Path, vhost: str) -> None:
        self.homes = sorted({str(home), str(home.resolve())}, key=len, reverse=True)
        self.vhost_url = re.compile(r"amqp://[^\s/]*/" + re.escape(vhost) + r"\b")
        self.host = re.compile(r"@" + re.escape(socket.gethostname()) + r"\b")
        self.ids: dict[str, str] = {}
        self.keys: dict[str, str] = {}

    def __call__(self, text: str) -> str:
        text = self.vhost_url.sub(READER_URL, text)  # first: the vhost's name is hex digits too
        for home in self.homes:
            text = text.replace(home, "~")
        text = ID.sub(lambda m: self.ids.setdefault(m.group(0), f"<id-{len(self.ids) + 1}>"), text)
        text = KEY.sub(lambda m: self.keys.setdefault(m.group(0), f"<key-{len(self.keys) + 1}>"), text)
        text = ISO_TIME.sub("YYYY-MM-DDThh:mm:ss.sss+00:00", text)
        text = LOG_TIME.sub("[… ", text)
        text = re.sub(r"\bduration_ms=[0-9.]+", "duration_ms=…", text)
        text = re.sub(r"\bForkPoolWorker-\d+", "ForkPoolWorker-…", text)
        return self.host.sub("@<host>", text)

    def restore(self, text: str) -> str:
        """``text`` with each ``<id-N>`` (``<key-N>``) put back to the message id (archive key) it stands for."""
        real = {placeholder: found for found, placeholder in [*self.ids.items(), *self.keys.items()]}

        def back(match: re.Match[str]) -> str:
            if match.group(0) not in real:
                raise RunError(f"{match.group(0)} stands for no message id or archive key the run has seen yet")
            return real[match.group(0)]

        return PLACEHOLDER.sub(back, text)

    def traceback(self, text: str) -> str:
        """A traceback's first line, the frames in the service's files, its end; ``…`` for the frames between."""
        lines = [line for line in text.rstrip("\n").split("\n") if not CARETS.match(line)]
        kept: list[str] = []
        i = 0
        while i < len(lines):
            line = lines[i]
            if line.startswith("  File "):
                frame = [line]
                while i + 1 < len(lines) and lines[i + 1].startswith("    "):
                    i += 1
                    frame.append(lines[i])
                if any(home in line for home in self.homes):
                    kept += frame
                elif not kept or kept[-1] != "  …":
                    kept.append("  …")
            else:
                kept.append(line)
            i += 1
        return "\n".join(kept) + "\n"


def head(lines: list[str], count: int) -> list[str]:
    return lines[:count] + (["…"] if len(lines) > count else [])


def json_excerpt(text: str, keys: list[str], tidy: Callable[[str], str]) -> list[str]:
    """The JSON object ``text`` as ``json.dumps(indent=2)`` prints it, only ``keys`` (``…`` for the others)."""
    try:
        found = json.loads(text)
    except ValueError as exc:
        raise RunError(f"expected one JSON object, got:\n{text}") from exc
    missing = [key for key in keys if key not in found]
    if missing:
        raise RunError(f"the JSON printed has no {missing} (it has {list(found)})")
    shown = ["{"]
    names = list(found)
    for index, key in enumerate(names):
        if key in keys:
            value = tidy(found[key]) if key == "traceback" else found[key]
            comma = "," if index < len(names) - 1 else ""
            shown.append(f"  {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}{comma}")
        elif shown[-1] != "  …":
            shown.append("  …")
    return [*shown, "}"]


def log_key(line: str) -> str | None:
    """What orders a worker log line: its queue (outcomes), nothing (the pool's lines), else the worker."""
    outcome = OUTCOME_QUEUE.search(line)
    if outcome:
        return outcome.group(1)
    return None if "/ForkPoolWorker-" in line else "worker"


def same_log(page: list[str], run: list[str]) -> bool:
    """The same lines, each queue's outcomes and the worker's own lines in the same order."""
    if sorted(page) != sorted(run):
        return False
    keys = {log_key(line) for line in page} - {None}
    return all([x for x in page if log_key(x) == k] == [x for x in run if log_key(x) == k] for k in keys)


# --- running -------------------------------------------------------------------------------------------------


def say(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class WorkerLog:
    """The worker's stdout and stderr (every worker of the run writes to one file), read as lines come."""

    def __init__(self, path: Path) -> None:
        self.path, self.lines, self._offset, self._partial = path, [], 0, b""
        path.touch()

    def poll(self) -> None:
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        *complete, self._partial = (self._partial + data).split(b"\n")
        self.lines += [line.decode("utf-8", "replace").rstrip("\r") for line in complete]


class Run:
    """One run of the page: the reader's two terminals, the worker, the broker's vhost."""

    def __init__(self, base: Path, url: str, vhost: str, api: Management) -> None:
        self.home, self.tool = base / "home", base / "run"
        self.home.mkdir()
        self.tool.mkdir()
        self.cwd, self.url, self.vhost, self.api = self.home, url, vhost, api
        self.normalise = Normaliser(self.home, vhost)
        bin_dir = str(Path(sys.executable).parent)  # the environment running this: the reader's .venv
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("KOMBU_EVENTS_", "CELERY_")) and k not in ("PYTHONPATH", "PYTHONHOME")}
        self.env = {**env, "HOME": str(self.home), "PATH": bin_dir + os.pathsep + env.get("PATH", os.defpath),
                    "VIRTUAL_ENV": str(Path(bin_dir).parent), "RABBIT_URL": url}
        self.log = WorkerLog(self.tool / "worker.log")
        self.cursor = 0  # the first worker log line no block has shown yet
        self.worker: subprocess.Popen[bytes] | None = None
        self.worker_command: str | None = None
        self.last_output: str | None = None

    # the second terminal

    def shell(self, command: str, where: str) -> str:
        """Run ``command`` with bash where the previous one left off; what it printed (stdout and stderr)."""
        self.settle()
        say("$ " + command.replace("\n", "\n> "))
        cwd_file = self.tool / "cwd"
        script = f"cd {shlex.quote(str(self.cwd))} || exit 99\ntrap 'pwd > {shlex.quote(str(cwd_file))}' EXIT\n"
        try:
            done = subprocess.run(["bash", "--noprofile", "--norc", "-c", script + command + "\n"],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env=self.env, timeout=COMMAND_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as exc:
            raise RunError(f"{where}: still running after {COMMAND_TIMEOUT_S:g} s: {command}") from exc
        output = done.stdout.decode("utf-8", "replace")
        if done.returncode != 0:
            raise RunError(f"{where}: exited with status {done.returncode}: {command}\n{output}")
        self.cwd = Path(cwd_file.read_text().strip())
        return output

    def settle(self) -> None:
        """Wait (as a reader typing would) until the management API has counted every queue of the vhost
        and counts no unacked message there: its statistics lag (a queue declared a moment ago has none
        yet, and ``status`` shows ``-``), and ``status`` reads its unacked column there."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:
            queues = self.api.get(f"queues/{urllib.parse.quote(self.vhost, safe='')}")
            counted = all(q.get("messages_unacknowledged") is not None for q in queues)
            if counted and not any(q.get("messages_unacknowledged") for q in queues):
                return
            time.sleep(0.2)

    # the first terminal

    def start_worker(self, command: str, where: str) -> None:
        say(f"$ {command} &")
        self.log.poll()
        since = len(self.log.lines)
        with (self.tool / "worker.log").open("ab") as out:
            self.worker = subprocess.Popen(
                ["bash", "--noprofile", "--norc", "-c", f"cd {shlex.quote(str(self.cwd))} || exit 99\n{command}\n"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.worker_command = command
        self.wait_for(READY, since, READY_TIMEOUT_S, f"{where}: the worker's `ready.`")

    def stop_worker(self) -> None:
        """Ctrl-C: SIGINT to the worker's process group (the worker and its pool); then, if need be, SIGKILL."""
        worker, self.worker = self.worker, None
        if worker is None:
            return
        say("^C (the worker)")
        group = worker.pid  # start_new_session: the bash's pid is the group's id
        _signal_group(group, signal.SIGINT)
        try:
            worker.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            say(f"the worker did not stop within {STOP_TIMEOUT_S:g} s of Ctrl-C: killing it")
        deadline = time.monotonic() + 10
        while _group_alive(group) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(group):
            _signal_group(group, signal.SIGKILL)
        worker.wait()

    def wait_for(self, pattern: re.Pattern[str], since: int, timeout: float, what: str) -> int:
        """The index of the first worker log line from ``since`` on matching ``pattern``, once it is there."""
        deadline = time.monotonic() + timeout
        checked = since
        while True:
            self.log.poll()
            for index in range(checked, len(self.log.lines)):
                if pattern.search(self.log.lines[index]):
                    return index
            checked = len(self.log.lines)
            if self.worker is None or self.worker.poll() is not None:
                raise RunError(f"{what}: the worker is not running; its last lines:\n" + self._tail())
            if time.monotonic() > deadline:
                raise RunError(f"{what}: no line matching {pattern.pattern!r} within {timeout:g} s; the worker's "
                               "last lines:\n" + self._tail())
            time.sleep(0.05)

    def _tail(self) -> str:
        self.log.poll()
        return "\n".join(self.log.lines[-30:])

    # the page's steps

    def play(self, page: list[tuple[Item, Directive | None]]) -> list[tuple[Block, list[str]]]:
        """Carry out every step of the page; the output blocks with what this run printed for them."""
        shown: list[tuple[Block, list[str]]] = []
        for item, found in page:
            where = f"docs/tutorial.md:{item.line_no}"
            if isinstance(item, Action):
                assert found is not None
                self.act(found, where)
            elif found is None:
                if item.kind == "shell":
                    self.last_output = self.normalise(self.shell("\n".join(item.lines), where))
            elif found.verb == "skip":
                say(f"(skipped: {where}, {found.argument})")
            elif found.verb == "worker":
                self.start_worker("\n".join(item.lines), where)
                self.last_output = None
            elif found.verb == "save as":
                source = re.fullmatch(r"\{literalinclude\}\s+(\S+)", item.info)
                if not source:
                    raise RunError(f"{where}: expected ```{{literalinclude}} PATH")
                shutil.copyfile(PAGE.parent / source.group(1), self.cwd / found.argument)
                say(f"(saved {source.group(1)} as {found.argument})")
            elif found.verb == "apply to":
                self.apply(item.lines, self.cwd / found.argument, where)
            else:
                shown.append((item, self.output(found, where)))
        return shown

    def act(self, found: Directive, where: str) -> None:
        if found.verb == "restart the worker":
            if self.worker_command is None:
                raise RunError(f"{where}: no worker to restart")
            self.stop_worker()
            self.start_worker(self.worker_command, where)
        elif found.verb == "stop the worker":
            self.stop_worker()
        else:  # expect no queue or exchange named PREFIX*
            prefix = found.argument.rstrip("*")
            vhost = urllib.parse.quote(self.vhost, safe="")
            left = [f"{kind[:-1]} {e['name']}" for kind in ("queues", "exchanges")
                    for e in self.api.get(f"{kind}/{vhost}") if e["name"].startswith(prefix)]
            if left:
                raise RunError(f"{where}: left after the clean-up: {', '.join(left)}")

    def output(self, found: Directive, where: str) -> list[str]:
        if found.verb == "output":
            if self.last_output is None:
                raise RunError(f"{where}: `output` follows no shell block that ran in the second terminal")
            lines = self.last_output.rstrip("\n").split("\n")
            count = found.option("head")
            return head(lines, int(count)) if count else lines
        if found.verb == "output of":
            text = self.shell(self.normalise.restore(found.argument), where)
            keys = found.option("json")
            if keys:
                tidied = json_excerpt(text, [k.strip() for k in keys.split(",")], self.normalise.traceback)
                return self.normalise("\n".join(tidied)).split("\n")
            return self.normalise(text).rstrip("\n").split("\n")
        # worker log
        until = re.compile(found.option("until") or "")
        show = re.compile(found.option("show") or DEFAULT_SHOW)
        last = self.wait_for(until, self.cursor, LOG_TIMEOUT_S, where)
        taken = [line for line in self.log.lines[self.cursor:last + 1] if show.search(line)]
        self.cursor = last + 1
        return [self.normalise(line) for line in taken]

    def apply(self, diff: list[str], path: Path, where: str) -> None:
        """Apply the one hunk of ``diff`` (no header: context, ``-`` and ``+`` lines) to ``path``."""
        old = [line[1:] for line in diff if line[:1] in (" ", "-")]
        new = [line[1:] for line in diff if line[:1] in (" ", "+")]
        if any(line[:1] not in (" ", "-", "+") for line in diff):
            raise RunError(f"{where}: a diff line starts with neither ' ', '-' nor '+'")
        text = path.read_text()
        before, after = "\n".join(old) + "\n", "\n".join(new) + "\n"
        if text.count(before) != 1:
            raise RunError(f"{where}: the fix does not apply to {path.name}: its lines are not there once")
        path.write_text(text.replace(before, after))
        say(f"(applied the fix to {path.name})")

    def close(self) -> None:
        self.stop_worker()


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


class Management:
    """GETs on RabbitMQ's management API, as the broker URL's user."""

    def __init__(self, broker: str) -> None:
        parts = urllib.parse.urlsplit(broker)
        user = urllib.parse.unquote(parts.username or "guest")
        password = urllib.parse.unquote(parts.password or "guest")
        self.base = (os.environ.get("KOMBU_EVENTS_TEST_MANAGEMENT")
                     or f"http://{parts.hostname or 'localhost'}:15672").rstrip("/")
        self.auth = "Basic " + b64encode(f"{user}:{password}".encode()).decode()

    def get(self, path: str) -> Any:
        request = urllib.request.Request(f"{self.base}/api/{path}", headers={"Authorization": self.auth})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.load(response)


# --- the page, again -----------------------------------------------------------------------------------------


def differences(shown: list[tuple[Block, list[str]]], read: list[tuple[Item, Directive | None]]) -> list[str]:
    """A unified diff for each output block whose page text is not what the run printed."""
    log_blocks = {id(item) for item, found in read if found is not None and found.verb == "worker log"}
    found = []
    for block, lines in shown:
        same = same_log(block.lines, lines) if id(block) in log_blocks else block.lines == lines
        if not same:
            found.append("\n".join(difflib.unified_diff(
                block.lines, lines, f"docs/tutorial.md:{block.line_no}", "this run", lineterm="")))
    return found


def rewritten(text: str, shown: list[tuple[Block, list[str]]],
              read: list[tuple[Item, Directive | None]]) -> str:
    """The page with each output block that differs replaced by what the run printed."""
    lines = text.split("\n")
    log_blocks = {id(item) for item, found in read if found is not None and found.verb == "worker log"}
    for block, new in sorted(shown, key=lambda pair: pair[0].start, reverse=True):
        same = same_log(block.lines, new) if id(block) in log_blocks else block.lines == new
        if not same:
            lines[block.start:block.end] = new
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the page shows another run")
    parser.add_argument("--broker", default=DEFAULT_BROKER, help="RabbitMQ (its management API on port 15672)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so that the worker and the vhost go when we are stopped

    text = PAGE.read_text(encoding="utf-8")
    try:
        read = read_page(text)
    except RunError as exc:
        say(f"tutorial_run: {exc}")
        return 2
    with ExitStack() as stack:
        try:
            url = stack.enter_context(temporary_vhost(args.broker))
        except (BrokerUnavailableError, KombuEventsError) as exc:
            say(f"tutorial_run: cannot make a vhost for the run: {exc}")
            return 3
        base = Path(tempfile.mkdtemp(prefix="tutorial-run-"))
        stack.callback(shutil.rmtree, base, ignore_errors=True)
        vhost = urllib.parse.unquote(urllib.parse.urlsplit(url).path[1:])
        run = Run(base, url, vhost, Management(args.broker))
        stack.callback(run.close)
        began = time.monotonic()
        try:
            shown = run.play(read)
        except RunError as exc:
            say(f"tutorial_run: {exc}")
            return 2
        run.close()
        say(f"(the run took {time.monotonic() - began:.1f} s)")
    diffs = differences(shown, read)
    if args.check:
        for diff in diffs:
            sys.stdout.write(diff + "\n")
        sys.stdout.flush()
        if diffs:
            say(f"tutorial_run: docs/tutorial.md shows another run in {len(diffs)} block(s); "
                "`python docs/_tools/tutorial_run.py` writes this one")
            return 1
        say("tutorial_run: docs/tutorial.md shows this run")
        return 0
    if diffs:
        PAGE.write_text(rewritten(text, shown, read), encoding="utf-8")
    say(f"tutorial_run: {len(diffs)} output block(s) of docs/tutorial.md rewritten")
    return 0


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
