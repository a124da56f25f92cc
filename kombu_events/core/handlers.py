"""A registered handler: the callable, its queue and binding keys, its failure policy."""
from __future__ import annotations

__all__ = ["Handler", "HandlerSpec", "validate_binding_key", "check_runnable", "circuit_breaker_of", "check_prefetch",
           "handler_argument", "handler_options", "check_publishers", "check_once", "awaits"]

import functools
import inspect
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Literal

from ..errors import ConfigurationError
from . import names
from .backoff import Backoff
from .batch import BatchOf, batch_contract, check_batch
from .breaker import CircuitBreaker
from .contracts import Contract, contract_for
from .names import MAX_NAME_BYTES
from .ordering import Ordering, check_hold, check_ordering

if TYPE_CHECKING:
    from .config import Settings


@dataclass(frozen=True)
class Handler:
    """One event handler and the queue it consumes."""

    fn: Callable[..., Any]
    name: str
    queue: str
    binding_keys: tuple[str, ...]
    max_retries: int
    backoff: Backoff
    retry_for: tuple[type[BaseException], ...] = (Exception,)
    dont_retry: tuple[type[BaseException], ...] = ()
    bind: bool = False
    raw: bool = False
    circuit_breaker: CircuitBreaker | None = None
    #: Messages of this queue in flight per worker (None: the service's ``prefetch_count``).
    prefetch: int | None = None
    #: Declare the queue with ``x-single-active-consumer``: one consumer of the fleet receives at a time.
    single_active_consumer: bool = False
    #: Declare the queue with ``x-expires``: deleted once unused (no consumer, no get) this long.
    expires_ms: int | None = None
    #: What the payload must fit (from the parameter's annotation; None: unchecked). docs/contracts.md
    contract: Contract | None = None
    #: Run only for events of this message type (an envelope's type, or the ``type`` property); others are acked.
    message_type: str | None = None
    #: RabbitMQ users whose events it runs for (the ``user_id`` property); others are archived. None: anyone's.
    publishers: frozenset[str] | None = None
    #: Effectively once (docs/effectively-once.md): False, True (keyed by message id, else a hash of routing
    #: key and body), or a callable ``(event) -> str`` giving the key. Needs ``Events(database=...)``.
    once: bool | Callable[[Any], str] = False
    #: At most this many calls of the handler at once in a worker, across its pool (None: as many as the pool runs).
    concurrency: int | None = None
    #: A batch handler (docs/batching.md): it gets a list of up to ``batch.max`` events per call.
    batch: BatchOf | None = None
    #: An ordered handler's ordering (docs/ordering.md); each of its partitions is a Handler of its own.
    ordering: Ordering | None = None
    #: A partition's ordered handler queue (the name of its consistent-hash exchange's source) and its index.
    partition_of: str | None = None
    partition: int | None = None
    #: A reader of a log (a :class:`~kombu_events.core.readers.Reader`, docs/logs.md): ``queue`` is then its lock
    #: queue, and it reads the log's stream. (``Any``: core.readers imports what imports this module.)
    reader: Any = None


def validate_binding_key(key: object) -> str:
    """Return ``key`` if it is a valid topic binding key, else raise ConfigurationError."""
    if not isinstance(key, str) or not key:
        raise ConfigurationError(f"binding key must be a non-empty string, got {key!r}")
    if len(key.encode("utf-8")) > MAX_NAME_BYTES:
        raise ConfigurationError(f"binding key {key!r} is longer than {MAX_NAME_BYTES} bytes")
    for word in key.split("."):
        if word not in ("*", "#") and ("*" in word or "#" in word):
            raise ConfigurationError(
                f"binding key {key!r}: a wildcard must be a whole word ('orders.*.created', 'orders.#')"
            )
    return key


def check_runnable(fn: object, *, role: str, argument: str, parameter: str, awaited: bool = False) -> None:
    """Raise ConfigurationError unless calling ``fn`` with one argument runs its body.

    The worker calls a handler and acks once the call returns: a generator function
    would return without running its body (so would a coroutine function, unless
    ``awaited``: the worker awaits what handlers return, :func:`awaits`), a class would
    only be constructed, and a function that cannot take one positional argument would
    fail on every event. ``role`` names what is registered ("handler"), ``argument`` what
    the worker passes ("the event's payload") and ``parameter`` the name suggested for it ("payload").
    """
    if not callable(fn):
        raise ConfigurationError(f"{role} {_describe(fn)} is not callable: register a function that takes "
                                 f"{argument}, e.g. def on_event({parameter}): ...")
    if isinstance(fn, type):
        raise ConfigurationError(
            f"{role} {_describe(fn)} is a class: calling it would only construct an instance (and the event "
            f"would count as handled); register a function, or an instance whose __call__ takes {argument}")
    unrunnable = _unrunnable(fn, awaited=awaited)
    if unrunnable is not None:
        raise ConfigurationError(f"{role} {_describe(fn)} {unrunnable}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and extension callables have none to read: let them be
        return
    try:
        signature.bind(object())
    except TypeError:
        raise ConfigurationError(
            f"{role} {_describe(fn)}{signature} cannot be called with one positional argument ({argument}): "
            f"every call would fail with TypeError; give it one parameter for it, "
            f"e.g. def {getattr(fn, '__name__', 'on_event')}({parameter}): ...") from None


#: What calling a function of each kind returns instead of running its body, and what to do instead.
_NOT_RUN: tuple[tuple[Callable[[object], bool], str, str], ...] = (
    (inspect.iscoroutinefunction, "an async def function",
     ("kombu-events awaits async def handlers, not this, so its body would never run; define it with def, "
      "or run the coroutine with asyncio.run inside it")),
    (inspect.isasyncgenfunction, "an async generator function",
     "calling it only creates an async generator, so its body would never run; define it with def, without yield"),
    (inspect.isgeneratorfunction, "a generator function",
     "calling it only creates a generator, so its body would never run; define it without yield"),
)


def _unrunnable(fn: Callable[..., Any], *, awaited: bool = False) -> str | None:
    """Why calling ``fn`` would not run its body (the sentence after its name), or None."""
    for candidate, how in _what_runs(fn):
        for test, kind, why in _NOT_RUN[awaited:]:  # awaited: a coroutine function (the first) runs
            if test(candidate):
                return f"{how} {kind}: {why}"
    return None


def _what_runs(fn: Callable[..., Any]) -> list[tuple[Any, str]]:
    """What calling ``fn`` runs: the function a partial wraps, and an object's ``__call__`` (with how to say so)."""
    target, via = fn, "is"
    while isinstance(target, functools.partial):
        target, via = target.func, "is a functools.partial of"
    candidates = [(target, via)]
    if not inspect.isroutine(target) and not isinstance(target, type):  # an object: what runs is its __call__
        candidates.append((type(target).__call__, f"{via} an object whose __call__ is"))
    return candidates


def awaits(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` returns a coroutine for the worker to await: an ``async def`` function, a
    partial of one, or an object whose ``__call__`` is one (the worker awaits it on its event loop)."""
    return any(inspect.iscoroutinefunction(candidate) for candidate, _ in _what_runs(fn))


def _is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` (a function, a partial of one, or an object) returns a coroutine."""
    target: Any = fn
    while isinstance(target, functools.partial):
        target = target.func
    call = target if inspect.isroutine(target) else type(target).__call__
    return inspect.iscoroutinefunction(call)


def _describe(fn: object) -> str:
    """``module.qualname`` of a function, class or method; what a partial or an object wraps; else its repr."""
    if isinstance(fn, functools.partial):
        return f"functools.partial({_describe(fn.func)}, ...)"
    name, module = getattr(fn, "__qualname__", None), getattr(fn, "__module__", None)
    if isinstance(name, str) and (inspect.isroutine(fn) or isinstance(fn, type)):
        return f"{module}.{name}" if module else name
    if callable(fn):
        return f"<{type(fn).__module__}.{type(fn).__qualname__} object>"
    text = repr(fn)
    return text if len(text) <= 80 else text[:77] + "..."


def circuit_breaker_of(where: str, value: Any, default: CircuitBreaker | None) -> CircuitBreaker | None:
    """A handler's breaker: ``None`` takes the service's ``default``, ``False`` turns it off."""
    if value is None:
        return default
    if value is False:
        return None
    if isinstance(value, CircuitBreaker):
        return value
    raise ConfigurationError(f"circuit_breaker of {where} must be a CircuitBreaker(...), None (the service's "
                             f"default) or False (none), got {value!r}")


def exception_classes(setting: str, value: Any) -> tuple[type[BaseException], ...]:
    """Normalise ``retry_for``/``dont_retry`` to a tuple of exception classes."""
    items = value if isinstance(value, (tuple, list, set, frozenset)) else (value,)
    for item in items:
        if not (isinstance(item, type) and issubclass(item, BaseException)):
            raise ConfigurationError(f"{setting} must list exception classes, got {item!r}")
    return tuple(items)


def check_prefetch(value: Any) -> int | None:
    """Return a handler's ``prefetch`` (None: the service's), else raise ConfigurationError."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65_535):
        raise ConfigurationError(f"prefetch must be an integer within 1 .. 65535 or None, got {value!r}")
    return value


def check_concurrency(value: Any) -> int | None:
    """Return a handler's ``concurrency`` (None: no limit of its own), else raise ConfigurationError."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10_000):
        raise ConfigurationError(f"concurrency must be an integer within 1 .. 10000 (calls of the handler at once "
                                 f"in a worker) or None, got {value!r}")
    return value


def check_publishers(value: Any) -> frozenset[str] | None:
    """A handler's ``publishers`` as a frozenset of user names (None: anyone's), else ConfigurationError."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (set, frozenset, list, tuple)):
        raise ConfigurationError(f"publishers must be a set of RabbitMQ user names, e.g. {{'orders'}}, got {value!r}")
    if not value or not all(isinstance(user, str) and user for user in value):
        raise ConfigurationError(f"publishers must name at least one RabbitMQ user, each a non-empty string, "
                                 f"got {value!r} (None accepts every publisher)")
    return frozenset(value)


def check_once(value: Any) -> bool | Callable[[Any], str]:
    """A handler's ``once``: True, False, or a callable ``(event) -> str`` giving the dedup key (else
    ConfigurationError)."""
    if isinstance(value, bool) or (callable(value) and not isinstance(value, type)):
        return value
    raise ConfigurationError(f"once must be True, False or a function (event) -> str giving the event's dedup key, "
                             f"got {value!r}")


def handler_options(binding_keys: tuple[str, ...], *, queue: str | None, name: str | None,
                    max_retries: int | None, backoff: Backoff | None, retry_for: Any, dont_retry: Any, bind: bool,
                    raw: bool, circuit_breaker: CircuitBreaker | Literal[False] | None, prefetch: int | None,
                    single_active_consumer: bool, message_type: str | None = None, publishers: Any = None,
                    once: Any = False, concurrency: Any = None, batch: Any = None, ordered_by: Any = None,
                    partitions: Any = None, hold_failures: Any = True) -> tuple[tuple[str, ...], dict[str, Any]]:
    """What ``@events.handler(...)`` was given, checked before any function: (binding keys, options).

    With ``type=`` and no binding key the queue is bound with ``#``: the type picks the events.
    """
    if message_type is not None and (not isinstance(message_type, str) or not message_type.strip()):
        raise ConfigurationError(f"type must be a non-empty string naming a message type, got {message_type!r}")
    if not binding_keys and message_type is not None:
        binding_keys = ("#",)
    if not binding_keys:
        raise ConfigurationError("handler() needs at least one binding key, e.g. 'orders.*.created', "
                                 "or type='...' to bind it to a message type")
    keys = tuple(validate_binding_key(k) for k in binding_keys)
    options = {
        "queue": queue, "name": name, "max_retries": max_retries, "backoff": backoff, "bind": bind,
        "raw": raw, "retry_for": exception_classes("retry_for", retry_for),
        "dont_retry": exception_classes("dont_retry", dont_retry),
        "circuit_breaker": circuit_breaker_of(f"handler({', '.join(map(repr, keys))})", circuit_breaker, None),
        "prefetch": check_prefetch(prefetch), "single_active_consumer": bool(single_active_consumer),
        "message_type": message_type, "publishers": check_publishers(publishers), "once": check_once(once),
        "concurrency": check_concurrency(concurrency),
        "batch": check_batch(batch, once=once, concurrency=concurrency, ordered_by=ordered_by),
        "ordering": check_ordering(ordered_by, partitions, hold_failures),
    }
    if circuit_breaker is None:
        del options["circuit_breaker"]  # the service's default, read with the settings
    if queue is not None:
        names.validate_name("queue", queue)
    return keys, options


@dataclass
class HandlerSpec:
    """A handler as registered (``@events.handler``), before the service's settings are known."""

    fn: Callable[..., Any]
    binding_keys: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)
    contract: Contract | None = None

    @classmethod
    def of(cls, fn: Callable[..., Any], binding_keys: tuple[str, ...], options: dict[str, Any]) -> HandlerSpec:
        """``fn`` registered with ``options``, refused now if the worker could not run it.

        The worker acks once the call returns (an ``async def`` handler: once it is awaited),
        run or not: a generator function, a class, or one that cannot take the argument is refused at import time;
        so is an annotation pydantic cannot validate (or any, without pydantic).
        """
        batch = options.get("batch")
        argument, parameter = handler_argument(bind=options["bind"], raw=options["raw"], batch=batch is not None)
        if options.get("once") and _is_async(fn):
            raise ConfigurationError(
                f"handler {_describe(fn)} is an async def function with once=True: the inbox runs the handler "
                "inside a database transaction of the worker's pool thread, which an async handler would leave; "
                "define it with def, or drop once=True")
        check_runnable(fn, role="handler", argument=argument, parameter=parameter, awaited=True)
        if options["name"] is None and not isinstance(getattr(fn, "__name__", None), str):
            raise ConfigurationError(f"handler {fn!r} has no __name__ to name its queue after: pass name=")
        contract_of = contract_for if batch is None else batch_contract
        contract = contract_of(fn, bind=options["bind"], raw=options["raw"], where=f"handler {_describe(fn)}")
        return cls(fn, binding_keys, options, contract)

    def resolve(self, service: str, s: Settings) -> Handler:
        """The handler this registration stands for, checked against the service's settings."""
        o = self.options
        name = o["name"] or self.fn.__name__
        queue = o["queue"] or names.handler_queue(service, name)
        names.validate_name(f"queue of handler {name!r}", queue, max_bytes=s.max_queue_bytes)
        reserved = {names.delivery_exchange(service), names.archive_name(service),
                    names.unrouted_name(s.exchange), names.deferred_exchange(s.exchange)}
        if queue in reserved or queue.startswith((names.delay_prefix(service), names.schedule_prefix(service),
                                                  names.deferred_exchange(s.exchange) + ".")):
            raise ConfigurationError(f"queue {queue!r} of handler {name!r} collides with the service's own entities")
        for key in self.binding_keys:
            if len(key.encode("utf-8")) > s.max_binding_key_bytes:
                raise ConfigurationError(
                    f"binding key {key!r} of handler {name!r} is too long: with publish_delay_levels="
                    f"{s.publish_delay_levels} it may be at most {s.max_binding_key_bytes} bytes")
        backoff: Backoff = o["backoff"] or s.default_backoff
        s.check_delay(f"backoff max_delay_ms of handler {name!r}", backoff.max_delay_ms)
        max_retries = s.max_retries if o["max_retries"] is None else o["max_retries"]
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or not 0 <= max_retries <= 10_000:
            raise ConfigurationError(
                f"max_retries of handler {name!r} must be an integer within 0 .. 10000, got {max_retries!r}")
        check_hold(name, o.get("ordering"), max_retries=max_retries, backoff=backoff)
        return Handler(fn=self.fn, name=name, queue=queue, binding_keys=self.binding_keys,
                       max_retries=max_retries, backoff=backoff, retry_for=o["retry_for"],
                       dont_retry=o["dont_retry"], bind=o["bind"], raw=o["raw"],
                       circuit_breaker=o.get("circuit_breaker", s.circuit_breaker), prefetch=_prefetch(o),
                       single_active_consumer=o["single_active_consumer"], contract=self.contract,
                       message_type=o.get("message_type"), publishers=o.get("publishers"),
                       once=o.get("once", False), concurrency=o.get("concurrency"), batch=o.get("batch"),
                       ordering=o.get("ordering"))


def partitioned(handler: Handler) -> tuple[Handler, ...]:
    """An ordered handler as its partitions, each a handler of its own queue (one event in flight, one active
    consumer in the fleet: docs/ordering.md); any other handler as itself."""
    ordering = handler.ordering
    if ordering is None:
        return (handler,)
    return tuple(replace(handler, queue=names.partition_queue(handler.queue, index, ordering.partitions),
                         prefetch=1, single_active_consumer=True, partition_of=handler.queue, partition=index)
                 for index in range(ordering.partitions))


def _prefetch(options: dict[str, Any]) -> int | None:
    """A handler's prefetch: a batch handler's is at least its ``batch.max`` (so that a full batch can arrive);
    unset, twice that (the next batch gathers while one runs), at most 65535."""
    prefetch: int | None = options["prefetch"]
    batch: BatchOf | None = options.get("batch")
    if batch is None:
        return prefetch
    return max(prefetch, batch.max) if prefetch is not None else min(65_535, 2 * batch.max)


def handler_argument(*, bind: bool, raw: bool, batch: bool = False) -> tuple[str, str]:
    """What the worker passes a handler, and the parameter name an error message suggests for it."""
    if batch:
        what = "Events" if bind else "body bytes" if raw else "payloads"
        return f"a list of {what}, as batch=", "events"
    if bind:
        return "an Event, as bind=True", "event"
    if raw:
        return "the body bytes, as raw=True", "body"
    return "the event's payload", "payload"

