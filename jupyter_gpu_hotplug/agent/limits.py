"""The agent's connection limits: how long a connection may idle, and how many may be open.

Why it exists: every open connection costs the agent a file descriptor and memory, and tornado
holds any number of them for as long as ``idle_connection_timeout`` says. Before these limits,
200 connections that never sent a byte were all held for 300 s. Now:

- a connection that sends nothing (no request line, no headers, nothing between two requests)
  is closed after ``idle_timeout`` seconds, and a body that stalls after ``body_timeout``;
- at most ``max_connections`` are open at once, and at most ``max_per_peer`` from one peer
  (one TCP address, or one uid on the unix socket), so one greedy or hostile client cannot
  take every slot from the others.

A connection over a cap is answered at once with ``503`` and ``Retry-After`` (the JSON error
shape, code ``busy``), then closed: the client learns why instead of seeing a reset. The
room this leaves: the notebook side opens one short connection per call (the agent client
sends ``Connection: close``), a browser tab's live stream goes through the Jupyter server, not
here, so even a node with a hundred kernels stays far below both caps.
"""

from __future__ import annotations

import json
from asyncio import Future
from collections import Counter
from dataclasses import dataclass
from typing import Any, Final

from tornado import web
from tornado.httpserver import HTTPServer
from tornado.iostream import IOStream, StreamClosedError

from .._structs import ErrorBody
from .handlers import peer_credentials

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


class LimitedHTTPServer(HTTPServer):
    """tornado's ``HTTPServer`` with a cap on open connections, overall and per peer."""

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
        self._open_by_peer: Counter[str] = Counter()
        self._peer_of: dict[IOStream, str] = {}
        self.refused = 0
        """Connections refused for a cap since the start (for tests and the soak benchmark)."""

    def handle_stream(self, stream: IOStream, address: Any) -> None:
        peer = _peer_key(stream, address)
        if len(self._connections) >= self.limits.max_connections:
            self._refuse(stream, f"the agent has {len(self._connections)} connections open")
            return
        if self._open_by_peer[peer] >= self.limits.max_per_peer:
            self._refuse(stream, f"{self._open_by_peer[peer]} connections of yours are open")
            return
        self._open_by_peer[peer] += 1
        self._peer_of[stream] = peer
        super().handle_stream(stream, address)

    def on_close(self, server_conn: object) -> None:
        stream = getattr(server_conn, "stream", None)
        peer = self._peer_of.pop(stream, None) if isinstance(stream, IOStream) else None
        if peer is not None:
            self._open_by_peer[peer] -= 1
            if not self._open_by_peer[peer]:
                del self._open_by_peer[peer]
        super().on_close(server_conn)

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
