"""Who is at the other end of a connection, captured once when the connection is accepted.

Why it exists: on the unix socket the caller is a process, and a pid is not an identity — a
client can connect, hand the connection to a child, and exit; once its pid is reused by a
process in another container, a lookup "by the peer's pid" at request time would act as that
other container. So the identity is bound to the *connection*: at accept, the kernel's record of
the peer (``SO_PEERCRED``) and a pidfd for that very process (``SO_PEERPIDFD``, Linux 6.5) go to
``Identity.bind_connection``, which resolves the peer's container while the pidfd proves the
peer alive; every request on the connection then carries the same ``ConnectionInfo``.

``httpserver.BindingHTTPServer`` takes that step for each accepted connection (before the
connection caps, which count per container); handlers read the result with ``connection_of``.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import weakref
from collections.abc import Callable
from typing import Final

from tornado import httputil, iostream

from ..core.seams import ConnectionInfo, PeerCredentials

__all__ = [
    "Binder",
    "bind_connection",
    "bound_to",
    "connection_of",
    "peer_credentials",
    "peer_pidfd",
]

log = logging.getLogger(__name__)

_UCRED: Final = struct.Struct("3i")
SO_PEERPIDFD: Final = getattr(socket, "SO_PEERPIDFD", 77)
"""``<asm-generic/socket.h>``; Python 3.11's socket module does not name it."""

Binder = Callable[..., ConnectionInfo]
"""``Identity.bind_connection``: ``(*, peer, pidfd) -> ConnectionInfo``."""

_TCP: Final = ConnectionInfo(transport="tcp")
_bound: weakref.WeakKeyDictionary[iostream.IOStream, ConnectionInfo] = weakref.WeakKeyDictionary()


def peer_credentials(sock: socket.socket | None) -> PeerCredentials | None:
    """The process at the other end of a unix socket; None for TCP."""
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    pid, uid, gid = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    return PeerCredentials(pid=pid, uid=uid, gid=gid)


def peer_pidfd(sock: socket.socket) -> int | None:
    """A pidfd of the peer process of a unix socket (the caller closes it); None when the
    kernel has none to give (too old, or the peer has already been reaped)."""
    try:
        return sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as e:
        log.debug("no SO_PEERPIDFD for the peer: %s", e)
        return None


def bind_socket(sock: socket.socket, binder: Binder) -> ConnectionInfo:
    """The ``ConnectionInfo`` of an accepted socket, as ``binder`` decides it."""
    peer = peer_credentials(sock)
    if peer is None:
        return binder(peer=None, pidfd=None)
    pidfd = peer_pidfd(sock)
    try:
        return binder(peer=peer, pidfd=pidfd)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def bind_connection(stream: iostream.IOStream, binder: Binder) -> None:
    """Bind ``stream``'s identity now, at accept (module docstring)."""
    try:
        _bound[stream] = bind_socket(stream.socket, binder)
    except Exception:
        # A connection whose identity cannot be told gets none: it may still use a token.
        log.exception("cannot identify the peer of a new connection")
        _bound[stream] = ConnectionInfo(transport="unix")


def bound_to(stream: iostream.IOStream) -> ConnectionInfo | None:
    """What ``stream`` was bound to at accept (None: not yet)."""
    return _bound.get(stream)


def connection_of(request: httputil.HTTPServerRequest) -> ConnectionInfo:
    """What the connection of ``request`` was bound to at accept (TCP when unknown)."""
    stream = getattr(request.connection, "stream", None)
    if isinstance(stream, iostream.IOStream):
        return _bound.get(stream, _TCP)
    return _TCP
