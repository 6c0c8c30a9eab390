"""Connection limits of the agent's HTTP server (issues 9 and 25): idle connections are closed,
a hoarder of silent connections loses them to the next caller, and only when every connection
is busy is a newcomer refused, with a JSON 503 and Retry-After. (The attacks of issue 25 on
these caps run against a whole agent in ``test_connection_fairness``.)

A real ``LimitedHTTPServer`` on loopback with small limits, driven with raw connections.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import pytest
from tornado import web
from tornado.netutil import bind_sockets

from jupyter_gpu_hotplug.agent.api.limits import DEFAULT_LIMITS, ConnectionLimits, LimitedHTTPServer

GET = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
SLOW = b"GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class _Hello(web.RequestHandler):
    def get(self) -> None:
        self.finish({"ok": True})


class _Slow(web.RequestHandler):
    """Busy until the test releases it."""

    async def get(self) -> None:
        release: asyncio.Event = self.settings["release"]
        await release.wait()
        self.finish({"ok": True})


@pytest.fixture
async def server() -> AsyncIterator[tuple[LimitedHTTPServer, int, asyncio.Event]]:
    release = asyncio.Event()
    limits = ConnectionLimits(idle_timeout=0.5, max_connections=4, max_per_peer=3, reserve=0)
    app = web.Application([("/", _Hello), ("/slow", _Slow)], release=release)
    http = LimitedHTTPServer(app, limits=limits)
    sockets = bind_sockets(0, "127.0.0.1")
    http.add_sockets(sockets)
    try:
        yield http, sockets[0].getsockname()[1], release
    finally:
        release.set()
        http.stop()
        await http.close_all_connections()


async def _open(port: int, request: bytes = b"") -> Connection:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if request:
        writer.write(request)
        await writer.drain()
    return reader, writer


async def _exchange(port: int) -> bytes:
    reader, writer = await _open(port, GET)
    try:
        return await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()


async def _until(condition: Callable[[], bool]) -> None:
    """Until ``condition()`` holds (accepting and reading are asynchronous)."""
    for _ in range(3000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


async def _busy(http: LimitedHTTPServer, port: int, count: int) -> list[Connection]:
    held = [await _open(port, SLOW) for _ in range(count)]
    await _until(
        lambda: len(http._open) == count and all(a.phase == "served" for a in http._open.values())
    )
    return held


async def test_an_idle_connection_is_closed(
    server: tuple[LimitedHTTPServer, int, asyncio.Event],
) -> None:
    _, port, _ = server
    reader, writer = await _open(port)
    # Sends nothing: closed after the idle timeout (before issue 9: held for 300 s).
    assert await asyncio.wait_for(reader.read(), 30) == b""
    writer.close()


async def test_a_hoarder_of_idle_connections_loses_the_oldest(
    server: tuple[LimitedHTTPServer, int, asyncio.Event],
) -> None:
    http, port, _ = server
    http.limits = ConnectionLimits(idle_timeout=60, max_connections=4, max_per_peer=3, reserve=0)
    held = [await _open(port) for _ in range(3)]
    await _until(lambda: len(http._open) == 3)

    assert (await _exchange(port)).startswith(b"HTTP/1.1 200 ")

    oldest_reader, _ = held[0]
    assert await asyncio.wait_for(oldest_reader.read(), 30) == b""
    assert http.evicted == 1 and http.refused == 0
    for _, writer in held:
        writer.close()


async def test_busy_connections_are_kept_and_the_newcomer_gets_json_503(
    server: tuple[LimitedHTTPServer, int, asyncio.Event],
) -> None:
    http, port, release = server
    held = await _busy(http, port, 3)

    refused = await _exchange(port)

    head, _, body = refused.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ")
    assert b"Retry-After: 1" in head
    error = json.loads(body)
    assert (error["error"], error["retryable"], error["retry_after"]) == ("busy", True, 1)
    assert "3 connections of yours are busy" in error["message"]
    release.set()
    for reader, writer in held:  # the busy ones were served to the end
        assert (await asyncio.wait_for(reader.read(), 30)).startswith(b"HTTP/1.1 200 ")
        writer.close()


async def test_total_cap_over_every_peer(
    server: tuple[LimitedHTTPServer, int, asyncio.Event],
) -> None:
    http, port, release = server
    # Every peer may have 10 here, but only 3 may be open in all.
    http.limits = ConnectionLimits(idle_timeout=0.5, max_connections=3, max_per_peer=10, reserve=0)
    held = await _busy(http, port, 3)

    refused = await _exchange(port)

    assert refused.startswith(b"HTTP/1.1 503 ")
    assert b"the agent has 3 busy connections" in refused
    release.set()
    for _, writer in held:
        writer.close()


def test_default_limits_leave_room_and_close_idlers() -> None:
    assert DEFAULT_LIMITS.idle_timeout <= 60
    assert DEFAULT_LIMITS.body_timeout <= 60
    assert DEFAULT_LIMITS.max_per_peer < DEFAULT_LIMITS.max_connections - DEFAULT_LIMITS.reserve
