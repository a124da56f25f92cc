"""JSON-ready data as YAML or JSON text (``kombu-events asyncapi --format``), without PyYAML; no I/O."""
from __future__ import annotations

__all__ = ["to_json", "to_yaml"]

import json
import re
from typing import Any


def to_json(doc: Any) -> str:
    """``doc`` as indented JSON, keys in the document's order."""
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def to_yaml(doc: Any) -> str:
    """``doc`` (JSON-ready data) as block-style YAML that every YAML 1.1 or 1.2 parser reads back as ``doc``.

    Written here rather than with PyYAML, which is no dependency: strings are plain where no YAML reading
    could take them for anything else, literal blocks (``|-``) when they span lines, JSON-quoted otherwise.
    """
    if isinstance(doc, (dict, list)) and doc:
        return "\n".join(_block(doc, 0)) + "\n"
    return _scalar(doc) + "\n"


def _block(value: dict[str, Any] | list[Any], indent: int) -> list[str]:
    lines: list[str] = []
    items = value.items() if isinstance(value, dict) else (("-", item) for item in value)
    for key, item in items:
        head = " " * indent + (key if isinstance(value, list) else _scalar(str(key)) + ":")
        if isinstance(item, (dict, list)) and item:
            nested = _block(item, indent + 2)
            if isinstance(value, list):  # "- key: value", the rest of the mapping under it
                lines += [head + " " + nested[0].lstrip(), *nested[1:]]
            else:
                lines += [head, *nested]
        elif isinstance(item, str) and _literal(item):
            pad = " " * (indent + 2)
            lines += [head + " |-", *(pad + line if line else "" for line in item.split("\n"))]
        else:
            lines.append(head + " " + _scalar(item))
    return lines


_PLAIN = re.compile(r"[A-Za-z_$/][A-Za-z0-9_ ./*#$-]*")
_WORDS = {"true", "false", "yes", "no", "on", "off", "y", "n", "null", "~"}


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        text = json.dumps(value)  # YAML 1.1 wants a dot in the mantissa: 1e-05 -> 1.0e-05
        return re.sub(r"^(-?\d+)(e)", r"\1.0\2", text) if "." not in text else text
    if isinstance(value, (dict, list)):
        return "{}" if isinstance(value, dict) else "[]"
    text = str(value)
    if _PLAIN.fullmatch(text) and not text.endswith(" ") and " #" not in text and text.lower() not in _WORDS:
        return text
    return _quoted(text)


def _quoted(text: str) -> str:
    """A JSON string (valid YAML double-quoted), with every non-printable character escaped."""
    body = json.dumps(text, ensure_ascii=False)
    return "".join(ch if ch.isprintable() else (f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
                   for ch in body)


def _literal(text: str) -> bool:
    """Whether ``text`` reads back the same from a ``|-`` block: lines, printable, none led by a blank."""
    lines = text.split("\n")
    return (len(lines) > 1 and not text.endswith("\n") and any(lines)
            and all(line.isprintable() and not line.startswith((" ", "\t")) and not line.endswith((" ", "\t"))
                    for line in lines))
