"""``Published``: what every publish returns (``Events.publish``, ``publish_many``, ``@events.event``, the outbox).

It is the event's ``message_id`` (a ``str``) and says where the event is now: confirmed by
the broker, or stored locally (the backlog, or the outbox) until it is published.
"""
from __future__ import annotations

__all__ = ["Published"]


class Published(str):
    """The ``message_id`` of an event ``publish`` accepted; ``stored_locally`` says where it is.

    False: the broker confirmed it. True: it waits in the local backlog and the flusher
    publishes it, in order, once the broker answers. It is a ``str`` (the message id),
    so code that stores or compares the id keeps working.
    """

    stored_locally: bool

    def __new__(cls, message_id: str, *, stored_locally: bool = False) -> Published:
        published = super().__new__(cls, message_id)
        published.stored_locally = stored_locally
        return published

    @property
    def message_id(self) -> str:
        """The id as a plain ``str``."""
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"Published({self.message_id!r}, stored_locally={self.stored_locally})"

    def __reduce__(self) -> tuple[object, ...]:
        return _published, (self.message_id, self.stored_locally)


def _published(message_id: str, stored_locally: bool) -> Published:
    return Published(message_id, stored_locally=stored_locally)
