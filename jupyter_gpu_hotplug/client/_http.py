"""HTTP/1.1 framing for the agent client, without I/O: the part both transports share.

Boundary: where the agent is (``AgentEndpoint``), the bytes of a request, when a response is
complete, and what a received response says. The transports (``_sync`` over blocking sockets,
``_async`` over asyncio streams) only connect and move these bytes; they raise
``TransportFailure`` and nothing else.

Why framing of our own instead of ``http.client`` for one client and tornado for the other:
the agent listens on TCP *or a unix socket*, which neither ``http.client`` nor tornado's
``AsyncHTTPClient`` supports directly. With both transports reduced to "connect, send, read
until complete", every byte-level behaviour (headers, the bearer token, chunked or sized
bodies, truncation) is the same code in both and is tested once, and it is always known
whether a failure happened before anything was sent (retrying is then always safe) or after.
Responses are still parsed by the standard library's ``http.client`` parser, fed from memory.
Each request uses its own connection (``Connection: close``): the token is re-read per call
anyway, calls are rare, and there is no pool that could hand out a connection the agent has
already dropped.
"""

from __future__ import annotations

import enum
import http.client
import io
import os
import re
import socket
import ssl
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "MAX_RESPONSE_BYTES",
    "AgentEndpoint",
    "MalformedResponse",
    "RawResponse",
    "ResponseReader",
    "Stage",
    "TransportFailure",
    "decode_response",
    "encode_request",
    "failure_from_os_error",
]

MAX_RESPONSE_BYTES: Final = 16 * 2**20
"""Answers are small JSON documents; anything bigger is not the agent."""

# sockaddr_un.sun_path is 108 bytes on Linux, including the terminating NUL.
_MAX_SOCKET_PATH_BYTES: Final = 107
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}
_HEADER_NAME: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEADER_VALUE: Final = re.compile(r"[\x20-\x7e\t]*")


@dataclass(frozen=True)
class AgentEndpoint:
    """Where the agent listens: ``http://host:port[/prefix]``, ``https://…`` or ``unix:/path``."""

    url: str
    """As configured; used in messages."""
    scheme: Literal["http", "https", "unix"]
    host: str
    """The host to connect to and name in ``Host``; ``localhost`` for a unix socket."""
    port: int
    """0 for a unix socket."""
    socket_path: str | None
    """The unix socket's path, for ``unix:`` URLs only."""
    base_path: str
    """A path prefix before ``/v1/...`` (behind a reverse proxy), ``""`` if none."""

    @classmethod
    def parse(cls, url: str) -> AgentEndpoint:
        """Check ``url`` and split it; ``ValueError`` says what is wrong with it.

        ``unix:/run/gpu-hotplug/agent.sock`` and ``unix:///run/gpu-hotplug/agent.sock`` name
        the same socket; the path must be absolute (the server's working directory is no
        sensible anchor).
        """
        text = url.strip()
        if not text.isascii() or any(char.isspace() or not char.isprintable() for char in text):
            raise ValueError(
                f"agent URL {url!r}: only printable ASCII without spaces (percent-encode the rest)"
            )
        if text.startswith("unix:"):
            path = text.removeprefix("unix:")
            if path.startswith("//"):
                path = path[2:]
            if not path.startswith("/"):
                raise ValueError(
                    f"agent URL {url!r}: a unix socket needs an absolute path, like "
                    "unix:/run/gpu-hotplug/agent.sock"
                )
            if len(path.encode()) > _MAX_SOCKET_PATH_BYTES:
                raise ValueError(
                    f"agent URL {url!r}: the socket path is longer than the "
                    f"{_MAX_SOCKET_PATH_BYTES} bytes a unix socket address can hold"
                )
            return cls(text, "unix", "localhost", 0, path, "")
        parts = urllib.parse.urlsplit(text)
        if parts.scheme not in _DEFAULT_PORTS:
            raise ValueError(
                f"agent URL {url!r}: expected http://HOST:PORT, https://HOST:PORT or "
                "unix:/path/to/agent.sock"
            )
        if parts.username is not None or parts.query or parts.fragment:
            raise ValueError(f"agent URL {url!r}: user info, query and fragment are not allowed")
        try:
            port = parts.port
        except ValueError as error:
            raise ValueError(f"agent URL {url!r}: {error}") from error
        if not parts.hostname:
            raise ValueError(f"agent URL {url!r} has no host")
        scheme: Literal["http", "https"] = "https" if parts.scheme == "https" else "http"
        return cls(
            text,
            scheme,
            parts.hostname,
            port if port is not None else _DEFAULT_PORTS[scheme],
            None,
            parts.path.rstrip("/"),
        )

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if self.socket_path is not None or self.port == _DEFAULT_PORTS[self.scheme]:
            return host
        return f"{host}:{self.port}"


def encode_request(
    endpoint: AgentEndpoint,
    method: str,
    target: str,
    *,
    headers: Mapping[str, str],
    body: bytes | None,
) -> bytes:
    """One HTTP/1.1 request; ``target`` is the path and query below the endpoint's prefix.

    Header values are checked, so a token with a line break cannot smuggle in headers.
    """
    lines = [f"{method} {endpoint.base_path}{target} HTTP/1.1", f"Host: {endpoint.host_header}"]
    all_headers = {**headers, "Connection": "close"}
    if body is not None:
        all_headers["Content-Length"] = str(len(body))
    for name, value in all_headers.items():
        if not _HEADER_NAME.fullmatch(name) or not _HEADER_VALUE.fullmatch(value):
            raise ValueError(f"header {name!r} has a value that cannot be sent in HTTP")
        lines.append(f"{name}: {value}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")
    return head if body is None else head + body


class Stage(enum.Enum):
    """How far a failed exchange got: decides whether repeating the request is safe."""

    CONNECT = "connect"
    """No connection: nothing was sent, so any request may be repeated."""
    EXCHANGE = "exchange"
    """Connected and (perhaps) sent: the agent may have acted on the request."""


class TransportFailure(Exception):
    """A transport could not complete an exchange; the client decides what to make of it."""

    def __init__(self, stage: Stage, reason: str, *, timed_out: bool = False) -> None:
        super().__init__(f"{stage.value}: {reason}")
        self.stage = stage
        self.reason = reason
        self.timed_out = timed_out


def failure_from_os_error(stage: Stage, error: OSError, *, timeout: float) -> TransportFailure:
    """The transport failure for a socket error, with a reason fit for people."""
    if isinstance(error, TimeoutError):
        waited = "no connection" if stage is Stage.CONNECT else "no answer"
        return TransportFailure(stage, f"{waited} within {timeout:g} s", timed_out=True)
    if isinstance(error, ssl.SSLCertVerificationError):
        reason = f"its TLS certificate was not accepted: {error.verify_message}"
    elif isinstance(error, ssl.SSLError):
        reason = f"TLS failed: {error.reason or error}"
    elif isinstance(error, socket.gaierror) or not error.errno:
        reason = error.strerror or str(error) or type(error).__name__
    else:
        # The errno's own words: asyncio replaces strerror with "Connect call failed (...)".
        reason = os.strerror(error.errno)
    return TransportFailure(stage, reason)


class MalformedResponse(ValueError):
    """The bytes received are not an HTTP response we can read."""


class ResponseReader:
    """Collects a response as it arrives and says when it is complete.

    Complete means: the header block has ended and either the status has no body (204, 304)
    or ``Content-Length`` bytes followed. Other responses (chunked, or no length) end when
    the agent closes the connection, which it must after ``Connection: close``.
    """

    def __init__(self) -> None:
        self._data = bytearray()
        self._expected_total: int | None = None

    @property
    def data(self) -> bytes:
        return bytes(self._data)

    def feed(self, chunk: bytes) -> bool:
        """Add received bytes; whether to stop reading (complete, or too large to be ours)."""
        self._data += chunk
        if len(self._data) > MAX_RESPONSE_BYTES:
            return True  # stop reading: decode_response refuses it
        if self._expected_total is None:
            self._expected_total = self._total_length()
        return self._expected_total is not None and len(self._data) >= self._expected_total

    def _total_length(self) -> int | None:
        """Header bytes plus body bytes, once the headers say; ``None`` while unknown."""
        end = self._data.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = bytes(self._data[:end]).decode("latin-1").split("\r\n")
        status_parts = head[0].split(" ", 2)
        if len(status_parts) < 2 or not status_parts[1].isdigit():
            return end + 4  # not HTTP: stop reading, decode_response says why
        status = int(status_parts[1])
        if status in (204, 304):
            return end + 4
        if status < 200:
            return None  # an interim answer: the real one follows; read until the agent closes
        fields = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip()
        if "chunked" in fields.get("transfer-encoding", "").lower():
            return None
        length = fields.get("content-length", "")
        return end + 4 + int(length) if length.isdigit() else None


@dataclass(frozen=True)
class RawResponse:
    """A whole response: what the client interprets."""

    status: int
    reason: str
    content_type: str | None
    body: bytes


class _MemorySocket:
    """Just enough of a socket for ``http.client.HTTPResponse`` to parse bytes from memory."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def makefile(self, mode: str) -> io.BytesIO:
        return io.BytesIO(self._data)


def decode_response(data: bytes, *, method: str) -> RawResponse:
    """Parse a received response.

    Raises ``TransportFailure`` (``EXCHANGE``) when the connection ended before the response
    did (nothing at all, or a cut-off body): the agent may have acted, the answer is lost.
    Raises ``MalformedResponse`` for bytes that are not HTTP.
    """
    if not data:
        raise TransportFailure(Stage.EXCHANGE, "the agent closed the connection without answering")
    if len(data) > MAX_RESPONSE_BYTES:
        raise MalformedResponse(f"the answer is larger than {MAX_RESPONSE_BYTES} bytes")
    if b"\r\n\r\n" not in data and b"\n\n" not in data:
        if not data.startswith(b"HTTP/"):
            raise MalformedResponse(f"not an HTTP response: {data[:40]!r}")
        raise TransportFailure(Stage.EXCHANGE, "the connection closed in the middle of the answer")
    response = http.client.HTTPResponse(_MemorySocket(data), method=method)  # type: ignore[arg-type]
    try:
        response.begin()
        body = response.read()
    except http.client.IncompleteRead as error:
        raise TransportFailure(
            Stage.EXCHANGE, "the connection closed in the middle of the answer"
        ) from error
    except http.client.HTTPException as error:
        raise MalformedResponse(
            f"not an HTTP response ({type(error).__name__}: {error})"
        ) from error
    return RawResponse(
        status=response.status,
        reason=response.reason,
        content_type=response.getheader("Content-Type"),
        body=body,
    )
