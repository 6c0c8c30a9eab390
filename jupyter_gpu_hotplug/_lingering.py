"""Refusing a request before its body is read, so that the client reads the refusal.

Why it exists (issue 23): both HTTP APIs refuse some requests as soon as their headers arrive —
a ``Content-Length`` above the limit (413), missing or wrong credentials (401, the agent) — so
that nothing is read or buffered for them. tornado then answers and *closes* the connection with
the body still arriving, and a kernel that closes a socket with unread input sends a reset: an
ordinary client that sends its whole body before it reads (``urllib``, ``requests``) sees
"connection reset" instead of the answer. nginx's remedy is the *lingering close*, done here
the same way: take the connection from tornado (``RequestHandler.detach``, allowed while the
headers are being handled), write the answer with ``Connection: close``, shut the sending side
(the client sees the end of the answer), then read and drop what the client still sends — at
most ``LINGER_MAX_BYTES`` and ``LINGER_SECONDS`` — and close.

The answer is written by hand because tornado's writer is gone once the connection is detached;
it is the same status, headers and JSON body the handler's own error path would write.
"""

from __future__ import annotations

import asyncio
import http
import logging
import socket
from collections.abc import Mapping
from typing import Final

from tornado import iostream, web

from ._structs import LINGER_MAX_BYTES, LINGER_SECONDS

__all__ = ["has_unread_body", "refuse_unread"]

log = logging.getLogger(__name__)

_CHUNK: Final = 256 * 1024
_MAX_LINGERING: Final = 256
"""Connections lingering at once; past it a refusal is answered and closed at once (a flood of
oversized uploads must not hold the process's descriptors)."""
_lingering: set[asyncio.Task[None]] = set()
"""Running lingers (a task needs a reference until it ends)."""


def has_unread_body(handler: web.RequestHandler) -> bool:
    """Whether the request declares a body (that, in ``prepare``, has not been read yet)."""
    headers = handler.request.headers
    length = headers.get("Content-Length")
    return "Transfer-Encoding" in headers or (length is not None and length.strip() != "0")


def response_bytes(status: int, body: bytes, headers: Mapping[str, str]) -> bytes:
    """An HTTP/1.1 response that closes the connection."""
    head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}"]
    head += [f"{name}: {value}" for name, value in headers.items()]
    head += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(head).encode("latin-1") + body


def refuse_unread(
    handler: web.RequestHandler, status: int, body: bytes, headers: Mapping[str, str]
) -> None:
    """Answer ``status`` with ``body`` now and linger (module docstring). Call from
    ``prepare`` of a ``stream_request_body`` handler; the handler is finished afterwards."""
    stream = handler.detach()
    linger = len(_lingering) < _MAX_LINGERING
    answer = response_bytes(status, body, headers)
    task = asyncio.ensure_future(_answer_and_linger(stream, answer, linger=linger))
    _lingering.add(task)
    task.add_done_callback(_lingering.discard)


async def _answer_and_linger(stream: iostream.IOStream, response: bytes, *, linger: bool) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LINGER_SECONDS
    dropped = 0
    try:
        await stream.write(response)
        stream.socket.shutdown(socket.SHUT_WR)
        while linger and dropped < LINGER_MAX_BYTES:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            chunk = await asyncio.wait_for(stream.read_bytes(_CHUNK, partial=True), remaining)
            dropped += len(chunk)
    except (iostream.StreamClosedError, TimeoutError, OSError):
        pass  # the client is done (or gone): nothing more to drop
    finally:
        stream.close()
    log.debug("dropped %d bytes of a refused request body", dropped)
