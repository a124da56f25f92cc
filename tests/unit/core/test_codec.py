"""core/codec.py: decoding by content type with an accept list; pickle only when asked for."""
from __future__ import annotations

import json
import pickle

import pytest

from kombu_events.core.codec import JSON, accept_set, decode
from kombu_events.errors import ConfigurationError, DecodeError

PICKLE = "application/x-python-serialize"
JSON_ONLY = frozenset({JSON})


@pytest.mark.parametrize(
    "body, content_type, expected",
    [
        (b'{"order_id": 42}', JSON, {"order_id": 42}),
        (b"[1, 2, 3]", JSON, [1, 2, 3]),
        ('{"name": "Zoë"}'.encode(), JSON, {"name": "Zoë"}),
        (b'"just a string"', JSON, "just a string"),
        (b"null", JSON, None),
        (b'{"order_id": 42}', None, {"order_id": 42}),  # no content type: tried as JSON
        (b'{"order_id": 42}', "", {"order_id": 42}),
    ],
)
def test_json(body, content_type, expected):
    assert decode(body, content_type, "utf-8", JSON_ONLY) == expected


def test_json_fast_path_does_not_go_through_kombu(mocker):
    loads = mocker.patch("kombu_events.core.codec.loads")
    assert decode(b"{}", JSON, None, JSON_ONLY) == {}
    loads.assert_not_called()


@pytest.mark.parametrize("content_type", [JSON, None])
@pytest.mark.parametrize("body", [b"not json", b"", b'{"a": ', b"\xff\xfe\x00garbage"])
def test_invalid_json_is_a_decode_error(body, content_type):
    with pytest.raises(DecodeError, match="not valid JSON"):
        decode(body, content_type, None, JSON_ONLY)


@pytest.mark.parametrize("content_type", ["text/plain", "application/xml", PICKLE, "application/x-yaml"])
def test_content_type_not_accepted_names_it(content_type):
    with pytest.raises(DecodeError) as info:
        decode(b"whatever", content_type, "utf-8", JSON_ONLY)
    assert repr(content_type) in str(info.value)
    assert "not accepted" in str(info.value)
    assert JSON in str(info.value)


def test_missing_content_type_without_json_accepted_is_refused():
    with pytest.raises(DecodeError, match="'application/json' is not accepted"):
        decode(b"{}", None, None, frozenset({PICKLE}))


UNPICKLED: list[str] = []


def _record(what: str) -> str:
    UNPICKLED.append(what)
    return what


class _SideEffect:
    def __reduce__(self):
        return (_record, ("unpickled",))


def test_pickle_is_refused_by_default_and_never_executed():
    UNPICKLED.clear()
    body = pickle.dumps(_SideEffect())
    with pytest.raises(DecodeError, match=PICKLE):
        decode(body, PICKLE, "binary", accept_set(["json"]))
    assert UNPICKLED == []
    assert decode(body, PICKLE, "binary", accept_set(["json", "pickle"])) == "unpickled"
    assert UNPICKLED == ["unpickled"], "the same body does unpickle once pickle is accepted"


def test_pickle_works_when_accepted():
    body = pickle.dumps({"a": 1, "b": (2, 3)})
    assert decode(body, PICKLE, "binary", accept_set(["json", "pickle"])) == {"a": 1, "b": (2, 3)}


def test_broken_body_of_an_accepted_type_is_a_decode_error():
    with pytest.raises(DecodeError, match=f"does not decode as {PICKLE}"):
        decode(b"not a pickle", PICKLE, "binary", accept_set(["pickle"]))


@pytest.mark.parametrize(
    "accept, expected",
    [
        (["json"], {JSON}),
        (["application/json"], {JSON}),
        (("json", "pickle"), {JSON, PICKLE}),
        (["json", "application/json"], {JSON}),
    ],
)
def test_accept_set(accept, expected):
    assert accept_set(accept) == frozenset(expected)


@pytest.mark.parametrize("bad", ["nonsense", "jsn"])
def test_accept_set_rejects_unknown_serializer_names(bad):
    with pytest.raises(ConfigurationError) as info:
        accept_set(["json", bad])
    assert str(info.value).startswith("accept_content=")
    assert bad in str(info.value)


LATIN = {"name": "Zo\u00eb", "city": "K\u00f6ln", "note": "se\u00f1or \u00bd"}
WIDE = {"name": "Zo\u00eb", "price": "12 \u20ac", "city": "\u6771\u4eac", "emoji": "\U0001f600"}


def _json(payload: object, encoding: str) -> bytes:
    return json.dumps(payload, ensure_ascii=False).encode(encoding)


@pytest.mark.parametrize(
    "payload, encoding, label",
    [
        (LATIN, "latin-1", "latin-1"),
        (LATIN, "latin-1", "ISO-8859-1"),
        (WIDE, "utf-16", "utf-16"),  # with a byte-order mark
        (WIDE, "utf-16-le", "utf-16-le"),
        (WIDE, "utf-16-be", "UTF-16BE"),
        (WIDE, "utf-8", "utf-8"),
        (WIDE, "utf-8", "UTF-8"),
        (WIDE, "utf-8", None),
        (WIDE, "utf-8", "binary"),
    ],
)
def test_json_in_the_content_encoding_it_is_labelled_with(payload, encoding, label):
    body = _json(payload, encoding)
    assert decode(body, JSON, label, JSON_ONLY) == payload


@pytest.mark.parametrize(
    "body, label",
    [
        (_json(LATIN, "latin-1"), "utf-8"),
        (_json(WIDE, "utf-8"), "utf-16"),
        (_json(WIDE, "utf-8") + b" ", "utf-16"),  # an odd number of bytes
        (_json(WIDE, "utf-16"), "utf-8"),
    ],
    ids=["latin-1 as utf-8", "utf-8 as utf-16", "odd utf-8 as utf-16", "utf-16 as utf-8"],
)
def test_json_in_another_encoding_than_its_label_is_a_decode_error(body, label):
    with pytest.raises(DecodeError, match=f"not valid JSON in {label}"):
        decode(body, JSON, label, JSON_ONLY)


def test_an_unknown_codec_is_refused_before_anything_is_decoded():
    with pytest.raises(DecodeError, match="content encoding 'no-such-codec' is not accepted"):
        decode(_json(LATIN, "utf-8"), JSON, "no-such-codec", JSON_ONLY)
