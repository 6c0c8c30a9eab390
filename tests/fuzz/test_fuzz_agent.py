"""Fuzzing tier, agent: a real agent subprocess under hand-written hostile requests (issue 9);
the requests generated from ``openapi.json`` are schemathesis' (``test_schemathesis_agent``).

Against ``jupyter gpu-hotplug agent --simulate 4`` (TCP with the token, and the unix socket)
and a real victim sandbox: every answer must be documented in ``openapi.json`` with a body
matching its schema, never a 5xx; and a refused request (any 4xx) must leave the ledger
(``GET /v1/gpus``) and the victim's device cgroups and ``/dev`` exactly as they were.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_hotplug.agent.settings import TcpAddress, UnixAddress
from jupyter_gpu_hotplug.linux import cgroups
from tests.agent.api_harness import ApiClient, Response
from tests.fixtures.agent import LocalAgent, LocalAgentFactory
from tests.fixtures.requirements import needs_root
from tests.fixtures.sandbox import SandboxFactory, SandboxProbe

from .host_view import HostView
from .hostile import HOSTILE_BODIES, exchange, raw_requests

pytestmark = [*needs_root, pytest.mark.fuzz]


@dataclass
class Fuzzed:
    agent: LocalAgent
    victim: SandboxProbe
    v1_root: Path | None

    def client(self, credentials: str) -> ApiClient:
        transport, _, token = credentials.partition("-")
        address: TcpAddress | UnixAddress = (
            TcpAddress("127.0.0.1", self.agent.port)
            if transport == "tcp"
            else UnixAddress(self.agent.socket_path)
        )
        secret = {"token": self.agent.token, "none": None, "wrong": "w" * 43}[token]
        return ApiClient(address, secret)

    def books(self) -> Any:
        return self.client("tcp-token").get("/v1/gpus").json()

    def host(self) -> HostView:
        return HostView.of(self.victim.sandbox, v1_root=self.v1_root)


@pytest.fixture
def fuzzed(
    local_agent_factory: LocalAgentFactory, sandbox_factory: SandboxFactory
) -> Iterator[Fuzzed]:
    agent = local_agent_factory(simulate=4)
    found = cgroups.discover()
    yield Fuzzed(
        agent, sandbox_factory(), None if found.devices_v1 is None else found.devices_v1.mount_point
    )


def _send(
    fuzzed: Fuzzed, credentials: str, method: str, target: str, body: bytes | None
) -> Response:
    # ``call`` checks the answer against openapi.json: documented status, schema-valid body.
    return fuzzed.client(credentials).call(method, target, raw=body)


def _refused_changes_nothing(fuzzed: Fuzzed, send: Any) -> Response:
    books, host = fuzzed.books(), fuzzed.host()
    response: Response = send()
    assert response.status < 500, response.body
    if response.status >= 400:
        assert fuzzed.books() == books, response.body
        assert fuzzed.host() == host, response.body
    return response


def test_hostile_bodies_are_400_and_change_nothing(fuzzed: Fuzzed) -> None:
    for case, body in HOSTILE_BODIES:
        for credentials in ("tcp-token", "unix-none"):
            response = _refused_changes_nothing(
                fuzzed,
                lambda c=credentials, b=body: _send(fuzzed, c, "POST", "/v1/attachments", b),
            )
            assert (response.status, response.error) == (400, "invalid_request"), case


def test_hostile_http_is_never_a_5xx(fuzzed: Fuzzed) -> None:
    address = ("127.0.0.1", fuzzed.agent.port)
    books, host = fuzzed.books(), fuzzed.host()
    for case, request in raw_requests("/v1/attachments", f"Bearer {fuzzed.agent.token}"):
        status = exchange(address, request)
        assert status is None or 400 <= status < 500, (case, status)
    assert (fuzzed.books(), fuzzed.host()) == (books, host)
    # And it still serves.
    assert fuzzed.client("tcp-token").get("/readyz").status == 200
