"""Typed contracts: the type a handler accepts or a publication sends, checked with pydantic.

A :class:`Contract` wraps one type -- a pydantic model, a dataclass, a ``TypedDict``, or
anything pydantic's ``TypeAdapter`` accepts -- and validates what arrives, serialises
what is sent (pydantic's JSON mode) and describes itself as JSON Schema. pydantic is
imported only when a contract is made (``pip install kombu-events[pydantic]``).

Some annotations promise nothing and stay unchecked, as before contracts existed:
none, ``Any``, ``object``, ``dict``, ``dict[str, Any]`` and ``Mapping[str, Any]``.
"""
from __future__ import annotations

__all__ = ["Contract", "Publication", "contract_for", "parameter_contracts", "untyped", "outgoing", "MAX_ERRORS",
           "MAX_INPUT_CHARS"]

import dataclasses
import inspect
import typing
from collections.abc import Mapping as AbcMapping
from typing import Any, Callable, NamedTuple

from ..errors import ConfigurationError, EncodeError, InvalidPayload
from .event import Event

#: Errors listed in one reason (the rest are counted); each offending input is cut to this many characters.
MAX_ERRORS = 20
MAX_INPUT_CHARS = 80

_EXTRA = "pip install 'kombu-events[pydantic]'"


def untyped(annotation: Any) -> bool:
    """Whether ``annotation`` promises nothing to check (a handler annotated so gets the payload as decoded)."""
    if annotation in (inspect.Parameter.empty, Any, object, dict, AbcMapping):
        return True
    origin = typing.get_origin(annotation)
    if origin in (dict, AbcMapping):
        return typing.get_args(annotation) in ((str, Any), ())
    return False


class Contract:
    """One payload type: ``validate`` what arrives, ``dump`` what is sent, ``schema`` to describe it."""

    def __init__(self, annotation: Any, *, where: str) -> None:
        self.annotation = annotation
        self.name = _name_of(annotation)
        self._adapter = _adapter(annotation, where)

    def validate(self, payload: Any) -> Any:
        """The payload as an instance of the type; :class:`~kombu_events.errors.InvalidPayload` if it does not fit."""
        from pydantic import ValidationError

        try:
            return self._adapter.validate_python(payload)
        except ValidationError as exc:
            raise _invalid(self.name, exc) from None

    def dump(self, value: Any) -> Any:
        """``value`` as JSON-ready Python (pydantic's JSON mode: datetimes as text, models as dicts)."""
        try:
            return self._adapter.dump_python(value, mode="json")
        except Exception as exc:  # PydanticSerializationError, or a value of another type
            raise EncodeError(f"payload does not serialise as {self.name}: {exc}") from exc

    def schema(self) -> dict[str, Any]:
        """The JSON Schema of what :meth:`validate` accepts."""
        return dict(self._adapter.json_schema())

    def __repr__(self) -> str:
        return f"<Contract {self.name}>"


def contract_for(fn: Callable[..., Any], *, bind: bool, raw: bool, where: str) -> Contract | None:
    """The contract of a handler's parameter, or None when it is unannotated (or ``raw=True``).

    With ``bind=True`` the handler gets an :class:`~kombu_events.Event`: annotate it
    ``Event[Model]`` for ``event.payload`` to be a ``Model``.
    """
    if raw:
        return None
    annotation = _first_annotation(fn, where)
    if bind:
        if annotation is Event or untyped(annotation):
            return None
        if typing.get_origin(annotation) is not Event:
            raise ConfigurationError(
                f"{where}: with bind=True the handler gets an Event, but its parameter is annotated "
                f"{_name_of(annotation)}; annotate it Event[{_name_of(annotation)}] to validate the payload")
        annotation = typing.get_args(annotation)[0]
    elif annotation is Event or typing.get_origin(annotation) is Event:
        raise ConfigurationError(f"{where}: its parameter is annotated {_name_of(annotation)}, but without bind=True "
                                 f"the handler gets the payload, not an Event: pass bind=True")
    return None if untyped(annotation) else Contract(annotation, where=where)


def parameter_contracts(fn: Callable[..., Any], *, where: str) -> dict[str, Contract]:
    """The contract of each annotated parameter of a publishing function (``@events.event``)."""
    signature = inspect.signature(fn)
    found = {}
    for parameter in signature.parameters.values():
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        annotation = _resolved(fn, parameter, where)
        if not untyped(annotation):
            found[parameter.name] = Contract(annotation, where=f"{where}, parameter {parameter.name!r}")
    return found


class Publication(NamedTuple):
    """What a service declared it sends: events whose routing key matches ``pattern`` fit ``contract``."""

    pattern: str
    contract: Contract


_ADAPTERS: dict[type, Any] = {}


def outgoing(payload: Any) -> Any:
    """A payload ready for ``json.dumps``: a pydantic model or dataclass instance in pydantic's JSON mode."""
    kind = type(payload)
    if kind in (dict, list, str, int, float, bool, type(None)):
        return payload
    if not (dataclasses.is_dataclass(payload) or hasattr(kind, "__pydantic_core_schema__")):  # a model, 2.0 on
        return payload  # json.dumps says what it cannot serialise
    adapter = _ADAPTERS.get(kind)
    if adapter is None:
        adapter = _ADAPTERS[kind] = _adapter(kind, f"publishing a {kind.__qualname__}")
    try:
        return adapter.dump_python(payload, mode="json")
    except Exception as exc:
        raise EncodeError(f"payload of type {kind.__qualname__} does not serialise: {exc}") from exc


def _first_annotation(fn: Callable[..., Any], where: str) -> Any:
    """The annotation of the parameter the worker fills (the first), resolved if written as a string."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return inspect.Parameter.empty
    if not parameters:
        return inspect.Parameter.empty
    return _resolved(fn, parameters[0], where)


def _resolved(fn: Callable[..., Any], parameter: inspect.Parameter, where: str) -> Any:
    """``parameter``'s annotation, evaluated if written as a string (``from __future__ import annotations``)."""
    annotation = parameter.annotation
    if not isinstance(annotation, str):
        return annotation
    target = fn
    while hasattr(target, "func"):  # functools.partial
        target = target.func
    if not inspect.isroutine(target):
        target = type(target).__call__
    try:
        return typing.get_type_hints(target).get(parameter.name, inspect.Parameter.empty)
    except Exception as exc:  # NameError for a name imported under TYPE_CHECKING only, SyntaxError, ...
        raise ConfigurationError(
            f"{where}: cannot resolve the annotation {annotation!r} of parameter {parameter.name!r} ({exc}); "
            f"import the type at module level (the worker validates payloads with it)") from None


def _adapter(annotation: Any, where: str) -> Any:
    try:
        from pydantic import TypeAdapter
    except ImportError:
        raise ConfigurationError(
            f"{where}: validating payloads as {_name_of(annotation)} needs pydantic: {_EXTRA} "
            f"(or remove the annotation, or annotate with dict)") from None
    try:
        return TypeAdapter(annotation)
    except Exception as exc:  # PydanticSchemaGenerationError, PydanticUserError, TypeError
        raise ConfigurationError(f"{where}: pydantic cannot validate {_name_of(annotation)}: {exc}") from None


def _invalid(name: str, exc: Any) -> InvalidPayload:
    errors = exc.errors(include_url=False)
    listed = [(_path(e.get("loc", ())), str(e.get("msg", "")), _cut(e.get("input"))) for e in errors[:MAX_ERRORS]]
    return InvalidPayload(name, listed, max(0, len(errors) - MAX_ERRORS))


def _path(loc: tuple[Any, ...]) -> str:
    """``items[2].price`` for ('items', 2, 'price'); ``(payload)`` for the payload itself."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(payload)"


def _cut(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # a repr that raises must not cost the reason
        text = f"<{type(value).__name__}>"
    return text if len(text) <= MAX_INPUT_CHARS else text[:MAX_INPUT_CHARS - 3] + "..."


def _name_of(annotation: Any) -> str:
    if isinstance(annotation, type) and typing.get_origin(annotation) is None:
        return annotation.__qualname__
    text = repr(annotation)
    return text.replace("typing.", "")
