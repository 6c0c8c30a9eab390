"""The agent's connection limits: deadlines for each phase of a request, and caps on open
connections that no one caller can use up for the others.

Why it exists: every open connection costs the agent a file descriptor and memory, and
tornado holds any number of them for as long as a client likes. A red team (issue 25) found
the first caps easy to turn against everyone: unix-socket connections were counted per uid (so
all root kernels and the Jupyter server shared 64), a connection past its headers could never
be made to give way, and credentials were checked only after the body — 64 stalled uploads
from one sandbox, or 512 slow unauthenticated bodies from 127.0.0.2-9, answered 503 to every
caller. Now:

- **Deadlines.** The headers of a request must arrive within ``idle_timeout`` of the moment
  the connection started waiting for them (a connection that sends nothing is closed then), and
  its body within ``body_timeout`` of the headers (tornado's ``header_timeout`` and
  ``body_timeout``: deadlines, not idle timers, so a trickle does not extend them).
- **Whose connection.** Each connection is counted for its *peer*: on the unix socket the
  container bound at accept (``connection.py``; a process in no container by its uid), over TCP
  the source address. At most ``max_per_peer`` per peer: one container's connections crowd out
  only its own.
- **Credentials at the headers.** The API checks a request's credentials as soon as its
  headers arrive (``handlers.ApiHandler.prepare``): a request without valid ones is refused
  before its body is read, so an unauthenticated client never holds a connection through a
  body phase.
- **Who gives way.** A connection is *evictable* while it waits for a request or while its
  request is still arriving (headers or body): nothing of it runs yet. One whose request is
  being served (an attach waiting in the queue, a detach scanning processes) is never cut.
  A newcomer over a cap takes the place of the oldest evictable connection — of its own peer
  at ``max_per_peer``, else of the peer that holds the most connections (never one holding
  fewer than the newcomer's peer would), so the greediest caller gives way first.
- **A reserve for token holders.** ``reserve`` of the ``max_connections`` places are kept for
  callers that show the agent token (the Jupyter server, an operator): when the others fill
  the rest and none of theirs can give way, a newcomer is let in *on probation* — its first
  request must carry the token, or it is answered ``503`` at its headers.

Only when nothing can give way is a newcomer answered at once with ``503`` and ``Retry-After``
(the JSON error shape, code ``busy``, ``retry_after``), then closed: it learns why instead of
seeing a reset. A well-behaved notebook opens one short connection per call (the agent client
sends ``Connection: close``) and a browser's live stream goes through the Jupyter server, so
even a node with a hundred kernels stays far below every cap.
"""

from __future__ import annotations

import json
import weakref
from asyncio import Future
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Final, Literal

from tornado import httputil, web
from tornado.httpserver import HTTPServer
from tornado.iostream import IOStream, StreamClosedError

from ..._httpkit import response_bytes
from ..core.errors import Unavailable
from .connection import peer_credentials

__all__ = ["DEFAULT_LIMITS", "Admission", "ConnectionLimits", "LimitedHTTPServer", "admission_of"]

RETRY_AFTER: Final = 1
"""Seconds a refused caller is told to wait (places free up as requests finish)."""


@dataclass(frozen=True)
class ConnectionLimits:
    """Connection limits of the agent's HTTP server (see the module docstring)."""

    idle_timeout: float = 10.0
    """Seconds within which a request's headers must arrive (and an idle connection is kept)."""
    body_timeout: float = 10.0
    """Seconds within which a request's body must arrive after its headers."""
    max_connections: int = 512
    """Connections open at once, over all listening addresses."""
    max_per_peer: int = 64
    """Connections open at once from one container (unix socket) or one TCP address."""
    reserve: int = 64
    """Of ``max_connections``, the places only a caller with the agent token may take."""


DEFAULT_LIMITS: Final = ConnectionLimits()


@dataclass(eq=False)
class Admission:
    """One open connection as the caps see it."""

    stream: IOStream
    peer: str
    phase: Literal["idle", "arriving", "served"] = "idle"
    """Waiting for a request; its request arriving (headers, body); its request being served."""
    token: bool = False
    """A request on it showed the agent token."""
    probation: bool = False
    """Let in on the token holders' reserve: its requests must show the token."""

    @property
    def evictable(self) -> bool:
        return self.phase != "served"


_admissions: weakref.WeakKeyDictionary[IOStream, Admission] = weakref.WeakKeyDictionary()


def admission_of(request: httputil.HTTPServerRequest) -> Admission | None:
    """How the caps admitted the connection of ``request`` (None: not through them)."""
    stream = getattr(request.connection, "stream", None)
    return _admissions.get(stream) if isinstance(stream, IOStream) else None


def peer_key(stream: IOStream, address: Any) -> str:
    """Whose connection this is when nothing better is known: the TCP address or the unix uid."""
    try:
        peer = peer_credentials(stream.socket)
    except OSError:
        return "unix:?"
    if peer is not None:
        return f"unix-uid:{peer.uid}"
    return f"tcp:{address[0]}" if isinstance(address, tuple) and address else "tcp:?"


def _refusal(message: str) -> bytes:
    body = Unavailable(message, retry_after=RETRY_AFTER, hint="try again in a moment").to_body()
    return response_bytes(
        503,
        json.dumps(body, separators=(",", ":")).encode(),
        {"Content-Type": "application/json; charset=utf-8", "Retry-After": str(RETRY_AFTER)},
    )


class _Tracked(httputil.HTTPMessageDelegate):
    """Passes a request through, telling the caps when it has arrived whole."""

    def __init__(self, inner: httputil.HTTPMessageDelegate, admission: Admission) -> None:
        self._inner = inner
        self._admission = admission

    def headers_received(
        self,
        start_line: httputil.RequestStartLine | httputil.ResponseStartLine,
        headers: httputil.HTTPHeaders,
    ) -> Awaitable[None] | None:
        self._admission.phase = "arriving"
        return self._inner.headers_received(start_line, headers)

    def data_received(self, chunk: bytes) -> Awaitable[None] | None:
        return self._inner.data_received(chunk)

    def finish(self) -> None:
        self._admission.phase = "served"
        self._inner.finish()

    def on_connection_close(self) -> None:
        self._inner.on_connection_close()


class LimitedHTTPServer(HTTPServer):
    """tornado's ``HTTPServer`` with the deadlines and caps of the module docstring."""

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
        self._open: dict[IOStream, Admission] = {}
        """Every open connection, oldest first."""
        self._by_peer: dict[str, list[Admission]] = {}
        self.refused = 0
        """Connections refused for a cap since the start (for tests and the soak benchmark)."""
        self.evicted = 0
        """Connections closed to make room since the start."""

    def peer_of(self, stream: IOStream, address: Any) -> str:
        """Whose connection this is, for ``max_per_peer`` (a subclass may know better)."""
        return peer_key(stream, address)

    def handle_stream(self, stream: IOStream, address: Any) -> None:
        admission = Admission(stream, self.peer_of(stream, address))
        mine = self._by_peer.get(admission.peer, [])
        if len(mine) >= self.limits.max_per_peer and not self._evict(mine):
            self._refuse(stream, f"{len(mine)} connections of yours are busy")
            return
        if len(self._open) >= self.limits.max_connections and not self._evict_greediest(
            admission.peer, tokens_too=True
        ):
            self._refuse(stream, f"the agent has {len(self._open)} busy connections")
            return
        ordinary = sum(1 for other in self._open.values() if not other.token)
        if ordinary >= self.limits.max_connections - self.limits.reserve:
            admission.probation = not self._evict_greediest(admission.peer, tokens_too=False)
        self._open[stream] = admission
        self._by_peer.setdefault(admission.peer, []).append(admission)
        _admissions[stream] = admission
        self.admit(stream, address)

    def admit(self, stream: IOStream, address: Any) -> None:
        """Serve a connection the caps let in (a subclass may do more first)."""
        super().handle_stream(stream, address)

    def start_request(
        self, server_conn: object, request_conn: httputil.HTTPConnection
    ) -> httputil.HTTPMessageDelegate:
        # Called when a connection starts waiting for its next request.
        stream = getattr(server_conn, "stream", None)
        delegate = super().start_request(server_conn, request_conn)
        admission = self._open.get(stream) if isinstance(stream, IOStream) else None
        if admission is None:
            return delegate
        admission.phase = "idle"
        return _Tracked(delegate, admission)

    def on_close(self, server_conn: object) -> None:
        stream = getattr(server_conn, "stream", None)
        if isinstance(stream, IOStream):
            self._forget(stream)
        super().on_close(server_conn)

    def _forget(self, stream: IOStream) -> None:
        admission = self._open.pop(stream, None)
        if admission is not None:
            mine = self._by_peer[admission.peer]
            mine.remove(admission)
            if not mine:
                del self._by_peer[admission.peer]

    def _evict_greediest(self, newcomer: str, *, tokens_too: bool) -> bool:
        """Make room by evicting from the peer holding the most connections (counting those
        of token holders only when ``tokens_too``: the reserve is theirs), if it holds more
        than the newcomer's peer would."""
        counts = {
            peer: [a for a in admissions if tokens_too or not a.token]
            for peer, admissions in self._by_peer.items()
        }
        greediest = max(counts, key=lambda peer: len(counts[peer]), default=None)
        if greediest is None:
            return False
        if len(counts[greediest]) <= len(self._by_peer.get(newcomer, [])) + 1:
            return False
        return self._evict(counts[greediest])

    def _evict(self, candidates: list[Admission]) -> bool:
        """Close the oldest evictable connection among ``candidates``; False if none is."""
        victim = next((admission for admission in candidates if admission.evictable), None)
        if victim is None:
            return False
        self.evicted += 1
        self._forget(victim.stream)  # now, not when tornado's close callback runs
        victim.stream.close()
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
