"""The new user's service, built from docs/howto/cloudevents-effectively-once.md as the page writes it: its
Node.js publisher (CloudEvents in structured mode, amqplib) and its Python service (a typed handler, ``once=True`` on
PostgreSQL, the outbox) saved from the page's blocks, its commands taken from the page's shell blocks and run in
order, in a vhost and a database of the test's own, with a real ``celery worker``. An order sent twice, a failure
archived, the fix, a replay by id, a late duplicate: every order is charged once and gets one receipt.

Under CI=true a missing PostgreSQL or Node.js fails the test instead of skipping it."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kombu_events.testing import temporary_vhost
from tests.conftest import CI
from tests.doc_examples import ROOT, blocks, shell_lines, write_page

from ..brokers import MANAGEMENT_URL
from .harness import NODE_DIR, unique, wait_for

pytestmark = pytest.mark.integration

PAGE = ROOT / "docs" / "howto" / "cloudevents-effectively-once.md"
POSTGRES = {"host": os.environ.get("KOMBU_EVENTS_TEST_PGHOST", "127.0.0.1"), "port": 5432, "user": "postgres"}
BIN = Path(sys.executable).parent  # the environment the reader installed kombu-events into


def _unavailable(why: str) -> None:
    if CI:
        pytest.fail(f"{why} (CI=true: this test must not be skipped)")
    pytest.skip(why)


def javascript(page: Path, name: str) -> str:
    """The page's ```javascript block whose first line names ``name``."""
    found = re.findall(r"^```javascript\n(// " + re.escape(name) + r"\b.*?)^```$", page.read_text(),
                       flags=re.MULTILINE | re.DOTALL)
    assert len(found) == 1, f"{page.name}: one javascript block for {name}"
    return found[0]


class Reader:
    """The page's commands, run as its reader runs them: one terminal for the worker, another for the rest."""

    def __init__(self, service_dir: Path, node_dir: Path, env: dict[str, str], database: str) -> None:
        self.service_dir, self.node_dir, self.env, self.database = service_dir, node_dir, env, database
        self.commands = [command for _, command in shell_lines(PAGE)]
        self.worker: subprocess.Popen[bytes] | None = None
        self.log = service_dir / "worker.log"

    def on_page(self, start: str) -> str:
        """The page's one command that starts with ``start``, with this test's database for the page's."""
        found = [c for c in self.commands if c.startswith(start)]
        assert len(found) == 1, f"{PAGE.name} shows {len(found)} commands starting with {start!r}: {found}"
        return re.sub(r"(5432/|-U postgres )orders\b", rf"\g<1>{self.database}", found[0])

    def run(self, start: str, *, node: bool = False, code: int = 0) -> subprocess.CompletedProcess[str]:
        """Run the page's command (``export`` sets the variable for the next ones)."""
        command = self.on_page(start)
        if command.startswith("export "):
            name, _, value = command.removeprefix("export ").partition("=")
            self.env[name] = value
            return subprocess.CompletedProcess(command, 0, "", "")
        result = subprocess.run(["bash", "-c", command], cwd=self.node_dir if node else self.service_dir,
                                env=self.env, capture_output=True, text=True, timeout=120)
        assert result.returncode == code, f"$ {command}\nexit {result.returncode}\n{result.stdout}{result.stderr}"
        return result

    def start_worker(self) -> None:
        command = self.on_page("celery -A orders worker")
        with open(self.log, "wb") as log:
            self.worker = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=self.service_dir, env=self.env,
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: " ready." in self.log.read_text() or self.worker.poll() is not None, 60, what="worker")
        assert self.worker.poll() is None, self.log.read_text()[-4000:]

    def stop_worker(self) -> None:
        if self.worker is not None and self.worker.poll() is None:
            os.killpg(self.worker.pid, signal.SIGTERM)
            try:
                self.worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.worker.pid, signal.SIGKILL)
                self.worker.wait(timeout=30)


@pytest.fixture
def database() -> Any:
    """A PostgreSQL database name of this test's own (made by the page's ``createdb``), dropped afterwards."""
    try:
        admin = psycopg.connect(dbname="postgres", autocommit=True, connect_timeout=5, **POSTGRES)
    except psycopg.OperationalError as exc:
        _unavailable(f"PostgreSQL is not reachable at {POSTGRES['host']}:5432: {exc}")
    name = unique("kev_orders_")
    with admin:
        try:
            yield name
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def reader(tmp_path, broker_url, database):
    """The reader's two directories (the Python service's, the Node.js publisher's), written from the page."""
    if shutil.which("node") is None or not (NODE_DIR / "node_modules" / "cloudevents").is_dir():
        _unavailable("node, or the npm packages of tests/node (npm ci --prefix tests/node), is missing")
    if shutil.which("createdb") is None or shutil.which("psql") is None:
        _unavailable("PostgreSQL's createdb and psql are not on PATH")
    service_dir, node_dir = tmp_path / "orders", tmp_path / "shop-js"
    service_dir.mkdir()
    node_dir.mkdir()
    modules = write_page(blocks(PAGE), service_dir)
    assert sorted(m.name for m in modules) == ["orders", "test_orders"]
    (node_dir / "publish-order.js").write_text(javascript(PAGE, "publish-order.js"), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KOMBU_EVENTS_", "CELERY_", "ORDERS_"))}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', os.defpath)}", VIRTUAL_ENV=str(BIN.parent),
               NODE_PATH=str(NODE_DIR / "node_modules"), PGCONNECT_TIMEOUT="5",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    with temporary_vhost(broker_url, management_url=MANAGEMENT_URL) as vhost_url:
        env["RABBIT_URL"] = vhost_url
        env["KOMBU_EVENTS_MANAGEMENT_URL"] = MANAGEMENT_URL
        found = Reader(service_dir, node_dir, env, database)
        try:
            yield found
        finally:
            found.stop_worker()


def test_the_pages_service_charges_every_order_once(reader, database):
    def query(sql: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(dbname=database, autocommit=True, **POSTGRES) as connection:
            return connection.execute(sql).fetchall()

    def per_order(table: str) -> dict[int, int]:
        return dict(query(f"SELECT order_id, count(*) FROM {table} GROUP BY order_id"))

    for command in ("pip install", "npm install amqplib cloudevents"):
        reader.on_page(command)  # done already: the checkout's environment, tests/node's packages

    # 5. The database
    reader.run("createdb")
    reader.run("export ORDERS_DATABASE_URL=")
    reader.run("kombu-events -A orders outbox create-tables")
    reader.run("python -c")
    reader.run("psql -h 127.0.0.1 -U postgres orders -c \"INSERT INTO currencies VALUES ('EUR')\"")

    # 6. Run it: order 7 twice (one message_id), 8, and 9 in a currency not enabled yet
    reader.start_worker()
    published = [c for c in reader.commands if c.startswith("node publish-order.js")]
    assert published == ["node publish-order.js 7 12.50 EUR"] * 2 + ["node publish-order.js 8 30.00 EUR",
                                                                      "node publish-order.js 9 20.00 CHF"]
    for command in published:
        result = subprocess.run(["bash", "-c", command], cwd=reader.node_dir, env=reader.env, capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, result.stderr
    wait_for(lambda: per_order("receipts") == {7: 1, 8: 1}, 60, interval=0.2, what="orders 7 and 8 handled")

    def archived() -> str:
        return str(reader.run("kombu-events -A orders archive list").stdout)

    listing = wait_for(lambda: "order-9-placed" in archived() and archived(), 30, interval=0.5, what="9 archived")
    assert "currency CHF is not enabled" in listing and "order-7" not in listing
    assert "event 'order-7-placed' was handled before (inbox)" in reader.log.read_text()

    # 7. Fix, then replay
    reader.run("psql -h 127.0.0.1 -U postgres orders -c \"INSERT INTO currencies VALUES ('CHF')\"")
    replayed = reader.run("kombu-events -A orders archive replay --id order-9-placed")
    assert "1 replayed, 0 kept" in replayed.stderr, replayed.stderr
    wait_for(lambda: per_order("receipts") == {7: 1, 8: 1, 9: 1}, 60, interval=0.2, what="order 9 handled")
    again = subprocess.run(["bash", "-c", "node publish-order.js 9 20.00 CHF"], cwd=reader.node_dir,
                           env=reader.env, capture_output=True, text=True, timeout=60)  # a late duplicate
    assert again.returncode == 0, again.stderr
    wait_for(lambda: "event 'order-9-placed' was handled before (inbox)" in reader.log.read_text(), 30,
             what="the late duplicate acked from the inbox")
    gone = reader.run("kombu-events -A orders archive replay --id order-9-placed", code=1)
    assert "not found: no archived copy with id 'order-9-placed'" in gone.stderr

    shown = reader.run("psql -h 127.0.0.1 -U postgres orders -c \"SELECT order_id").stdout
    assert re.findall(r"^\s*(\d+)\s*\|\s*(\d+)\s*$", shown, flags=re.MULTILINE) == [("7", "1"), ("8", "1"), ("9", "1")]
    assert per_order("charges") == {7: 1, 8: 1, 9: 1}
    assert per_order("receipts") == {7: 1, 8: 1, 9: 1}
    wait_for(lambda: query("SELECT count(*) FROM kombu_events_outbox") == [(0,)], 30, what="the outbox relayed")
    assert query("SELECT queue, count(*) FROM kombu_events_inbox GROUP BY queue ORDER BY queue") == [
        ("orders.charge", 3), ("orders.send_receipt", 3)]
    assert "0 message(s) shown" in reader.run("kombu-events -A orders archive list").stderr
