"""Fixtures of the integration tests."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import pytest

from .harness import Project, unique
from .private_broker import PrivateBroker

if TYPE_CHECKING:
    import psycopg

#: Modules whose tests lean on timing (faults, breakers, periods, a cluster, green pools, crash accounting) or
#: start private nodes: marked ``heavy``, they run after the rest (scripts/test runs the others in two processes
#: at once), in two groups side by side: each group's modules one at a time, in a process of its own
#: (``xdist_group``). The groups are balanced by time (about 4.5 min each when run alone). The nodes they
#: stop or kill are their own (each pytest process starts its own private node); the node on 5672 is
#: stopped only by the ``serial`` test, which runs last, alone.
HEAVY = {
    # Balanced by a CI run's durations (scripts/test prints the heavy step's 20 slowest): test_log_proof (96 s) moved
    # to heavy-b, the lighter group, on 2026-11-29.
    "test_cluster": "heavy-a", "test_everything_on": "heavy-a", "test_console_10k": "heavy-a",
    "test_inbox_crashes": "heavy-a", "test_green_pools": "heavy-a",
    "test_no_secret_shown": "heavy-b", "test_backlog": "heavy-b", "test_tls": "heavy-b", "test_periodic": "heavy-b",
    "test_breaker": "heavy-b", "test_faults": "heavy-b", "test_log_proof": "heavy-b", "test_replay_restart": "heavy-b",
}
HERE = Path(__file__).parent

#: The machine's PostgreSQL (test_django.py, test_inbox_crashes.py): each test makes databases of its own on it.
POSTGRES = {"host": os.environ.get("KOMBU_EVENTS_TEST_PGHOST", "127.0.0.1"), "port": 5432, "user": "postgres"}


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(items):
    """Mark the HEAVY modules' tests ``heavy``, in their group (not tests/unit's modules of the same names)."""
    for item in items:
        group = HEAVY.get(item.path.stem) if item.path.parent == HERE else None
        if group is not None:
            item.add_marker(pytest.mark.heavy)
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture
def make_project(tmp_path, broker_url):
    """``make_project(body, **kwargs)``: a Project in its own directory, cleaned up after the test."""
    projects: list[Project] = []

    def make(body: str, **kwargs) -> Project:
        directory = tmp_path / f"p{len(projects)}"
        directory.mkdir()
        project = Project(directory, broker_url, body, **kwargs)
        projects.append(project)
        return project

    yield make
    errors = []
    for project in projects:
        try:
            project.cleanup()
        except Exception as exc:  # clean up the others anyway, then fail
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture(scope="session")
def private_broker_session(tmp_path_factory):
    """A RabbitMQ node of this session's own (scripts/rabbitmq-cluster), stopped at the end, no VM left behind.

    Skips locally when it cannot start; fails under CI=true.
    """
    broker = PrivateBroker(tmp_path_factory.mktemp("rabbitmq"))
    try:
        broker.start()
    except Exception as exc:
        try:
            broker.stop()  # whatever did start, and any VM of it left behind
        except Exception as stop_error:
            exc = RuntimeError(f"{exc}; then stopping it failed too: {stop_error}")
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"the private RabbitMQ node did not start (CI=true: must not skip): {exc}")
        pytest.skip(f"the private RabbitMQ node did not start: {exc}")
    yield broker
    strays = broker.stop()
    assert not strays, f"beam processes of {broker.name} outlived `rabbitmq-cluster stop` (killed): {strays}"


@pytest.fixture
def private_broker(private_broker_session):
    """The session's private node, its app running when the test starts and when it ends."""
    if not private_broker_session.app_running:
        private_broker_session.start_app()
    yield private_broker_session
    if not private_broker_session.app_running:
        private_broker_session.start_app()


def _postgres_unavailable(why: str) -> None:
    """Skip locally; fail under CI=true."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{why} (CI=true: tests that need PostgreSQL must not be skipped)")
    pytest.skip(why)


@pytest.fixture(scope="module")
def postgres() -> Iterator[psycopg.Connection]:
    """A connection to the server's ``postgres`` database (autocommit); skips locally without it, fails in CI."""
    import psycopg  # only the tests that ask for it need the driver

    try:
        connection = psycopg.connect(dbname="postgres", autocommit=True, connect_timeout=5, **POSTGRES)
    except psycopg.OperationalError as exc:
        _postgres_unavailable(f"PostgreSQL is not reachable at {POSTGRES['host']}:5432: {exc}")
    with connection:
        yield connection


@pytest.fixture
def effects_database(make_database) -> Callable[[str, str], str]:
    """``effects_database(prefix, columns)``: a new database (``make_database``) with kombu-events' inbox and outbox
    tables and a table ``effects (columns)``; its SQLAlchemy URL."""
    def make(prefix: str, columns: str) -> str:
        import psycopg
        import sqlalchemy

        from kombu_events.database.tables import metadata
        database = make_database(prefix)
        url = f"postgresql+psycopg://postgres@{POSTGRES['host']}:5432/{database}"
        engine = sqlalchemy.create_engine(url)
        metadata.create_all(engine)
        engine.dispose()
        with psycopg.connect(dbname=database, autocommit=True, **POSTGRES) as connection:
            connection.execute(f"CREATE TABLE effects ({columns})")
        return url
    return make


@pytest.fixture
def make_database(postgres) -> Iterator[Callable[[str], str]]:
    """``make_database(prefix)``: the name of a new database of this test's own, dropped afterwards (its sessions
    too)."""
    names: list[str] = []

    def make(prefix: str) -> str:
        name = unique(prefix)
        names.append(name)
        postgres.execute(f'CREATE DATABASE "{name}"')
        return name

    try:
        yield make
    finally:
        for name in names:
            postgres.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
