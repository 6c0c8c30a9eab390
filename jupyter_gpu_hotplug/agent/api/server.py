"""Listening sockets and the HTTP server of the agent API.

Why it exists: where the API listens is part of its security. A unix socket identifies its
callers (``SO_PEERCRED``), so it is created with a restrictive mode (0660 by default, set
before ``listen()`` so there is no window in which anyone could connect) and an optional
group; a socket file left by a crashed agent is replaced, but one that another live process
is serving is never taken over. TCP offers no identity and relies on the token.

``AgentServer`` owns the sockets and the tornado ``HTTPServer``: ``start`` binds everything or
nothing, ``stop`` closes the listeners, lets requests in flight finish, and removes the unix
socket files it created (only if they are still its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from tornado import web
from tornado.netutil import bind_sockets

from ..settings import ListenAddress, TcpAddress, UnixAddress
from .connection import Binder
from .handlers import ApiContext, ApiHandler, UnknownRouteHandler, default_handlers
from .httpserver import BindingHTTPServer
from .limits import DEFAULT_LIMITS, ConnectionLimits
from .validation import MAX_BODY_BYTES

__all__ = ["AgentServer", "ListenError", "bind_unix_socket", "make_application"]

log = logging.getLogger(__name__)

_BACKLOG: Final = 128
_STALE_PROBE_TIMEOUT: Final = 1.0
# Bodies above the API's own limit are still read (and refused with a JSON error) up to
# this size; beyond it tornado itself drops the connection.
_SERVER_MAX_BODY: Final = 16 * MAX_BODY_BYTES


class ListenError(Exception):
    """An address cannot be listened on (in use, bad permissions, not a socket...)."""


def make_application(
    context: ApiContext, handlers: Sequence[tuple[str, type[ApiHandler]]] = default_handlers
) -> web.Application:
    """The tornado application serving ``handlers`` (default: the whole API) with ``context``."""
    return web.Application(
        list(handlers),
        default_handler_class=UnknownRouteHandler,
        gpu_hotplug=context,
        compress_response=False,
        xsrf_cookies=False,
    )


def _socket_in_use(path: Path) -> bool:
    """Whether a live process accepts connections on the unix socket ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(_STALE_PROBE_TIMEOUT)
    try:
        probe.connect(str(path))
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return False
        raise ListenError(f"cannot tell whether {path} is in use: {e.strerror}") from e
    finally:
        probe.close()
    return True


def bind_unix_socket(path: Path, *, mode: int, group: int | None = None) -> socket.socket:
    """A listening unix socket at ``path`` with ``mode`` (and ``group``), replacing a stale one.

    The parent directory is created (0755) if missing. Raises ``ListenError`` when ``path``
    is something other than a socket, or a socket another process is serving.
    """
    try:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        existing: os.stat_result | None = path.lstat()
    except FileNotFoundError:
        existing = None
    except OSError as e:
        raise ListenError(f"cannot use {path}: {e.strerror}") from e
    if existing is not None:
        if not stat.S_ISSOCK(existing.st_mode):
            raise ListenError(f"{path} exists and is not a socket; remove it or listen elsewhere")
        if _socket_in_use(path):
            raise ListenError(
                f"another process is serving on {path}; stop it or listen on another path"
            )
        log.warning("removing the stale socket %s left by an earlier agent", path)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.bind(str(path))
        # Before listen(): until then every connect() is refused, so no caller can slip in
        # while the mode is still the umask's.
        os.chmod(path, mode)
        if group is not None:
            os.chown(path, -1, group)
        sock.listen(_BACKLOG)
    except OSError as e:
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        raise ListenError(f"cannot listen on unix:{path}: {e.strerror}") from e
    return sock


@dataclass(frozen=True)
class BoundAddress:
    """An address being served, as bound (a TCP port 0 becomes the real port)."""

    requested: ListenAddress
    actual: ListenAddress


class AgentServer:
    """The HTTP server over all listening addresses."""

    def __init__(
        self,
        application: web.Application,
        *,
        binder: Binder,
        limits: ConnectionLimits = DEFAULT_LIMITS,
    ) -> None:
        self._server = BindingHTTPServer(application, max_body_size=_SERVER_MAX_BODY, limits=limits)
        self._server.binder = binder
        self._unix_sockets: list[tuple[Path, int]] = []
        self.bound: list[BoundAddress] = []

    def start(
        self, addresses: Sequence[ListenAddress], *, socket_mode: int, socket_group: int | None
    ) -> None:
        """Bind every address (all or nothing) and start serving on the running loop."""
        sockets: list[socket.socket] = []
        try:
            for address in addresses:
                bound = self._bind(address, socket_mode=socket_mode, socket_group=socket_group)
                sockets.extend(bound)
                actual: ListenAddress = address
                if isinstance(address, TcpAddress) and bound:
                    actual = TcpAddress(address.host, bound[0].getsockname()[1])
                self.bound.append(BoundAddress(address, actual))
        except BaseException:
            for sock in sockets:
                sock.close()
            self._remove_unix_sockets()
            self.bound.clear()
            raise
        self._server.add_sockets(sockets)
        for bound_address in self.bound:
            log.info("serving the agent API on %s", bound_address.actual)

    def _bind(
        self, address: ListenAddress, *, socket_mode: int, socket_group: int | None
    ) -> list[socket.socket]:
        if isinstance(address, UnixAddress):
            sock = bind_unix_socket(address.path, mode=socket_mode, group=socket_group)
            self._unix_sockets.append((address.path, os.stat(address.path).st_ino))
            return [sock]
        try:
            return bind_sockets(address.port, address.host or None, backlog=_BACKLOG)
        except OSError as e:
            raise ListenError(f"cannot listen on {address}: {e.strerror}") from e

    def stop_listening(self) -> None:
        """Accept no new connections and remove the unix socket files; open ones go on."""
        self._server.stop()
        self._remove_unix_sockets()

    async def close_connections(self, *, timeout: float = 10.0) -> None:
        """Close every open connection (after ``stop_listening``)."""
        try:
            await asyncio.wait_for(self._server.close_all_connections(), timeout)
        except TimeoutError:
            log.warning("connections still open after %.0f s; leaving them", timeout)

    def _remove_unix_sockets(self) -> None:
        for path, inode in self._unix_sockets:
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == inode:
                    path.unlink()
        self._unix_sockets.clear()
