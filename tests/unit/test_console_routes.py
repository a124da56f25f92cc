"""The console's pages and JSON API, through its own application over a stubbed archive
(test_console_routes_kit): what the API accepts, the purge's confirmed count, what a viewer is offered,
and ids of any shape through every link and form."""
from __future__ import annotations

import time
from urllib.parse import quote, urlencode

import pytest
from markupsafe import escape

from kombu_events.console.auth import SECURITY_HEADERS
from kombu_events.console.jobs import Job

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
    resolve,
    submit,
)

IDS = ("m1", "m2", "m3")


def _console(**settings):
    return console([archived(i) for i in IDS], **settings)


# -- (2) the JSON API refuses what it cannot read, with a 400 that says why ------------------------------

BAD = [
    ("/api/purge", b'{"ids": 5, "yes": true}', "ids"),
    ("/api/purge", b'{"ids": "m1", "yes": true}', "ids"),  # a string is no list of ids (not 'm', '1')
    ("/api/purge", b'{"ids": [1, 2], "yes": true}', "ids"),
    ("/api/purge", b'{"ids": [["m1"]], "yes": true}', "ids"),
    ("/api/replay", b'{"ids": {"m1": true}}', "ids"),
    ("/api/replay", b'{"ids": 5, "dry_run": true}', "ids"),
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


@pytest.mark.parametrize("query, named", [("limit=lots", "limit"), ("limit=1.5", "limit"), ("limit=-1", "limit")])
def test_a_bad_api_query_is_a_400_that_names_it(query, named):
    answer = _console().web.get(f"/api/archive?{query}", headers=BEARER_VIEWER)
    assert answer.status_code == 400 and named in answer.json()["error"]


def test_well_typed_api_bodies_are_taken():
    c = _console()
    headers = {**BEARER_OPERATOR, "Content-Type": "application/json; charset=utf-8"}
    dry = c.web.post("/api/replay", content=b'{"ids": ["m1"], "dry_run": true, "to_queue": null}',
                     headers=headers)
    assert dry.status_code == 200 and [m["id"] for m in dry.json()["messages"]] == ["m1"]
    replayed = c.web.post("/api/replay", content=b'{"q": "", "ids": ["m2"], "limit": 1, "dry_run": false}',
                          headers=headers)
    assert replayed.status_code == 200 and replayed.json()["replayed"] == 1 and c.stub.replayed == [
        ("m2", None, None)]
    purged = c.web.post("/api/purge", content=b'{"q": "", "limit": 5, "yes": true, "before": "2030-01-01"}',
                        headers=headers)
    assert purged.status_code == 200 and c.stub.purged == ["m1", "m3"]
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

@pytest.mark.parametrize("body", [b"{}", b'{"q": ""}', b'{"yes": false}', b'{"ids": ["m1"]}',
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
    assert done.json()["purged"] == 3 and c.stub.purged == list(IDS)
    assert [e["action"] for e in c.audit] == ["purge"]


# -- (7c) a purge deletes only the count confirmed ---------------------------------------------------------

def _confirmation(c, q=""):
    page = c.web.get("/purge", params={"q": q}, headers=OPERATOR)
    forms = Page(page.text).post_forms()
    assert page.status_code == 200 and len(forms) == 1
    return forms[0]


@pytest.mark.parametrize("change", ["archived", "gone"])
def test_a_purge_asks_again_when_the_archive_changed_since_the_confirmation(change):
    c = _console()
    form = _confirmation(c)
    assert ("count", "3") in form.fields
    if change == "archived":  # a worker archived one more meanwhile (before the confirmation's time)
        c.stub.messages.append(archived("m4", archived_at="2026-01-01T00:00:00.000+00:00"))
    else:  # another operator purged one meanwhile
        c.stub.messages.pop(0)
    again = submit(c.web, "/purge", form, OPERATOR)
    assert again.status_code == 200 and "The archive changed since you asked" in again.text
    assert c.stub.purged == [] and c.audit == []
    second = Page(again.text).post_forms()[0]
    count = "4" if change == "archived" else "2"
    assert ("count", count) in second.fields
    done = submit(c.web, "/purge", second, OPERATOR)
    assert done.status_code == 200 and f"Purged {count} message(s)" in done.text
    assert len(c.stub.purged) == int(count) and c.stub.messages == []


@pytest.mark.parametrize("count", [None, "", "2", "4", "03", "three"])
def test_a_purge_posted_without_the_right_count_purges_nothing(count):
    c = _console()
    form = {"q": "", **({"count": count} if count is not None else {})}
    answer = c.web.post("/purge", data=form, headers={**OPERATOR, **SAME_ORIGIN})
    assert answer.status_code == 200 and "Delete 3 message(s) for good" in answer.text
    assert c.stub.purged == []


def test_a_purge_takes_only_what_was_archived_by_the_confirmation():
    c = _console()
    form = _confirmation(c)
    c.stub.messages.append(archived("later", archived_at="2999-01-01T00:00:00.000+00:00"))
    assert submit(c.web, "/purge", form, OPERATOR).status_code == 200
    assert c.stub.purged == list(IDS) and [m.id for m in c.stub.messages] == ["later"]


# -- (5) nobody is offered a button they cannot use --------------------------------------------------------

PAGES = ["/", "/?fragment=1", "/failures", "/failures?q=orders&by=key", "/events/m1", "/purge", "/purge?q=orders",
         "/jobs/j1", "/jobs/j1?fragment=1", "/audit"]


def _with_a_running_job(c):
    job = Job("j1", "alice", frozenset({"m1"}), "", state="running", started_at=time.time())
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
        assert 'name="id"' not in answer.text and "<button" not in answer.text.replace(
            '<button type="submit">Search</button>', ""), path


def test_an_operator_is_offered_each_action():
    c = _console(allow_edit=True)
    _with_a_running_job(c)
    offered = {path: [b for f in Page(c.web.get(path, headers=OPERATOR).text).post_forms() for b in f.buttons]
               for path in PAGES}
    assert offered["/failures"] == ["replay-button"] and offered["/purge"] == ["confirm-purge"]
    assert len(offered["/events/m1"]) == 2
    assert len(offered["/jobs/j1"]) == 1 and len(offered["/jobs/j1?fragment=1"]) == 1
    assert any(resolve("/failures", link).startswith("/purge?")
               for link in Page(c.web.get("/failures", headers=OPERATOR).text).links)


# -- (6) any id, through every link and form -----------------------------------------------------------

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
def test_any_id_goes_through_every_link_and_form_and_comes_back_the_same(message_id):
    c = console([archived(message_id), archived("plain")], allow_edit=True)
    url = _event_page(c, message_id)
    assert _followed(c, url, OPERATOR)[0].status_code == 200  # the event page's own links work

    # the event's replay form, as a dry run, then its confirmation: a job that replays that id and no other
    replay_form, edit_form = Page(c.web.get(url, headers=OPERATOR).text).post_forms()
    dry = submit(c.web, url, replay_form, OPERATOR, tick=lambda name, value: name == "dry_run")
    assert dry.status_code == 200 and "1 message(s) would be replayed" in dry.text
    job = submit(c.web, "/replay", Page(dry.text).post_forms()[0], OPERATOR)
    assert job.status_code == 303 and _followed(c, resolve("/replay", job.headers["location"]), OPERATOR)
    _wait_for_jobs(c)
    assert c.stub.replayed == [(message_id, None, None)]

    # edit and replay: the edited body goes with that id
    c.stub.messages.append(archived(message_id))
    edited = submit(c.web, url, edit_form, OPERATOR)
    assert edited.status_code == 200 and "Edited copy replayed" in edited.text
    assert c.stub.replayed[-1] == (message_id, None, b'{"order": 1}')

    # the failures page: tick both, replay only those ticked
    c.stub.messages.append(archived(message_id))
    failures = Page(c.web.get("/failures", headers=OPERATOR).text).post_forms()[0]
    dry = submit(c.web, "/failures", failures, OPERATOR, choose={"scope": "selected"},
                 tick=lambda name, value: name in ("id", "dry_run"))
    assert "2 message(s) would be replayed" in dry.text
    submit(c.web, "/replay", Page(dry.text).post_forms()[0], OPERATOR)
    _wait_for_jobs(c)
    assert sorted(i for i, _, _ in c.stub.replayed[-2:]) == sorted([message_id, "plain"])


@pytest.mark.parametrize("message_id", [i for i in ODD_IDS if i not in (".", "..")], ids=repr)
def test_any_id_is_shown_by_the_api_at_its_percent_encoded_path(message_id):
    c = console([archived(message_id), archived("plain")])
    answer = c.web.get("/api/archive/" + quote(message_id, safe=""), headers=BEARER_VIEWER)
    assert answer.status_code == 200 and answer.json()["id"] == message_id


def test_a_group_link_and_the_read_again_link_keep_the_search():
    c = _console()
    search = 'key:orders.# "order 1" #x &y=1 100%'
    _, reached = _followed(c, "/failures?" + urlencode({"q": search}), OPERATOR)
    assert any(f'value="{escape(search)}"' in page.text for url, page in reached.items() if "fresh=1" in url)
