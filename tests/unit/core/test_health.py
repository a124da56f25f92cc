"""Health checks: what a check returns becomes a Health; registering them and circuit breakers on ``Events``."""
from __future__ import annotations

import pytest
from celery import Celery

from kombu_events import CircuitBreaker, ConfigurationError, Degraded, Events, Healthy, Unhealthy
from kombu_events.core.config import resolve_settings
from kombu_events.core.health import Health, HealthCheck, run_check
from kombu_events.middleware.breakers import Breakers


def fine():
    return Healthy


def slow():
    return Degraded("p99 2 s")


def broken():
    raise ConnectionError("refused")


def odd():
    return "ok"


class Meh(Health):
    """A Health of the user's own, with no status a circuit knows."""


def meh():
    return Meh("so-so")


def meh_class():
    return Meh


@pytest.mark.parametrize("fn, expected", [
    (fine, Healthy()),
    (slow, Degraded("p99 2 s")),
    (lambda: Unhealthy(), Unhealthy()),
    (broken, Unhealthy("health check broken raised builtins.ConnectionError: refused")),
    (odd, Unhealthy("health check odd returned 'ok', not Healthy, Degraded or Unhealthy")),
    (meh, Unhealthy("health check meh returned Meh('so-so'), not Healthy, Degraded or Unhealthy")),
    (meh_class, Unhealthy(f"health check meh_class returned {Meh!r}, not Healthy, Degraded or Unhealthy")),
])
def test_a_check_always_gives_a_health_whatever_it_does(fn, expected):
    assert run_check(fn) == expected


def test_health_values_show_their_status_and_reason():
    assert (Healthy().status, Degraded().status, Unhealthy().status) == ("healthy", "degraded", "unhealthy")
    assert repr(Unhealthy("db down")) == "Unhealthy('db down')" and repr(Healthy()) == "Healthy()"
    assert Unhealthy("a") != Degraded("a") and len({Healthy(), Healthy()}) == 1


@pytest.mark.parametrize("options, match", [
    ({"interval_s": 0}, "interval_s"), ({"timeout_s": -1}, "timeout_s"), ({"interval_s": True}, "interval_s"),
])
def test_a_bad_check_interval_or_timeout_names_the_setting(options, match):
    with pytest.raises(ConfigurationError, match=match):
        HealthCheck(fine, (fine,), **options)


def test_a_check_must_serve_a_handler():
    with pytest.raises(ConfigurationError, match="names no handler"):
        HealthCheck(fine, ())


def events(**settings) -> Events:
    return Events(Celery("t", set_as_current=False), service="billing", **settings)


def breakers_of(ev: Events) -> Breakers | None:
    return next((m for m in ev.hooks.middleware if isinstance(m, Breakers)), None)


def test_breakers_are_off_by_default_and_add_no_middleware():
    ev = events()

    @ev.handler("orders.#")
    def charge(payload): ...

    assert ev.handlers[0].circuit_breaker is None and breakers_of(ev) is None


def test_a_handlers_breaker_adds_the_middleware_last_for_that_handler_only():
    ev = events()
    policy = CircuitBreaker(max_failures=2)

    @ev.handler("orders.#", circuit_breaker=policy)
    def charge(payload): ...

    @ev.handler("refunds.#")
    def refund(payload): ...

    breakers = breakers_of(ev)
    assert list(breakers.circuits) == ["billing.charge"]
    assert breakers.circuits["billing.charge"].breaker.policy is policy
    assert ev.hooks.middleware[-1] is breakers
    assert (breakers.prefetch_count, breakers.max_delay_ms) == (100, ev.settings.max_delay_ms)


def test_the_service_default_applies_unless_a_handler_turns_it_off():
    ev = events(circuit_breaker=CircuitBreaker(reset_s=5))

    @ev.handler("orders.#")
    def charge(payload): ...

    @ev.handler("refunds.#", circuit_breaker=False)
    def refund(payload): ...

    assert [h.circuit_breaker for h in ev.handlers] == [CircuitBreaker(reset_s=5), None]


def test_the_setting_from_celery_config_may_be_a_mapping():
    app = Celery("t", set_as_current=False)
    app.conf.kombu_events_circuit_breaker = {"max_failures": 3, "reset_s": 1}
    settings = resolve_settings("billing", app.conf, environ={})
    assert settings.circuit_breaker == CircuitBreaker(max_failures=3, reset_s=1)


@pytest.mark.parametrize("value, match", [({"max_failurez": 3}, "max_failurez"), (5, "CircuitBreaker")])
def test_a_bad_service_breaker_is_refused(value, match):
    with pytest.raises(ConfigurationError, match=match):
        resolve_settings("billing", None, environ={}, circuit_breaker=value)


def test_a_bad_handler_breaker_is_refused_at_decoration():
    with pytest.raises(ConfigurationError, match=r"circuit_breaker of handler\('orders.#'\)"):
        events().handler("orders.#", circuit_breaker={"max_failures": 1})


def test_health_check_registers_one_check_for_several_handlers():
    ev = events(circuit_breaker=CircuitBreaker())

    @ev.handler("orders.#")
    def charge(payload): ...

    @ev.handler("refunds.#")
    def refund(payload): ...

    @ev.health_check(charge, refund, interval_s=3)
    def database():
        return Healthy()

    [run] = breakers_of(ev).runs
    assert run.check == HealthCheck(database, (charge, refund), 3, 10)
    assert [c.runs for c in breakers_of(ev).circuits.values()] == [[run], [run]]
    assert database() == Healthy(), "the decorator returns the function"


def test_a_health_check_of_a_handler_without_a_breaker_fails_when_the_routes_are_resolved():
    ev = events()

    @ev.handler("orders.#")
    def charge(payload): ...

    @ev.health_check(charge)
    def database():
        return Healthy()

    with pytest.raises(ConfigurationError, match="give it circuit_breaker="):
        ev.routes()
