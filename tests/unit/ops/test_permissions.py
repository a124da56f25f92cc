"""The permissions of a service's users, from its topology: anchored regexes of escaped names that match every
name a user needs and none of another service's; the passive check's comparison of arguments; the setting."""
from __future__ import annotations

import re
import shlex

import pytest
from celery import Celery

from kombu_events import Events
from kombu_events.broker.verify import differences
from kombu_events.core.config import resolve_settings
from kombu_events.errors import ConfigurationError
from kombu_events.ops.permissions import celery_entities, deploy_grant, pattern, runtime_grant, topic_grant


def service(name: str = "bill.ing+1", exchange: str = "ev(ents)", **settings):
    app = Celery(name, set_as_current=False)
    events = Events(app, service=name, exchange=exchange, delay_levels=3, publish_delay_levels=2, **settings)

    @events.handler("orders.*", name="on.order[1]")
    def on_order(payload):
        pass

    @events.periodic("tick", every=60)
    def tick(event):
        pass

    return events


def matches(regex: str, name: str) -> bool:
    return re.fullmatch(regex, name) is not None and re.search(regex, name) is not None


@pytest.mark.parametrize(("names", "yes", "no"), [
    (["a.b", "a.c", "d"], ["a.b", "a.c", "d"], ["a", "a.bc", "xa.b", "a.b.c", "d.e", ""]),
    (["x", "x.y"], ["x", "x.y"], ["x.", "x.yy", "xx"]),
    (["s.q(1)", "s.a+b", "s.d$"], ["s.q(1)", "s.a+b", "s.d$"], ["s.q1", "s.aab", "s.d", "sxq(1)"]),
    ([], [""], ["a", "."]),
])
def test_pattern_matches_exactly_the_names(names, yes, no):
    regex = pattern(names)
    assert regex.startswith("^") and regex.endswith("$")
    for name in yes:
        assert re.search(regex, name), (regex, name)
    for name in no:
        assert not re.search(regex, name), (regex, name)


def test_the_deploy_user_gets_every_name_of_the_topology_and_no_other_services():
    events = service()
    topology = events.topology()
    grant = deploy_grant(topology)
    every = [e.name for e in topology.exchanges] + [q.name for q in topology.queues]
    assert "bill.ing+1.on.order[1]" in every and "ev(ents).deferred.1" in every
    for regex in (grant.configure, grant.write, grant.read):
        assert all(matches(regex, name) for name in every)
        for other in ("bill.ing+1x.on.order[1]", "billxing+1.archive", "bill.ing1.archive", "other.archive",
                      "bill.ing+1.on.order1", "ev(ents)x", "events", "ev(ents).deferred.2", "bill.ing+1.delay.3",
                      "celery", "amq.default"):
            assert not matches(regex, other), (regex, other)


def test_the_runtime_user_configures_only_celerys_names():
    events = service()
    topology = events.topology()
    grant = runtime_grant(topology, celery_entities(events.app))
    mine = [e.name for e in topology.exchanges] + [q.name for q in topology.queues]
    assert not any(matches(grant.configure, name) for name in mine)
    for name in ("celery", "celery.pidbox", "reply.celery.pidbox", "celeryev", "w1@host.example.celery.pidbox",
                 "3f2a.reply.celery.pidbox", "celeryev.5d1e"):
        assert matches(grant.configure, name) and matches(grant.read, name), name


def test_the_runtime_user_writes_where_it_publishes_and_reads_what_it_consumes():
    events = service()
    topology = events.topology()
    grant = runtime_grant(topology, celery_entities(events.app))
    for name in ("ev(ents)", "ev(ents).deferred.0", "ev(ents).deferred.1", "bill.ing+1.delay.0",
                 "bill.ing+1.delay.2", "bill.ing+1.delivery", "bill.ing+1.archive", "amq.default"):
        assert matches(grant.write, name), name
    for name in ("ev(ents).deferred", "ev(ents).unrouted", "bill.ing+1.on.order[1]", "other.archive", "events"):
        assert not matches(grant.write, name), name
    for name in ("bill.ing+1.on.order[1]", "bill.ing+1.schedule.tick", "bill.ing+1.schedule.tick.state",
                 "bill.ing+1.archive"):  # the archive stream: the worker's metrics count it
        assert matches(grant.read, name), name
    for name in ("bill.ing+1.delay.0", "ev(ents).unrouted", "other.on.order[1]",
                 "bill.ing+1.on.order1"):
        assert not matches(grant.read, name), name


def test_the_commands_are_shell_quoted_and_name_the_vhost_and_user():
    events = service()
    topology = events.topology()
    line = runtime_grant(topology, celery_entities(events.app)).command("/prod vh", "run user")
    words = shlex.split(line)
    assert words[:5] == ["rabbitmqctl", "set_permissions", "-p", "/prod vh", "run user"] and len(words) == 8
    assert shlex.split(topic_grant(topology).command("/", "u"))[4:] == ["u", r"^(ev\(ents\))$", ".*", "^$"]


def test_celerys_names_follow_the_apps_settings():
    app = Celery("x", set_as_current=False)
    app.conf.task_default_queue = "jobs.q"
    app.conf.control_exchange = "ctl"
    app.conf.event_exchange = "evx"
    found = celery_entities(app)
    assert found.task_queues == ("jobs.q",)
    assert "ctl.pidbox" in found.exchanges and "reply.ctl.pidbox" in found.exchanges
    assert "evx" in found.exchanges and re.fullmatch(found.made_up_queues[0], "node@h.ctl.pidbox")


def test_differences_name_each_argument_and_type_that_differs():
    topology = service().topology()
    archive = topology.archive_exchange
    listed = {f"queue {q.name}": {"arguments": dict(q.queue_arguments or {})} for q in topology.queues}
    listed.update({f"exchange {e.name}": {"type": e.type, "arguments": dict(e.arguments or {})}
                   for e in topology.exchanges})
    assert differences(topology, listed) == []
    listed[f"queue {archive}"]["arguments"]["x-message-ttl"] = 5
    listed[f"exchange {archive}"]["type"] = "topic"
    found = differences(topology, listed)
    assert len(found) == 2 and all(archive in line for line in found)
    assert any("x-message-ttl=5" in line for line in found)


def test_declare_is_a_setting_from_keywords_or_celery_conf():
    assert resolve_settings("s").declare is True
    assert resolve_settings("s", {"kombu_events_declare": False}).declare is False
    assert resolve_settings("s", declare=False).declare is False
    with pytest.raises(ConfigurationError, match="declare"):
        resolve_settings("s", declare="no")


def test_never_declare_wins_over_the_settings():
    events = service(declare=True)
    assert events.settings.declare is True
    events.never_declare()
    assert events.settings.declare is False


def test_the_management_api_is_never_asked_in_plain_http_for_a_tls_connection(monkeypatch):
    from types import SimpleNamespace

    from kombu_events.broker import verify

    asked: list[str] = []
    monkeypatch.setattr(verify.urllib.request, "urlopen", lambda request, timeout: asked.append(request.full_url))
    tls = SimpleNamespace(ssl={"cert_reqs": 2}, hostname="broker.example", virtual_host="/", userid="svc",
                          password="secret")
    assert verify._listing(tls, None) is None and asked == []
    plain = SimpleNamespace(ssl=False, hostname="127.0.0.1", virtual_host="/", userid="svc", password="secret")
    verify._listing(plain, None)  # the fake urlopen answers nothing usable: None, but it was asked
    assert asked == ["http://127.0.0.1:15672/api/queues/%2F?columns=name,type,arguments"]


def _listing(topology, *, rabbitmq4: bool) -> dict:
    """The management API's listing of a declared topology: RabbitMQ 4 lists a queue's x-queue-type even
    where it was not declared; 3.10 lists the arguments as declared. Both give each queue's ``type``."""
    listed = {}
    for queue in topology.queues:
        arguments = dict(queue.queue_arguments or {})
        kind = arguments.get("x-queue-type", "classic")
        if not rabbitmq4:
            arguments.pop("x-queue-type", None)  # as a queue made by an older version lists it on 3.10
        listed[f"queue {queue.name}"] = {"type": kind, "arguments": {**arguments, "x-queue-type": kind}
                                         if rabbitmq4 else arguments}
    listed.update({f"exchange {e.name}": {"type": e.type, "arguments": dict(e.arguments or {})}
                   for e in topology.exchanges})
    return listed


@pytest.mark.parametrize("rabbitmq4", [False, True], ids=["3.10", "4.0"])
def test_a_classic_queue_listed_with_or_without_its_type_matches(rabbitmq4):
    topology = service().topology()
    assert differences(topology, _listing(topology, rabbitmq4=rabbitmq4)) == []


def test_a_queue_of_the_other_type_differs_unless_it_is_the_exchanges_shared_ladder():
    topology = service().topology()
    listed = _listing(topology, rabbitmq4=True)
    handler = topology.handler_queues[0].name
    deferred = next(q.name for q in topology.queues if topology.role(q.name) == "deferred")
    for name in (handler, deferred):
        listed[f"queue {name}"]["type"] = "quorum"
        listed[f"queue {name}"]["arguments"].update({"x-queue-type": "quorum", "x-overflow": "reject-publish"})
    found = differences(topology, listed)
    assert [line for line in found if deferred in line] == []  # another service declared it first
    assert any(f"queue {handler!r} is a quorum queue" in line for line in found)


def test_an_archive_of_an_earlier_version_is_kept_with_a_warning_and_a_stream_with_other_retention_differs(caplog):
    topology = service().topology()
    archive = topology.archive_exchange
    listed = _listing(topology, rabbitmq4=True)
    listed[f"queue {archive}"] = {"type": "classic", "arguments": {"x-queue-type": "classic",
                                                                   "x-message-ttl": 604_800_000}}
    assert differences(topology, listed) == [], "kept, as declare keeps it: workers of both versions run"
    assert "migrate --archive" in caplog.text
    listed[f"queue {archive}"] = {"type": "stream", "arguments": {"x-queue-type": "stream", "x-max-age": "1s"}}
    assert differences(topology, listed) == [], "its retention is the one it was made with (archive rewrite)"
    listed[f"queue {archive}"] = {"type": "stream", "arguments": {"x-queue-type": "stream", "x-max-priority": 3}}
    assert any("x-max-priority" in line for line in differences(topology, listed))
