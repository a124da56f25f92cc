"""publishing/breakers.py and health.py: the publisher's breakers, fed by publishes and health checks
(virtual clock).
"""
from __future__ import annotations

import pytest

from kombu_events.core.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from kombu_events.core.health import DEGRADED, HEALTHY, UNHEALTHY, Degraded, Healthy, Unhealthy, run_check
from kombu_events.errors import ConfigurationError
from kombu_events.publishing.breakers import PUBLISHER_CIRCUIT, PublisherBreakers, publisher_policy
from kombu_events.publishing.health import (
    BROKER,
    BrokerAnswers,
    PublisherCheck,
    as_check,
    broker_check,
)


def run(check: PublisherCheck) -> tuple[str, str]:
    """Run a publisher check as the flusher does: its status and the reason it gave."""
    result = run_check(check.fn)
    return result.status, result.reason


def Check(name: str = BROKER, interval_s: float | None = None, result: object = Healthy,
          circuit: CircuitBreaker | None = None) -> PublisherCheck:
    """A check that returns (or raises) ``result``."""
    def fn():
        if isinstance(result, Exception):
            raise result
        return result

    return PublisherCheck(fn, interval_s=interval_s, circuit=circuit, name=name)


def test_one_failed_publish_opens_the_broker_circuit_by_default():
    breakers = PublisherBreakers([Check()])
    assert breakers.closed()
    change = breakers.publish_failed(100.0, "connection refused")
    assert change is not None and (change.check, change.previous, change.state) == (BROKER, CLOSED, OPEN)
    assert not breakers.closed()
    assert breakers.open_reasons() == ["circuit 'broker' open: connection refused"]
    assert breakers.publish_failed(100.1, "again") is None, "a failure while open changes nothing"


def test_an_open_circuit_is_probed_by_its_check_once_its_reset_time_comes():
    breakers = PublisherBreakers([Check()])
    breakers.publish_failed(100.0, "refused")
    assert breakers.due(100.5) == [] and breakers.next_due(100.5) == 101.0  # reset_s = 1
    (probe,) = breakers.due(101.0)
    assert probe.name == BROKER and breakers.breakers[BROKER].state == HALF_OPEN
    assert breakers.due(101.0) == [], "exactly one probe at a time"
    assert not breakers.closed(), "publishing still goes to the backlog while half-open"
    change = breakers.report(BROKER, HEALTHY, 101.2)
    assert change is not None and (change.previous, change.state) == (HALF_OPEN, CLOSED)
    assert breakers.closed() and breakers.next_due(101.2) is None


def test_a_failed_probe_reopens_for_longer_up_to_the_cap():
    breakers = PublisherBreakers([Check()])
    breakers.publish_failed(0.0, "refused")
    now, waits = 0.0, []
    for _ in range(8):
        now = breakers.next_due(now)
        assert [c.name for c in breakers.due(now)] == [BROKER]
        breakers.report(BROKER, UNHEALTHY, now, "refused")
        waits.append(breakers.next_due(now) - now)
    assert waits == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0], "exponential from 1 s, capped at 30 s"


def test_a_users_check_runs_on_its_interval_and_trips_its_own_circuit():
    dependency = Check("payments-api", interval_s=5.0, circuit=CircuitBreaker(max_unhealthy=2, reset_s=10.0))
    breakers = PublisherBreakers([Check(), dependency])
    assert breakers.periodic()
    assert breakers.due(0.0) == [dependency]
    assert breakers.report("payments-api", UNHEALTHY, 0.0) is None, "one unhealthy is not two"
    assert breakers.due(4.9) == [] and breakers.next_due(4.9) == 5.0
    assert breakers.due(5.0) == [dependency]
    change = breakers.report("payments-api", UNHEALTHY, 5.0, "503 from payments")
    assert change is not None and change.state == OPEN and change.reason == "503 from payments"
    assert not breakers.closed() and breakers.breakers[BROKER].state == CLOSED
    assert breakers.next_due(5.0) == 15.0
    assert breakers.due(15.0) == [dependency]
    assert breakers.report("payments-api", HEALTHY, 15.0).state == CLOSED
    assert breakers.closed()


def test_degraded_checks_trip_only_at_their_own_threshold():
    breakers = PublisherBreakers([Check(), Check("db", interval_s=1.0)])
    for t in range(9):
        assert breakers.report("db", DEGRADED, float(t)) is None
    assert breakers.report("db", DEGRADED, 9.0).state == OPEN  # the default: 10 degraded within 10 s


def test_guard_configuration_errors():
    with pytest.raises(ConfigurationError, match="must include the broker"):
        PublisherBreakers([Check("db")])
    with pytest.raises(ConfigurationError, match="unique"):
        PublisherBreakers([Check(), Check()])


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
def test_a_check_gives_the_status_and_reason_it_returned(result, expected):
    assert run(Check("db", result=result)) == expected


@pytest.mark.parametrize("result", [True, None, "healthy", ConnectionError("refused")])
def test_anything_else_is_unhealthy_with_the_reason_saying_what(result):
    status, reason = run(Check("db", result=result))
    assert status == UNHEALTHY and reason.startswith("health check ")


def test_as_check_wraps_functions_and_refuses_the_rest():
    def payments_up():
        return Healthy

    check = as_check(payments_up)
    assert check.name.endswith("payments_up") and check.interval_s == 10.0 and check.circuit is None
    assert run(check) == (HEALTHY, "")
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
    status, reason = run(check)  # unit tests may not open sockets: the attempt fails, as when down
    assert status == UNHEALTHY and "does not answer" in reason and "secret" not in reason
