"""The faults of the everything-on scenario, injected into a running :class:`~.everything.Scenario`.

:class:`Faults` is the scenario's half that breaks things: each ``_<fault>`` method injects
one fault, waits for its effect (the circuit opened and closed, the worker consuming
again, a silent connection noticed) and raises AssertionError if the effect did not
come; :meth:`Faults.inject` turns that into a problem in the scenario's ledger and goes on.
It uses the scenario's broker, proxy, worker, records and ledger.
"""
from __future__ import annotations

__all__ = ["Faults", "FAULTS", "DEPENDENCY_DOWN", "faults_for", "children"]

import os
import signal
import time
from typing import Any

from .everything_accounting import errors_between, last_record_before
from .everything_app import DOWN_FLAG
from .harness import wait_for

#: In the order they are injected, one after each chunk of events.
FAULTS = ("breaker", "pool_child_kill", "broker_restart", "silent_connection", "worker_kill")
#: Faults during whose chunk the breaker's dependency is down: a silent connection then meets an open circuit,
#: whose half-open probe resumes its queue on the event loop meanwhile.
DEPENDENCY_DOWN = ("breaker", "silent_connection")
BREAKER_DOWN_S = 3.0
BROKER_DOWN_S = 1.0
#: How long a silent connection may go unnoticed (heartbeat 4 s: missed after 8 s, checked every 2 s).
NOTICE_WITHIN_S = 20.0


def faults_for(pool: str) -> tuple[str, ...]:
    """The faults of one cycle: killing a pool child needs a pool of child processes."""
    return tuple(f for f in FAULTS if f != "pool_child_kill" or pool == "prefork")


def children(pid: int) -> list[int]:
    """Pids of the direct children of ``pid``."""
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                found += [int(c) for c in fh.read().split()]
    except OSError:
        pass
    return found


class Faults:
    """Fault injection for :class:`~.everything.Scenario` (a mixin: the scenario holds the state it uses)."""

    broker: Any
    proxy: Any
    worker: Any
    records: Any
    records_dir: Any
    ledger: Any
    started: float
    _lock: Any
    _down_since: float

    def note(self, what: str) -> None:
        raise NotImplementedError

    def _start_worker(self) -> None:
        raise NotImplementedError

    def inject(self, fault: str) -> None:
        """Inject ``fault``; a fault that did not have its effect is a problem in the ledger."""
        self.note(f"fault: {fault}")
        started = time.time()
        try:
            getattr(self, f"_{fault}")()
        except AssertionError as exc:
            self.ledger.fault_problems.append(f"{fault} at +{started - self._wall_start():.0f}s: {exc}")
            self.note(f"fault {fault}: PROBLEM: {exc}")
        self.ledger.faults[fault] += 1
        self.ledger.last_fault_end = time.time()

    def _wall_start(self) -> float:
        return time.time() - (time.monotonic() - self.started)

    def _breaker(self) -> None:
        since = self._down_since
        time.sleep(max(0.0, since + BREAKER_DOWN_S - time.time()))
        (self.records_dir / DOWN_FLAG).unlink()
        changes = lambda: [c["state"] for c in self.records("circuits") if c["t"] >= since]  # noqa: E731
        opened = "open" in changes()
        wait_for(lambda: changes() and changes()[-1] == "closed", timeout=20, interval=0.2,
                 what=f"the circuit closed again ({changes()})")
        self.note(f"circuit: {' -> '.join(changes())}")
        assert opened, f"the dependency was down {BREAKER_DOWN_S} s, yet the circuit did not open: {changes()}"

    def _pool_child_kill(self) -> None:
        with self._lock:
            assert self.worker is not None
            pid = self.worker.proc.pid
            kids = children(pid)
            assert kids, f"worker {pid} has no pool children"
            busy = [h["pid"] for h in self.records("hooks") if h["hook"] == "handling" and h["pid"] in kids]
            victim = busy[-1] if busy else kids[0]
            os.kill(victim, signal.SIGKILL)
            self.ledger.killed.add(victim)
        self.note(f"killed pool child {victim} (-9) of worker {pid}")

    def _broker_restart(self) -> None:
        since = time.time()
        self._connection_fault()
        self.broker.stop_app()
        time.sleep(BROKER_DOWN_S)
        self.broker.start_app()
        self.ledger.broker_stops.append((since, time.time()))
        self.note(f"broker restarted (down {time.time() - since:.1f} s)")
        self._await_consuming(since, "after the broker restart")

    def _silent_connection(self) -> None:
        try:
            self._circuit_open()
            self._silence()
        finally:
            (self.records_dir / DOWN_FLAG).unlink()

    def _circuit_open(self) -> None:
        """Wait (a while) until the breaker's circuit is open: its dependency has been down since the chunk."""
        def state() -> str:
            changes = [c["state"] for c in self.records("circuits") if c["t"] >= self._down_since]
            return changes[-1] if changes else "closed"
        try:
            wait_for(lambda: state() == "open", timeout=10, interval=0.1, what="the circuit open")
        except AssertionError:
            self.note(f"the circuit is {state()}, not open, as the connection goes silent")

    def _silence(self) -> None:
        assert self.proxy is not None
        since, wall = time.monotonic(), time.time()
        self._connection_fault()
        frozen = self.proxy.freeze()
        try:
            wait_for(lambda: self.proxy.accepted_since(since), timeout=NOTICE_WITHIN_S, interval=0.1,
                     what=f"a new connection from the worker: {frozen} connection(s) silent")
            self.note(f"{frozen} connection(s) silent: the worker connected again after "
                      f"{self.proxy.accepted[-1] - since:.1f} s")
        except AssertionError as exc:
            thawed = time.time()
            self.proxy.thaw()
            time.sleep(3)  # what was blocked on the silent connection fails now: its log says what it was
            log = self.worker.log if self.worker else ""
            raise AssertionError(
                f"{exc}; the worker's last log line before the connection flowed again: "
                f"{last_record_before(log, thawed)!r}; errors it logged once it flowed (the broker had closed it "
                f"meanwhile): {errors_between(log, wall, time.time()) or 'none'}") from None
        finally:
            self.proxy.thaw()
        self._await_consuming(wall, "after its connection went silent")

    def _worker_kill(self) -> None:
        """kill -9 the worker's main process, then its orphaned pool children; start a new worker."""
        with self._lock:
            worker = self.worker
            assert worker is not None, "no worker to kill"
            pid = worker.proc.pid
            kids = children(pid)
            os.kill(pid, signal.SIGKILL)
            worker.proc.wait(timeout=30)
            worker.kill()  # the orphans: its process group
            self.ledger.killed.update([pid, *kids])
            self.note(f"killed worker {pid} (-9) and its children {kids}")
            self._start_worker()

    def _connection_fault(self) -> None:
        with self._lock:
            if self.worker is not None:
                self.ledger.connection_faults[self.worker.proc.pid] += 1

    def _await_consuming(self, since: float, when: str) -> None:
        wait_for(lambda: self.worker and self._started_since(self.worker.proc.pid, since), timeout=60, interval=0.2,
                 what=f"the worker consuming again {when}")

    def _started_since(self, pid: int, since: float) -> bool:
        """Whether worker ``pid`` started consuming (the ``started`` hook) at ``since`` (time.time()) or later."""
        return any(h["hook"] == "started" and h["pid"] == pid and h["t"] >= since
                   for h in reversed(self.records("hooks")))
