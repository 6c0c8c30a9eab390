"""The HTTP kit both APIs' handlers are built with: how a request body is read and refused.

Why it exists: the agent's API (``agent/api``) and the server extension's (``server``) are two
tornado applications that must read bodies the same way — and must never import each other. What
they share of HTTP lives here, one floor above the wire contract (``_structs``, which knows no web
framework) and below both APIs (import-linter holds it to that):

- **bounded bodies** (``BoundedBody``): a body is streamed in and refused past the API's limit,
  from its ``Content-Length`` before a byte is read, or (chunked) as the chunks add up;
- **strict JSON** (``load_request_json``): one RFC 8259 document, UTF-8, no duplicate keys, and
  any hostile body a ``WireFormatError`` (a 400), never a 5xx;
- **the lingering close** (``refuse_unread``, issue 23): both APIs refuse some requests as soon as
  their headers arrive — a ``Content-Length`` above the limit (413), missing or wrong credentials
  (401, the agent) — so that nothing is read or buffered for them. tornado then answers and
  *closes* the connection with the body still arriving, and a kernel that closes a socket with
  unread input sends a reset: an ordinary client that sends its whole body before it reads
  (``urllib``, ``requests``) sees "connection reset" instead of the answer. nginx's remedy is the
  lingering close, done here the same way: take the connection from tornado
  (``RequestHandler.detach``, allowed while the headers are being handled), write the answer
  with ``Connection: close``, shut the sending side (the client sees the end of the answer), then
  read and drop what the client still sends — at most ``LINGER_MAX_BYTES`` and
  ``LINGER_SECONDS`` — and close. The answer is written by hand because tornado's writer is gone
  once the connection is detached; it is the same status, headers and JSON body the handler's
  own error path would write;
- **the streamed-body plumbing** (``StreamedBodyHandler``), the base both APIs' body-reading
  handlers derive from, so that the three above are wired once;
- **refusals logged as one line** (``RefusalLogging``): both APIs refuse through exceptions,
  which tornado would log as "Uncaught exception" with a traceback; each API says which of its
  exceptions are refusals, and only a bug keeps the full report;
- **``Allow``** (``allow_header``): the methods a 405 lists.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import ClassVar, Final, NamedTuple, TypeAlias

from tornado import iostream, web

from ._structs import WireFormatError

__all__ = [
    "LINGER_MAX_BYTES",
    "LINGER_SECONDS",
    "BoundedBody",
    "ExcInfo",
    "Refusal",
    "RefusalLogging",
    "StreamedBodyHandler",
    "allow_header",
    "implements",
    "load_request_json",
    "response_bytes",
]

log = logging.getLogger(__name__)

# --- strict JSON ----------------------------------------------------------------------------------


def _reject_constant(name: str) -> object:
    # json accepts NaN and Infinity by default; JSON (RFC 8259) does not.
    raise WireFormatError(f"the request body contains {name}, which JSON does not allow")


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    # Last-wins (json's default) would let two readers of one body disagree on its meaning.
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            shown = json.dumps(key)
            raise WireFormatError(
                f"field {shown if len(shown) <= 40 else shown[:37] + '...'} appears twice in "
                "the request body",
                field=key if len(key) <= 64 else f"{key[:61]}...",
            )
        result[key] = value
    return result


def load_request_json(body: bytes, *, max_body: int) -> object:
    """The one JSON value of a request ``body``, read strictly, or ``WireFormatError``.

    Strict: at most ``max_body`` bytes, UTF-8, RFC 8259 (no NaN/Infinity), no duplicate keys,
    integers of at most ``sys.get_int_max_str_digits()`` digits and nesting Python can parse —
    a hostile body yields this error, never a ``ValueError`` or ``RecursionError`` (a 5xx).
    """
    if len(body) > max_body:
        raise WireFormatError(f"the request body is {len(body)} bytes; the limit is {max_body}")
    if not body.strip():
        raise WireFormatError('the request body is empty; send a JSON object such as {"count": 1}')
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise WireFormatError(f"the request body is not UTF-8 ({e.reason})") from e
    try:
        return json.loads(
            text, parse_constant=_reject_constant, object_pairs_hook=_reject_duplicates
        )
    except WireFormatError:
        raise
    except json.JSONDecodeError as e:
        raise WireFormatError(
            f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from e
    except ValueError as e:
        # The only other ValueError: int() refuses more than sys.get_int_max_str_digits() digits.
        raise WireFormatError("the request body has a number with too many digits") from e
    except RecursionError as e:
        raise WireFormatError("the request body is nested too deeply") from e


# --- bounded bodies -------------------------------------------------------------------------------


class BoundedBody:
    """A request body gathered as it arrives, refused once it is known to exceed ``limit``.

    Both HTTP APIs stream their bodies through one: ``declare`` checks ``Content-Length``
    when the headers arrive (nothing is read of a body declared too large), ``add`` counts
    chunks as they come and drops everything past the limit (a chunked body declares nothing).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.too_large = False
        self._data = bytearray()

    def declare(self, content_length: str | None) -> bool:
        """Whether the declared length is unacceptable (over the limit, or not a number)."""
        if content_length is not None and (
            not content_length.isdigit() or int(content_length) > self.limit
        ):
            self.too_large = True
        return self.too_large

    def add(self, chunk: bytes) -> None:
        if self.too_large or len(self._data) + len(chunk) > self.limit:
            self.too_large = True
            self._data.clear()
            return
        self._data.extend(chunk)

    def value(self) -> bytes:
        """The whole body (meaningful only when not ``too_large``)."""
        return bytes(self._data)


# --- the lingering close --------------------------------------------------------------------------

LINGER_MAX_BYTES: Final = 64 * 1024 * 1024
"""After refusing a request whose body it has not read (413, 401), an HTTP API reads and drops
at most this much more of it before closing, so that a client still sending reads the answer
instead of a reset (nginx's lingering close). Both APIs, the agent's and the server's."""
LINGER_SECONDS: Final = 10.0
"""...and for at most this long."""

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


# --- the methods a handler serves -----------------------------------------------------------------

HTTP_METHODS: Final = ("GET", "HEAD", "POST", "DELETE", "PATCH", "PUT", "OPTIONS")
"""The methods a handler may implement (tornado's ``SUPPORTED_METHODS``)."""


def implements(handler: type, method: str) -> bool:
    """Whether ``handler`` serves ``method``: its function for it is not ``RequestHandler``'s
    (which answers every method with 405)."""
    name = method.lower()
    return getattr(handler, name, None) is not getattr(web.RequestHandler, name, None)


def allow_header(handler: type) -> str:
    """The ``Allow`` header of a 405 answer from ``handler`` (RFC 9110 §15.5.6: a 405 must
    list the methods the resource supports): the methods it ``implements``."""
    return ", ".join(method for method in HTTP_METHODS if implements(handler, method))


# --- the streamed-body plumbing -------------------------------------------------------------------


ExcInfo: TypeAlias = tuple[type[BaseException] | None, BaseException | None, TracebackType | None]
"""What tornado hands ``log_exception``: ``sys.exc_info()``'s three."""


class RefusalLogging(web.RequestHandler):
    """Logs what a handler raised as its API means it: a refusal (bad input, a busy GPU, a
    caller turned away: an answer the API gives on purpose) as one line, a bug with its
    traceback. An API's base handler derives from it and says in ``log_refusal`` which of its
    exceptions are refusals and how its log names them."""

    def log_refusal(self, error: BaseException) -> bool:
        """Log ``error`` as one line if this API refuses with it, and say whether it did;
        False: a bug, for ``log_bug``."""
        return False

    def log_bug(self, exc_info: ExcInfo) -> None:
        """Log an exception that is no refusal: tornado's full report unless the API says
        otherwise."""
        super().log_exception(*exc_info)

    def log_exception(
        self,
        typ: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if value is None or not self.log_refusal(value):
            self.log_bug((typ, value, tb))


class Refusal(NamedTuple):
    """An API's answer to a request refused at its headers, written by hand (lingering)."""

    status: int
    body: bytes
    headers: Mapping[str, str]


@web.stream_request_body
class StreamedBodyHandler(web.RequestHandler):
    """The base of a handler whose body is streamed in, bounded, and refused unread.

    An API's base handler derives from it, sets ``max_body`` and ``too_large`` (its own 413
    error, made from the limit) and says in ``unread_refusal`` how it answers one of its errors
    by hand; its ``prepare`` calls ``screen`` first. The verbs then read ``body``.
    """

    max_body: ClassVar[int]
    """The largest body this API accepts, in bytes."""
    too_large: ClassVar[type[Exception]]
    """This API's 413 error, made from ``max_body``."""

    _body: BoundedBody

    def unread_refusal(self, error: Exception) -> Refusal | None:
        """How this API answers ``error`` raised at the headers with the body unread (logging
        and counting it as it does), or None to let it take tornado's usual path (a bug)."""
        return None

    async def screen(self, checks: Callable[[], Awaitable[None]] | None = None) -> bool:
        """At the headers, before the body: run the API's own ``checks`` (credentials), then
        refuse a declared ``Content-Length`` over ``max_body``. A refusal with a body still to
        come is answered now, lingering (``refuse_unread``): True, the handler is finished; one
        without a body is raised as usual. False: go on, read the body."""
        self._body = BoundedBody(self.max_body)
        try:
            if checks is not None:
                await checks()
            if self._body.declare(self.request.headers.get("Content-Length")):
                raise self.too_large(self.max_body)
        except Exception as e:
            refusal = self.unread_refusal(e) if has_unread_body(self) else None
            if refusal is None:
                raise
            refuse_unread(self, refusal.status, refusal.body, refusal.headers)
            return True
        return False

    def data_received(self, chunk: bytes) -> None:
        self._body.add(chunk)

    @property
    def body(self) -> bytes:
        """The request body, whole; ``too_large`` if it grew past the limit (chunked uploads)."""
        if self._body.too_large:
            raise self.too_large(self.max_body)
        return self._body.value()
