"""The ``console`` command: serve the failed-message console of the ``-A`` app's service with uvicorn.

It listens on 127.0.0.1 unless told otherwise, and refuses any other address without authentication
(a password from the environment or a file, bearer tokens from a file, or a trusted proxy's user header).
Needs the ``console`` extra (``pip install 'kombu-events[console]'``).
"""
from __future__ import annotations

__all__ = ["console"]

import os
from pathlib import Path
from typing import Any

import click

from ..core.config import MANAGEMENT_URL_ENV, check_management_url
from ..errors import ConfigurationError
from .common import Context, examples, guarded

try:  # the console extra; without it, every other command still works
    import uvicorn

    from ..console import AuthSettings, ConsoleSettings, create_app
    from ..console.auth import check_listen
except ImportError as exc:
    _MISSING: ImportError | None = exc
else:
    _MISSING = None


def _secret(env: str | None, path: Path | None, what: str) -> str | None:
    """A password from the environment variable ``env`` or the first line of file ``path``."""
    if env is not None:
        value = os.environ.get(env)
        if not value:
            raise ConfigurationError(f"{what}: environment variable {env} is not set or empty")
        return value
    if path is not None:
        lines = path.read_text(encoding="utf-8").splitlines()
        if not lines or not lines[0].strip():
            raise ConfigurationError(f"{what}: file {path} is empty")
        return lines[0].strip()
    return None


def _tokens(path: Path | None) -> dict[str, tuple[str, str]]:
    """Bearer tokens from a file: one ``ROLE NAME TOKEN`` a line (``#`` starts a comment)."""
    found: dict[str, tuple[str, str]] = {}
    if path is None:
        return found
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 3 or len(parts[2]) < 24:
            raise ConfigurationError(f"{path}:{number}: expected 'ROLE NAME TOKEN' with a token of at least "
                                     "24 characters")
        found[parts[2]] = (parts[1], parts[0])
    return found


@click.command("console")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback needs authentication.")
@click.option("--port", type=click.IntRange(0, 65535), default=8089, show_default=True)
@click.option("--password-env", metavar="VAR", help="Operator password (HTTP Basic) from this environment variable.")
@click.option("--password-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Operator password from the first line of this file.")
@click.option("--viewer-password-env", metavar="VAR", help="Viewer password from this environment variable.")
@click.option("--viewer-password-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Viewer password from the first line of this file.")
@click.option("--token-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Bearer tokens, one 'ROLE NAME TOKEN' a line (role: viewer or operator).")
@click.option("--proxy-header", metavar="HEADER",
              help="Trust this header (e.g. X-Forwarded-User) for the user's name, from --trusted-proxy only.")
@click.option("--trusted-proxy", multiple=True, default=["127.0.0.1", "::1"], show_default=True,
              help="Address of the reverse proxy that sets --proxy-header (repeat for several).")
@click.option("--proxy-operator", multiple=True, help="A proxy user who is an operator (others are viewers).")
@click.option("--read-only", is_flag=True, help="Show everything, change nothing (no replay, no purge).")
@click.option("--allow-edit", is_flag=True,
              help="Let operators edit an event's body and replay the copy (off by default).")
@click.option("--audit-file", type=click.Path(dir_okay=False, path_type=Path),
              default="kombu-events-console-audit.jsonl", show_default=True,
              help="Where the audit trail is appended (JSON Lines).")
@click.option("--management-url",
              help="RabbitMQ management API, for the overview's unacked counts (default: the management_url "
                   f"setting, {MANAGEMENT_URL_ENV}, else http://<broker host>:15672).")
@click.pass_obj
@guarded
def console(obj: Context, host: str, port: int, password_env: str | None, password_file: Path | None,
            viewer_password_env: str | None, viewer_password_file: Path | None, token_file: Path | None,
            proxy_header: str | None, trusted_proxy: tuple[str, ...], proxy_operator: tuple[str, ...],
            read_only: bool, allow_edit: bool, audit_file: Path, management_url: str | None) -> None:
    """Serve the failed-message console (overview, failures grouped, replay, purge, audit trail)."""
    if management_url is not None:
        check_management_url(management_url, setting="--management-url")
    if _MISSING is not None:
        raise ConfigurationError(f"the console needs the console extra: pip install 'kombu-events[console]' "
                                 f"({_MISSING})")
    passwords = {role: secret for role, secret in (
        ("operator", _secret(password_env, password_file, "operator password")),
        ("viewer", _secret(viewer_password_env, viewer_password_file, "viewer password"))) if secret}
    auth = AuthSettings(passwords=passwords, tokens=_tokens(token_file), proxy_header=proxy_header,
                        trusted_proxies=frozenset(trusted_proxy), proxy_operators=frozenset(proxy_operator))
    check_listen(host, auth)
    settings = ConsoleSettings(auth=auth, read_only=read_only, allow_edit=allow_edit, audit_path=audit_file,
                               management_url=management_url)
    app: Any = create_app(obj.events, settings, broker_url=obj.url)
    click.echo(f"kombu-events console for service {obj.events.service} on http://{host}:{port}/", err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", server_header=False, proxy_headers=False)


examples(console,
         "kombu-events -A proj.events console                      # http://127.0.0.1:8089/, local only",
         "kombu-events -A proj.events console --host 0.0.0.0 --password-env CONSOLE_PW   # a password, set",
         "kombu-events -A proj.events console --read-only --token-file /etc/kombu-events/console-tokens",
         "kombu-events -A proj.events console --management-url https://rabbitmq.internal:15671   # unacked counts")
