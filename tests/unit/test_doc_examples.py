"""The Python examples of README.md and docs/ work as written (tests/doc_examples.py reads them).

Every block compiles. Every complete block runs, with its continuations, as the module it
says it is, and none publishes while it is imported. Then what the page shows is done to
it, against the test kit's stub (no broker): its test functions run (with the fixtures
``events_stub`` and ``monkeypatch``, and those the page defines), each
``kombu-events -A APP publish KEY JSON`` of the page's shell blocks is published to the
app's services, and each periodic function is called with a period's payload. A handler
that none of that reached then gets an event of its first binding key, payload ``{}``.
Every handler must have run, and none may have failed for a reason that says the example
is broken (a ``NameError``; for the page's own events a ``TypeError`` or
``AttributeError`` too), nor any middleware hook or signal receiver (they are logged).
Every ``celery -A X`` and ``kombu-events -A X`` of the pages must name a module an example
defines, whose app Celery finds. Fragments are only compiled here; ``tox -e type``
type-checks every block with mypy (tests/typing/check_doc_examples.py).
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import logging
import re
import sys
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from kombu_events import Event, registry, signals
from kombu_events.periodic.tokens import TokenHandler
from kombu_events.publishing.service import ServicePublisher
from kombu_events.testing import StubEvents
from tests.doc_examples import (
    COMPLETE,
    ROOT,
    Block,
    Module,
    app_options,
    bad_markers,
    blocks,
    modules,
    pages,
    shell_publishes,
    slug,
    write_page,
)

PAGES = pages()
BLOCKS = {page: blocks(page) for page in PAGES}
EVERY_BLOCK = [block for found in BLOCKS.values() for block in found]
RUNNABLE = [page for page in PAGES if modules(BLOCKS[page])]

#: What a handler's failure says when the example itself is broken, not the event it got.
BROKEN = re.compile(r"\b(NameError|UnboundLocalError|ImportError|ModuleNotFoundError|AttributeError|TypeError"
                    r"|SyntaxError|RecursionError)\b")
#: The same for an event the page does not show (its payload is made up): what no payload can cause.
BROKEN_ANYWAY = re.compile(r"\b(NameError|UnboundLocalError|ImportError|ModuleNotFoundError|SyntaxError)\b")
#: Handlers whose events a page's shell lines publish may retry: the stub's clock goes this far, at most.
HORIZON_S = 24 * 3600
#: `-A` values that name no app of the docs: the other library's, in a migration guide's "before".
NOT_OURS = {"proj.consumer:consumer_app", "billing.celery"}


def rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def test_the_pages_are_read():
    assert [rel(p) for p in PAGES[:1]] == ["README.md"]
    assert {"docs/tutorial.md", "docs/howto/pools.md", "docs/migrating/from-celery-amqp-events.md"} <= {
        rel(p) for p in PAGES}
    readme = BLOCKS[PAGES[0]]
    assert len(readme) >= 5 and readme[0].file == "proj/events.py"
    assert any(block.included == "docs/_examples/shop.py" for block in EVERY_BLOCK), "the tutorial's service"


@pytest.mark.parametrize("block", EVERY_BLOCK, ids=lambda b: b.where)
def test_every_block_is_marked_and_compiles(block: Block):
    assert bad_markers(block) is None, bad_markers(block)
    # Padded, so that a SyntaxError names the page's line.
    compile("\n" * (block.line - 1) + block.code, block.included or block.page, "exec", dont_inherit=True)


@pytest.mark.parametrize("page", RUNNABLE, ids=rel)
def test_every_complete_example_runs_against_the_stub(page: Path, tmp_path: Path):
    with _page_modules(page, tmp_path) as (_found, loaded):
        services = list(registry.services)
        for app in {id(e.app): e.app for e in services}.values():
            registry.resolve(app)  # validates every setting and handler, as a worker does at start-up
        for events in services:
            events.topology()
        ran: set[Any] = set()
        with _watching(ran) as troubles:
            for module in loaded:
                _run_tests(module, loaded, tmp_path)
            for publish in shell_publishes(page):
                target = _module_named(loaded, publish.app)
                if target is not None:
                    _publish_as_the_shell_does(target, publish, troubles)
            for events in services:
                _call_periodic_functions(events, ran)
            for events in services:
                _send_what_the_page_does_not(events, ran, troubles)
        assert not troubles, "\n".join(troubles)
        missing = [f"{h.fn.__module__}.{h.fn.__name__} ({h.queue})" for events in services for h in events.handlers
                   if not isinstance(h.fn, TokenHandler) and h.fn not in ran]
        assert not missing, f"{rel(page)}: handlers that never ran, even for an event of their binding key: {missing}"


def test_no_example_publishes_at_import_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The guard the runs above rely on: a block that publishes when imported fails, naming its line."""
    block = Block("README.md", 3, "from celery import Celery\nfrom kombu_events import Events\n"
                  "app = Celery('x', broker='memory://')\nevents = Events(app, service='x')\n"
                  "events.publish('x.y', {})\n", COMPLETE)
    [module] = _write([block], tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(AssertionError, match=r"README.md:7: .*publishes while it is imported"), \
            _forgotten(tmp_path, [module]), _no_publishing():
        _import(module, tmp_path)


#: Each module the examples define, and the page that defines it (README's proj.events first).
DEFINED = {}
for _page in reversed(RUNNABLE):
    DEFINED.update({module.name: _page for module in modules(BLOCKS[_page])})


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_app_option_names_an_app_the_docs_define(page: Path, tmp_path: Path):
    """``celery -A X`` / ``kombu-events -A X``, in a code block or the prose: X is a module an example of
    the docs defines (README's ``proj.events``, the tutorial's ``shop`` ...), and Celery finds its app."""
    from celery.app.utils import find_app

    options = [(where, app) for where, app in app_options(page) if app not in NOT_OURS and not app.isupper()]
    unknown = [f"{where}: -A {app}" for where, app in options if app not in DEFINED]
    assert not unknown, f"no example defines these apps (they define {sorted(DEFINED)}): {unknown}"
    own = {module.name for module in modules(BLOCKS[page])}
    where_defined = {app: page if app in own else DEFINED[app] for _where, app in options}
    for defining in sorted(set(where_defined.values())):
        wanted = {app for app, there in where_defined.items() if there == defining}
        with _page_modules(defining, tmp_path / slug(rel(defining)), only=wanted):
            for where, app in options:
                if where_defined[app] == defining:
                    try:
                        find_app(app)
                    except Exception as exc:
                        raise AssertionError(f"{where}: -A {app} does not load: {exc!r}") from exc


# -- running a page's modules --------------------------------------------------------------------------------------

@contextlib.contextmanager
def _page_modules(page: Path, into: Path, only: set[str] | None = None) -> Iterator[tuple[list[Module], list[Any]]]:
    """Write the page's modules under ``into``, import each (or those named ``only``), publishing forbidden
    meanwhile; forget them after."""
    into.mkdir(parents=True, exist_ok=True)
    found = _write(BLOCKS[page], into)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_on_path(into))
        stack.enter_context(_forgotten(into, found))
        stack.enter_context(_signals_restored())
        with _no_publishing():
            loaded = [_import(module, into) for module in found if only is None or module.name in only]
        yield found, loaded


def _import(module: Module, into: Path) -> Any:
    try:
        return importlib.import_module(module.name)
    except AssertionError:
        raise
    except Exception as exc:
        raise AssertionError(f"{module.where}: importing {module.name} fails:\n{_traceback(exc, into)}") from exc


@contextlib.contextmanager
def _on_path(directory: Path) -> Iterator[None]:
    sys.path.insert(0, str(directory))
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path.remove(str(directory))


@contextlib.contextmanager
def _forgotten(directory: Path, found: list[Module]) -> Iterator[None]:
    """Modules of the same top-level names set aside before, the page's own removed after."""
    tops = {m.name.split(".")[0] for m in found}
    saved = {name: mod for name, mod in sys.modules.items() if name.split(".")[0] in tops}
    for name in saved:
        del sys.modules[name]
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] in tops]:
            del sys.modules[name]
        sys.modules.update(saved)


@contextlib.contextmanager
def _signals_restored() -> Iterator[None]:
    """Receivers that the examples connect are gone after the test."""
    every = [getattr(signals, name) for name in signals.__all__ if name != "TypedSignal"]
    saved = [list(s.receivers) for s in every]
    try:
        yield
    finally:
        for signal, receivers in zip(every, saved):
            signal.receivers[:] = receivers
            signal.sender_receivers_cache.clear()


@contextlib.contextmanager
def _no_publishing() -> Iterator[None]:
    """``events.publish`` and friends fail while the examples are imported: no example may publish then."""
    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        frame = next((f for f in reversed(traceback.extract_stack()) if not f.filename.startswith(str(ROOT))
                      and "site-packages" not in f.filename), None)
        where = "?" if frame is None else f"{_page_of(frame.filename)}:{frame.lineno}"
        raise AssertionError(f"{where}: the example publishes while it is imported (a worker, the CLI and every "
                             "test would publish then): publish from a function, a view, or a shell line")

    originals = ServicePublisher.publish, ServicePublisher.publish_many
    ServicePublisher.publish = ServicePublisher.publish_many = refuse
    try:
        yield
    finally:
        ServicePublisher.publish, ServicePublisher.publish_many = originals


#: Each module file written, and the page (or included file) its lines are those of.
_WRITTEN: dict[str, str] = {}


def _write(some: list[Block], into: Path) -> list[Module]:
    found = write_page(some, into)
    for module in found:
        _WRITTEN[str(into / module.path)] = module.blocks[0].included or module.page
    return found


def _page_of(filename: str) -> str:
    return _WRITTEN.get(filename, filename)


def _traceback(exc: BaseException, into: Path) -> str:
    """The traceback, with each written module's file named by its page (whose line numbers it has)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    for written, page in _WRITTEN.items():
        text = text.replace(written, page)
    return text


def _module_named(loaded: list[Any], name: str) -> Any:
    return next((m for m in loaded if m.__name__ == name), None)


# -- what the page does to them ------------------------------------------------------------------------------------

def _run_tests(module: Any, loaded: list[Any], into: Path) -> None:
    """Run the module's ``test_*`` functions, as pytest would, with the fixtures the pages use."""
    fixtures = {name: fn for m in loaded for name, obj in vars(m).items()
                if (fn := _fixture_function(obj)) is not None}
    for name, test in vars(module).items():
        if not (name.startswith("test_") and inspect.isfunction(test) and test.__module__ == module.__name__):
            continue
        parameters = list(inspect.signature(test).parameters)
        if "events_broker" in parameters:
            continue  # needs RabbitMQ: tests/integration/test_docs_example.py runs docs/examples
        with contextlib.ExitStack() as stack:
            arguments = {p: _fixture(p, fixtures, stack) for p in parameters}
            try:
                test(**arguments)
            except Exception as exc:
                raise AssertionError(f"{module.__name__}.{name} fails:\n{_traceback(exc, into)}") from exc


def _fixture(name: str, defined: dict[str, Callable[..., Any]], stack: contextlib.ExitStack) -> Any:
    if name == "events_stub":
        return lambda target, **options: stack.enter_context(StubEvents(target, **options))
    if name == "monkeypatch":
        return stack.enter_context(pytest.MonkeyPatch.context())
    if name in defined:
        fn = defined[name]
        value = fn(**{p: _fixture(p, defined, stack) for p in inspect.signature(fn).parameters})
        if inspect.isgenerator(value):
            stack.callback(lambda: next(value, None))
            return next(value)
        return value
    raise AssertionError(f"an example's test asks for a fixture this test does not provide: {name!r}")


def _fixture_function(obj: Any) -> Callable[..., Any] | None:
    """The function of a ``@pytest.fixture`` (pytest >= 8.4, and before), else None."""
    unwrap = getattr(obj, "_get_wrapped_function", None)
    if callable(unwrap):
        return unwrap()
    if hasattr(obj, "_pytestfixturefunction"):
        return obj.__pytest_wrapped__.obj
    return None


def _publish_as_the_shell_does(module: Any, publish: Any, troubles: list[str]) -> None:
    """``kombu-events -A APP publish KEY JSON``: into the app's stub; each retry comes due; nothing is broken."""
    services = [e for e in registry.services if e.app is module.app]
    with StubEvents(module.app) as stub:
        stub.publish(publish.routing_key, json.loads(publish.body))
        stub.join(fail_fast=False)
        while stub.pending and stub.now < HORIZON_S:
            stub.advance(max(0.0, stub.pending[0].due - stub.now), fail_fast=False)
        assert not stub.pending, f"{publish.where}: still pending after {HORIZON_S} virtual seconds: {stub.pending}"
        for settled in stub.settled:
            if settled.reason and BROKEN.search(settled.reason):
                troubles.append(f"{publish.where}: {settled.handler.__name__} failed: {settled.reason}")
    assert services


def _send_what_the_page_does_not(events: Any, ran: set[Any], troubles: list[str]) -> None:
    """A handler that nothing on its page sends an event gets one: its first binding key (``*`` and ``#`` one
    word), payload ``{}``. It must run; it may fail for want of a field, not for a name the example lacks."""
    for handler in events.handlers:
        if isinstance(handler.fn, TokenHandler) or handler.fn in ran or not handler.binding_keys:
            continue
        key = ".".join("x" if word in ("*", "#") else word for word in handler.binding_keys[0].split("."))
        with StubEvents(events) as stub:
            stub.publish(key, {})
            stub.join(fail_fast=False)
            for settled in stub.settled:
                if settled.reason and BROKEN_ANYWAY.search(settled.reason):
                    troubles.append(f"{settled.handler.__module__}.{settled.handler.__name__}, sent {key} {{}}: "
                                    f"{settled.reason}")


def _call_periodic_functions(events: Any, ran: set[Any]) -> None:
    """Each periodic function, with the payload of a period (the stub does not run schedules)."""
    for handler in events.handlers:
        if isinstance(handler.fn, TokenHandler):
            schedule = handler.fn.schedule
            due = datetime.fromtimestamp(schedule.due_ms(1) / 1000, tz=timezone.utc)
            payload = {"schedule": schedule.name, "period": 1, "due": due.isoformat(timespec="milliseconds"),
                       "missed": [], "missed_count": 0}
            handler.fn.fn(Event(payload, f"{events.service}.schedule.{schedule.name}", handler.queue, 1))
            ran.add(handler.fn)


@contextlib.contextmanager
def _watching(ran: set[Any]) -> Iterator[list[str]]:
    """Record each handler that starts; collect what middleware and signal receivers logged as failing."""
    troubles: list[str] = []

    def started(sender: Any, **kwargs: Any) -> None:
        ran.add(sender)

    class Failures(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info and record.levelno >= logging.ERROR:
                troubles.append(f"{record.name}: {record.getMessage()}\n"
                                + "".join(traceback.format_exception(*record.exc_info)))

    handler = Failures()
    root = logging.getLogger()
    root.addHandler(handler)
    signals.handler_started.connect(weak=False, dispatch_uid="test_doc_examples")(started)
    try:
        yield troubles
    finally:
        signals.handler_started.disconnect(dispatch_uid="test_doc_examples")
        root.removeHandler(handler)
