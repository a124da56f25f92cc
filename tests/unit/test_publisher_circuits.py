"""publishing/circuits.py and checks.py: the publisher's circuits, fed by publishes and health checks
(virtual clock).
"""
from __future__ import annotations

import pytest

from kombu_events.core.circuit import (
    CLOSED,
    DEGRADED,
    HALF_OPEN,
    HEALTHY,
    OPEN,
    UNHEALTHY,
    CircuitBreaker,
)
from kombu_events.core.health import Degraded, Healthy, Unhealthy
from kombu_events.errors import ConfigurationError
from kombu_events.publishing.checks import (
    BROKER,
    BrokerAnswers,
    PublisherCheck,
    as_check,
    broker_check,
    run_check,
)
from kombu_events.publishing.circuits import PUBLISHER_CIRCUIT, Guard, publisher_policy


def Check(name: str = BROKER, interval_s: float | None = None, result: object = Healthy,
          circuit: CircuitBreaker | None = None) -> PublisherCheck:
    """A check that returns (or raises) ``result``."""
    def fn():
        if isinstance(result, Exception):
            raise result
        return result

    return PublisherCheck(fn, interval_s=interval_s, circuit=circuit, name=name)


def test_one_failed_publish_opens_the_broker_circuit_by_default():
    guard = Guard([Check()])
    assert guard.closed()
    change = guard.publish_failed(100.0, "connection refused")
    assert change is not None and (change.check, change.previous, change.state) == (BROKER, CLOSED, OPEN)
    assert not guard.closed()
    assert guard.open_reasons() == ["circuit 'broker' open: connection refused"]
    assert guard.publish_failed(100.1, "again") is None, "a failure while open changes nothing"


def test_an_open_circuit_is_probed_by_its_check_once_its_reset_time_comes():
    guard = Guard([Check()])
    guard.publish_failed(100.0, "refused")
    assert guard.due(100.5) == [] and guard.next_due(100.5) == 101.0  # reset_s = 1
    (probe,) = guard.due(101.0)
    assert probe.name == BROKER and guard.breakers[BROKER].state == HALF_OPEN
    assert guard.due(101.0) == [], "exactly one probe at a time"
    assert not guard.closed(), "publishing still goes to the backlog while half-open"
    change = guard.report(BROKER, HEALTHY, 101.2)
    assert change is not None and (change.previous, change.state) == (HALF_OPEN, CLOSED)
    assert guard.closed() and guard.next_due(101.2) is None


def test_a_failed_probe_reopens_for_longer_up_to_the_cap():
    guard = Guard([Check()])
    guard.publish_failed(0.0, "refused")
    now, waits = 0.0, []
    for _ in range(8):
        now = guard.next_due(now)
        assert [c.name for c in guard.due(now)] == [BROKER]
        guard.report(BROKER, UNHEALTHY, now, "refused")
        waits.append(guard.next_due(now) - now)
    assert waits == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0], "exponential from 1 s, capped at 30 s"


def test_a_users_check_runs_on_its_interval_and_trips_its_own_circuit():
    dependency = Check("payments-api", interval_s=5.0, circuit=CircuitBreaker(max_unhealthy=2, reset_s=10.0))
    guard = Guard([Check(), dependency])
    assert guard.periodic()
    assert guard.due(0.0) == [dependency]
    assert guard.report("payments-api", UNHEALTHY, 0.0) is None, "one unhealthy is not two"
    assert guard.due(4.9) == [] and guard.next_due(4.9) == 5.0
    assert guard.due(5.0) == [dependency]
    change = guard.report("payments-api", UNHEALTHY, 5.0, "503 from payments")
    assert change is not None and change.state == OPEN and change.reason == "503 from payments"
    assert not guard.closed() and guard.breakers[BROKER].state == CLOSED
    assert guard.next_due(5.0) == 15.0
    assert guard.due(15.0) == [dependency]
    assert guard.report("payments-api", HEALTHY, 15.0).state == CLOSED
    assert guard.closed()


def test_degraded_checks_trip_only_at_their_own_threshold():
    guard = Guard([Check(), Check("db", interval_s=1.0)])
    for t in range(9):
        assert guard.report("db", DEGRADED, float(t)) is None
    assert guard.report("db", DEGRADED, 9.0).state == OPEN  # the default: 10 degraded within 10 s


def test_guard_configuration_errors():
    with pytest.raises(ConfigurationError, match="must include the broker"):
        Guard([Check("db")])
    with pytest.raises(ConfigurationError, match="unique"):
        Guard([Check(), Check()])


def test_publisher_policy():
    assert publisher_policy(None, True) is PUBLISHER_CIRCUIT
    custom = CircuitBreaker(reset_s=5)
    assert publisher_policy(custom, True) is custom
    with pytest.raises(ConfigurationError, match="need a backlog"):
        publisher_policy(custom, False)
    with pytest.raises(ConfigurationError, match="need a backlog"):
        publisher_policy(None, False, [Check("db")])
    with pytest.raises(ConfigurationError, match="must be a CircuitBreaker"):
        publisher_policy({"reset_s": 5}, True)  # type: ignore[arg-type]


@pytest.mark.parametrize(("result", "expected"), [
    (Healthy, (HEALTHY, "")), (Healthy(), (HEALTHY, "")), (Degraded("slow"), (DEGRADED, "slow")),
    (Unhealthy("503 from payments"), (UNHEALTHY, "503 from payments")),
])
def test_run_check_returns_the_status_and_reason_the_check_gave(result, expected):
    assert run_check(Check("db", result=result)) == expected


@pytest.mark.parametrize("result", [True, None, "healthy", ConnectionError("refused")])
def test_anything_else_is_unhealthy_with_the_reason_saying_what(result):
    status, reason = run_check(Check("db", result=result))
    assert status == UNHEALTHY and reason.startswith("health check ")


def test_as_check_wraps_functions_and_refuses_the_rest():
    def payments_up():
        return Healthy

    check = as_check(payments_up)
    assert check.name.endswith("payments_up") and check.interval_s == 10.0 and check.circuit is None
    assert run_check(check) == (HEALTHY, "")
    own = Check("db")
    assert as_check(own) is own
    with pytest.raises(ConfigurationError, match="functions or PublisherCheck"):
        as_check("payments")
    with pytest.raises(ConfigurationError, match="interval_s"):
        PublisherCheck(payments_up, interval_s=0)
    with pytest.raises(ConfigurationError, match="must be a CircuitBreaker"):
        PublisherCheck(payments_up, circuit={"reset_s": 1})  # type: ignore[arg-type]


def test_the_broker_check_is_only_a_probe_and_hides_the_password():
    check = broker_check("amqp://guest:secret@localhost//")
    assert check.name == BROKER and check.interval_s is None and isinstance(check.fn, BrokerAnswers)
    status, reason = run_check(check)  # unit tests may not open sockets: the attempt fails, as when down
    assert status == UNHEALTHY and "does not answer" in reason and "secret" not in reason
