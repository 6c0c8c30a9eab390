"""The agent's HTTP server: tornado's, with identity bound at accept and connection caps.

Why it exists: two things must happen to every accepted connection before its first request —
``connection`` binds who is at the other end (peer credentials and pidfd, resolved to a
container while the peer is provably alive), and the caps of ``limits`` decide whether it may
stay. This class puts them in that order, because the caps count connections per container:
before issue 25 they were counted per uid, and every root kernel shared one budget.
"""

from __future__ import annotations

from typing import Any

from tornado import iostream

from .connection import Binder, bind_connection, bound_to
from .limits import LimitedHTTPServer, peer_key

__all__ = ["BindingHTTPServer"]


class BindingHTTPServer(LimitedHTTPServer):
    """``LimitedHTTPServer`` that binds each connection's identity and counts per container."""

    binder: Binder
    """Set right after construction (tornado's ``initialize`` takes no extra arguments)."""

    def handle_stream(self, stream: iostream.IOStream, address: Any) -> None:
        bind_connection(stream, self.binder)
        super().handle_stream(stream, address)

    def peer_of(self, stream: iostream.IOStream, address: Any) -> str:
        bound = bound_to(stream)
        if bound is not None and bound.container is not None:
            return f"container:{bound.container}"
        return peer_key(stream, address)
