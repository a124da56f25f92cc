"""Who may use the console and how: authentication, roles and the cross-site check, as pure decisions.

The console is secure by default: it listens on 127.0.0.1, and :func:`check_listen` refuses any
other address unless some authentication is configured. A request is let in by a password
(HTTP Basic; the user name is taken as the actor's name for the audit trail), a bearer token,
or a trusted reverse proxy's user header; with none of them configured, only a loopback
listener serves, to requests whose ``Host`` is a loopback name (no DNS rebinding). A viewer
reads; an operator also replays and purges. Every state change is a POST that
:func:`cross_site_refusal` checks (``Sec-Fetch-Site``, then ``Origin``). No socket here:
the ASGI glue in :mod:`.app` calls these functions.
"""
from __future__ import annotations

__all__ = ["VIEWER", "OPERATOR", "Principal", "AuthSettings", "authenticate", "check_listen", "claimed_login",
           "cross_site_refusal", "loopback_host", "CONTENT_SECURITY_POLICY", "SECURITY_HEADERS"]

import base64
import binascii
import hmac
import ipaddress
from dataclasses import dataclass, field
from typing import Mapping

from ..errors import ConfigurationError

VIEWER, OPERATOR = "viewer", "operator"
ROLES = (VIEWER, OPERATOR)

#: Only the console's own scripts, styles and images; no inline script, no framing, forms post to itself.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "x-frame-options": "DENY",
    "cache-control": "no-store",
}
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


@dataclass(frozen=True)
class Principal:
    """Who makes a request: a name for the audit trail and a role (``viewer`` or ``operator``)."""

    name: str
    role: str
    how: str  # password | token | proxy | local

    @property
    def can_act(self) -> bool:
        """An operator may replay and purge; a viewer only reads."""
        return self.role == OPERATOR


@dataclass(frozen=True)
class AuthSettings:
    """How requests authenticate (any of them; none means loopback only, everyone an operator).

    ``passwords``: role -> password (HTTP Basic). ``tokens``: token -> (name, role) (``Authorization:
    Bearer``). ``proxy_header``: the header a trusted reverse proxy sets to the user's name, believed
    only from ``trusted_proxies`` (IP addresses); ``proxy_operators`` are operators, other users viewers.
    """

    passwords: Mapping[str, str] = field(default_factory=dict)
    tokens: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    proxy_header: str | None = None
    trusted_proxies: frozenset[str] = frozenset({"127.0.0.1", "::1"})
    proxy_operators: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for role, password in self.passwords.items():
            if role not in ROLES:
                raise ConfigurationError(f"unknown role {role!r} for a password; roles: {', '.join(ROLES)}")
            if len(password) < 12:
                raise ConfigurationError(f"the {role} password is {len(password)} characters long; "
                                         "give one of at least 12")
        for name, role in self.tokens.values():
            if role not in ROLES:
                raise ConfigurationError(f"unknown role {role!r} for token {name!r}; roles: {', '.join(ROLES)}")

    @property
    def configured(self) -> bool:
        """Some authentication is set up (the console may then listen beyond loopback)."""
        return bool(self.passwords or self.tokens or self.proxy_header)


def is_loopback(host: str) -> bool:
    """``host`` (an address or a name) is this machine only."""
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_listen(host: str, auth: AuthSettings) -> None:
    """Refuse to listen on ``host`` beyond loopback when no authentication is configured."""
    if not is_loopback(host) and not auth.configured:
        raise ConfigurationError(
            f"refusing to listen on {host} without authentication: anyone who reaches it could replay and "
            "purge the archive; set a password (--password-env/--password-file), a token (--token-file) or "
            "a trusted proxy header (--proxy-header), or listen on 127.0.0.1")


def loopback_host(host_header: str) -> bool:
    """The ``Host`` header names this machine (port ignored): an unauthenticated console answers only that."""
    name = host_header.rsplit(":", 1)[0] if not host_header.endswith("]") else host_header
    return is_loopback(name.strip().lower())


def _basic(value: str, passwords: Mapping[str, str]) -> Principal | None:
    try:
        user, _, password = base64.b64decode(value, validate=True).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    for role in (OPERATOR, VIEWER):
        expected = passwords.get(role)
        if expected and hmac.compare_digest(password.encode(), expected.encode()):
            return Principal(user or role, role, "password")
    return None


def _bearer(value: str, tokens: Mapping[str, tuple[str, str]]) -> Principal | None:
    for token, (name, role) in tokens.items():
        if hmac.compare_digest(value.encode(), token.encode()):
            return Principal(name, role, "token")
    return None


def authenticate(headers: Mapping[str, str], client: str | None, auth: AuthSettings) -> Principal | None:
    """Who sends a request with these (lower-cased) ``headers`` from ``client`` (an IP), or None.

    With no authentication configured, a request from loopback to a loopback ``Host`` is a local
    operator (the console then listens on loopback only, :func:`check_listen`).
    """
    scheme, _, value = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "basic" and auth.passwords:
        return _basic(value.strip(), auth.passwords)
    if scheme.lower() == "bearer" and auth.tokens:
        return _bearer(value.strip(), auth.tokens)
    if auth.proxy_header and client in auth.trusted_proxies:
        user = headers.get(auth.proxy_header.lower(), "").strip()
        if user:
            return Principal(user, OPERATOR if user in auth.proxy_operators else VIEWER, "proxy")
    if not auth.configured and client is not None and is_loopback(client) \
            and loopback_host(headers.get("host", "")):
        return Principal("local", OPERATOR, "local")
    return None


def claimed_login(headers: Mapping[str, str]) -> str | None:
    """Who a request's credentials claim to be, for the log of a failed login (never the secret):
    ``user 'NAME'`` for HTTP Basic, ``a bearer token``; None when it presents no credentials."""
    scheme, _, value = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return "a bearer token"
    if scheme.lower() != "basic":
        return None
    try:
        user = base64.b64decode(value.strip(), validate=True).decode("utf-8").partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        return "an unreadable Basic header"
    return f"user {user[:64]!r}"


def cross_site_refusal(headers: Mapping[str, str], scheme: str, *, by_token: bool = False) -> str | None:
    """Why a state-changing request must be refused as cross-site, or None when it comes from the console.

    ``Sec-Fetch-Site`` (every current browser sends it) must be ``same-origin`` (``none``: typed by the
    user, no page involved); without it, ``Origin`` must be this console's own. A request with neither
    comes from no browser: it is let through only when a bearer token authenticated it (``by_token``: a
    script, which has no ambient credential a foreign page could borrow). An ``Authorization: Bearer``
    header that did not authenticate the request (a junk token, or a console without tokens that let the
    request in by other means) proves nothing, and Basic auth a browser resends by itself.
    """
    site = headers.get("sec-fetch-site")
    if site is not None:
        return None if site in ("same-origin", "none") else f"cross-site request refused (Sec-Fetch-Site: {site})"
    origin = headers.get("origin")
    if origin is not None:
        expected = f"{scheme}://{headers.get('host', '')}"
        return None if origin == expected else f"cross-site request refused (Origin: {origin})"
    if by_token:
        return None
    return ("state change refused: no Sec-Fetch-Site or Origin header (a script must authenticate with a "
            "bearer token)")
