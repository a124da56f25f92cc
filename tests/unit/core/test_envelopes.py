"""Envelopes of other ecosystems: each format in each mode, from the fixtures their documentation
shows (tests/fixtures/envelopes, each with a .source naming where it comes from), the malformed
cases with their exact reasons, the time formats, ``Envelope.matches``, and a fuzz test that
nothing but ``DecodeError`` ever escapes ``unwrap``."""
from __future__ import annotations

import base64
import json
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings, strategies as st

from kombu_events.core.codec import accept_set, decode as codec_decode
from kombu_events.core.envelope_formats import nservicebus_time, rfc3339
from kombu_events.core.envelopes import Envelope, EnvelopeError, unwrap
from kombu_events.errors import DecodeError

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "envelopes"
JSON_ONLY = accept_set(["json"])
UTC = timezone.utc
CE_STRUCTURED = "application/cloudevents+json; charset=utf-8"
MASSTRANSIT = "application/vnd.masstransit+json"


def decode(body: bytes, content_type: str | None, content_encoding: str | None) -> Any:
    """The worker's decoder: JSON only."""
    return codec_decode(body, content_type, content_encoding, JSON_ONLY)


class Recorder:
    """A decoder that returns what it was asked to decode."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, body: bytes, content_type: str | None, content_encoding: str | None) -> Any:
        self.calls.append((body, content_type, content_encoding))
        return "decoded"


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def header_lines(text: str, separator: str) -> dict[str, str]:
    """``name<separator>value`` lines as a dict (a line without the separator is skipped)."""
    pairs = (line.split(separator, 1) for line in text.splitlines() if separator in line)
    return {name.strip(): value.strip() for name, value in pairs}


def run(body: Any, content_type: str | None = None, headers: dict[str, Any] | None = None,
        properties: dict[str, Any] | None = None, decoder: Any = decode, content_encoding: str | None = None):
    return unwrap(body, content_type, content_encoding, headers, properties or {}, decoder)


def malformed(body: Any, content_type: str | None = None, headers: dict[str, Any] | None = None) -> str:
    with pytest.raises(EnvelopeError) as caught:
        run(body, content_type, headers)
    return str(caught.value)


def test_every_fixture_cites_its_source():
    data = [path for path in FIXTURES.iterdir() if not path.name.endswith(".source")]
    assert len(data) >= 6
    for path in data:
        source = (FIXTURES / (path.name + ".source")).read_text()
        assert "https://" in source, path.name


# CloudEvents, structured mode.

def test_cloudevents_structured_from_the_spec():
    payload, envelope = run(fixture("cloudevents-structured.json"), CE_STRUCTURED)
    assert payload == {"appinfoA": "abc", "appinfoB": 123, "appinfoC": True}
    assert envelope == Envelope(
        kind="cloudevents", type="com.example.someevent", id="C234-1234-1234", source="/mycontext",
        time=datetime(2018, 4, 5, 17, 31, tzinfo=UTC), correlation_id=None, types=("com.example.someevent",),
        attributes={"specversion": "1.0", "comexampleextension1": "value", "comexampleothervalue": 5,
                    "datacontenttype": "application/json"})  # "subject": null is unset


def test_cloudevents_structured_data_is_any_json_value_and_never_parsed_again():
    payload, envelope = run(fixture("cloudevents-structured-string.json"), "application/cloudevents+json")
    assert payload == "I'm just a string"
    assert envelope.id == "D234-1234-1234"


@pytest.mark.parametrize("content_type", ["application/cloudevents+json", "Application/CloudEvents+JSON",
                                          "application/cloudevents+json;charset=UTF-8"])
def test_cloudevents_structured_content_type_is_read_without_case_or_parameters(content_type):
    _, envelope = run(fixture("cloudevents-structured.json"), content_type)
    assert envelope.kind == "cloudevents"


def test_cloudevents_structured_body_may_arrive_as_text():
    payload, _ = run(fixture("cloudevents-structured.json").decode(), CE_STRUCTURED)
    assert payload["appinfoB"] == 123


def test_cloudevents_structured_charset_parameter_decodes_the_body():
    body = json.dumps(EVENT | {"data": "été"}, ensure_ascii=False).encode("utf-16")
    payload, _ = run(body, "application/cloudevents+json; charset=utf-16")
    assert payload == "été"


EVENT = {"specversion": "1.0", "id": "e-1", "source": "/orders", "type": "com.example.order.placed"}


def structured(**changes: Any) -> bytes:
    event = {**EVENT, **changes}
    return json.dumps({name: value for name, value in event.items() if value is not ...}).encode()


def test_cloudevents_data_base64_is_decoded_by_its_datacontenttype():
    recorder = Recorder()
    body = structured(data_base64=base64.b64encode(b"\x00\x01thrift").decode(),
                      datacontenttype="application/vnd.apache.thrift.binary")
    assert run(body, CE_STRUCTURED, decoder=recorder)[0] == "decoded"
    assert recorder.calls == [(b"\x00\x01thrift", "application/vnd.apache.thrift.binary", None)]


def test_cloudevents_data_base64_is_json_by_default():
    payload, _ = run(structured(data_base64=base64.b64encode(b'{"n": 2}').decode()), CE_STRUCTURED)
    assert payload == {"n": 2}


def test_cloudevents_data_base64_of_a_type_not_accepted_is_the_decoders_error():
    body = structured(data_base64="AAE=", datacontenttype="application/x-python-serialize")
    with pytest.raises(DecodeError) as caught:
        run(body, CE_STRUCTURED)
    assert not isinstance(caught.value, EnvelopeError)
    assert "not accepted" in str(caught.value)


def test_cloudevents_without_data_has_payload_none():
    assert run(structured(), CE_STRUCTURED)[0] is None


PREFIX = "malformed CloudEvents envelope (structured): "


@pytest.mark.parametrize(("body", "reason"), [
    (structured(source=...), "missing required attribute 'source'"),
    (structured(id=...), "missing required attribute 'id'"),
    (structured(type=...), "missing required attribute 'type'"),
    (structured(specversion=...), "missing required attribute 'specversion'"),
    (structured(id=""), "missing required attribute 'id'"),
    (structured(source=None), "missing required attribute 'source'"),
    (structured(specversion="0.3"), "unsupported specversion '0.3' (only '1.0' is)"),
    (structured(specversion=1.0), "attribute 'specversion' is not a string: 1.0"),
    (structured(type=["a"]), "attribute 'type' is not a string: ['a']"),
    (structured(time="yesterday"), "attribute 'time' is not an RFC 3339 timestamp: 'yesterday'"),
    (structured(time="2018-04-05T17:31:00"), "attribute 'time' is not an RFC 3339 timestamp: '2018-04-05T17:31:00'"),
    (structured(time="2018-02-30T17:31:00Z"), "attribute 'time' is not an RFC 3339 timestamp: '2018-02-30T17:31:00Z'"),
    (structured(data_base64="... base64 encoded string ..."),  # the spec's own placeholder
     "'data_base64' is not base64: '... base64 encoded string ...'"),
    (structured(data_base64="été"), "'data_base64' is not base64: 'été'"),
    (structured(data_base64=5), "'data_base64' is not a string: 5"),
    (structured(data={"a": 1}, data_base64="AAE="), "both 'data' and 'data_base64' are present"),
    (structured(data_base64="AAE=", datacontenttype=["a"]), "attribute 'datacontenttype' is not a string: ['a']"),
    (b"[1, 2]", "body is not a JSON object but list"),
    (b'"event"', "body is not a JSON object but str"),
    (b"{", ("body is not JSON: JSONDecodeError: Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1)")),
    (b"\xff{}", ("body is not JSON: UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in position 0: "
                 "invalid start byte")),
])
def test_cloudevents_structured_malformed(body, reason):
    assert malformed(body, CE_STRUCTURED) == PREFIX + reason


def test_cloudevents_structured_nested_too_deep_is_malformed_not_a_crash():
    assert malformed(b"[" * 100_000, CE_STRUCTURED).startswith(PREFIX + "body is not JSON: RecursionError")


def test_cloudevents_structured_unknown_charset_is_malformed():
    assert malformed(structured(), "application/cloudevents+json; charset=klingon") == (
        PREFIX + "content encoding 'klingon' is not accepted: only utf-8, utf-16, utf-32 (each also -be or -le), "
        "latin-1 (iso-8859-1), ascii and binary are")


def test_envelope_error_is_a_decode_error_that_names_kind_mode_and_reason():
    with pytest.raises(DecodeError) as caught:
        run(structured(source=...), CE_STRUCTURED)
    error = caught.value
    assert isinstance(error, EnvelopeError)
    assert (error.kind, error.mode) == ("cloudevents", "structured")
    assert error.reason == "missing required attribute 'source'"


# CloudEvents, binary mode.

def http_binary_fixture() -> tuple[bytes, str, dict[str, str]]:
    head, body = fixture("cloudevents-http-binary.txt").split(b"\n\n", 1)
    lines = header_lines(head.decode(), ": ")
    content_type = lines.pop("content-type")
    return body, content_type, lines


def test_cloudevents_binary_from_the_spec_reads_as_its_structured_twin():
    body, content_type, headers = http_binary_fixture()
    payload, envelope = run(body, content_type, headers)
    twin_payload, twin = run(fixture("cloudevents-structured.json"), CE_STRUCTURED)
    assert payload == twin_payload
    assert envelope.attributes == {**twin.attributes, "comexampleothervalue": "5"}  # a header is a string
    assert envelope == Envelope(**{**twin.__dict__, "attributes": envelope.attributes})


def test_cloudevents_binary_from_the_amqp_binding():
    lines = header_lines(fixture("cloudevents-amqp-binary.txt").decode(), ": ")
    headers = {name: value for name, value in lines.items() if name.startswith("cloudEvents:")}
    payload, envelope = run(b'{"n": 1}', lines["content-type"], headers)  # the spec elides the data
    assert payload == {"n": 1}
    assert (envelope.kind, envelope.type, envelope.id, envelope.source, envelope.time) == (
        "cloudevents", "com.example.someevent", "1234-1234-1234", "/mycontext/subcontext",
        datetime(2018, 4, 5, 3, 56, 24, tzinfo=UTC))
    assert envelope.attributes == {"specversion": "1.0", "datacontenttype": "application/json; charset=utf-8"}


@pytest.mark.parametrize("prefix", ["cloudEvents_", "cloudEvents:", "ce-", "ce_", "CE-", "CLOUDEVENTS_", "Ce_"])
def test_cloudevents_binary_prefixes_any_case(prefix):
    headers = {prefix + name: value for name, value in EVENT.items()}
    payload, envelope = run(b'{"n": 1}', "application/json", headers)
    assert (payload, envelope.id, envelope.source, envelope.type) == ({"n": 1}, "e-1", "/orders",
                                                                      "com.example.order.placed")


def test_cloudevents_binary_body_goes_to_the_decoder_with_the_message_content_type():
    recorder = Recorder()
    headers = {"ce-" + name: value for name, value in EVENT.items()}
    run(b"<x/>", "application/xml", headers, decoder=recorder, content_encoding="utf-8")
    assert recorder.calls == [(b"<x/>", "application/xml", "utf-8")]


def test_cloudevents_binary_header_values_may_be_bytes_or_native_amqp_types():
    headers = {"ce-" + name: value.encode() for name, value in EVENT.items()}
    headers |= {"ce-time": datetime(2024, 5, 1, 10, 0), "ce-sequence": 7, "ce-weight": Decimal("1.5"),
                "ce-blob": b"\xff", "ce-nested": {"at": datetime(2024, 5, 1), "list": [b"a", 1]}}
    _, envelope = run(b"{}", None, headers)
    assert envelope.id == "e-1"
    assert envelope.time == datetime(2024, 5, 1, 10, 0, tzinfo=UTC)  # py-amqp's timestamps are naive UTC
    assert envelope.attributes == {"specversion": "1.0", "sequence": 7, "weight": "1.5", "blob": "\ufffd",
                                   "nested": {"at": "2024-05-01T00:00:00", "list": ["a", 1]}}
    json.dumps(envelope.attributes)


BINARY = "malformed CloudEvents envelope (binary): "


@pytest.mark.parametrize(("headers", "reason"), [
    ({"ce-specversion": "1.0", "ce-source": "/s", "ce-type": "t"}, "missing required attribute 'id'"),
    ({"ce-id": "1", "ce-source": "/s", "ce-type": "t"}, "missing required attribute 'specversion'"),
    ({"ce-unrelated": "x", "ce-type": "t"}, "missing required attribute 'specversion'"),
    ({**{"ce-" + k: v for k, v in EVENT.items()}, "cloudEvents_id": "other"},
     "attribute 'id' is given twice, with different values ('cloudEvents_id')"),
    ({**{"ce-" + k: v for k, v in EVENT.items()}, "ce-id": b"\xff"}, "attribute 'id' is not UTF-8 text: b'\\xff'"),
    ({**{"ce-" + k: v for k, v in EVENT.items()}, "ce-time": "noon"},
     "attribute 'time' is not an RFC 3339 timestamp: 'noon'"),
])
def test_cloudevents_binary_malformed(headers, reason):
    assert malformed(b"{}", "application/json", headers) == BINARY + reason


def test_a_prefixed_header_that_is_no_cloudevents_attribute_leaves_the_message_bare():
    assert run(b'{"n": 1}', "application/json", {"ce-unrelated": "x", "cloudEvents_partitionkey": "p"}) == (
        {"n": 1}, None)


def test_cloudevents_binary_same_value_under_two_prefixes_is_fine():
    headers = {**{"ce-" + k: v for k, v in EVENT.items()}, "cloudEvents_id": "e-1"}
    assert run(b"{}", None, headers)[1].id == "e-1"


def test_structured_content_type_wins_over_binary_headers():
    headers = {"ce-" + k: v for k, v in EVENT.items()} | {"ce-id": "from-header"}
    _, envelope = run(structured(id="from-body"), CE_STRUCTURED, headers)
    assert envelope.id == "from-body"


# MassTransit.

def test_masstransit_envelope_from_the_documentation():
    payload, envelope = run(fixture("masstransit-envelope.json"), MASSTRANSIT)
    assert payload == {"orderId": "181c0000-6393-3630-36a4-08daf4e7c6da", "timestamp": "2023-01-12T21:55:53.714Z"}
    assert envelope == Envelope(
        kind="masstransit", type="urn:message:Company.Project:SubmitOrder", id="181c0000-6393-3630-36a4-08daf4e7c6da",
        source="rabbitmq://localhost/source", time=datetime(2023, 1, 12, 21, 55, 53, 715882, tzinfo=UTC),
        correlation_id=None, types=("urn:message:Company.Project:SubmitOrder",),
        attributes={"requestId": "ef375b18-69ee-4a9e-b5ec-44ee1177a27e",
                    "destinationAddress": "rabbitmq://localhost/destination",
                    "responseAddress": "rabbitmq://localhost/response", "faultAddress": "rabbitmq://localhost/fault",
                    "headers": {"Application-Header": "SomeValue"},
                    "host": json.loads(fixture("masstransit-envelope.json"))["host"]})
    assert envelope.matches("Company.Project.SubmitOrder")


def masstransit(**changes: Any) -> bytes:
    document = {"messageId": "m-1", "messageType": ["urn:message:A.B:C", "urn:message:A.B:IBase"], "message": {"x": 1},
                "sentTime": "2023-01-12T21:55:53.7158823Z", "correlationId": "c-1", **changes}
    return json.dumps({name: value for name, value in document.items() if value is not ...}).encode()


def test_masstransit_envelope_lists_every_type_and_reads_dotnet_times():
    _, envelope = run(masstransit(), MASSTRANSIT)
    assert envelope.types == ("urn:message:A.B:C", "urn:message:A.B:IBase")
    assert envelope.type == "urn:message:A.B:C"
    assert envelope.time == datetime(2023, 1, 12, 21, 55, 53, 715882, tzinfo=UTC)  # 7 digits: .NET ticks
    assert envelope.correlation_id == "c-1"


@pytest.mark.parametrize(("sent", "expected"), [
    ("2023-01-12T21:55:53Z", datetime(2023, 1, 12, 21, 55, 53, tzinfo=UTC)),
    ("2023-01-12T21:55:53.7+01:00", datetime(2023, 1, 12, 20, 55, 53, 700000, tzinfo=UTC)),
    ("2023-01-12T21:55:53.715882", datetime(2023, 1, 12, 21, 55, 53, 715882, tzinfo=UTC)),  # kind unspecified
])
def test_masstransit_sent_time(sent, expected):
    assert run(masstransit(sentTime=sent), MASSTRANSIT)[1].time == expected


MT = "malformed MassTransit envelope (envelope): "


@pytest.mark.parametrize(("body", "reason"), [
    (masstransit(message=...), "missing 'message'"),
    (masstransit(message=None), "missing 'message'"),
    (masstransit(messageType=...), "'messageType' is not a list of strings: None"),
    (masstransit(messageType="urn:message:A:B"), "'messageType' is not a list of strings: 'urn:message:A:B'"),
    (masstransit(messageType=["urn:message:A:B", 5]), "'messageType' is not a list of strings: ['urn:message:A:B', 5]"),
    (masstransit(messageType=[]), "'messageType' is empty"),
    (masstransit(sentTime="12/01/2023"), "'sentTime' is not an ISO 8601 time: '12/01/2023'"),
    (masstransit(messageId=["m"]), "'messageId' is not a string: ['m']"),
    (b"null", "body is not a JSON object but NoneType"),
])
def test_masstransit_envelope_malformed(body, reason):
    assert malformed(body, MASSTRANSIT) == MT + reason


def masstransit_raw_headers() -> dict[str, Any]:
    # The header names of the documentation's table, with the values of its envelope example.
    return {"MessageId": "181c0000-6393-3630-36a4-08daf4e7c6da", "RequestId": "ef375b18-69ee-4a9e-b5ec-44ee1177a27e",
            "MT-Source-Address": "rabbitmq://localhost/source", "MT-Response-Address": "rabbitmq://localhost/response",
            "MT-Fault-Address": "rabbitmq://localhost/fault", "Content-Type": "application/json",
            "MT-MessageType": "urn:message:Company.Project:SubmitOrder;urn:message:Company.Project:IOrder",
            "MT-Host-Info": '{"machineName":"MyComputer"}'}


def test_masstransit_raw_json_from_the_documentation():
    payload, envelope = run(fixture("masstransit-raw.json"), "application/json", masstransit_raw_headers(),
                            {"correlation_id": "c-9", "timestamp": 1673560553})
    assert payload == json.loads(fixture("masstransit-raw.json"))
    assert envelope == Envelope(
        kind="masstransit", type="urn:message:Company.Project:SubmitOrder", id="181c0000-6393-3630-36a4-08daf4e7c6da",
        source="rabbitmq://localhost/source", time=datetime(2023, 1, 12, 21, 55, 53, tzinfo=UTC), correlation_id="c-9",
        types=("urn:message:Company.Project:SubmitOrder", "urn:message:Company.Project:IOrder"),
        attributes={"RequestId": "ef375b18-69ee-4a9e-b5ec-44ee1177a27e",
                    "MT-Response-Address": "rabbitmq://localhost/response",
                    "MT-Fault-Address": "rabbitmq://localhost/fault", "MT-Host-Info": '{"machineName":"MyComputer"}'})
    assert envelope.matches("Company.Project:IOrder")


def test_masstransit_raw_id_falls_back_to_the_message_id_property():
    _, envelope = run(b"{}", "application/json", {"MT-MessageType": "urn:message:A:B"}, {"message_id": "p-1"})
    assert (envelope.id, envelope.time, envelope.source) == ("p-1", None, None)


@pytest.mark.parametrize("value", ["", " ; ;", b""])
def test_masstransit_raw_without_a_type_is_malformed(value):
    assert malformed(b"{}", "application/json", {"MT-MessageType": value}) == (
        "malformed MassTransit envelope (raw): header 'MT-MessageType' names no message type")


# NServiceBus.

def nservicebus_headers() -> dict[str, str]:
    return header_lines(fixture("nservicebus-publish.txt").decode(), " = ")


def test_nservicebus_from_the_documentation():
    recorder = Recorder()
    payload, envelope = run(b"<MessageToPublish/>", None, nservicebus_headers(), decoder=recorder)
    assert payload == "decoded"
    assert recorder.calls == [(b"<MessageToPublish/>", "text/xml", None)]  # NServiceBus.ContentType
    qualified = ("Core.Headers.Writers.MyNamespace.MessageToPublish, MyAssembly, Version=1.0.0.0, Culture=neutral, "
                 "PublicKeyToken=null")
    assert envelope == Envelope(
        kind="nservicebus", type=qualified, id="5fb721f2-d442-4a21-86b1-b33b000c1b4b", source="HeaderWriterPublish",
        time=datetime(2025, 8, 16, 0, 44, 4, 735032, tzinfo=UTC), correlation_id="5fb721f2-d442-4a21-86b1-b33b000c1b4b",
        types=(qualified,),
        attributes={"$.diagnostics.originating.hostid": "7f787fc8e0611a3fab8a93c8767f6639",
                    "NServiceBus.ContentType": "text/xml",
                    "NServiceBus.ConversationId": "2d55209a-f4fb-4984-84cf-b33b000c1b4b",
                    "NServiceBus.MessageIntent": "Publish", "NServiceBus.OriginatingMachine": "MACHINENAME",
                    "NServiceBus.ReplyToAddress": "HeaderWriterPublish", "NServiceBus.Version": "8.2.5"})
    assert envelope.matches("Core.Headers.Writers.MyNamespace.MessageToPublish")


def test_nservicebus_message_content_type_wins_and_types_split_on_semicolons():
    headers = nservicebus_headers() | {"NServiceBus.EnclosedMessageTypes": "A.Placed, A, Version=1.0.0.0; A.IEvent, A"}
    payload, envelope = run(b'{"n": 1}', "application/json", headers)
    assert payload == {"n": 1}
    assert envelope.types == ("A.Placed, A, Version=1.0.0.0", "A.IEvent, A")


NSB = ("malformed NServiceBus envelope (headers): header 'NServiceBus.TimeSent' is not an NServiceBus timestamp "
       "(yyyy-MM-dd HH:mm:ss:ffffff Z): ")


@pytest.mark.parametrize("sent", ["2015-12-03T09:32:29.529466Z", "2015-12-03 09:32:29:52946 Z",
                                  "2015-13-03 09:32:29:529466 Z", "2015-12-03 09:32:29:529466Z", "",
                                  "2015-12-03 09:32:29:\uff15\uff12\uff19\uff14\uff16\uff16 Z"])
def test_nservicebus_time_sent_that_does_not_parse_is_malformed(sent):
    headers = nservicebus_headers() | {"NServiceBus.TimeSent": sent}
    assert malformed(b"{}", "application/json", headers) == NSB + repr(sent)


def test_nservicebus_without_time_sent_has_no_time():
    headers = {"NServiceBus.EnclosedMessageTypes": "A.B", "NServiceBus.MessageId": "m"}
    assert run(b"{}", "application/json", headers)[1].time is None


# Spring AMQP.

def test_spring_type_id_from_the_sample():
    properties = {"message_id": "m-7", "correlation_id": "c-7", "timestamp": 1_700_000_000,
                  "content_type": "application/json"}
    payload, envelope = run(fixture("spring-typeid.json"), "application/json", {"__TypeId__": "foo"}, properties)
    assert payload == {"foo": "value"}
    assert envelope == Envelope(kind="spring", type="foo", id="m-7", source=None,
                                time=datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC), correlation_id="c-7",
                                types=("foo",), attributes={})


def test_spring_keeps_the_collection_type_headers_and_never_loads_a_class():
    headers = {"__TypeId__": "java.util.ArrayList", "__ContentTypeId__": "com.example.Order"}
    _, envelope = run(b"[]", "application/json", headers, {"timestamp": 10 ** 30})
    assert envelope.matches("java.util.ArrayList") and not envelope.matches("ArrayList")
    assert envelope.attributes == {"__ContentTypeId__": "com.example.Order"}
    assert envelope.time is None  # a timestamp no datetime holds is left out, not the envelope's fault


@pytest.mark.parametrize(("value", "reason"), [("", "header '__TypeId__' is empty"),
                                               (["x"], "header '__TypeId__' is not a string: ['x']")])
def test_spring_malformed(value, reason):
    expected = "malformed Spring AMQP envelope (headers): " + reason
    assert malformed(b"{}", "application/json", {"__TypeId__": value}) == expected


# Bare messages and the choice among envelopes.

@pytest.mark.parametrize("headers", [None, {}, {"x-death": [{"count": 1}], "trace": "t"},
                                     {"kombu-events-attempts": 2, "kombu-events-ce-id": "x"},
                                     {1: "not a name"}, {"cel": 1, "c": 2}])
def test_bare_message_is_decoded_as_is(headers):
    recorder = Recorder()
    assert run(b"{}", "application/json", headers, decoder=recorder, content_encoding="utf-8") == ("decoded", None)
    assert recorder.calls == [(b"{}", "application/json", "utf-8")]


def test_one_envelope_is_chosen_when_headers_name_several():
    spring_and_nsb = {"__TypeId__": "foo", "NServiceBus.EnclosedMessageTypes": "A.B"}
    assert run(b"{}", None, spring_and_nsb)[1].kind == "nservicebus"
    assert run(b"{}", None, spring_and_nsb | {"MT-MessageType": "urn:message:A:B"})[1].kind == "masstransit"
    with_ce = spring_and_nsb | {"ce-" + name: value for name, value in EVENT.items()}
    assert run(b"{}", None, with_ce)[1].kind == "cloudevents"


def test_header_names_are_matched_without_case_and_may_be_bytes():
    _, envelope = run(b"{}", None, {b"__typeid__": b"foo", "MESSAGEID": "ignored: spring reads the property"})
    assert (envelope.kind, envelope.type) == ("spring", "foo")


# Envelope.matches.

@pytest.mark.parametrize(("kind", "types", "wanted", "expected"), [
    ("masstransit", ("urn:message:Company.Contracts:OrderPlaced",), "urn:message:Company.Contracts:OrderPlaced", True),
    ("masstransit", ("urn:message:Company.Contracts:OrderPlaced",), "Company.Contracts:OrderPlaced", True),
    ("masstransit", ("urn:message:Company.Contracts:OrderPlaced",), "Company.Contracts.OrderPlaced", True),
    ("masstransit", ("urn:message:Company.Contracts:OrderPlaced",), "OrderPlaced", False),
    ("masstransit", ("urn:message:Company.Contracts:OrderPlaced",), "company.contracts.orderplaced", False),
    ("masstransit", ("urn:message:A:Svc+Nested",), "A.Svc+Nested", True),
    ("masstransit", ("urn:message:A:B", "urn:message:A:IBase"), "A.IBase", True),
    ("nservicebus", ("My.OrderPlaced, MyAssembly, Version=1.0.0.0, Culture=neutral, PublicKeyToken=null",),
     "My.OrderPlaced", True),
    ("nservicebus", ("My.OrderPlaced, MyAssembly",), "My.OrderPlaced, MyAssembly", True),
    ("nservicebus", ("My.OrderPlaced",), "My.OrderPlaced", True),
    ("nservicebus", ("My.OrderPlaced, MyAssembly",), "OrderPlaced", False),
    ("nservicebus", ("My.Batch`1[[My.Order, MyAssembly]], MyAssembly",), "My.Batch`1[[My.Order, MyAssembly]]", True),
    ("nservicebus", ("My.Batch`1[[My.Order, MyAssembly]], MyAssembly",), "My.Batch`1[[My.Order", False),
    ("cloudevents", ("com.example.someevent",), "com.example.someevent", True),
    ("cloudevents", ("com.example.someevent",), "someevent", False),
    ("spring", ("com.example.Order",), "com.example.Order", True),
    ("spring", ("urn:message:A:B",), "A:B", False),  # short forms are MassTransit's only
])
def test_matches(kind, types, wanted, expected):
    envelope = Envelope(kind=kind, type=types[0], id=None, source=None, time=None, correlation_id=None, types=types)
    assert envelope.matches(wanted) is expected


# Times.

@pytest.mark.parametrize(("text", "expected"), [
    ("2018-04-05T17:31:00Z", datetime(2018, 4, 5, 17, 31, tzinfo=UTC)),
    ("2018-04-05t17:31:00z", datetime(2018, 4, 5, 17, 31, tzinfo=UTC)),
    ("2018-04-05 17:31:00.5Z", datetime(2018, 4, 5, 17, 31, 0, 500000, tzinfo=UTC)),
    ("2018-04-05T17:31:00.123456789Z", datetime(2018, 4, 5, 17, 31, 0, 123456, tzinfo=UTC)),
    ("2018-04-05T17:31:00-05:30", datetime(2018, 4, 5, 17, 31, tzinfo=timezone(-timedelta(hours=5, minutes=30)))),
    ("2018-04-05T17:31:00+00:00", datetime(2018, 4, 5, 17, 31, tzinfo=UTC)),
])
def test_rfc3339(text, expected):
    parsed = rfc3339(text)
    assert parsed == expected and parsed.utcoffset() == expected.utcoffset()


@pytest.mark.parametrize("text", ["2018-04-05T17:31:00", "2018-04-05", "2018-04-05T17:31Z", "2018-04-05T17:31:00+24:00",
                                  "2018-04-05T17:31:00.Z", " 2018-04-05T17:31:00Z", "2018-04-05T25:31:00Z"])
def test_rfc3339_refuses(text):
    with pytest.raises(ValueError):
        rfc3339(text)


def test_nservicebus_time_is_utc_to_the_microsecond():
    assert nservicebus_time("2015-12-03 09:32:29:529466 Z") == datetime(2015, 12, 3, 9, 32, 29, 529466, tzinfo=UTC)


# Whatever arrives, only DecodeError comes out.

NAMES = ["ce-id", "ce-specversion", "ce-source", "ce-type", "ce-time", "cloudEvents:id", "CE_SPECVERSION", "ce-",
         "MT-MessageType", "MessageId", "CorrelationId", "MT-Source-Address", "NServiceBus.EnclosedMessageTypes",
         "NServiceBus.TimeSent", "NServiceBus.ContentType", "NServiceBus.MessageId", "__TypeId__", "kombu-events-x"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=30), st.binary(max_size=30),
                    st.datetimes(), st.decimals(allow_nan=True),
                    st.sampled_from(["1.0", "0.3", "2015-12-03 09:32:29:529466 Z", "2018-04-05T17:31:00Z", "a;b"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                           max_size=3), max_leaves=8)
names = st.one_of(st.sampled_from(NAMES), st.text(max_size=20), st.binary(max_size=10), st.integers())
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                       max_size=3), max_leaves=8)
documents = st.dictionaries(st.sampled_from(["specversion", "id", "source", "type", "time", "data", "data_base64",
                                             "datacontenttype", "message", "messageType", "messageId", "sentTime",
                                             "sourceAddress", "correlationId", "x"]), json_values | st.sampled_from(
                                                 ["1.0", "AAE=", "application/json", ["urn:message:A:B"]]), max_size=8)
content_types = st.one_of(st.none(), st.integers(), st.text(max_size=40), st.sampled_from(
    ["application/cloudevents+json", "application/cloudevents+json; charset=utf-16", MASSTRANSIT,
     "application/json", "text/xml", "application/cloudevents+json; charset=nope"]))
random_headers = st.dictionaries(names, values, max_size=4)
random_bodies = st.one_of(st.binary(max_size=60), st.text(max_size=60), st.none(), st.integers(),
                          documents.map(lambda d: json.dumps(d).encode()))
# Valid envelopes with random changes on top, so that the fuzz reaches past the first check.
STRUCTURED = [(CE_STRUCTURED, EVENT), (MASSTRANSIT, {"message": {"x": 1}, "messageType": ["urn:message:A:B"]})]
HEADERS = [{"ce-" + name: value for name, value in EVENT.items()}, {"MT-MessageType": "urn:message:A:B"},
           {"NServiceBus.EnclosedMessageTypes": "A.B, A", "NServiceBus.TimeSent": "2015-12-03 09:32:29:529466 Z"},
           {"__TypeId__": "foo"}]


@st.composite
def messages(draw: Any) -> tuple[Any, Any, Any]:
    """(body, content type, headers): a structured envelope, a header-borne one, or anything at all."""
    shape = draw(st.sampled_from(["structured", "headers", "random"]))
    if shape == "structured":
        content_type, base = draw(st.sampled_from(STRUCTURED))
        changes = draw(st.dictionaries(st.sampled_from(sorted(set(base) | {"time", "data", "data_base64", "sentTime"})),
                                       json_values, max_size=2))
        return json.dumps({**base, **changes}).encode(), content_type, draw(st.none() | random_headers)
    if shape == "headers":
        headers = {**draw(st.sampled_from(HEADERS)), **draw(random_headers)}
        return draw(st.sampled_from([b"{}", b'{"n": 1}', b"[]"]) | random_bodies), draw(content_types), headers
    return draw(random_bodies), draw(content_types), draw(st.none() | random_headers)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(message=messages(), content_encoding=st.one_of(st.none(), st.sampled_from(
           ["utf-8", "binary", "latin-1", "nope", "rot13"])),
       properties=st.dictionaries(st.sampled_from(["message_id", "correlation_id", "timestamp", "x"]), values,
                                  max_size=3))
@example(message=(b'{"specversion": "1.0", "id": "1", "source": "s", "type": "t", "time": "2018-04-05T17:31:00+99:00"}',
                  "application/cloudevents+json", None), content_encoding=None, properties={})
@example(message=(b"{}", None, {"ce-specversion": "1.0", "ce-id": "1", "ce-source": "s", "ce-type": "t",
                                "__TypeId__": "x"}), content_encoding=None, properties={"timestamp": -10 ** 20})
@example(message=(b"{}", None, {"ce-id": Decimal("sNaN"), "cloudEvents_id": Decimal("sNaN")}), content_encoding=None,
         properties={})
def test_only_decode_errors_escape(message, content_encoding, properties):
    body, content_type, headers = message
    try:
        _, envelope = unwrap(body, content_type, content_encoding, headers, properties, decode)
    except DecodeError as exc:
        event(type(exc).__name__)
        return
    event(envelope.kind if envelope else "bare")
    if envelope is not None:
        assert envelope.kind in ("cloudevents", "masstransit", "nservicebus", "spring")
        assert envelope.time is None or envelope.time.tzinfo is not None
        json.dumps(envelope.attributes)
