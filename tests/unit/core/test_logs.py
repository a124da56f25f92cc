"""core/logs.py: passwords masked in URLs and error texts; the level of each outcome line."""
from __future__ import annotations

import logging

import pytest

from kombu_events.cli import common
from kombu_events.core.logs import log_outcome, safe_text, safe_url

# (text, every spelling of its password(s), what it reads as once masked): good for safe_url and safe_text.
MASKED = [
    ("amqp://guest:s3cr3t-pw@localhost:5672//", ["s3cr3t-pw"], "amqp://guest:**@localhost:5672//"),
    ("amqps://billing:s3cr3t-pw@rabbit.example.com:5671/prod?ssl_check_hostname=1", ["s3cr3t-pw"],
     "amqps://billing:**@rabbit.example.com:5671/prod?ssl_check_hostname=1"),
    ("pyamqp://svc:s3cr3t-pw@h//", ["s3cr3t-pw"], "pyamqp://svc:**@h//"),
    ("AMQP://svc:s3cr3t-pw@h//", ["s3cr3t-pw"], "AMQP://svc:**@h//"),
    ("amqp://:s3cr3t-pw@h//", ["s3cr3t-pw"], "amqp://:**@h//"),
    # percent-encoded: neither the encoded nor the decoded password may show
    ("amqp://svc:s3%40cr%3At%2F%23x@h:5672/v%2Fh", ["s3%40cr%3At%2F%23x", "s3@cr:t/#x", "s3", "cr%3At"],
     "amqp://svc:**@h:5672/v%2Fh"),
    # unencoded special characters, which break URL parsers
    ("amqp://svc:s3@cr:t/x#y?z@h//", ["s3@cr:t/x#y?z", "s3", "cr:t", "x#y"], "amqp://svc:**@h//"),
    ("amqp://svc:s3cr3t;pw@h//", ["s3cr3t", ";pw"], "amqp://svc:**@h//"),
    ("amqp://svc:p'\"!$&()*+,=[]{}~%^`|\\<>-s3cr3t@h//", ["s3cr3t", "p'\"!$&"], "amqp://svc:**@h//"),
    # fail-over URLs, as kombu takes them
    ("amqp://a:pw-one@h1:5672//;amqps://b:pw-two@h2:5671/v;amqp://c@h3//", ["pw-one", "pw-two"],
     "amqp://a:**@h1:5672//;amqps://b:**@h2:5671/v;amqp://c@h3//"),
    # inside an error message
    ("cannot reach the broker at amqp://svc:s3cr3t-pw@127.0.0.1:1//: [Errno 111] Connection refused",
     ["s3cr3t-pw"], "cannot reach the broker at amqp://svc:**@127.0.0.1:1//: [Errno 111] Connection refused"),
    # already masked: unchanged
    ("amqp://svc:**@h//", [], "amqp://svc:**@h//"),
]

# Free text with several URLs: whitespace ends a URL (safe_url takes one value, where a password may hold a space).
IN_TEXT = [
    ("OperationalError: 'amqp://svc:s3cr3t-pw@h//' and http://admin:mgmt-pw@h:15672/api failed",
     ["s3cr3t-pw", "mgmt-pw"], "OperationalError: 'amqp://svc:**@h//' and http://admin:**@h:15672/api failed"),
    ("tried amqp://a:pw-one@h1// then amqp://b:pw-two@h2//: timed out", ["pw-one", "pw-two"],
     "tried amqp://a:**@h1// then amqp://b:**@h2//: timed out"),
]

# No password: returned exactly as given.
UNCHANGED = ["amqp://guest@localhost:5672//", "amqp://localhost:5672//", "memory://",
             "redis://h:6379/0", "no URL here: user:password@host", ""]


@pytest.mark.parametrize("mask", [safe_url, safe_text, common.safe_text], ids=["safe_url", "safe_text", "cli"])
@pytest.mark.parametrize("text, passwords, expected", MASKED)
def test_passwords_are_masked_and_the_rest_stays_readable(mask, text, passwords, expected):
    masked = mask(text)
    for password in passwords:
        assert password not in masked
    assert masked == expected


@pytest.mark.parametrize("mask", [safe_text, common.safe_text], ids=["safe_text", "cli"])
@pytest.mark.parametrize("text, passwords, expected", IN_TEXT)
def test_every_url_of_an_error_text_is_masked(mask, text, passwords, expected):
    masked = mask(text)
    for password in passwords:
        assert password not in masked
    assert masked == expected


@pytest.mark.parametrize("mask", [safe_url, safe_text, common.safe_text], ids=["safe_url", "safe_text", "cli"])
@pytest.mark.parametrize("text", UNCHANGED)
def test_text_without_a_password_is_unchanged(mask, text):
    assert mask(text) == text


def test_safe_url_masks_a_password_with_a_space_and_a_list_of_urls():
    assert safe_url("amqp://svc:s3cr3t pw@h//") == "amqp://svc:**@h//"
    assert safe_url(["amqp://a:pw-one@h1//", "amqp://b:pw-two@h2//"]) == "amqp://a:**@h1//;amqp://b:**@h2//"
    assert safe_url(None) == "None"


@pytest.mark.parametrize(
    "outcome, level",
    [("ack", logging.INFO), ("retry", logging.INFO), ("requeue", logging.WARNING), ("archive", logging.ERROR),
     ("held", logging.ERROR)],
)
def test_each_outcome_is_logged_at_its_level(caplog, outcome, level):
    caplog.set_level(logging.DEBUG, logger="kombu_events.outcome")
    log_outcome(outcome, queue="billing.audit", routing_key="orders.3.created", message_id="m-1", attempt=2,
                duration_ms=5.5, delay_ms=1000, reason="why")
    [record] = caplog.records
    assert record.name == "kombu_events.outcome"
    assert (record.levelno, record.levelname) == (level, logging.getLevelName(level))
    assert record.getMessage().startswith(f"event outcome={outcome} queue=billing.audit ")
    assert record.kombu_events["outcome"] == outcome


@pytest.mark.parametrize(("reply_text", "method_sig", "expected"), [
    ("ACCESS_REFUSED - access to exchange 'shop.delay.3' in vhost 'shop' refused for user 'shop'", (60, 40),
     "RabbitMQ refused write to exchange 'shop.delay.3' for user 'shop' (ACCESS_REFUSED)"),
    ("ACCESS_REFUSED - access to queue 'shop.audit' in vhost '/' refused for user 'run'", (60, 20),
     "RabbitMQ refused read from queue 'shop.audit' for user 'run' (ACCESS_REFUSED)"),
    ("ACCESS_REFUSED - access to queue 'q' in vhost '/' refused for user 'run'", (50, 10),
     "RabbitMQ refused configure queue 'q' for user 'run' (ACCESS_REFUSED)"),
    ("ACCESS_REFUSED - access to exchange 'x' in vhost '/' refused for user 'u'", None,
     "RabbitMQ refused access to exchange 'x' for user 'u' (ACCESS_REFUSED)"),
    ("ACCESS_REFUSED - something else", (60, 40), "RabbitMQ refused access (ACCESS_REFUSED - something else)"),
])
def test_a_refusal_names_the_permission_the_resource_and_the_user(reply_text, method_sig, expected):
    from kombu_events.core.logs import refusal_text

    assert refusal_text(reply_text, method_sig) == expected
