"""Fuzzing tier, the agent's connections (issue 25): hostile clients that try to take the agent
from everyone else — by holding connections, by sending bodies slowly, by trickling headers —
against a real agent subprocess, while a well-behaved token holder keeps calling.

What must hold: the well-behaved caller is answered 200 every time; a hostile connection is
answered with a documented 4xx, or ``503 busy`` with ``Retry-After`` and ``retry_after``, or
closed — never any other 5xx; and the agent still serves afterwards.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
from collections.abc import Iterator

import pytest

from jupyter_gpu_hotplug.agent.api.limits import DEFAULT_LIMITS
from jupyter_gpu_hotplug.agent.settings import TcpAddress
from tests.agent.api_harness import ApiClient
from tests.fixtures.agent import LocalAgent, LocalAgentFactory
from tests.fixtures.requirements import needs_root
from tests.fixtures.waiting import DEADLINE

pytestmark = [*needs_root, pytest.mark.fuzz]

SOURCES = [f"127.0.0.{n}" for n in range(2, 10)]


def _post(authorization: str | None, length: int = 100) -> bytes:
    auth = f"Authorization: {authorization}\r\n" if authorization else ""
    return (
        f"POST /v1/attachments HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n{{"
    ).encode()


HOSTILE: dict[str, tuple[bool, bytes]] = {
    # name: (authenticated?, what it sends and then never finishes)
    "silent": (False, b""),
    "slow-headers": (False, b"GET /v1/gpus HTTP/1.1\r\nHost: x\r\nX-Slow: a"),
    "slow-body-anonymous": (False, _post(None)),
    "slow-body-token": (True, b""),  # filled in with the agent's token
}


@pytest.fixture
def agent(local_agent_factory: LocalAgentFactory) -> LocalAgent:
    return local_agent_factory(simulate=2)


@contextlib.contextmanager
def _hostile(agent: LocalAgent, kind: str) -> Iterator[list[socket.socket]]:
    """``max_connections`` connections of ``kind`` from 127.0.0.2-9, held open."""
    authenticated, request = HOSTILE[kind]
    if authenticated:
        request = _post(f"Bearer {agent.token}")
    held: list[socket.socket] = []
    try:
        for source in SOURCES:
            for _ in range(DEFAULT_LIMITS.max_connections // len(SOURCES)):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(sock)
                sock.bind((source, 0))
                sock.connect(("127.0.0.1", agent.port))
                if request:
                    sock.sendall(request)
        yield held
    finally:
        for sock in held:
            sock.close()


def _answers(held: list[socket.socket]) -> list[int | None]:
    """What each hostile connection got so far: a status, or None (closed, or nothing yet)."""
    statuses: list[int | None] = []
    for sock in select.select(held, [], [], 0)[0]:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            data = b""
        if not data.startswith(b"HTTP/1.1 "):
            statuses.append(None)
            continue
        status = int(data.split(b" ", 2)[1])
        statuses.append(status)
        if status == 503:
            head, _, body = data.partition(b"\r\n\r\n")
            assert b"\r\nRetry-After: " in head, data
            error = json.loads(body)
            assert (error["error"], error["retry_after"]) == ("busy", 1), data
    return statuses


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_hostile_connections_leave_a_token_holder_served(agent: LocalAgent, kind: str) -> None:
    caller = ApiClient(TcpAddress("127.0.0.1", agent.port), agent.token, timeout=DEADLINE)
    with _hostile(agent, kind) as held:
        for _ in range(20):
            answer = caller.get("/v1/gpus")
            assert answer.status == 200, answer.body

        for status in _answers(held):
            assert status is None or 400 <= status < 500 or status == 503, (kind, status)
    assert caller.get("/readyz").status == 200
