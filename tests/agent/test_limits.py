"""Connection limits of the agent's HTTP server (issue 9): idle connections are closed, and
the caps on open connections refuse the surplus with a JSON 503 while others are served.

A real ``LimitedHTTPServer`` on loopback with small limits, driven with raw sockets.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from tornado import web
from tornado.netutil import bind_sockets

from jupyter_gpu_hotplug.agent.limits import DEFAULT_LIMITS, ConnectionLimits, LimitedHTTPServer

GET = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


class _Hello(web.RequestHandler):
    def get(self) -> None:
        self.finish({"ok": True})


@pytest.fixture
async def server() -> AsyncIterator[tuple[LimitedHTTPServer, int]]:
    limits = ConnectionLimits(idle_timeout=0.5, max_connections=4, max_per_peer=3)
    http = LimitedHTTPServer(web.Application([("/", _Hello)]), limits=limits)
    sockets = bind_sockets(0, "127.0.0.1")
    http.add_sockets(sockets)
    try:
        yield http, sockets[0].getsockname()[1]
    finally:
        http.stop()
        await http.close_all_connections()


async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def _exchange(port: int) -> bytes:
    reader, writer = await _open(port)
    writer.write(GET)
    try:
        return await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()


async def _settle(http: LimitedHTTPServer, count: int) -> None:
    """Until the server has accepted ``count`` connections (accepting is asynchronous)."""
    for _ in range(1000):
        if len(http._connections) + http.refused >= count:
            return
        await asyncio.sleep(0.01)


async def test_an_idle_connection_is_closed(server: tuple[LimitedHTTPServer, int]) -> None:
    _, port = server
    reader, writer = await _open(port)
    # Sends nothing: closed after the idle timeout (before issue 9: held for 300 s).
    assert await asyncio.wait_for(reader.read(), 30) == b""
    writer.close()


async def test_per_peer_cap_refuses_with_json_503(server: tuple[LimitedHTTPServer, int]) -> None:
    http, port = server
    held = [await _open(port) for _ in range(3)]
    await _settle(http, 3)

    refused = await _exchange(port)

    head, _, body = refused.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ")
    assert b"Retry-After: 1" in head
    error = json.loads(body)
    assert (error["error"], error["retryable"]) == ("busy", True)
    assert "3 connections of yours" in error["message"]
    for _, writer in held:
        writer.close()


async def test_room_comes_back_when_connections_close(
    server: tuple[LimitedHTTPServer, int],
) -> None:
    http, port = server
    held = [await _open(port) for _ in range(3)]
    await _settle(http, 3)
    for _, writer in held:
        writer.close()
    for _ in range(1000):
        if not http._connections:
            break
        await asyncio.sleep(0.01)

    assert (await _exchange(port)).startswith(b"HTTP/1.1 200 ")


async def test_total_cap_over_every_peer(server: tuple[LimitedHTTPServer, int]) -> None:
    http, port = server
    # Every peer may have 10 here, but only 3 may be open in all.
    http.limits = ConnectionLimits(idle_timeout=0.5, max_connections=3, max_per_peer=10)
    held = [await _open(port) for _ in range(3)]
    await _settle(http, 3)

    refused = await _exchange(port)

    assert refused.startswith(b"HTTP/1.1 503 ")
    assert b"the agent has 3 connections open" in refused
    for _, writer in held:
        writer.close()


def test_default_limits_leave_room_and_close_idlers() -> None:
    assert DEFAULT_LIMITS.idle_timeout <= 60
    assert DEFAULT_LIMITS.max_per_peer < DEFAULT_LIMITS.max_connections
