"""The failed-message console: a web application (Starlette, Jinja2 templates, htmx shipped with the
package) over a service's queues and archive, to see what failed and why and to replay or purge it safely
(``kombu-events console``, or :func:`create_app` mounted in your own ASGI application; docs/console.md).

Needs the ``console`` extra: ``pip install 'kombu-events[console]'``.
"""
from __future__ import annotations

__all__ = ["create_app", "ConsoleSettings", "AuthSettings"]

from .app import ConsoleSettings, create_app
from .auth import AuthSettings
