"""Fuzzing tier, agent: a real agent subprocess under requests generated from openapi.json and
hand-written hostile ones (issue 9).

Against ``jupyter gpu-hotplug agent --simulate 4`` (TCP with and without the token, and the
unix socket) and a real victim sandbox whose pid the generated targets may name: every answer
must be documented in ``openapi.json`` with a body matching its schema, never a 5xx; and a
refused request (any 4xx) must leave the ledger (``GET /v1/gpus``) and the victim's device
cgroups and ``/dev`` exactly as they were. Target pids that could name someone else's process
on this shared host are replaced by the victim's (or kept when above ``pid_max``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from jupyter_gpu_hotplug.agent import openapi_document
from jupyter_gpu_hotplug.agent.settings import TcpAddress, UnixAddress
from jupyter_gpu_hotplug.linux import cgroups
from tests.agent.api_harness import ApiClient, Response, template_of
from tests.fixtures.agent import LocalAgent, LocalAgentFactory
from tests.fixtures.requirements import needs_root
from tests.fixtures.sandbox import SandboxFactory, SandboxProbe

from .host_view import HostView
from .hostile import HOSTILE_BODIES, exchange, raw_requests
from .openapi_strategies import Document

pytestmark = [*needs_root, pytest.mark.fuzz]

DOC = Document(json.loads(openapi_document()))
PID_MAX = int(Path("/proc/sys/kernel/pid_max").read_text())
CREDENTIALS = ("tcp-token", "tcp-none", "tcp-wrong", "unix-none", "unix-token")


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

    def fix_value(self, name: str, value: Any) -> Any:
        """Never a pid of someone else's process: the victim's, or one that cannot exist."""
        if name == "pid" and isinstance(value, int) and not isinstance(value, bool):
            return value if value > PID_MAX or value < 2 else self.victim.sandbox.pid
        return value


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


@settings(settings.get_profile("fuzz"))
@given(data=st.data())
def test_generated_requests_are_documented_and_never_5xx(
    fuzzed: Fuzzed, data: st.DataObject
) -> None:
    method, target, body = data.draw(DOC.request(fix_value=fuzzed.fix_value))
    credentials = data.draw(st.sampled_from(CREDENTIALS))

    response = _refused_changes_nothing(
        fuzzed, lambda: _send(fuzzed, credentials, method, target, body)
    )
    event(f"{method} {template_of(target)} -> {response.status}")


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
