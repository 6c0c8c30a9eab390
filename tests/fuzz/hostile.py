"""Hand-written hostile requests for both HTTP APIs: what a red team sends first.

Bodies (``HOSTILE_BODIES``): huge numbers, deep nesting, duplicate keys, non-JSON constants,
broken UTF-8, unicode and path-like strings in every member, CRLF and NUL. Raw exchanges
(``RAW_REQUESTS``): chunked bodies (valid, oversized, malformed), CRLF and NUL in the request
line and headers, an oversized declared length, garbage instead of HTTP. Each is refused with
a documented 4xx (or the connection is closed without an answer, for garbage that is not
HTTP); none may give a 5xx.
"""

from __future__ import annotations

import errno
import json
import socket
from collections.abc import Iterator

MEMBERS = ("count", "target", "wait_seconds", "request_id", "kernel_id", "uuid", "force")
NASTY_STRINGS = (
    "../../../../var/lib/gpu-hotplug/token",
    "/proc/1/root/etc/shadow",
    "a\r\nContent-Length: 0\r\n\r\nGET /healthz HTTP/1.1",
    "nul\x00byte",
    "\u202e\u0000\ufeff",
    "\U0001f680" * 64,
    "GPU-\uff21\uff22\uff23\uff24",  # fullwidth letters
)


def _body_cases() -> Iterator[tuple[str, bytes]]:
    yield "huge-count", b'{"count": 1' + b"0" * 5000 + b"}"
    yield "huge-negative", b'{"count": -' + b"9" * 5000 + b"}"
    yield "huge-float", b'{"count": 1, "wait_seconds": 1e99999}'
    yield "deep-request-id", b'{"count": 1, "request_id": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    yield "deep-target", b'{"count": 1, "target": ' + b'{"a":' * 3000 + b"1" + b"}" * 3001
    yield "duplicate", b'{"count": 1, "count": 2}'
    yield "duplicate-nested", b'{"count": 1, "target": {"pid": 5, "pid": 6}}'
    yield "nan", b'{"count": NaN}'
    yield "infinity", b'{"count": 1, "wait_seconds": -Infinity}'
    yield "bad-utf8", b'{"count": 1, "request_id": "\xc3\x28"}'
    yield "utf16", '{"count": 1}'.encode("utf-16")
    yield "nul", b'{"count": 1}\x00'
    yield "crlf", b'{"count":\r\n1,\r\n"x":\r\n"\\r\\n"}'
    yield "lone-surrogate", b'{"count": 1, "request_id": "\\ud800"}'
    for member in MEMBERS:
        for number, text in enumerate(NASTY_STRINGS):
            yield f"{member}-string-{number}", json.dumps({"count": 1, member: text}).encode()
            yield (
                f"{member}-target-{number}",
                json.dumps(
                    {"count": 1, "target": {"pod": {"namespace": text, "name": text}}}
                ).encode(),
            )


HOSTILE_BODIES: tuple[tuple[str, bytes], ...] = tuple(_body_cases())


def chunked(*chunks: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


def raw_requests(path: str, authorization: str) -> Iterator[tuple[str, bytes]]:
    """``(case, bytes)`` sent as they are to ``POST path`` (``authorization``: header value)."""
    auth = f"Authorization: {authorization}\r\n".encode()
    post = f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode() + auth
    yield (
        "chunked-valid",
        post + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(b'{"cou', b'nt": 0}'),
    )
    yield (
        "chunked-oversized",
        post + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(*[b"x" * 8192] * 16),
    )
    yield "chunked-bad-size", post + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n"
    yield (
        "chunked-and-length",
        (post + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n" + chunked(b"{}")),
    )
    yield "length-not-a-number", post + b"Content-Length: 12a\r\n\r\n" + b'{"count": 1}'
    yield "length-negative", post + b"Content-Length: -1\r\n\r\n"
    yield "length-huge", post + b"Content-Length: 99999999999999999999\r\n\r\n{"
    yield (
        "crlf-in-query",
        f"GET {path}?pid=1%0d%0aX:1 HTTP/1.1\r\nHost: x\r\n".encode() + auth + b"\r\n",
    )
    yield (
        "nul-in-path",
        f"GET {path}%00/../healthz HTTP/1.1\r\nHost: x\r\n".encode() + auth + b"\r\n",
    )
    yield "raw-nul-in-path", b"GET /v1/gp\x00us HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n"
    yield "header-with-nul", post + b"X-Evil: a\x00b\r\nContent-Length: 2\r\n\r\n{}"
    yield "header-folding", post + b"X-Evil: a\r\n  folded\r\nContent-Length: 2\r\n\r\n{}"
    yield "huge-header", post + b"X-Big: " + b"a" * 200_000 + b"\r\n\r\n"
    yield "bad-method", f"BREW {path} HTTP/1.1\r\nHost: x\r\n".encode() + auth + b"\r\n"
    yield "http-0.9", f"GET {path}\r\n\r\n".encode()
    yield "not-http", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64 + b"\r\n\r\n"


_CLOSED_EARLY = frozenset({errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN})


def exchange(address: tuple[str, int], request: bytes, *, timeout: float = 30.0) -> int | None:
    """Send ``request`` on a fresh connection; the answer's status, or None if the server
    closed the connection without one (what tornado does with input that is not HTTP)."""
    with socket.create_connection(address, timeout=timeout) as sock:
        try:
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
        except OSError as e:
            # Refused while we were still sending (EPIPE, ECONNRESET), or closed by the server
            # before our shutdown (ENOTCONN): read what it said.
            if e.errno not in _CLOSED_EARLY:
                raise
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
    if not data.startswith(b"HTTP/1."):
        return None
    return int(data.split(b" ", 2)[1])
