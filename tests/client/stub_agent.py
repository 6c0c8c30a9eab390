"""A small, real HTTP server that answers like the node agent, from canned contract responses.

Why a real server: the client's transports (TCP, unix socket, HTTP framing, dropped
connections, timeouts) are what is under test, so nothing below the client may be faked. The
server is tornado, like the real agent, on its own event loop in a thread (the blocking client
must be able to call it from the test's thread).

Every canned answer is checked against ``agent/openapi.json`` when it is set: the schema for
that operation and status must accept it, so the client is tested against the contract and not
against what a test author imagined. Deliberately broken answers say so (``off_contract=``,
with the reason).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import tornado.httpserver
import tornado.netutil
import tornado.web
from jsonschema import Draft202012Validator  # type: ignore[import-untyped]
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from jupyter_gpu_hotplug.agent import openapi_document
from tests.fixtures.agent import Listening

DOC: Final[dict[str, Any]] = json.loads(openapi_document())
_BASE: Final = "urn:gpu-hotplug-agent-openapi"
_REGISTRY: Final[Registry[Any]] = Registry().with_resource(_BASE, DRAFT202012.create_resource(DOC))
ROUTES: Final = (
    "/healthz",
    "/v1/gpus",
    "/v1/attachments",
    "/v1/attachments/{uuid}",
    "/v1/idle-releases",
    "/v1/queue",
    "/v1/queue/{request_id}",
)
_START_TIMEOUT: Final = 30.0


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = _REGISTRY.resolver(_BASE).lookup(node["$ref"]).contents
    return node


def _absolute_refs(node: Any) -> Any:
    """A schema taken out of the document, its local ``#/...`` references made absolute."""
    if isinstance(node, dict):
        return {
            key: f"{_BASE}{value}"
            if key == "$ref" and value.startswith("#")
            else _absolute_refs(value)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_absolute_refs(item) for item in node]
    return node


def check_against_contract(method: str, route: str, status: int, body: object | None) -> None:
    """Fail unless ``openapi.json`` documents this answer for this operation."""
    responses = DOC["paths"][route][method.lower()]["responses"]
    assert str(status) in responses, f"{method} {route} has no documented {status} response"
    response = _resolve(responses[str(status)])
    if "content" not in response:
        assert body is None, f"{method} {route} {status} has no body in the contract"
        return
    schema = _absolute_refs(response["content"]["application/json"]["schema"])
    validator = Draft202012Validator(
        schema,
        registry=_REGISTRY,
        format_checker=Draft202012Validator.FORMAT_CHECKER,
    )
    errors = [error.message for error in validator.iter_errors(body)]
    assert not errors, f"canned {method} {route} {status} breaks the contract: {errors}"


def check_attach_request(body: object) -> None:
    """Fail unless ``body`` satisfies the contract's ``AttachRequest`` schema."""
    validator = Draft202012Validator(
        {"$ref": f"{_BASE}#/components/schemas/AttachRequest"}, registry=_REGISTRY
    )
    errors = [error.message for error in validator.iter_errors(body)]
    assert not errors, f"attach request {body} breaks the contract: {errors}"


@dataclass(frozen=True)
class Recorded:
    """One request as the stub received it."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class _Canned:
    status: int
    body: bytes
    content_type: str | None


@dataclass
class _Script:
    """What the stub does next, per ``(METHOD, route)``; shared between threads under a lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    answers: dict[tuple[str, str], _Canned] = field(default_factory=dict)
    drops: dict[tuple[str, str], int] = field(default_factory=dict)
    raw: dict[tuple[str, str], bytes] = field(default_factory=dict)
    hangs: set[tuple[str, str]] = field(default_factory=set)
    requests: list[Recorded] = field(default_factory=list)


def _route_of(path: str) -> str | None:
    if path in ROUTES:
        return path
    if path.startswith("/v1/attachments/") and path.count("/") == 3:
        return "/v1/attachments/{uuid}"
    if path.startswith("/v1/queue/") and path.count("/") == 3:
        return "/v1/queue/{request_id}"
    return None


class _Handler(tornado.web.RequestHandler):
    SUPPORTED_METHODS = ("GET", "POST", "DELETE")

    def initialize(self, script: _Script, release: asyncio.Event) -> None:
        self.script = script
        self.release = release

    async def _serve(self) -> None:
        request = self.request
        route = _route_of(request.path)
        key = (request.method or "", route or "")
        with self.script.lock:
            self.script.requests.append(
                Recorded(
                    method=request.method or "",
                    path=request.path,
                    query={k: self.get_query_argument(k) for k in request.query_arguments},
                    headers=dict(request.headers),
                    body=request.body,
                )
            )
            dropping = self.script.drops.get(key, 0)
            if dropping:
                self.script.drops[key] = dropping - 1
            raw = self.script.raw.get(key)
            hang = key in self.script.hangs
            canned = self.script.answers.get(key)
        if dropping:
            self.detach().close()  # the request arrived; the answer never will
            return
        if raw is not None:
            stream = self.detach()
            await stream.write(raw)
            stream.close()
            return
        if hang:
            await self.release.wait()
            return
        if canned is None:
            self.set_status(404)
            self.finish({"error": "not_found", "message": f"stub: no answer for {key}"})
            return
        self.set_status(canned.status)
        if canned.content_type is not None:
            self.set_header("Content-Type", canned.content_type)
        self.finish(canned.body or None)

    async def get(self, *_: str) -> None:
        await self._serve()

    async def post(self, *_: str) -> None:
        await self._serve()

    async def delete(self, *_: str) -> None:
        await self._serve()


class StubAgent(Listening):
    """Answers like the agent on TCP (``tcp_url``), a unix socket (``unix_url``) and, given a
    certificate, on TLS (``https_url``)."""

    def __init__(self, socket_path: Path, *, tls: ssl.SSLContext | None = None) -> None:
        self.socket_path = socket_path
        self._tls = tls
        self.tls_port = 0
        self._script = _Script()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._release: asyncio.Event | None = None
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="stub-agent", daemon=True)
        self.port = 0

    @property
    def https_url(self) -> str:
        assert self._tls is not None, "start the stub with a TLS context"
        return f"https://localhost:{self.tls_port}"

    # --- scripting ---------------------------------------------------------------------------

    def respond(self, method: str, route: str, status: int, body: object | None = None) -> None:
        """Answer ``method route`` with a contract response (checked against the schema)."""
        check_against_contract(method, route, status, body)
        payload = b"" if body is None else json.dumps(body).encode()
        content_type = None if body is None else "application/json"
        with self._script.lock:
            self._script.answers[(method, route)] = _Canned(status, payload, content_type)

    def respond_off_contract(
        self,
        method: str,
        route: str,
        status: int,
        body: bytes,
        *,
        content_type: str,
        off_contract: str,
    ) -> None:
        """Answer with something the contract does not allow; ``off_contract`` says why."""
        assert off_contract, "say why this answer leaves the contract"
        with self._script.lock:
            self._script.answers[(method, route)] = _Canned(status, body, content_type)

    def send_raw(self, method: str, route: str, data: bytes) -> None:
        """Write ``data`` as the whole answer, then close (truncated or broken HTTP)."""
        with self._script.lock:
            self._script.raw[(method, route)] = data

    def drop_next(self, method: str, route: str, times: int = 1) -> None:
        """Close the next ``times`` connections of this operation after reading the request."""
        with self._script.lock:
            self._script.drops[(method, route)] = times

    def hang(self, method: str, route: str) -> None:
        """Never answer this operation (until the stub stops)."""
        with self._script.lock:
            self._script.hangs.add((method, route))

    @property
    def requests(self) -> list[Recorded]:
        with self._script.lock:
            return list(self._script.requests)

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT):
            raise RuntimeError("the stub agent did not start")
        if self._failure is not None:
            raise RuntimeError("the stub agent failed to start") from self._failure

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(_START_TIMEOUT)
        assert not self._thread.is_alive(), "the stub agent did not stop"

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as error:  # reported to start(); the thread has nobody else
            self._failure = error
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._release = asyncio.Event()
        app = tornado.web.Application(
            [(r"/.*", _Handler, {"script": self._script, "release": self._release})]
        )
        servers = [tornado.httpserver.HTTPServer(app)]
        sockets = tornado.netutil.bind_sockets(0, "127.0.0.1")
        servers[0].add_sockets(sockets)
        servers[0].add_socket(tornado.netutil.bind_unix_socket(str(self.socket_path)))
        self.port = sockets[0].getsockname()[1]
        if self._tls is not None:
            servers.append(tornado.httpserver.HTTPServer(app, ssl_options=self._tls))
            tls_sockets = tornado.netutil.bind_sockets(0, "127.0.0.1")
            servers[1].add_sockets(tls_sockets)
            self.tls_port = tls_sockets[0].getsockname()[1]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            self._release.set()
            for server in servers:
                server.stop()
                await server.close_all_connections()


@contextmanager
def running_stub(socket_path: Path, *, tls: ssl.SSLContext | None = None) -> Iterator[StubAgent]:
    stub = StubAgent(socket_path, tls=tls)
    stub.start()
    try:
        yield stub
    finally:
        stub.stop()
        socket_path.unlink(missing_ok=True)
