"""Contracts' JSON Schemas for AsyncAPI: pydantic's draft 2020-12 rewritten to AsyncAPI's default schema format
(JSON Schema draft 07 and more), each schema and its ``$defs`` named in ``components/schemas``; no I/O."""
from __future__ import annotations

__all__ = ["Schemas", "draft07", "component_key", "unique_key"]

import json
import re
from typing import Any, Iterable

from ..core.contracts import Contract
from ..errors import ConfigurationError

_DEFS = "#/$defs/"
_SCHEMAS = "#/components/schemas/"


class Schemas:
    """``components/schemas``: each contract's schema and its ``$defs``, named, shared when identical."""

    def __init__(self) -> None:
        self.found: dict[str, Any] = {}
        self._keys: dict[str, str] = {}  # a schema's fingerprint -> its key

    def add(self, contract: Contract, *, where: str) -> dict[str, str]:
        """Add ``contract``'s schema; return the payload: a reference to it."""
        try:
            body = contract.schema()
        except Exception as exc:  # pydantic's PydanticUserError, PydanticInvalidForJsonSchema, ...
            why = str(exc).strip().split("\n", 1)[0]  # pydantic adds lines of links
            raise ConfigurationError(f"{where}: cannot describe {contract.name} as JSON Schema: {why}") from None
        defs: dict[str, Any] = body.pop("$defs", {})
        names = {name: self._name(name, defs) for name in sorted(defs)}
        for name in sorted(defs):
            self.found.setdefault(names[name], draft07(defs[name], names))
        if set(body) == {"allOf"} and len(body["allOf"]) == 1 and set(body["allOf"][0]) == {"$ref"}:
            body = body["allOf"][0]  # how older pydantic (2.4) refers to a recursive model
        ref = body.get("$ref", "")
        if set(body) == {"$ref"} and ref.startswith(_DEFS):  # pydantic's way for a recursive model
            return {"$ref": _SCHEMAS + names[ref[len(_DEFS):]]}
        title = body.get("title")
        # a class's own name (pydantic's title), else the type's without module paths: list[Line]
        name = title if isinstance(title, str) and title else re.sub(r"(?:\w+\.)+(\w+)", r"\1", contract.name)
        key = self._name(name, {**defs, name: body}, top=body)
        self.found.setdefault(key, draft07(body, names))
        return {"$ref": _SCHEMAS + key}

    def _name(self, name: str, defs: dict[str, Any], top: Any = None) -> str:
        """The key of schema ``name`` of ``defs``: its own name, unless another schema took it."""
        schema = defs[name] if top is None else top
        closure = _closure(schema, defs)
        fingerprint = json.dumps([name, schema, {n: defs[n] for n in sorted(closure)}], sort_keys=True)
        if fingerprint not in self._keys:
            self._keys[fingerprint] = unique_key(component_key(name), set(self._keys.values()))
        return self._keys[fingerprint]


def _closure(schema: Any, defs: dict[str, Any]) -> set[str]:
    """The names of ``defs`` that ``schema`` refers to, directly or not."""
    found: set[str] = set()
    todo = [schema]
    while todo:
        for ref in _refs(todo.pop()):
            if ref.startswith(_DEFS) and ref[len(_DEFS):] in defs and ref[len(_DEFS):] not in found:
                found.add(ref[len(_DEFS):])
                todo.append(defs[ref[len(_DEFS):]])
    return found


def _refs(value: Any) -> Iterable[str]:
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "$ref" and isinstance(item, str):
                yield item
            else:
                yield from _refs(item)
    elif isinstance(value, list):
        for item in value:
            yield from _refs(item)


# Keywords whose value is a schema, a list of schemas, or a map of names to schemas (the rest is data).
_ONE = frozenset({"additionalProperties", "additionalItems", "not", "contains", "propertyNames", "if", "then",
                  "else", "unevaluatedItems", "unevaluatedProperties", "contentSchema"})
_LIST = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
_MAP = frozenset({"properties", "patternProperties", "definitions", "dependentSchemas"})


def draft07(schema: Any, names: dict[str, str]) -> Any:
    """``schema`` (JSON Schema 2020-12, as pydantic writes it) as AsyncAPI's schema format (draft 07 and more).

    ``#/$defs/X`` becomes ``#/components/schemas/<names[X]>``; ``prefixItems`` becomes draft 07's array
    ``items`` (the 2020-12 ``items`` its ``additionalItems``); a ``$ref`` with sibling keywords (ignored
    beside it in draft 07) moves into an ``allOf``; an OpenAPI-style ``discriminator`` object (AsyncAPI's
    is a property name only) is kept as ``x-discriminator``. Values of data keywords stay as they are.
    """
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str):
            out[key] = _SCHEMAS + names[value[len(_DEFS):]] if value.startswith(_DEFS) else value
        elif key in _ONE or (key == "items" and isinstance(value, dict)):
            out[key] = draft07(value, names)
        elif key in _LIST or (key == "items" and isinstance(value, list)):
            out[key] = [draft07(item, names) for item in value]
        elif key in _MAP and isinstance(value, dict):
            out[key] = {name: draft07(item, names) for name, item in value.items()}
        elif key == "discriminator" and isinstance(value, dict):
            mapping = {k: draft07({"$ref": v}, names)["$ref"] for k, v in value.get("mapping", {}).items()}
            out["x-discriminator"] = {**value, **({"mapping": mapping} if mapping else {})}
        else:
            out[key] = value
    if "prefixItems" in out:
        rest = out.pop("items", None)
        out["items"] = out.pop("prefixItems")
        if rest is not None:
            out["additionalItems"] = rest
    if "$ref" in out and len(out) > 1:
        out["allOf"] = [{"$ref": out.pop("$ref")}, *out.get("allOf", [])]
    return out


def component_key(text: str) -> str:
    """``text`` as a component key (``^[A-Za-z0-9._-]+$``): other characters become ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text) or "_"


def unique_key(key: str, taken: Iterable[str]) -> str:
    """``key``, or ``key_2``, ``key_3``... : the first not in ``taken``."""
    used = set(taken)
    candidate, n = key, 1
    while candidate in used:
        n += 1
        candidate = f"{key}_{n}"
    return candidate
