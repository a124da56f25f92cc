"""The console's ASGI application against the real broker (Starlette's TestClient: no socket of its own).

Each test has its own service with an archive seeded as a worker fills it; the worker and the browser
are in test_console_browser.py.
"""
from __future__ import annotations

import json
import logging
import re

import pytest
from kombu import Connection
from starlette.testclient import TestClient

from kombu_events.console import AuthSettings, ConsoleSettings, create_app
from kombu_events.console.audit import BY_HEADER, JOB_HEADER
from kombu_events.console.jobs import RECOVERABLE
from kombu_events.ops.archive import ORIGINAL_ID, ReplayProgress, browse, read, replay

from .console_helpers import SAME_ORIGIN, Seeded, basic, seeded
from .harness import queue_depth, wait_for
from .json_schemas import assert_valid

pytestmark = pytest.mark.integration

OPERATOR_PW, VIEWER_PW = "operator-pw-0123456789", "viewer-pw-0123456789"
AUTH = AuthSettings(passwords={"operator": OPERATOR_PW, "viewer": VIEWER_PW},
                    tokens={"t" * 32: ("ci-bot", "operator")})
OPERATOR, VIEWER = basic("alice", OPERATOR_PW), basic("bob", VIEWER_PW)


@pytest.fixture
def service(broker_url):
    yield from seeded(broker_url)


def client(service: Seeded, tmp_path, **settings) -> TestClient:
    settings.setdefault("auth", AUTH)
    app = create_app(service.events, ConsoleSettings(audit_path=tmp_path / "audit.jsonl", **settings))
    return TestClient(app, base_url="http://127.0.0.1:8089", client=("127.0.0.1", 50000))


def _ids(service: Seeded) -> list[str]:
    with Connection(service.broker_url) as conn:
        return [m.id for m in read(conn, service.events.topology())]


def fill(service: Seeded) -> dict[str, list[str]]:
    """Three groups: 3 orders 'order N not found', 2 orders 'timeout', 1 users failure."""
    notfound = service.archive([("orders", f"orders.{n}.created", f"KeyError: 'order {n} not found'",
                                 json.dumps({"order": n}).encode()) for n in (1, 2, 3)])
    timeout = service.archive([("orders", "orders.9.paid", "TimeoutError: db took 30.5 s", b'{"order": 9}')] * 2)
    users = service.archive([("users", "users.7.joined", "ValueError: bad email", b"\xff\xfe binary")])
    return {"notfound": notfound, "timeout": timeout, "users": users}


# -- (1) secure by default ------------------------------------------------------------------------------

def test_no_credentials_401_viewer_cannot_act_cross_site_refused_no_password_shown(service, tmp_path):
    groups = fill(service)
    with client(service, tmp_path) as web:
        answer = web.get("/")
        assert answer.status_code == 401 and "Basic" in answer.headers["www-authenticate"]
        assert answer.headers["content-security-policy"] and answer.headers["x-frame-options"] == "DENY"
        assert web.get("/failures", headers=basic("eve", "wrong-password-123")).status_code == 401
        page = web.get("/failures", headers=VIEWER)
        assert page.status_code == 200 and "bob (viewer)" in page.text
        assert "guest:guest" not in page.text and ":guest@" not in page.text and "**" in page.text
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
        form = {"q": "", "scope": "matching"}
        refused = web.post("/replay", data=form, headers={**VIEWER, **SAME_ORIGIN})
        assert refused.status_code == 403 and "viewer" in refused.text
        cross = web.post("/replay", data=form, headers={**OPERATOR, "Sec-Fetch-Site": "cross-site"})
        assert cross.status_code == 403 and "cross-site" in cross.text
        foreign = web.post("/replay", data=form, headers={**OPERATOR, "Origin": "https://evil.example"})
        assert foreign.status_code == 403
        bare = web.post("/replay", data=form, headers=OPERATOR)  # Basic auth but no browser header at all
        assert bare.status_code == 403
        assert web.get("/replay", headers=OPERATOR).status_code == 405  # state changes are POSTs only
        assert web.put("/api/purge", headers={**OPERATOR, **SAME_ORIGIN}).status_code == 405
    assert sorted(_ids(service)) == sorted(i for ids in groups.values() for i in ids)  # nothing was replayed


def test_unauthenticated_console_answers_only_loopback_and_read_only_refuses(service, tmp_path):
    fill(service)
    with client(service, tmp_path, auth=AuthSettings()) as web:
        assert web.get("/", headers={"Host": "127.0.0.1:8089"}).status_code == 200
        assert web.get("/", headers={"Host": "evil.example"}).status_code == 401  # DNS rebinding
    app = create_app(service.events, ConsoleSettings(auth=AuthSettings()))
    with TestClient(app, base_url="http://127.0.0.1:8089", client=("10.1.2.3", 4000)) as web:
        assert web.get("/").status_code == 401
    with client(service, tmp_path, read_only=True) as web:
        answer = web.post("/replay", data={"scope": "matching"}, headers={**OPERATOR, **SAME_ORIGIN})
        assert answer.status_code == 403 and "read-only" in answer.text
        assert "Replay" not in web.get("/failures", headers=OPERATOR).text.split("<h2>Messages")[0] \
            .split("Act on them")[-1]
    proxy = AuthSettings(proxy_header="X-Forwarded-User", proxy_operators=frozenset({"carol"}))
    with client(service, tmp_path, auth=proxy) as web:
        assert "carol (operator)" in web.get("/", headers={"X-Forwarded-User": "carol"}).text
        assert "dave (viewer)" in web.get("/", headers={"X-Forwarded-User": "dave"}).text
        assert web.get("/").status_code == 401


# -- (2) overview, grouped failures, search; (3) one event ----------------------------------------------

def test_overview_groups_search_and_event_page_leave_the_archive_as_it_was(service, tmp_path):
    groups = fill(service)
    before = _ids(service)
    with client(service, tmp_path) as web:
        overview = web.get("/", headers=VIEWER).text
        assert service.queue("orders") in overview and "no consumer" in overview
        assert "at most 100,000 messages" in overview
        page = web.get("/failures", headers=VIEWER).text
        assert re.search(r"orders — KeyError: &lt;str&gt;</a></th>\s*<td class=\"n\">3</td>", page), page
        assert re.search(r"orders — TimeoutError: db took &lt;n&gt; s</a></th>\s*<td class=\"n\">2</td>", page)
        by_key = web.get("/failures", params={"by": "key"}, headers=VIEWER).text
        assert re.search(r"orders.9.paid</a></th>\s*<td class=\"n\">2</td>", by_key)
        group_link = re.search(r'href="/failures\?q=(group%3A[^&"]+)[^"]*">[^<]*KeyError', page).group(1)
        grouped = web.get(f"/failures?q={group_link}", headers=VIEWER).text
        assert "<strong>3</strong> of 6" in grouped
        searched = web.get("/failures", params={"q": "key:orders.*.created exception:KeyError order"},
                           headers=VIEWER).text
        assert "<strong>3</strong> of 6" in searched
        assert "<strong>1</strong> of 6" in web.get("/failures", params={"q": "handler:users"},
                                                    headers=VIEWER).text
        assert "<strong>0</strong> of 6" in web.get("/failures", params={"q": "since:2999-01-01"},
                                                    headers=VIEWER).text
        one = web.get(f"/events/{groups['notfound'][0]}", headers=VIEWER).text
        assert "&#34;order&#34;: 1" in one and "Traceback" in one and "gave up after 3 attempts" in one
        binary = web.get(f"/events/{groups['users'][0]}", headers=VIEWER).text
        assert "ff fe 20 62" in binary  # not UTF-8: shown as hex
    assert _ids(service) == before  # browsing is not consuming: same messages, same order


# -- (4) replay as a job, dry run, to another queue, audit stamped; purge with confirmation ---------------

def test_replay_group_as_a_job_dry_run_other_queue_and_audit(service, tmp_path):
    groups = fill(service)
    with client(service, tmp_path) as web:
        dry = web.post("/replay", data={"q": "exception:TimeoutError", "scope": "matching", "dry_run": "1"},
                       headers={**OPERATOR, **SAME_ORIGIN})
        assert dry.status_code == 200 and "2 message(s) would be replayed" in dry.text
        assert queue_depth(service.broker_url, service.queue("orders"))[0] == 0 and len(_ids(service)) == 6
        started = web.post("/replay", data={"q": "exception:KeyError", "scope": "matching", "rate": "50"},
                           headers={**OPERATOR, **SAME_ORIGIN}, follow_redirects=False)
        assert started.status_code == 303
        job_id = started.headers["location"].rsplit("/", 1)[1]
        progress = wait_for(lambda: (lambda j: j if j["state"] == "done" else None)(
            web.get(f"/api/jobs/{job_id}", headers=OPERATOR).json()), 20, what="job done")
        assert progress["replayed"] == 3 and progress["kept"] == []
        moved = web.post("/replay", data={"scope": "selected", "id": groups["users"], "to_queue":
                                          service.queue("orders")}, headers={**OPERATOR, **SAME_ORIGIN})
        assert moved.status_code == 200
        elsewhere = web.post("/replay", data={"scope": "matching", "to_queue": "another.service.queue"},
                             headers={**OPERATOR, **SAME_ORIGIN})
        assert elsewhere.status_code == 400 and "not a handler queue" in elsewhere.text
        audit = web.get("/audit", headers=VIEWER).text
        assert "alice" in audit and "replay" in audit
    copies = service.take("orders")
    wait_for(lambda: len(copies) >= 4 or copies.extend(service.take("orders")), 10, what="4 copies")
    assert sorted(m.properties["message_id"] for m in copies) == sorted(groups["notfound"] + groups["users"])
    assert all(m.properties["application_headers"][BY_HEADER] == "alice" for m in copies)
    assert {m.properties["application_headers"][JOB_HEADER] for m in copies if
            m.properties["message_id"] in groups["notfound"]} == {job_id}
    assert sorted(_ids(service)) == sorted(groups["timeout"])  # the rest stayed
    lines = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [(e["action"], e["count"]) for e in lines][:2] == [("replay", 3), ("replay finished", 3)]


def test_purge_states_scope_and_count_and_refuses_a_changed_selection(service, tmp_path):
    groups = fill(service)
    with client(service, tmp_path) as web:
        confirm = web.get("/purge", params={"q": "handler:orders"}, headers=OPERATOR).text
        assert "Purge 5 archived message(s)?" in confirm and service.queue("orders") in confirm
        before = re.search(r'name="before" value="([^"]+)"', confirm).group(1)
        changed = web.post("/purge", data={"q": "handler:orders", "before": before, "count": "4"},
                           headers={**OPERATOR, **SAME_ORIGIN})
        assert "Confirm again" in changed.text and len(_ids(service)) == 6
        done = web.post("/purge", data={"q": "handler:orders", "before": before, "count": "5"},
                        headers={**OPERATOR, **SAME_ORIGIN})
        assert "Purged 5 message(s)" in done.text
    assert _ids(service) == groups["users"]


# -- (5) the JSON API: the archive CLI's documents --------------------------------------------------------

def test_json_api_answers_with_the_archive_cli_schemas(service, tmp_path):
    groups = fill(service)
    token = {"Authorization": "Bearer " + "t" * 32}
    with client(service, tmp_path) as web:
        listed = web.get("/api/archive", params={"q": "handler:orders", "limit": 10}, headers=token).json()
        assert len(listed) == 5 and [assert_valid("archive-list", m) for m in listed]
        shown = web.get(f"/api/archive/{groups['users'][0]}", headers=token).json()
        assert_valid("archive-show", shown)
        dry = web.post("/api/replay", json={"q": "exception:TimeoutError", "dry_run": True}, headers=token).json()
        assert assert_valid("archive-replay", dry)["matched"] == 2 and len(_ids(service)) == 6
        done = web.post("/api/replay", json={"ids": groups["timeout"]}, headers=token).json()
        assert assert_valid("archive-replay", done)["replayed"] == 2
        refused = web.post("/api/purge", json={"q": "handler:users"}, headers=token)
        assert refused.status_code == 400
        purged = web.post("/api/purge", json={"q": "handler:users", "yes": True}, headers=token).json()
        assert assert_valid("archive-purge", purged)["purged"] == 1
        assert web.post("/api/purge", json={"yes": True}, headers=OPERATOR).status_code == 403  # no browser header
    assert sorted(_ids(service)) == sorted(groups["notfound"])
    assert sorted(m.properties["message_id"] for m in service.take("orders")) == sorted(groups["timeout"])


def test_reading_keeps_order_and_counts(service):
    """Browsing (a consumer that never acks) and `archive list` (basic.get, no ack): same order, nothing
    removed, nothing duplicated, read after read."""
    ids = service.archive([("orders", f"orders.{n}.created", "KeyError: x", b"{}") for n in range(20)])
    for _ in range(3):
        with Connection(service.broker_url) as conn:
            assert [m.id for m in browse(conn, service.events.topology())] == ids
            assert [m.id for m in browse(conn, service.events.topology(), limit=5)] == ids[:5]
        assert _ids(service) == ids
    assert queue_depth(service.broker_url, service.queue("archive"))[0] == 20


def test_a_cancelled_job_keeps_the_rest_and_new_failures_are_not_mixed_in(service, tmp_path):
    old = service.archive([("orders", f"orders.{n}.created", "KeyError: 'x'", b"{}") for n in range(6)])
    with client(service, tmp_path) as web:
        page = web.get("/failures", params={"q": "exception:KeyError"}, headers=OPERATOR).text
        before = re.search(r'name="before" value="([^"]+)"', page).group(1)
        new = service.archive([("orders", "orders.9.created", "KeyError: 'y'", b"{}")])  # after the page was read
        started = web.post("/replay", data={"q": "exception:KeyError", "before": before, "scope": "matching",
                                            "rate": "4"}, headers={**OPERATOR, **SAME_ORIGIN},
                           follow_redirects=False)
        job_id = started.headers["location"].rsplit("/", 1)[1]
        wait_for(lambda: web.get(f"/api/jobs/{job_id}", headers=OPERATOR).json()["sent"] >= 2, 10, what="2 sent")
        assert web.post(f"/jobs/{job_id}/cancel", headers={**OPERATOR, **SAME_ORIGIN}).status_code == 200
        job = wait_for(lambda: (lambda j: j if j["state"] == "cancelled" else None)(
            web.get(f"/api/jobs/{job_id}", headers=OPERATOR).json()), 10, what="cancelled")
        assert job["total"] == 6 and 2 <= job["replayed"] < 6
        assert "cancel" in web.get("/audit", headers=VIEWER).text
    replayed = [m.properties["message_id"] for m in service.take("orders")]
    assert len(replayed) == job["replayed"] and set(replayed) <= set(old)
    left = _ids(service)
    assert sorted(left + replayed) == sorted(old + new) and new[0] in left  # none lost, the new one untouched


def test_edit_and_replay_is_off_unless_enabled_and_sends_a_new_id_with_the_original_in_a_header(service, tmp_path):
    [original] = service.archive([("orders", "orders.5.created", "KeyError: 'amount'", b'{"order": 5}')])
    form = {"body": '{"order": 5, "amount": 10}'}
    with client(service, tmp_path) as web:
        assert "Edit and replay" not in web.get(f"/events/{original}", headers=OPERATOR).text
        off = web.post(f"/events/{original}/edit", data=form, headers={**OPERATOR, **SAME_ORIGIN})
        assert off.status_code == 403 and _ids(service) == [original]
    with client(service, tmp_path, allow_edit=True) as web:
        assert "Edit and replay" in web.get(f"/events/{original}", headers=OPERATOR).text
        assert web.post(f"/events/{original}/edit", data=form, headers={**VIEWER, **SAME_ORIGIN}).status_code == 403
        done = web.post(f"/events/{original}/edit", data=form, headers={**OPERATOR, **SAME_ORIGIN})
        assert done.status_code == 200 and "Edited copy replayed" in done.text
        assert "edit and replay" in web.get("/audit", headers=VIEWER).text
    [copy] = service.take("orders")
    headers = copy.properties["application_headers"]
    assert copy.body == form["body"].encode() and copy.properties["message_id"] != original
    assert headers[ORIGINAL_ID] == original and headers[BY_HEADER] == "alice"
    assert _ids(service) == []


# -- replay's transactions --------------------------------------------------------------------------------

def test_a_copy_returned_at_commit_is_archived_again_and_kept_never_lost(service):
    """The users queue exists when the replay looks, and is deleted before the commit: the broker returns
    both users copies at the commit, which removed their originals from the archive; both are archived again."""
    ids = fill(service)
    second = service.archive([("users", "users.8.joined", "ValueError: bad email", b'{"user": 8}')])[0]
    first = ids["users"][0]

    def match(message):  # the second users message: its queue was checked (for the first) and goes away now
        if message.id == second:
            with Connection(service.broker_url) as conn:
                conn.default_channel.queue_delete(service.queue("users"))
        return True

    with Connection(service.broker_url) as conn:
        replayed, kept = replay(conn, service.events.topology(), match)
    assert sorted(m.id for m in replayed) == sorted(ids["notfound"] + ids["timeout"])
    why = "returned by the broker (its queue was deleted during the replay); archived again"
    assert [(m.id, w) for m, w in kept] == [(first, why), (second, why)]
    archived = {m.id: m for m in _read_all(service)}
    assert list(archived) == [first, second]
    assert archived[first].reason.startswith("gave up after 3 attempts")  # archived as it was
    assert archived[first].body == b"\xff\xfe binary"
    assert len(service.take("orders")) == 5


def test_a_connection_lost_before_the_commit_sends_nothing_and_removes_nothing(service):
    """Copies and acks are one transaction: a connection closed before its commit leaves the archive whole
    and the queues empty; the next replay sends each message once."""
    ids = fill(service)
    every = [i for group in ids.values() for i in group]
    conn = Connection(service.broker_url)
    conn.connect()

    def match(message):  # the third message read: the connection dies with two copies sent, uncommitted
        match.calls += 1
        if match.calls == 3:
            conn.connection.sock.close()  # a connection lost as a broker restart loses it
        return True
    match.calls = 0

    with pytest.raises(RECOVERABLE):
        replay(conn, service.events.topology(), match, commit_every_s=3600)
    conn.release()
    assert sorted(_ids(service)) == sorted(every)
    assert queue_depth(service.broker_url, service.queue("orders"))[0] == 0
    with Connection(service.broker_url) as again:
        replayed, kept = replay(again, service.events.topology(), lambda m: True)
    assert (len(replayed), kept) == (6, [])
    taken = service.take("orders") + service.take("users")
    assert sorted(m.properties["message_id"] for m in taken) == sorted(every)


@pytest.fixture
def three_queues(broker_url):
    yield from seeded(broker_url, handlers=("orders", "users", "billing"))


def test_a_queue_deleted_inside_a_transaction_loses_nothing_and_settles_each_message_once(three_queues, caplog):
    """Copies for three queues share one transaction (``window=5``), one queue deleted before its commit.
    RabbitMQ 3.x returns that queue's copies at the commit; RabbitMQ 4 refuses the commit after the rest took
    effect (``partial tx completion``) and the replay reads on from a fresh channel. On both, every archived
    message ends up exactly once, in its queue or in the archive, and is looked at and reported once."""
    service, url = three_queues, three_queues.broker_url
    names = ["o1", "x1", "u1", "n1", "b1", "o2", "u2", "b2", "o3", "u3"]  # x: no queue of the service; n: no match
    targets = {"o": "orders", "u": "users", "b": "billing", "x": "other", "n": "orders"}
    ids = service.archive([(targets[n[0]], f"{targets[n[0]]}.{n}", "KeyError: x", n.encode()) for n in names])
    name = dict(zip(ids, names))
    looked_at = []

    def match(message):
        looked_at.append(name[message.id])
        if len(looked_at) == 1:  # every message on its way to the replay: all read before the next copy is sent
            wait_for(lambda: queue_depth(url, service.queue("archive"))[0] == 0, 10, what="all delivered")
        if name[message.id] == "u2":  # users was looked up for u1: u2's copy is sent all the same, then a commit
            with Connection(url) as conn:
                conn.default_channel.queue_delete(service.queue("users"))
        return name[message.id] != "n1"

    progress = ReplayProgress()
    with Connection(url) as conn, caplog.at_level(logging.WARNING, logger="kombu_events.ops.archive"):
        conn.connect()
        refuses = int(conn.connection.server_properties["version"].split(".")[0]) >= 4
        replayed, kept = replay(conn, service.events.topology(), match, window=5, commit_every_s=3600,
                                progress=progress)

    assert looked_at == names  # each once, in order: none read again as new, after a fresh channel neither
    assert sorted(name[m.id] for m in replayed) == ["b1", "b2", "o1", "o2", "o3"] and progress.copies_confirmed == 5
    again = "returned by the broker (its queue was deleted during the replay); archived again"
    gone = (f"queue {service.queue('users')!r} does not exist on the broker (declare it, or replay to "
            "another queue)")
    assert [(name[m.id], why) for m, why in kept] == [
        ("x1", f"queue {service.queue('other')!r} is not a queue of this service"), ("u1", again), ("u2", again),
        ("u3", gone)]
    archived = _read_all(service)
    assert [name[m.id] for m in archived] == ["x1", "n1", "u3", "u1", "u2"]  # archived again: at the end
    assert (archived[3].body, archived[3].reason) == (b"u1", "gave up after 3 attempts: KeyError: x")
    delivered = service.take("orders") + service.take("billing")
    assert sorted(name[m.properties["message_id"]] for m in delivered) == ["b1", "b2", "o1", "o2", "o3"]
    refused = [r.getMessage() for r in caplog.records if "refused a replay's commit" in r.getMessage()]
    assert len(refused) == refuses and all("5 copies sent, 3 delivered, 2 not" in r for r in refused)


def _read_all(service: Seeded) -> list:
    with Connection(service.broker_url) as conn:
        return read(conn, service.events.topology())


def test_replay_from_a_quorum_archive_to_quorum_queues_in_transactions(broker_url):
    for quorum in seeded(broker_url, queue_type="quorum"):
        ids = fill(quorum)
        with Connection(broker_url) as conn:
            replayed, kept = replay(conn, quorum.events.topology(), lambda m: True, window=2)
        assert (len(replayed), kept) == (6, [])
        taken = quorum.take("orders") + quorum.take("users")
        assert sorted(m.properties["message_id"] for m in taken) == sorted(i for g in ids.values() for i in g)
        assert _read_all(quorum) == []
