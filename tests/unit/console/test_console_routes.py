"""The console's pages and JSON API, through its own application over a stubbed archive
(test_console_routes_kit): what the API accepts, the purge's confirmed count, what a viewer is offered,
archive keys (never message ids) in every action, the bounds of a search and of a page, and keys and ids of
any shape through every link and form."""
from __future__ import annotations

import threading
import time
from urllib.parse import quote

import pytest
from markupsafe import escape

from kombu_events.console import query
from kombu_events.console.auth import SECURITY_HEADERS
from kombu_events.console.jobs import Job
from kombu_events.core.archive_records import PURGED, REPLAYED

from .test_console_routes_kit import (
    BEARER_OPERATOR,
    BEARER_VIEWER,
    JSON,
    OPERATOR,
    SAME_ORIGIN,
    VIEWER,
    Page,
    archived,
    console,
    key_of,
    resolve,
    submit,
)

IDS = ("m1", "m2", "m3")
KEYS = [key_of(i) for i in IDS]


def _console(**settings):
    return console([archived(i) for i in IDS], **settings)


# -- (2) the JSON API refuses what it cannot read, with a 400 that says why ------------------------------

BAD = [
    ("/api/purge", b'{"keys": 5, "yes": true}', "keys"),
    ("/api/purge", b'{"keys": "m1", "yes": true}', "keys"),  # a string is no list of keys (not 'm', '1')
    ("/api/purge", b'{"keys": [1, 2], "yes": true}', "keys"),
    ("/api/purge", b'{"keys": [["m1"]], "yes": true}', "keys"),
    ("/api/replay", b'{"keys": {"m1": true}}', "keys"),
    ("/api/replay", b'{"keys": 5, "dry_run": true}', "keys"),
    ("/api/purge", b'{"ids": ["m1"], "yes": true}', 'Send "keys"'),  # message ids are not unique
    ("/api/replay", b'{"ids": ["m1"]}', 'Send "keys"'),
    ("/api/replay", b'{"q": "' + b"x" * 1001 + b'", "dry_run": true}', "1,001 characters"),
    ("/api/purge", b'{"limit": "2", "yes": true}', "limit"),
    ("/api/purge", b'{"limit": 1.5, "yes": true}', "limit"),
    ("/api/purge", b'{"limit": true, "yes": true}', "limit"),
    ("/api/replay", b'{"limit": -1}', "limit"),
    ("/api/purge", b'{"yes": "true"}', "yes"),
    ("/api/purge", b'{"yes": 1}', "yes"),
    ("/api/purge", b'{"yes": true, "dry_run": "no"}', "dry_run"),
    ("/api/replay", b'{"dry_run": "false"}', "dry_run"),
    ("/api/replay", b'{"dry_run": 0}', "dry_run"),
    ("/api/replay", b'{"q": 5}', "q"),
    ("/api/purge", b'{"q": ["handler:orders"], "yes": true}', "q"),
    ("/api/replay", b'{"to_queue": 5}', "to_queue"),
    ("/api/replay", b'{"before": 20261125}', "before"),
    ("/api/replay", b'{"dryrun": true}', "dryrun"),  # a typo must not replay for real
    ("/api/purge", b'{"yes": true, "id": ["m1"]}', "'id'"),
    ("/api/purge", b'[]', "object"),
    ("/api/replay", b'"everything"', "object"),
    ("/api/replay", b'null', "object"),
    ("/api/purge", b'{"yes": tru', "JSON"),
    ("/api/purge", b'{"yes": true', "JSON"),
    ("/api/replay", b'\xff\xfe{', "JSON"),
    ("/api/replay", b'{"q": "\xff"}', "JSON"),
]


@pytest.mark.parametrize("path, body, named", BAD, ids=[f"{p[5:]}:{b[:30]!r}" for p, b, _ in BAD])
def test_a_bad_api_body_is_a_400_that_names_what_is_wrong_and_changes_nothing(path, body, named):
    c = _console()
    answer = c.web.post(path, content=body, headers={**BEARER_OPERATOR, **JSON})
    assert answer.status_code == 400, answer.text
    assert named in answer.json()["error"]
    assert answer.headers["content-security-policy"] == SECURITY_HEADERS["content-security-policy"]
    assert (c.stub.purged, c.stub.replayed, c.audit) == ([], [], [])


@pytest.mark.parametrize("path", ["/api/purge", "/api/replay"])
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonp"])
def test_an_api_body_that_is_not_sent_as_json_is_a_400(path, content_type):
    c = _console()
    headers = {**BEARER_OPERATOR, **({"Content-Type": content_type} if content_type else {})}
    answer = c.web.post(path, content=b'{"q": "", "yes": true}', headers=headers)
    assert answer.status_code == 400 and "Content-Type: application/json" in answer.json()["error"]
    assert (c.stub.purged, c.stub.replayed) == ([], [])


@pytest.mark.parametrize("query, named", [("limit=lots", "limit"), ("limit=1.5", "limit"), ("limit=-1", "limit"),
                                          ("limit=501", "at most 500"), ("q=" + "x" * 1001, "at most 1,000")])
def test_a_bad_api_query_is_a_400_that_names_it(query, named):
    answer = _console().web.get(f"/api/archive?{query}", headers=BEARER_VIEWER)
    assert answer.status_code == 400 and named in answer.json()["error"]


def test_well_typed_api_bodies_are_taken():
    c = _console()
    headers = {**BEARER_OPERATOR, "Content-Type": "application/json; charset=utf-8"}
    dry = c.web.post("/api/replay", json={"keys": [KEYS[0]], "dry_run": True, "to_queue": None}, headers=headers)
    assert dry.status_code == 200 and [(m["key"], m["id"]) for m in dry.json()["messages"]] == [(KEYS[0], "m1")]
    replayed = c.web.post("/api/replay", json={"q": "", "keys": [KEYS[1]], "limit": 1, "dry_run": False},
                          headers=headers)
    assert replayed.status_code == 200 and replayed.json()["replayed"] == 1 and c.stub.replayed == [
        (KEYS[1], None, None)]
    purged = c.web.post("/api/purge", content=b'{"q": "", "limit": 5, "yes": true, "before": "2030-01-01"}',
                        headers=headers)
    assert purged.status_code == 200 and c.stub.purged == [KEYS[0], KEYS[2]] and purged.json()["erased"] == 0
    assert c.web.get("/api/archive?limit=0", headers=BEARER_VIEWER).json() == []


@pytest.mark.parametrize("form, named", [
    ({"q": ""}, "scope"),  # a bare POST must not replay the whole archive
    ({"scope": "everything"}, "scope"),
    ({"scope": "matching", "rate": "fast"}, "rate"),
    ({"scope": "matching", "rate": "-5"}, "rate"),
    ({"scope": "matching", "rate": "nan"}, "rate"),
    ({"scope": "matching", "rate": "inf"}, "rate"),
    ({"scope": "matching", "to_queue": "svc.nope"}, "svc.nope"),
])
def test_a_replay_form_it_cannot_read_is_a_400_that_names_it(form, named):
    c = _console()
    answer = c.web.post("/replay", data=form, headers={**OPERATOR, **SAME_ORIGIN})
    assert answer.status_code == 400 and named in answer.text
    assert (c.stub.replayed, c.app.state.jobs.all()) == ([], [])


# -- (7d) an API purge needs "yes": true -------------------------------------------------------------------

@pytest.mark.parametrize("body", [b"{}", b'{"q": ""}', b'{"yes": false}', b'{"keys": ["m1"]}',
                                  b'{"dry_run": false}', b'{"q": "", "yes": null}'])
def test_an_api_purge_without_yes_true_purges_nothing(body):
    c = _console()
    answer = c.web.post("/api/purge", content=body, headers={**BEARER_OPERATOR, **JSON})
    assert answer.status_code == 400 and '"yes": true' in answer.json()["error"]
    assert c.stub.purged == [] and len(c.stub.messages) == 3


def test_an_api_purge_dry_run_lists_and_purges_nothing_and_yes_purges():
    c = _console()
    dry = c.web.post("/api/purge", content=b'{"dry_run": true}', headers={**BEARER_OPERATOR, **JSON})
    assert dry.status_code == 200 and dry.json()["matched"] == 3 and c.stub.purged == []
    done = c.web.post("/api/purge", content=b'{"q": "", "yes": true}', headers={**BEARER_OPERATOR, **JSON})
    assert done.json()["purged"] == 3 and c.stub.purged == KEYS
    assert [(e["action"], e["keys"]) for e in c.audit] == [("purge", KEYS)]  # audited with what it hid


# -- (7c) a purge deletes only the count confirmed ---------------------------------------------------------

def _confirmation(c, q=""):
    page = c.web.get("/purge", params={"q": q}, headers=OPERATOR)
    forms = Page(page.text).post_forms()
    assert page.status_code == 200 and len(forms) == 1
    return forms[0]


def test_a_purge_asks_again_when_the_archive_changed_since_the_confirmation():
    c = _console()
    form = _confirmation(c)
    assert ("count", "3") in form.fields
    c.stub.settle(PURGED, [KEYS[0]], "bob")  # another operator purged one meanwhile
    again = submit(c.web, "/purge", form, OPERATOR)
    assert again.status_code == 200 and "The archive changed since you asked" in again.text
    assert c.stub.purged == [] and c.audit == []
    second = Page(again.text).post_forms()[0]
    assert ("count", "2") in second.fields
    done = submit(c.web, "/purge", second, OPERATOR)
    assert done.status_code == 200 and "Purged 2 archived copies" in done.text
    assert c.stub.purged == KEYS[1:] and c.stub.messages == []


def test_the_purge_confirmation_says_a_purge_hides_and_what_removes_for_good():
    text = _console().web.get("/purge", headers=OPERATOR).text
    assert "A purge hides these copies at once" in text and "until retention removes them" in text
    assert "168 h (archive_ttl_ms)" in text and "1 GiB in all (archive_max_bytes)" in text
    assert "kombu-events archive purge --for-good" in text


@pytest.mark.parametrize("count", [None, "", "2", "4", "03", "three"])
def test_a_purge_posted_without_the_right_count_purges_nothing(count):
    c = _console()
    form = {"q": "", **({"count": count} if count is not None else {})}
    answer = c.web.post("/purge", data=form, headers={**OPERATOR, **SAME_ORIGIN})
    assert answer.status_code == 200 and "Purge 3 copies" in answer.text
    assert c.stub.purged == []


def test_a_purge_takes_only_what_was_archived_by_the_confirmation():
    c = _console()
    form = _confirmation(c)
    c.stub.add(archived("later"))  # a worker archived one more meanwhile: after the confirmation's offset
    assert submit(c.web, "/purge", form, OPERATOR).status_code == 200
    assert c.stub.purged == KEYS and [m.id for m in c.stub.messages] == ["later"]


# -- (5) nobody is offered a button they cannot use --------------------------------------------------------

PAGES = ["/", "/?fragment=1", "/failures", "/failures?q=orders&by=key", f"/events/{KEYS[0]}", "/purge",
         "/purge?q=orders", "/jobs/j1", "/jobs/j1?fragment=1", "/audit"]


def _with_a_running_job(c):
    job = Job("j1", "alice", frozenset({KEYS[0]}), "", state="running", started_at=time.time())
    c.app.state.jobs._jobs[job.id] = job
    c.app.state.audit.record("alice", "operator", "replay", 1, job="j1")


@pytest.mark.parametrize("headers, settings", [(VIEWER, {}), (BEARER_VIEWER, {}), (OPERATOR, {"read_only": True})],
                         ids=["viewer", "viewer-token", "operator-read-only"])
def test_no_page_offers_an_action_to_whoever_cannot_act(headers, settings):
    c = _console(allow_edit=True, **settings)
    _with_a_running_job(c)
    for path in PAGES:
        answer = c.web.get(path, headers=headers)
        page = Page(answer.text)
        assert answer.status_code == 200, path
        assert page.post_forms() == [], f"{path} offers {[f.buttons for f in page.post_forms()]}"
        assert not [link for link in page.links if not link.startswith("#")
                    and resolve(path, link).startswith("/purge")], path
        assert 'name="key"' not in answer.text and "<button" not in answer.text.replace(
            '<button type="submit">Search</button>', ""), path


def test_an_operator_is_offered_each_action():
    c = _console(allow_edit=True)
    _with_a_running_job(c)
    offered = {path: [b for f in Page(c.web.get(path, headers=OPERATOR).text).post_forms() for b in f.buttons]
               for path in PAGES}
    assert offered["/failures"] == ["replay-button"] and offered["/purge"] == ["confirm-purge"]
    assert len(offered[f"/events/{KEYS[0]}"]) == 2
    assert len(offered["/jobs/j1"]) == 1 and len(offered["/jobs/j1?fragment=1"]) == 1
    assert any(resolve("/failures", link).startswith("/purge?")
               for link in Page(c.web.get("/failures", headers=OPERATOR).text).links)


# -- (6) any key and any id, through every link and form ----------------------------------------------------

ODD_IDS = ["a/b", "/leading", "trailing/", "what?x=1&y=2", "frag#ment", "100%", "%2e%2e%2f", "%2F", "../../audit",
           "..", ".", "./x", "with space", "line\nbreak", "trailing-newline\n", "cr\rand\r\ncrlf", "tab\there",
           "ünïcødé-✓-日本語", "a/edit", "edit", "x/../y", "+plus+", "&amp;", "<b>tag</b>", "'quote\"", "nul\x00byte"]


def _wait_for_jobs(c):
    deadline = time.monotonic() + 10
    while not all(j.finished for j in c.app.state.jobs.all()):
        assert time.monotonic() < deadline, "a job did not finish"
        time.sleep(0.01)


def _followed(c, page_url, headers):
    """Every link of the page at ``page_url``, followed: none dead; the pages they lead to."""
    answer = c.web.get(page_url, headers=headers)
    assert answer.status_code == 200, page_url
    reached = {}
    for link in Page(answer.text).links:
        target = resolve(page_url, link)
        followed = c.web.get(target, headers=headers)
        assert followed.status_code == 200, f"{link!r} on {page_url!r} is dead ({followed.status_code})"
        reached[target] = followed
    return answer, reached


def _event_page(c, message_id):
    """The page an event's link on the failures page leads to (exactly one link shows it)."""
    heading = f"<h1>Event <code>{escape(message_id)}</code></h1>"
    _, reached = _followed(c, "/failures", OPERATOR)
    found = [url for url, page in reached.items() if heading in page.text]
    assert len(found) == 1, f"{message_id!r}: links found {found}"
    return found[0]


@pytest.mark.parametrize("message_id", ODD_IDS, ids=[repr(i) for i in ODD_IDS])
def test_any_id_and_key_go_through_every_link_and_form_and_come_back_the_same(message_id):
    """The archive key of a record anyone wrote may hold anything too: here it is the odd id itself."""
    c = console([archived(message_id, key=message_id), archived("plain")], allow_edit=True)
    url = _event_page(c, message_id)
    assert _followed(c, url, OPERATOR)[0].status_code == 200  # the event page's own links work

    # the event's replay form, as a dry run, then its confirmation: a job that replays that key and no other
    replay_form, _ = Page(c.web.get(url, headers=OPERATOR).text).post_forms()
    dry = submit(c.web, url, replay_form, OPERATOR, tick=lambda name, value: name == "dry_run")
    assert dry.status_code == 200 and "1 archived copy would be replayed" in dry.text
    job = submit(c.web, "/replay", Page(dry.text).post_forms()[0], OPERATOR)
    assert job.status_code == 303 and _followed(c, resolve("/replay", job.headers["location"]), OPERATOR)
    _wait_for_jobs(c)
    assert c.stub.replayed == [(message_id, None, None)]

    # edit and replay: the edited body goes with that key
    c.stub.add(archived(message_id, key=message_id + "#2"))
    url = _event_page(c, message_id)
    edited = submit(c.web, url, Page(c.web.get(url, headers=OPERATOR).text).post_forms()[1], OPERATOR)
    assert edited.status_code == 200 and "Edited copy replayed" in edited.text
    assert c.stub.replayed[-1] == (message_id + "#2", None, b'{"order": 1}')

    # the failures page: tick both, replay only those ticked
    c.stub.add(archived(message_id, key=message_id + "#3"))
    failures = Page(c.web.get("/failures", headers=OPERATOR).text).post_forms()[0]
    dry = submit(c.web, "/failures", failures, OPERATOR, choose={"scope": "selected"},
                 tick=lambda name, value: name in ("key", "dry_run"))
    assert "2 archived copies would be replayed" in dry.text
    submit(c.web, "/replay", Page(dry.text).post_forms()[0], OPERATOR)
    _wait_for_jobs(c)
    assert sorted(k for k, _, _ in c.stub.replayed[-2:]) == sorted([message_id + "#3", key_of("plain")])


@pytest.mark.parametrize("message_id", [i for i in ODD_IDS if i not in (".", "..")], ids=repr)
def test_any_key_and_any_id_held_by_one_copy_is_shown_by_the_api_at_its_percent_encoded_path(message_id):
    c = console([archived(message_id), archived("plain", key=message_id)])
    by_key = c.web.get("/api/archive/" + quote(message_id, safe=""), headers=BEARER_VIEWER)
    assert by_key.status_code == 200 and (by_key.json()["key"], by_key.json()["id"]) == (message_id, "plain")
    c.stub.settle(PURGED, [message_id])
    by_id = c.web.get("/api/archive/" + quote(message_id, safe=""), headers=BEARER_VIEWER)
    assert by_id.status_code == 200 and (by_id.json()["key"], by_id.json()["id"]) == (key_of(message_id),
                                                                                       message_id)


def test_a_group_link_and_the_purge_link_keep_the_search():
    c = console([archived(i, body=b'{"order": 1, "note": "#x &y=1 100%"}') for i in IDS])
    search = 'key:orders.# "order 1" #x &y=1 100%'
    _, reached = _followed(c, "/failures?q=" + quote(search), OPERATOR)
    assert any(f'value="{escape(search)}"' in page.text for url, page in reached.items() if url.startswith("/purge"))
    assert any("group%3A" in url and "<strong>3</strong> of 3" in page.text for url, page in reached.items())


# -- archive keys: copies that share a message id are acted on one by one ------------------------------------

def _duplicates():
    return console([archived("dup", body=b'{"word": "alpha"}', key="a" * 20),
                    archived("dup", body=b'{"word": "beta"}', key="b" * 20), archived("other")])


def test_copies_sharing_a_message_id_are_purged_one_by_one():
    c = _duplicates()
    confirm = c.web.get("/purge", params={"q": "alpha"}, headers=OPERATOR)
    assert "Purge 1 archived copy?" in confirm.text
    done = submit(c.web, "/purge", Page(confirm.text).post_forms()[0], OPERATOR)
    assert "Purged 1 archived copy" in done.text
    assert c.stub.purged == ["a" * 20] and [m.key for m in c.stub.messages] == ["b" * 20, key_of("other")]
    api = c.web.post("/api/purge", json={"q": "dup", "yes": True, "dry_run": True}, headers=BEARER_OPERATOR)
    assert [m["key"] for m in api.json()["messages"]] == ["b" * 20]


def test_copies_sharing_a_message_id_are_replayed_one_by_one():
    c = _duplicates()
    dry = c.web.post("/replay", data={"q": "alpha", "scope": "matching", "dry_run": "1"},
                     headers={**OPERATOR, **SAME_ORIGIN})
    assert "1 archived copy would be replayed" in dry.text
    assert submit(c.web, "/replay", Page(dry.text).post_forms()[0], OPERATOR).status_code == 303
    _wait_for_jobs(c)
    assert c.stub.replayed == [("a" * 20, None, None)]
    api = c.web.post("/api/replay", json={"keys": ["b" * 20]}, headers=BEARER_OPERATOR)
    assert api.json()["replayed"] == 1 and c.stub.replayed[-1] == ("b" * 20, None, None)
    assert [m.id for m in c.stub.messages] == ["other"]


def test_an_event_page_by_message_id_leads_to_its_copy_or_lists_the_copies_that_share_it():
    c = _duplicates()
    one = c.web.get("/events/other", headers=VIEWER)
    assert one.status_code == 303 and one.headers["location"] == f"/events/{key_of('other')}"
    several = c.web.get("/events/dup", headers=VIEWER)
    assert several.status_code == 300 and f"/events/{'a' * 20}" in several.text and f"/events/{'b' * 20}" in \
        several.text
    assert c.web.get("/api/archive/dup", headers=BEARER_VIEWER).status_code == 409


def test_the_page_of_a_settled_copy_says_how_it_was_settled():
    c = _console()
    c.stub.settle(REPLAYED, [KEYS[0]], "carol")
    answer = c.web.get(f"/events/{KEYS[0]}", headers=VIEWER)
    assert answer.status_code == 404 and "no archived copy with key" in answer.text and "replayed by carol" in \
        answer.text


# -- bounded pages: a body preview and its download, a search's length and time ------------------------------

def test_an_event_page_shows_a_bounded_preview_and_downloads_the_whole_body():
    large = b'{"blob": "' + b"x" * 100_000 + b'"}'
    c = console([archived("big", body=large)], allow_edit=True)
    page = c.web.get(f"/events/{key_of('big')}", headers=OPERATOR)
    assert page.status_code == 200 and len(page.text) < 20_000
    assert "The first 4,096 of 100,012 bytes" in page.text and "Download the whole body" in page.text
    assert len(Page(page.text).post_forms()) == 1  # no edit of a body larger than its preview
    download = c.web.get(f"/download?key={key_of('big')}", headers=VIEWER)
    assert download.status_code == 200 and download.content == large
    assert download.headers["content-type"] == "application/octet-stream"
    assert download.headers["content-disposition"] == f'attachment; filename="{key_of("big")}.json"'
    listed = c.web.get("/api/archive", headers=BEARER_VIEWER).json()
    assert listed[0]["truncated"] is True and len(listed[0]["body"]) == 1024 and listed[0]["size"] == len(large)


def test_a_search_that_takes_too_long_says_partial_results():
    c = console([archived(f"m{n}") for n in range(2000)], search_budget_s=0.0)
    page = c.web.get("/failures", params={"q": "m1999"}, headers=VIEWER)
    assert page.status_code == 200 and "Partial results: the search looked at 256 of 2,000" in page.text
    listed = c.web.get("/api/archive", params={"q": "m1999"}, headers=BEARER_VIEWER)
    assert listed.json() == [] and listed.headers["x-search-partial"].startswith("searched 256 of 2000")
    whole = c.web.post("/api/replay", json={"q": "m1999", "dry_run": True}, headers=BEARER_OPERATOR)
    assert whole.json()["matched"] == 1  # an action's selection is never partial


def test_a_page_made_while_the_index_catches_up_says_so():
    c = _console()
    c.stub.index.caught_up = False
    c.stub.index.reached(10)  # the end found when the index began: offset 10, of which 0 to 2 read so far
    page = c.web.get("/failures", headers=VIEWER)
    assert "Catching up: the console is still reading the archive (3 records read of about 11)" in page.text
    assert c.web.get("/api/archive", headers=BEARER_VIEWER).headers["x-index-catching-up"] == "3 records read so far"
    assert c.web.get("/events/unknown", headers=VIEWER).status_code == 503


def test_a_job_keeps_to_its_rate_and_a_cancel_stops_it_between_windows():
    c = console([archived(f"m{n}") for n in range(6)])
    started = c.web.post("/replay", data={"q": "", "scope": "matching", "rate": "2"},
                         headers={**OPERATOR, **SAME_ORIGIN})
    job = c.app.state.jobs.get(started.headers["location"].rsplit("/", 1)[1])
    deadline = time.monotonic() + 5
    while job.replayed < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert c.web.post(f"/jobs/{job.id}/cancel", headers={**OPERATOR, **SAME_ORIGIN}).status_code == 303
    _wait_for_jobs(c)
    assert job.state == "cancelled" and 2 <= job.replayed < 6 and len(c.stub.replayed) == job.replayed
    assert len(c.stub.messages) == 6 - job.replayed


def test_a_search_runs_off_the_event_loop_and_holds_up_no_other_request(monkeypatch):
    real = query.search

    def slow(*args, **kwargs):
        time.sleep(1.0)  # a search of a very large archive, as the event loop would feel it if it ran there
        return real(*args, **kwargs)

    monkeypatch.setattr(query, "search", slow)
    c = _console()
    with c.web as web:  # one event loop for every request, as a server has
        searching = threading.Thread(target=lambda: web.get("/failures", params={"q": "m1"}, headers=VIEWER))
        searching.start()
        time.sleep(0.2)
        started = time.perf_counter()
        assert web.get("/api/jobs/none", headers=BEARER_VIEWER).status_code == 404
        waited = time.perf_counter() - started
        assert searching.is_alive()
        searching.join()
    assert waited < 0.25


def test_the_first_page_of_the_index_never_waits_for_a_search(monkeypatch):
    real = query.search
    entered = threading.Event()

    def slow(copies, q, **kwargs):
        if not q.empty:
            entered.set()
            time.sleep(1.0)  # a search holding its turn
        return real(copies, q, **kwargs)

    monkeypatch.setattr(query, "search", slow)
    c = _console()
    with c.web as web:
        searching = threading.Thread(target=lambda: web.get("/api/archive", params={"q": "m1"}, headers=BEARER_VIEWER))
        searching.start()
        assert entered.wait(5)
        started = time.perf_counter()
        assert web.get("/api/archive", params={"limit": "1"}, headers=BEARER_VIEWER).status_code == 200
        waited = time.perf_counter() - started
        searching.join()
    assert waited < 0.25, "no search: no turn to wait for"
