"""The agent's connection limits: how long a connection may idle, and how many may be open.

Why it exists: every open connection costs the agent a file descriptor and memory, and tornado
holds any number of them for as long as ``idle_connection_timeout`` says. Before these limits,
200 connections that never sent a byte were all held for 300 s. Now:

- a connection that sends nothing (no request line, no headers, nothing between two requests)
  is closed after ``idle_timeout`` seconds, and a body that stalls after ``body_timeout``;
- at most ``max_connections`` are open at once, and at most ``max_per_peer`` from one peer
  (one TCP address, or one uid on the unix socket), so one greedy or hostile client cannot
  take every slot from the others.

At a cap, the oldest *idle* connection (connected, waiting for a request) of the same peer
is closed to make room, so a hoarder of silent connections loses them to the next caller;
only when every connection is busy is a newcomer answered at once with ``503`` and
``Retry-After`` (the JSON error shape, code ``busy``), then closed: the client learns why
instead of seeing a reset. The room this leaves: the notebook side opens one short
connection per call (the agent client sends ``Connection: close``), a browser tab's live
stream goes through the Jupyter server, not here, so even a node with a hundred kernels
stays far below both caps.
"""

from __future__ import annotations

import json
from asyncio import Future
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

from tornado import httputil, web
from tornado.httpserver import HTTPServer
from tornado.iostream import IOStream, StreamClosedError

from ..._structs import ErrorBody
from .connection import peer_credentials

__all__ = ["DEFAULT_LIMITS", "ConnectionLimits", "LimitedHTTPServer"]


@dataclass(frozen=True)
class ConnectionLimits:
    """Connection limits of the agent's HTTP server (see the module docstring)."""

    idle_timeout: float = 30.0
    """Seconds a connection may send nothing (headers included) before it is closed."""
    body_timeout: float = 30.0
    """Seconds a request body may take to arrive."""
    max_connections: int = 512
    """Connections open at once, over all listening addresses."""
    max_per_peer: int = 64
    """Connections open at once from one TCP address or one unix-socket uid."""


DEFAULT_LIMITS: Final = ConnectionLimits()


def _peer_key(stream: IOStream, address: Any) -> str:
    """Whose connection this is, for ``max_per_peer``: the TCP address or the unix uid."""
    try:
        peer = peer_credentials(stream.socket)
    except OSError:
        return "unix:?"
    if peer is not None:
        return f"unix-uid:{peer.uid}"
    return f"tcp:{address[0]}" if isinstance(address, tuple) and address else "tcp:?"


def _refusal(message: str) -> bytes:
    body: ErrorBody = {
        "error": "busy",
        "message": f"{message}; try again in a moment",
        "retryable": True,
    }
    payload = json.dumps(body, separators=(",", ":")).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(payload)}\r\n"
        "Retry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode("ascii") + payload


class _Tracked(httputil.HTTPMessageDelegate):
    """Passes a request through, telling the server when its headers have arrived."""

    def __init__(self, inner: httputil.HTTPMessageDelegate, on_headers: Callable[[], None]) -> None:
        self._inner = inner
        self._on_headers = on_headers

    def headers_received(
        self,
        start_line: httputil.RequestStartLine | httputil.ResponseStartLine,
        headers: httputil.HTTPHeaders,
    ) -> Awaitable[None] | None:
        self._on_headers()
        return self._inner.headers_received(start_line, headers)

    def data_received(self, chunk: bytes) -> Awaitable[None] | None:
        return self._inner.data_received(chunk)

    def finish(self) -> None:
        self._inner.finish()

    def on_connection_close(self) -> None:
        self._inner.on_connection_close()


class LimitedHTTPServer(HTTPServer):
    """tornado's ``HTTPServer`` with a cap on open connections, overall and per peer.

    When a cap is reached, a new connection first evicts the oldest *idle* one (connected
    but waiting for a request: the shape of a slow or hostile client) of the same peer, or,
    at the total cap, of the peer holding the most; only when every connection is busy is
    the newcomer refused. So a client that hoards silent connections loses them to the
    next caller instead of locking it out.
    """

    def initialize(  # type: ignore[override]  # tornado's Configurable passes them on
        self,
        request_callback: web.Application,
        *,
        max_body_size: int | None = None,
        limits: ConnectionLimits = DEFAULT_LIMITS,
    ) -> None:
        super().initialize(
            request_callback,
            max_body_size=max_body_size,
            idle_connection_timeout=limits.idle_timeout,
            body_timeout=limits.body_timeout,
        )
        self.limits = limits
        self._by_peer: dict[str, list[IOStream]] = {}
        self._peer_of: dict[IOStream, str] = {}
        self._idle: set[IOStream] = set()
        self.refused = 0
        """Connections refused for a cap since the start (for tests and the soak benchmark)."""
        self.evicted = 0
        """Idle connections closed to make room since the start."""

    def handle_stream(self, stream: IOStream, address: Any) -> None:
        peer = _peer_key(stream, address)
        mine = self._by_peer.get(peer, [])
        if len(mine) >= self.limits.max_per_peer and not self._evict(mine):
            self._refuse(stream, f"{len(mine)} connections of yours are busy")
            return
        if len(self._peer_of) >= self.limits.max_connections:
            greediest = max(self._by_peer.values(), key=len)
            if not (self._evict(greediest) or self._evict(list(self._peer_of))):
                self._refuse(stream, f"the agent has {len(self._peer_of)} busy connections")
                return
        self._by_peer.setdefault(peer, []).append(stream)
        self._peer_of[stream] = peer
        self._idle.add(stream)
        self.admit(stream, address)

    def admit(self, stream: IOStream, address: Any) -> None:
        """Serve a connection the caps let in (a subclass may do more first)."""
        super().handle_stream(stream, address)

    def start_request(
        self, server_conn: object, request_conn: httputil.HTTPConnection
    ) -> httputil.HTTPMessageDelegate:
        # Called when a connection starts waiting for its next request: idle until headers.
        stream = getattr(server_conn, "stream", None)
        delegate = super().start_request(server_conn, request_conn)
        if not isinstance(stream, IOStream) or stream not in self._peer_of:
            return delegate
        self._idle.add(stream)
        return _Tracked(delegate, lambda: self._idle.discard(stream))

    def on_close(self, server_conn: object) -> None:
        stream = getattr(server_conn, "stream", None)
        if isinstance(stream, IOStream):
            self._forget(stream)
        super().on_close(server_conn)

    def _forget(self, stream: IOStream) -> None:
        peer = self._peer_of.pop(stream, None)
        self._idle.discard(stream)
        if peer is not None:
            mine = self._by_peer[peer]
            mine.remove(stream)
            if not mine:
                del self._by_peer[peer]

    def _evict(self, candidates: list[IOStream]) -> bool:
        """Close the oldest idle connection among ``candidates``; False if none is idle."""
        victim = next((stream for stream in candidates if stream in self._idle), None)
        if victim is None:
            return False
        self.evicted += 1
        self._forget(victim)  # now, not when tornado's close callback runs
        victim.close()
        return True

    def _refuse(self, stream: IOStream, message: str) -> None:
        self.refused += 1
        try:
            written = stream.write(_refusal(message))
        except StreamClosedError:  # the peer has gone already: nothing to tell it
            stream.close()
            return

        def close(done: Future[None]) -> None:
            # A peer that went away meanwhile is no error of ours.
            if not done.cancelled():
                done.exception()
            stream.close()

        written.add_done_callback(close)
