"""The console's ASGI application against the real broker (Starlette's TestClient: no socket of its own).

Each test has its own service with an archive (a stream) seeded as a worker fills it; the worker and the
browser are in test_console_browser.py. What the archive holds is read here by offset, as the console reads
it: a read changes nothing, so the tests count records before and after.
"""
from __future__ import annotations

import json
import re
import threading
import time

import pytest
from kombu import Connection
from starlette.testclient import TestClient

from kombu_events.cli.common import schema
from kombu_events.console import AuthSettings, ConsoleSettings, create_app
from kombu_events.console.audit import BY_HEADER, JOB_HEADER
from kombu_events.core import wire
from kombu_events.core.archive_records import PURGED, REPLAYED, Settlement
from kombu_events.ops.archive import ORIGINAL_ID

from .console_helpers import SAME_ORIGIN, Seeded, basic, seeded
from .harness import queue_depth, unique, wait_for
from .json_schemas import assert_valid

pytestmark = pytest.mark.integration

OPERATOR_PW, VIEWER_PW = "operator-pw-0123456789", "viewer-pw-0123456789"
TOKEN = "t" * 32
AUTH = AuthSettings(passwords={"operator": OPERATOR_PW, "viewer": VIEWER_PW}, tokens={TOKEN: ("ci-bot", "operator")})
OPERATOR, VIEWER = basic("alice", OPERATOR_PW), basic("bob", VIEWER_PW)
BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def service(broker_url):
    yield from seeded(broker_url)


def client(service: Seeded, tmp_path, **settings) -> TestClient:
    """A console of ``service`` (enter it: its index follows the archive while the client is open)."""
    settings.setdefault("auth", AUTH)
    app = create_app(service.events, ConsoleSettings(audit_path=tmp_path / "audit.jsonl", **settings))
    return TestClient(app, base_url="http://127.0.0.1:8089", client=("127.0.0.1", 50000))


def caught_up(web: TestClient) -> TestClient:
    """``web`` once its index has read the archive to its end."""
    assert web.app.state.service.index.wait_caught_up(30), "the index did not catch up"
    return web


def _ids(service: Seeded) -> list[str]:
    return [m.id for m in service.pending()]


def _stream(service: Seeded) -> list[tuple]:
    """Every record of the archive, as stored: offset, key (or settlement), properties, headers, body."""
    return [(r.offset, r.action, r.keys) if isinstance(r, Settlement) else
            (r.offset, r.key, r.id, r.properties, r.headers, r.body) for r in service.records()]


def _settled(service: Seeded, action: str) -> list[str]:
    return [k for r in service.records() if isinstance(r, Settlement) and r.action == action for k in r.keys]


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
        assert "Replay" not in caught_up(web).get("/failures", headers=OPERATOR).text.split(
            "<h2 id=\"messages-title\">")[0].split("Act on them")[-1]
    proxy = AuthSettings(proxy_header="X-Forwarded-User", proxy_operators=frozenset({"carol"}))
    with client(service, tmp_path, auth=proxy) as web:
        assert "carol (operator)" in web.get("/", headers={"X-Forwarded-User": "carol"}).text
        assert "dave (viewer)" in web.get("/", headers={"X-Forwarded-User": "dave"}).text
        assert web.get("/").status_code == 401


# -- (2) overview, grouped failures, search; (3) one event ----------------------------------------------

def test_overview_groups_search_and_event_page_leave_the_archive_as_it_was(service, tmp_path):
    groups = fill(service)
    before = _stream(service)
    with client(service, tmp_path) as web:
        caught_up(web)
        overview = web.get("/", headers=VIEWER).text
        assert service.queue("orders") in overview and "no consumer" in overview
        assert "kept at most 168 h (archive_ttl_ms) and 1 GiB in all (archive_max_bytes)" in overview
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
        one = web.get(f"/events/{service.key_of[groups['notfound'][0]]}", headers=VIEWER).text
        assert "&#34;order&#34;: 1" in one and "Traceback" in one and "gave up after 3 attempts" in one
        binary = web.get(f"/events/{service.key_of[groups['users'][0]]}", headers=VIEWER).text
        assert "ff fe 20 62" in binary  # not UTF-8: shown as hex
        by_id = web.get(f"/events/{groups['users'][0]}", headers=VIEWER, follow_redirects=False)
        assert by_id.headers["location"] == f"/events/{service.key_of[groups['users'][0]]}"
    assert _stream(service) == before  # reading is not consuming: the same records, the same order, none added


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_a_hundred_reads_of_the_pages_and_the_api_leave_every_archived_event_in_place(broker_url, tmp_path,
                                                                                       queue_type):
    for service in seeded(broker_url, queue_type=queue_type):
        groups = fill(service)
        key = service.key_of[groups["notfound"][0]]
        before = _stream(service)
        assert len(before) == 7  # the 'opened' record and six copies
        depth = queue_depth(broker_url, service.queue("archive"))[0]  # the broker's count of the stream
        with client(service, tmp_path) as web:
            caught_up(web)
            for n in range(100):
                assert "<strong>6</strong> of 6" in web.get("/failures", params={"q": ""}, headers=VIEWER).text, n
                assert len(web.get("/api/archive", headers=BEARER).json()) == 6
                if n % 10 == 0:  # a copy read at its offset, whole or in part
                    assert web.get(f"/events/{key}", headers=VIEWER).status_code == 200
                    assert web.get(f"/api/archive/{key}", headers=BEARER).json()["key"] == key
                    assert web.get(f"/download?key={key}", headers=VIEWER).content == b'{"order": 1}'
        assert _stream(service) == before and queue_depth(broker_url, service.queue("archive"))[0] == depth
        assert sorted(_ids(service)) == sorted(i for ids in groups.values() for i in ids)


# -- (4) replay as a job, dry run, to another queue, audit stamped; purge with confirmation ---------------

def _done(web: TestClient, job_id: str, state: str = "done") -> dict:
    return wait_for(lambda: (lambda j: j if j["state"] == state else None)(
        web.get(f"/api/jobs/{job_id}", headers=OPERATOR).json()), 20, what=f"job {state}")


def test_replay_group_as_a_job_dry_run_other_queue_and_audit(service, tmp_path):
    groups = fill(service)
    with client(service, tmp_path) as web:
        caught_up(web)
        dry = web.post("/replay", data={"q": "exception:TimeoutError", "scope": "matching", "dry_run": "1"},
                       headers={**OPERATOR, **SAME_ORIGIN})
        assert dry.status_code == 200 and "2 archived copies would be replayed" in dry.text
        assert queue_depth(service.broker_url, service.queue("orders"))[0] == 0 and len(_ids(service)) == 6
        started = web.post("/replay", data={"q": "exception:KeyError", "scope": "matching", "rate": "50"},
                           headers={**OPERATOR, **SAME_ORIGIN}, follow_redirects=False)
        assert started.status_code == 303
        job_id = started.headers["location"].rsplit("/", 1)[1]
        progress = _done(web, job_id)
        assert progress["replayed"] == 3 and progress["kept"] == [] and progress["missing"] == []
        assert "<strong>3</strong> of 3" in web.get("/failures", headers=VIEWER).text  # the index shows it at once
        moved = web.post("/replay", data={"scope": "selected", "key": service.key_of[groups["users"][0]],
                                          "to_queue": service.queue("orders")}, headers={**OPERATOR, **SAME_ORIGIN})
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
    assert {m.properties["application_headers"][wire.REPLAY_OF] for m in copies} == {
        service.key_of[i] for i in groups["notfound"] + groups["users"]}
    assert {m.properties["application_headers"][JOB_HEADER] for m in copies if
            m.properties["message_id"] in groups["notfound"]} == {job_id}
    assert sorted(_ids(service)) == sorted(groups["timeout"])  # the rest stayed
    lines = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [(e["action"], e["count"]) for e in lines][:2] == [("replay", 3), ("replay finished", 3)]


def test_purge_states_scope_count_and_what_it_means_and_refuses_a_changed_selection(service, tmp_path):
    groups = fill(service)
    with client(service, tmp_path) as web:
        confirm = caught_up(web).get("/purge", params={"q": "handler:orders"}, headers=OPERATOR).text
        assert "Purge 5 archived copies?" in confirm and service.queue("orders") in confirm
        assert "until retention removes them" in confirm and "archive purge --for-good" in confirm
        through = re.search(r'name="through" value="([^"]+)"', confirm).group(1)
        changed = web.post("/purge", data={"q": "handler:orders", "through": through, "count": "4"},
                           headers={**OPERATOR, **SAME_ORIGIN})
        assert "Confirm again" in changed.text and len(_ids(service)) == 6
        later = service.archive([("orders", "orders.8.created", "KeyError: late", b"{}")])  # after the confirmation
        done = web.post("/purge", data={"q": "handler:orders", "through": through, "count": "5"},
                        headers={**OPERATOR, **SAME_ORIGIN})
        assert "Purged 5 archived copies" in done.text
        assert "<strong>2</strong> of 2" in web.get("/failures", headers=VIEWER).text
    assert _ids(service) == groups["users"] + later
    purged = [service.key_of[i] for i in groups["notfound"] + groups["timeout"]]
    assert sorted(_settled(service, PURGED)) == sorted(purged)
    [entry] = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert (entry["action"], entry["count"], sorted(entry["keys"])) == ("purge", 5, sorted(purged))


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_copies_sharing_a_message_id_are_purged_and_replayed_one_by_one(broker_url, tmp_path, queue_type):
    for service in seeded(broker_url, queue_type=queue_type):
        same = unique("dup")
        service.archive([("orders", "orders.1.created", "KeyError: x", b'{"word": "alpha"}')], ids=[same])
        alpha = service.key_of[same]
        service.archive([("orders", "orders.1.created", "KeyError: x", b'{"word": "beta"}')], ids=[same])
        beta = service.key_of[same]
        service.archive([("orders", "orders.1.created", "KeyError: x", b'{"word": "gamma"}')], ids=[same])
        gamma = service.key_of[same]
        with client(service, tmp_path) as web:
            confirm = caught_up(web).get("/purge", params={"q": "alpha"}, headers=OPERATOR).text
            assert "Purge 1 archived copy?" in confirm
            through = re.search(r'name="through" value="([^"]+)"', confirm).group(1)
            done = web.post("/purge", data={"q": "alpha", "through": through, "count": "1"},
                            headers={**OPERATOR, **SAME_ORIGIN})
            assert "Purged 1 archived copy" in done.text
            dry = web.post("/replay", data={"q": "beta", "scope": "matching", "dry_run": "1"},
                           headers={**OPERATOR, **SAME_ORIGIN})
            assert "1 archived copy would be replayed" in dry.text
            started = web.post("/replay", data={"q": "beta", "scope": "matching", "count": "1"},
                               headers={**OPERATOR, **SAME_ORIGIN}, follow_redirects=False)
            assert _done(web, started.headers["location"].rsplit("/", 1)[1])["replayed"] == 1
            by_id = web.get(f"/events/{same}", headers=VIEWER, follow_redirects=False)  # one copy has it now
            assert by_id.headers["location"] == f"/events/{gamma}"
        [copy] = service.take("orders")
        assert copy.body == b'{"word": "beta"}' and copy.properties["message_id"] == same
        assert copy.properties["application_headers"][wire.REPLAY_OF] == beta
        assert [m.body for m in service.pending()] == [b'{"word": "gamma"}']
        assert (_settled(service, PURGED), _settled(service, REPLAYED)) == ([alpha], [beta])


# -- (5) the JSON API: the archive CLI's documents --------------------------------------------------------

def _list_item_schema() -> dict:
    """archive-list, as the API lists it: the index's fields (traceback, headers, properties on show)."""
    document = dict(schema("archive-list"))
    left_out = {"traceback", "headers", "properties"}
    document["required"] = [f for f in document["required"] if f not in left_out]
    document["properties"] = {k: v for k, v in document["properties"].items() if k not in left_out}
    return document


def test_json_api_answers_with_the_archive_cli_schemas(service, tmp_path):
    from jsonschema import Draft202012Validator

    groups = fill(service)
    with client(service, tmp_path) as web:
        listed = caught_up(web).get("/api/archive", params={"q": "handler:orders", "limit": 10}, headers=BEARER).json()
        assert len(listed) == 5 and not list(Draft202012Validator(_list_item_schema()).iter_errors(listed[0]))
        assert [m["key"] for m in listed] == [service.key_of[i] for i in groups["notfound"] + groups["timeout"]]
        assert web.get("/api/archive", params={"limit": 501}, headers=BEARER).status_code == 400
        shown = web.get(f"/api/archive/{service.key_of[groups['users'][0]]}", headers=BEARER).json()
        assert assert_valid("archive-show", shown)["id"] == groups["users"][0]
        dry = web.post("/api/replay", json={"q": "exception:TimeoutError", "dry_run": True}, headers=BEARER).json()
        assert assert_valid("archive-replay", dry)["matched"] == 2 and len(_ids(service)) == 6
        keys = [service.key_of[i] for i in groups["timeout"]]
        done = web.post("/api/replay", json={"keys": keys}, headers=BEARER).json()
        assert assert_valid("archive-replay", done)["replayed"] == 2
        again = web.post("/api/replay", json={"keys": keys[:1]}, headers=BEARER)
        assert again.status_code == 207 and again.json()["messages"][0]["outcome"] == "not_found"
        refused = web.post("/api/purge", json={"q": "handler:users"}, headers=BEARER)
        assert refused.status_code == 400
        purged = web.post("/api/purge", json={"q": "handler:users", "yes": True}, headers=BEARER).json()
        assert assert_valid("archive-purge", purged)["purged"] == 1
        assert web.post("/api/purge", json={"yes": True}, headers=OPERATOR).status_code == 403  # no browser header
    assert sorted(_ids(service)) == sorted(groups["notfound"])
    assert sorted(m.properties["message_id"] for m in service.take("orders")) == sorted(groups["timeout"])


def test_a_cancelled_job_keeps_the_rest_and_new_failures_are_not_mixed_in(service, tmp_path):
    old = service.archive([("orders", f"orders.{n}.created", "KeyError: 'x'", b"{}") for n in range(6)])
    with client(service, tmp_path) as web:
        page = caught_up(web).get("/failures", params={"q": "exception:KeyError"}, headers=OPERATOR).text
        through = re.search(r'name="through" value="([^"]+)"', page).group(1)
        new = service.archive([("orders", "orders.9.created", "KeyError: 'y'", b"{}")])  # after the page was read
        wait_for(lambda: web.app.state.service.entry(service.key_of[new[0]]), 10, what="the new one indexed")
        started = web.post("/replay", data={"q": "exception:KeyError", "through": through, "scope": "matching",
                                            "rate": "4"}, headers={**OPERATOR, **SAME_ORIGIN},
                           follow_redirects=False)
        job_id = started.headers["location"].rsplit("/", 1)[1]
        wait_for(lambda: web.get(f"/api/jobs/{job_id}", headers=OPERATOR).json()["replayed"] >= 2, 10,
                 what="2 replayed")
        assert web.post(f"/jobs/{job_id}/cancel", headers={**OPERATOR, **SAME_ORIGIN}).status_code == 200
        job = _done(web, job_id, "cancelled")
        assert job["total"] == 6 and 2 <= job["replayed"] < 6
        assert "cancel" in web.get("/audit", headers=VIEWER).text
    replayed = [m.properties["message_id"] for m in service.take("orders")]
    assert len(replayed) == job["replayed"] and set(replayed) <= set(old)
    left = _ids(service)
    assert sorted(left + replayed) == sorted(old + new) and new[0] in left  # none lost, the new one untouched


def test_edit_and_replay_is_off_unless_enabled_and_sends_a_new_id_with_the_original_in_a_header(service, tmp_path):
    [original] = service.archive([("orders", "orders.5.created", "KeyError: 'amount'", b'{"order": 5}')])
    key = service.key_of[original]
    form = {"body": '{"order": 5, "amount": 10}'}
    with client(service, tmp_path) as web:
        assert "Edit and replay" not in caught_up(web).get(f"/events/{key}", headers=OPERATOR).text
        off = web.post(f"/events/{key}/edit", data=form, headers={**OPERATOR, **SAME_ORIGIN})
        assert off.status_code == 403 and _ids(service) == [original]
    with client(service, tmp_path, allow_edit=True) as web:
        assert "Edit and replay" in caught_up(web).get(f"/events/{key}", headers=OPERATOR).text
        assert web.post(f"/events/{key}/edit", data=form, headers={**VIEWER, **SAME_ORIGIN}).status_code == 403
        done = web.post(f"/events/{key}/edit", data=form, headers={**OPERATOR, **SAME_ORIGIN})
        assert done.status_code == 200 and "Edited copy replayed" in done.text
        assert "edit and replay" in web.get("/audit", headers=VIEWER).text
        assert "replayed by alice" in web.get(f"/events/{key}", headers=VIEWER).text
    [copy] = service.take("orders")
    headers = copy.properties["application_headers"]
    assert copy.body == form["body"].encode() and copy.properties["message_id"] != original
    assert headers[ORIGINAL_ID] == original and headers[BY_HEADER] == "alice" and headers[wire.REPLAY_OF] == key
    assert _ids(service) == []


# -- the index: it follows the archive, survives a lost connection, and keeps pages quick ----------------------

def test_the_index_follows_a_worker_archiving_while_pages_are_read(service, tmp_path):
    """Copies archived in bursts while a reader asks for pages and the API all along: every copy in the index
    once, in stream order, and the archive as the worker left it."""
    first = fill(service)
    archived: list[str] = []

    def worker() -> None:
        for burst in range(10):
            archived.extend(service.archive([("orders", f"orders.{burst}.{n}", "KeyError: burst", b"{}")
                                             for n in range(30)]))
            time.sleep(0.05)

    with client(service, tmp_path) as web:
        thread = threading.Thread(target=worker)
        thread.start()
        counts = []
        while thread.is_alive():
            page = web.get("/failures", headers=VIEWER)
            counts.append(int(re.search(r"<strong>(\d+)</strong> of", page.text).group(1)))
            assert web.get("/api/archive", params={"limit": 500}, headers=BEARER).status_code == 200
        thread.join()
        total = 6 + len(archived)
        wait_for(lambda: f"<strong>{total}</strong> of {total}" in web.get("/failures", headers=VIEWER).text, 10,
                 what="every copy indexed")
        listed = web.get("/api/archive", params={"limit": 500}, headers=BEARER).json()
    assert counts == sorted(counts) and len(counts) > 3  # it grew while the pages were read, never shrank
    assert [m["id"] for m in listed] == [i for ids in first.values() for i in ids] + archived
    assert [m["key"] for m in listed] == [m.key for m in service.pending()]


def test_the_index_reads_on_after_a_lost_connection_from_where_it_was(service, tmp_path):
    before = fill(service)
    with client(service, tmp_path) as web:
        follower = caught_up(web).app.state.service.follower
        wait_for(lambda: follower.connection is not None, 10, what="the index connected")
        follower.connection.connection.sock.close()  # as a broker restart drops it
        later = service.archive([("users", "users.1.joined", "ValueError: later", b"{}") for _ in range(3)])
        wait_for(lambda: "<strong>9</strong> of 9" in web.get("/failures", headers=VIEWER).text, 20,
                 what="the copies archived meanwhile")
        listed = web.get("/api/archive", headers=BEARER).json()
        assert follower.reconnects >= 1
    assert [m["id"] for m in listed] == [i for ids in before.values() for i in ids] + later  # none twice


def test_the_index_reads_an_archive_rewritten_for_good_again_from_its_start(service, tmp_path):
    """``archive purge --for-good`` deletes the archive and makes it again, the same keys at other offsets:
    the index reads it again, and the copies erased are gone from it too."""
    from kombu_events.ops.archive_rewrite import rewrite

    groups = fill(service)
    with client(service, tmp_path) as web:
        confirm = caught_up(web).get("/purge", params={"q": "handler:users"}, headers=OPERATOR).text
        through = re.search(r'name="through" value="([^"]+)"', confirm).group(1)
        web.post("/purge", data={"q": "handler:users", "through": through, "count": "1"},
                 headers={**OPERATOR, **SAME_ORIGIN})
        with Connection(service.broker_url) as conn:
            assert rewrite(conn, service.events.topology())["erased"] == 1
        stream = [(m.key, m.offset) for m in service.pending()]
        wait_for(lambda: [(e.key, e.offset) for e in web.app.state.service.view().entries] == stream, 20,
                 what="the index of the archive rewritten")
        assert "<strong>5</strong> of 5" in web.get("/failures", headers=VIEWER).text
        key = service.key_of[groups["notfound"][0]]
        assert web.get(f"/download?key={key}", headers=VIEWER).content == b'{"order": 1}'  # at its new offset
    assert len(stream) == 5


def test_a_search_stops_at_its_budget_and_never_holds_up_another_request(service, tmp_path):
    service.archive([("orders", f"orders.{n}.created", f"KeyError: 'order {n}'", json.dumps(
        {"order": n, "text": "lorem ipsum " * 80}).encode()) for n in range(3000)], confirm=False)
    long_search = " ".join(f"word{n}" for n in range(150))  # 1,139 characters: too long
    with client(service, tmp_path) as web:
        wait_for(lambda: len(web.app.state.service.view().entries) == 3000, 30, what="3000 indexed")
        too_long = web.get("/failures", params={"q": long_search}, headers=VIEWER)
        assert too_long.status_code == 400 and "at most 1,000" in too_long.text
        heavy = " ".join(["lorem", "ipsum"] * 80 + ["keyerror", "absent"])  # 162 words, all but one in every copy
        waits: list[float] = []
        searches: list[str] = []

        def search() -> None:
            for _ in range(3):
                searches.append(web.get("/failures", params={"q": heavy}, headers=VIEWER).text)

        threads = [threading.Thread(target=search) for _ in range(4)]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            started = time.perf_counter()
            assert web.get("/api/jobs/none", headers=BEARER).status_code == 404
            waits.append(time.perf_counter() - started)
            time.sleep(0.01)
    assert len(searches) == 12 and all("<strong>0</strong> of 3000" in s or "Partial results" in s for s in searches)
    assert len(waits) >= 3 and max(waits) < 0.5, sorted(waits)[-5:]


def test_an_event_page_of_a_large_body_shows_a_preview_and_downloads_the_whole_body(service, tmp_path):
    body = json.dumps({"blob": "x" * (5 * 2**20)}).encode()
    [message_id] = service.archive([("orders", "orders.1.created", "KeyError: big", body)])
    key = service.key_of[message_id]
    with client(service, tmp_path) as web:
        page = caught_up(web).get(f"/events/{key}", headers=VIEWER)
        assert page.status_code == 200 and len(page.content) < 50_000 and "The first 4,096 of" in page.text
        assert len(web.get("/api/archive", headers=BEARER).json()[0]["body"]) == 1024
        assert web.get(f"/download?key={key}", headers=VIEWER).content == body
