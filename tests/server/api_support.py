"""Helpers of the REST API tests: calling the API, reading its event stream, kernel seams.

``RegisteredSandboxes`` is the tests' ``c.GPUHotplug.kernel_sandboxes_class``: it maps kernel
ids to processes prepared by the test (probe sandboxes) so that attach and detach can be
tested against a real agent without starting Jupyter kernels; ``local_mode`` configures the
server for that, and ``NoAgent`` points it at a port nobody listens on. ``SseClient`` reads
the stream over a plain socket, so a test decides exactly when the client goes away.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from jupyter_server.serverapp import ServerApp
from tornado.httpclient import HTTPResponse
from traitlets.config import Config

from jupyter_gpu_hotplug.client import AsyncAgentClient, Gpu
from jupyter_gpu_hotplug.server.errors import KernelNotFound, KernelNotSandboxed
from jupyter_gpu_hotplug.server.handlers import MANAGER_SETTING
from jupyter_gpu_hotplug.server.kernel_sandboxes import KernelSandboxes
from jupyter_gpu_hotplug.server.manager import HotplugManager
from jupyter_gpu_hotplug.server.validation import KernelId
from tests.fixtures.agent import free_tcp_port
from tests.fixtures.waiting import DEADLINE

Fetch = Callable[..., Awaitable[HTTPResponse]]


class RegisteredSandboxes(KernelSandboxes):
    """Kernel ids the test registered, each mapped to a pid (``None``: not sandboxed)."""

    def __init__(self, *, kernel_manager: Any) -> None:
        super().__init__(kernel_manager=kernel_manager)
        self.pids: dict[str, int | None] = {}

    def register(self, kernel_id: str, pid: int | None) -> KernelId:
        self.pids[kernel_id] = pid
        return KernelId(kernel_id)

    def kernel_ids(self) -> list[KernelId]:
        return [KernelId(kernel_id) for kernel_id in self.pids]

    def pid_of(self, kernel_id: KernelId) -> int:
        if kernel_id not in self.pids:
            raise KernelNotFound(kernel_id)
        pid = self.pids[kernel_id]
        if pid is None:
            raise KernelNotSandboxed(kernel_id)
        return pid


def local_mode(
    config: Config, *, agent_url: str, token_path: Path | None, metrics_interval: float
) -> Config:
    """``config`` in local mode against ``agent_url``, kernels mapped by ``RegisteredSandboxes``."""
    settings = config.GPUHotplug
    settings.agent_url = agent_url
    settings.token_path = "" if token_path is None else str(token_path)
    settings.mode = "local"
    settings.metrics_interval = metrics_interval
    settings.kernel_sandboxes_class = RegisteredSandboxes
    return config


class NoAgent:
    """Base of test classes run with no agent: its URL is a free port nobody listens on, and
    there is no token (overrides the module's ``agent_url`` and ``token_path`` fixtures)."""

    @pytest.fixture
    def agent_url(self) -> str:
        return f"http://127.0.0.1:{free_tcp_port()}"

    @pytest.fixture
    def token_path(self) -> None:
        return None


class BrokenClient(AsyncAgentClient):
    """An agent client with a bug: for the "never a traceback" tests."""

    async def gpus(self) -> tuple[Gpu, ...]:
        raise RuntimeError("a bug in the client")


def manager_of(server: ServerApp) -> HotplugManager:
    manager = server.web_app.settings[MANAGER_SETTING]
    assert isinstance(manager, HotplugManager)
    return manager


def sandboxes_of(server: ServerApp) -> RegisteredSandboxes:
    sandboxes = manager_of(server).sandboxes
    assert isinstance(sandboxes, RegisteredSandboxes)
    return sandboxes


@dataclass(frozen=True)
class Reply:
    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def error(self, status: int, code: str) -> dict[str, Any]:
        """The JSON error body, after checking that the reply is ``status`` with ``code``."""
        assert self.status == status, self.body
        body: dict[str, Any] = self.json()
        assert body["error"] == code, body
        return body


async def call(
    fetch: Fetch,
    method: str,
    route: str,
    body: object = None,
    *,
    raw: bytes | None = None,
    params: Mapping[str, str] | None = None,
) -> Reply:
    """``method gpu-hotplug/api/<route>``; any status is returned, not raised."""
    payload = raw if raw is not None else None if body is None else json.dumps(body).encode()
    if method == "POST" and payload is None:
        payload = b""
    response = await fetch(
        "gpu-hotplug",
        "api",
        route,
        method=method,
        body=payload,
        params=dict(params or {}),
        raise_error=False,
        allow_nonstandard_methods=True,
    )
    return Reply(response.code, dict(response.headers), response.body or b"")


@dataclass(frozen=True)
class Event:
    """One server-sent event."""

    kind: str
    data: Any


def upload(url: str, size: int, authorization: str | None) -> tuple[int, dict[str, Any]]:
    """``POST`` ``size`` bytes to ``url`` with ``urllib`` (which sends the whole body before it
    reads the answer, as most clients do); the status and JSON body. Blocking."""
    request = urllib.request.Request(url, data=b"x" * size, method="POST")
    request.add_header("Content-Type", "application/json")
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=DEADLINE) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


async def raw_exchange(port: int, request: bytes) -> tuple[int, dict[str, Any]]:
    """Send ``request`` as it is to the server on ``port``; the status and JSON body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), DEADLINE)
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), DEADLINE)
    finally:
        writer.close()
    return int(lines[0].split()[1]), json.loads(body)


class SseClient:
    """A client of the event stream over a plain TCP connection.

    HTTP/1.0, so the server sends the body as it comes (no chunked framing) and ends it by
    closing the connection.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        status: int,
        headers: dict[str, str],
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.status = status
        self.headers = headers

    @classmethod
    async def connect(cls, port: int, path: str, *, token: str) -> SseClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: token {token}\r\nAccept: text/event-stream\r\n\r\n".encode()
        )
        await writer.drain()
        async with asyncio.timeout(DEADLINE):
            status_line = (await reader.readline()).decode()
            headers = {}
            while (line := (await reader.readline()).decode().strip()) != "":
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        return cls(reader, writer, int(status_line.split()[1]), headers)

    async def body(self) -> bytes:
        """The rest of the answer, until the server closes the connection."""
        async with asyncio.timeout(DEADLINE):
            return await self._reader.read()

    async def next_event(self) -> Event | None:
        """The next event (``retry:`` lines skipped); ``None`` when the server ended the stream."""
        kind, data = "message", list[str]()
        async with asyncio.timeout(DEADLINE):
            while True:
                raw = await self._reader.readline()
                if not raw:
                    return None
                line = raw.decode().rstrip("\n")
                if line == "":
                    if data:
                        return Event(kind, json.loads("\n".join(data)))
                    kind = "message"
                    continue
                name, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if name == "event":
                    kind = value
                elif name == "data":
                    data.append(value)

    async def events_until(self, done: Callable[[Event], bool]) -> list[Event]:
        """Events up to and including the first for which ``done`` is true."""
        seen: list[Event] = []
        while True:
            event = await self.next_event()
            if event is None:
                pytest.fail(f"the stream ended before the expected event; got {seen}")
            seen.append(event)
            if done(event):
                return seen

    async def close(self) -> None:
        self._writer.close()
        await self._writer.wait_closed()


def stream_path(base_url: str, kernel_id: str | None = None) -> str:
    path = f"{base_url.rstrip('/')}/gpu-hotplug/api/stream"
    return path if kernel_id is None else f"{path}?kernel_id={kernel_id}"


def progress_states(events: list[Event], request_id: str) -> list[str]:
    return [
        e.data["state"]
        for e in events
        if e.kind == "progress" and e.data["request_id"] == request_id
    ]
