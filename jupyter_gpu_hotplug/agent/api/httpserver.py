"""The agent's HTTP server: tornado's, with connection caps and identity bound at accept.

Why it exists: two things must happen to every accepted connection before its first request —
the caps of ``limits`` decide whether it may stay, and ``connection`` binds who is at the other
end (peer credentials and pidfd, resolved to a container while the peer is provably alive).
This class only puts the two in that order: a connection refused by a cap is never resolved.
"""

from __future__ import annotations

from typing import Any

from tornado import iostream

from .connection import Binder, bind_connection
from .limits import LimitedHTTPServer

__all__ = ["BindingHTTPServer"]


class BindingHTTPServer(LimitedHTTPServer):
    """``LimitedHTTPServer`` that binds each admitted connection's identity."""

    binder: Binder
    """Set right after construction (tornado's ``initialize`` takes no extra arguments)."""

    def admit(self, stream: iostream.IOStream, address: Any) -> None:
        bind_connection(stream, self.binder)
        super().admit(stream, address)
