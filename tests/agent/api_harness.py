"""An agent served for real (tornado, TCP and a unix socket) over the in-memory host fakes, and a
small HTTP client that checks every answer against ``openapi.json``.

The agent runs on its own event loop in a background thread, so tests (including hypothesis
ones) are plain synchronous code, exactly as a client would be. Every response that goes through
``ApiClient.call`` is checked: its status must be documented for the route and method, and a
JSON body must match the schema documented for that status — so each test that talks to the API
also proves that the server keeps to its contract.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import re
import socket
import threading
from collections.abc import Coroutine, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from jsonschema import Draft202012Validator  # type: ignore[import-untyped]
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from jupyter_gpu_hotplug.agent import openapi_document
from jupyter_gpu_hotplug.agent.core.workers import Workers
from jupyter_gpu_hotplug.agent.local.allocator import LedgerAllocator
from jupyter_gpu_hotplug.agent.local.backend import LocalBackend
from jupyter_gpu_hotplug.agent.local.identity import LocalIdentity
from jupyter_gpu_hotplug.agent.local.ledger import Ledger
from jupyter_gpu_hotplug.agent.runtime import Agent, Components
from jupyter_gpu_hotplug.agent.settings import AgentSettings, TcpAddress, UnixAddress

from .fakes import FakeHost, FakeInjector, FakeInventory, FakeResolver, fake_gpus

_T = TypeVar("_T")
TOKEN = "test-token-0123456789abcdefghijklmnop"
DOC: dict[str, Any] = json.loads(openapi_document())
_BASE = "urn:agent-openapi"
_REGISTRY: Registry[Any] = Registry().with_resource(_BASE, DRAFT202012.create_resource(DOC))
_TEMPLATES = [
    (re.compile(r"/v1/attachments/[^/]+"), "/v1/attachments/{uuid}"),
    (re.compile(r"/v1/attachments"), "/v1/attachments"),
    (re.compile(r"/v1/gpus"), "/v1/gpus"),
    (re.compile(r"/v1/idle-releases"), "/v1/idle-releases"),
    (re.compile(r"/v1/queue/[^/]+"), "/v1/queue/{request_id}"),
    (re.compile(r"/v1/queue"), "/v1/queue"),
    (re.compile(r"/v1/openapi\.json"), "/v1/openapi.json"),
    (re.compile(r"/healthz"), "/healthz"),
    (re.compile(r"/readyz"), "/readyz"),
    (re.compile(r"/metrics"), "/metrics"),
]


def template_of(path: str) -> str | None:
    """The documented path a request path matches (None: not an API route)."""
    bare = path.partition("?")[0]
    return next((t for pattern, t in _TEMPLATES if pattern.fullmatch(bare)), None)


def _escape(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")


def _resolve(node: dict[str, Any], pointer: str) -> tuple[dict[str, Any], str]:
    """Follow ``$ref``s from ``node`` (at JSON pointer ``pointer`` in the document)."""
    while "$ref" in node:
        pointer = node["$ref"]
        target: Any = DOC
        for part in pointer.removeprefix("#/").split("/"):
            target = target[part.replace("~1", "/").replace("~0", "~")]
        node = target
    return node, pointer


def documented_response(
    template: str, method: str, status: int
) -> tuple[dict[str, Any], str] | None:
    """The response object documented for this answer and its JSON pointer, or None."""
    operation = DOC["paths"][template].get(method.lower())
    if operation is None or str(status) not in operation["responses"]:
        return None
    pointer = f"#/paths/{_escape(template)}/{method.lower()}/responses/{status}"
    return _resolve(operation["responses"][str(status)], pointer)


@dataclass(frozen=True)
class Response:
    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def error(self) -> str | None:
        return self.json().get("error") if self.status >= 400 else None


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(str(self._path))
        self.sock = sock


class ContractViolation(AssertionError):
    """The server answered something ``openapi.json`` does not allow."""


@dataclass(frozen=True)
class ApiClient:
    """Plain HTTP to one agent address, checking every answer against the contract."""

    address: TcpAddress | UnixAddress
    token: str | None = None
    timeout: float = 30.0

    def with_token(self, token: str | None) -> ApiClient:
        return ApiClient(self.address, token, self.timeout)

    def _connection(self) -> http.client.HTTPConnection:
        if isinstance(self.address, UnixAddress):
            return UnixConnection(self.address.path, self.timeout)
        return http.client.HTTPConnection(
            self.address.host, self.address.port, timeout=self.timeout
        )

    def call(
        self,
        method: str,
        path: str,
        body: object = None,
        *,
        raw: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        check: bool = True,
    ) -> Response:
        sent = dict(headers or {})
        if self.token is not None:
            sent.setdefault("Authorization", f"Bearer {self.token}")
        payload = raw if raw is not None else None if body is None else json.dumps(body).encode()
        if payload is not None:
            sent.setdefault("Content-Type", "application/json")
        connection = self._connection()
        try:
            connection.request(method, path, body=payload, headers=sent)
            reply = connection.getresponse()
            response = Response(reply.status, dict(reply.getheaders()), reply.read())
        finally:
            connection.close()
        if check:
            check_contract(method, path, response)
        return response

    def get(self, path: str, **kwargs: Any) -> Response:
        return self.call("GET", path, **kwargs)

    def post(self, path: str, body: object = None, **kwargs: Any) -> Response:
        return self.call("POST", path, body, **kwargs)

    def delete(self, path: str, **kwargs: Any) -> Response:
        return self.call("DELETE", path, **kwargs)


def check_contract(method: str, path: str, response: Response) -> None:
    """Raise ``ContractViolation`` unless ``openapi.json`` documents this answer."""
    template = template_of(path)
    if template is None or method.lower() not in DOC["paths"][template]:
        # Not an API operation: only the shape of the error is promised.
        if response.status not in (404, 405) or response.error not in (
            "not_found",
            "invalid_request",
        ):
            raise ContractViolation(f"{method} {path} -> {response.status} {response.body[:200]!r}")
        return
    found = documented_response(template, method, response.status)
    if found is None:
        raise ContractViolation(
            f"{method} {template} answered {response.status}, which openapi.json does not "
            f"document: {response.body[:300]!r}"
        )
    documented, pointer = found
    content = documented.get("content")
    if content is None:
        if response.body:
            raise ContractViolation(f"{method} {template} {response.status} has a body")
        return
    if "application/json" not in content:
        return
    schema_pointer = f"{pointer}/content/{_escape('application/json')}/schema"
    validator = Draft202012Validator({"$ref": f"{_BASE}{schema_pointer}"}, registry=_REGISTRY)
    errors = sorted(validator.iter_errors(response.json()), key=str)
    if errors:
        raise ContractViolation(
            f"{method} {template} {response.status} body does not match its schema: {errors[0]}"
        )
    if response.status == 500 and response.headers.get("X-Request-Id") != response.json().get(
        "request_id"
    ):
        raise ContractViolation("a 500's request_id must be the X-Request-Id of the response")


@dataclass
class ServedAgent:
    """An agent running over fakes; ``tcp``/``unix`` clients reach it."""

    agent: Agent
    host: FakeHost
    injector: FakeInjector
    inventory: FakeInventory
    ledger: Ledger
    tcp: ApiClient
    unix: ApiClient
    loop: asyncio.AbstractEventLoop
    metrics: ApiClient | None = None
    """The metrics address of its own, when the agent was given one."""

    def run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coroutine`` on the agent's event loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=60)

    def sample(self, name: str, **labels: str) -> float:
        value = self.agent.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


@dataclass
class _LoopThread:
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=60)


def _start_loop() -> _LoopThread:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="agent-loop", daemon=True)
    thread.start()
    return _LoopThread(loop, thread)


@contextlib.contextmanager
def serve_agent(
    tmp_path: Path, *, gpus: int = 4, max_gpus: int = 8, metrics_listen: bool = False
) -> Iterator[ServedAgent]:
    """Start an agent over fakes, yield it, stop everything (``metrics_listen``: /metrics on a
    TCP port of its own, reached through ``ServedAgent.metrics``)."""
    host = FakeHost()
    resolver = FakeResolver(host)
    injector = FakeInjector(host)
    inventory = FakeInventory(fake_gpus(gpus))
    ledger = Ledger.open(tmp_path / "state")
    socket_path = tmp_path / "agent.sock"
    settings = AgentSettings(
        listen=(TcpAddress("127.0.0.1", 0), UnixAddress(socket_path)),
        state_dir=tmp_path / "state",
        max_gpus_per_target=max_gpus,
        simulate=0,
        reconcile_interval=0,
        metrics_listen=(TcpAddress("127.0.0.1", 0),) if metrics_listen else (),
    )
    workers = Workers(host_threads=8)
    backend = LocalBackend(
        ledger=ledger,
        allocator=LedgerAllocator(ledger, workers),
        resolver=resolver,
        identity=LocalIdentity(TOKEN, token_path=tmp_path / "token", resolver=resolver),
    )
    components = Components(
        settings=settings,
        backend=backend,
        inventory=inventory,
        injector=injector,
        workers=workers,
        closers=[backend.close],
    )
    runner = _start_loop()

    async def create_and_start() -> Agent:
        agent = Agent(components)
        await agent.start()
        return agent

    try:
        agent: Agent = runner.run(create_and_start())
        try:
            tcp_address = next(
                b.actual for b in agent.server.bound if isinstance(b.actual, TcpAddress)
            )
            yield ServedAgent(
                agent=agent,
                host=host,
                injector=injector,
                inventory=inventory,
                ledger=ledger,
                tcp=ApiClient(tcp_address, TOKEN),
                unix=ApiClient(UnixAddress(socket_path)),
                loop=runner.loop,
                metrics=None
                if agent.metrics_server is None
                else ApiClient(agent.metrics_server.bound[0].actual, TOKEN),
            )
        finally:
            runner.run(agent.stop())
    finally:
        runner.loop.call_soon_threadsafe(runner.loop.stop)
        runner.thread.join(timeout=30)
        runner.loop.close()


def self_in(served: ServedAgent, container_name: str) -> None:
    """Make this test process (the unix-socket peer) a process of ``container_name``."""
    served.host.spawn(os.getpid(), container_name)
