"""A TCP proxy whose connections can go silent: no byte forwarded either way, and no socket closed.

A NAT entry that expires, a firewall that drops a flow, a peer's host that freezes:
the TCP connection stays open on both ends and nothing more arrives. Only
heartbeats tell a client so. :meth:`SilentProxy.freeze` does that to every
connection open at the time (new connections go through normally, as after a NAT
entry expired); :meth:`SilentProxy.thaw` lets the frozen ones flow again, by which
time both ends have usually given up on them.
"""
from __future__ import annotations

__all__ = ["SilentProxy"]

import logging
import socket
import threading
import time

logger = logging.getLogger(__name__)

CHUNK = 65_536


class _Link:
    """One proxied connection: the client's socket, the upstream one, and whether bytes flow between them."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client, self.upstream = client, upstream
        self.flowing = threading.Event()
        self.flowing.set()
        self.closed = False
        self._lock = threading.Lock()

    def start(self) -> None:
        for src, dst in ((self.client, self.upstream), (self.upstream, self.client)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                self.flowing.wait()
                if self.closed:
                    return
                data = src.recv(CHUNK)
                self.flowing.wait()  # read just as the link froze: held, neither forwarded nor closed
                if self.closed or not data:
                    return
                dst.sendall(data)
        except OSError:
            return
        finally:
            self.close()

    def close(self) -> None:
        """Close both sockets (once); pumps waiting for a frozen link wake up and end."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self.flowing.set()
        for sock in (self.client, self.upstream):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


class SilentProxy:
    """Listens on a free loopback port and forwards each connection to ``upstream`` (host, port)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = int(self._listener.getsockname()[1])
        #: Monotonic time of every connection accepted, in order.
        self.accepted: list[float] = []
        self._links: list[_Link] = []
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True, name=f"silent-proxy-{self.port}")
        self._thread.start()

    def url(self, broker_url: str) -> str:
        """``broker_url`` (an ``amqp://`` URL of the upstream) with this proxy's port instead."""
        host, port = self.upstream
        return broker_url.replace(f"{host}:{port}", f"127.0.0.1:{self.port}", 1)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _address = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.accepted.append(time.monotonic())
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError as exc:  # the broker is down: the client sees its connection closed, as it would
                logger.debug("silent proxy: upstream %s refused: %s", self.upstream, exc)
                client.close()
                continue
            client.settimeout(None)
            upstream.settimeout(None)
            link = _Link(client, upstream)
            with self._lock:
                self._links = [lk for lk in self._links if not lk.closed] + [link]
            link.start()

    def freeze(self) -> int:
        """Silence every open connection, both ways, sockets left open; return how many."""
        with self._lock:
            links = [lk for lk in self._links if not lk.closed]
        for link in links:
            link.flowing.clear()
        return len(links)

    def thaw(self) -> None:
        """Let frozen connections flow again (what their ends sent or closed meanwhile goes through)."""
        with self._lock:
            links = list(self._links)
        for link in links:
            link.flowing.set()

    def accepted_since(self, since: float) -> int:
        """Connections accepted after monotonic time ``since``."""
        return sum(1 for t in self.accepted if t > since)

    def close(self) -> None:
        """Stop listening and close every connection."""
        self._closed = True
        self._listener.close()
        self._thread.join(timeout=5)
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close()
