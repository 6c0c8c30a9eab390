"""Fuzzing tier, server extension: a real jupyter_server with the extension, a real local
agent subprocess, a real victim sandbox standing in for a kernel (issue 9).

schemathesis (``--checks all``, see ``schemathesis_run``) runs against the document this server
serves (``gpu-hotplug/api/openapi.json``: the extension's own, with its ``max_count`` and local
mode's required ``kernel_id``), on the running server; the stream is left out (it never ends).
The hand-written hostile bodies and raw HTTP are sent too. Every answer must be below 500 and,
when an error, carry the extension's error shape (``error``, ``message``, ``reason``,
``retryable``); a refused request must leave the agent's books and the victim's device access
unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_server.serverapp import ServerApp
from traitlets.config import Config

from jupyter_gpu_hotplug.linux import cgroups
from tests.fixtures.agent import LocalAgent
from tests.fixtures.requirements import needs_root
from tests.fixtures.sandbox import SandboxProbe
from tests.server.api_support import Fetch, Reply, call, local_mode, sandboxes_of

from .host_view import HostView
from .hostile import HOSTILE_BODIES, exchange, raw_requests
from .schemathesis_run import command, run

pytestmark = [*needs_root, pytest.mark.fuzz]

KERNEL = "kernel-victim"
SHAPE = {"error", "message", "reason", "retryable"}
STREAM = "/gpu-hotplug/api/stream"


@pytest.fixture
def jp_server_config(jp_server_config: Config, local_agent: LocalAgent) -> Config:
    return local_mode(
        jp_server_config,
        agent_url=local_agent.tcp_url,
        token_path=local_agent.token_path,
        metrics_interval=0.5,
    )


@pytest.fixture
def victim(jp_serverapp: ServerApp, sandbox: SandboxProbe) -> Iterator[SandboxProbe]:
    sandboxes_of(jp_serverapp).register(KERNEL, sandbox.sandbox.pid)
    yield sandbox


def _state(agent: LocalAgent, victim: SandboxProbe) -> tuple[Any, HostView]:
    found = cgroups.discover()
    v1_root: Path | None = None if found.devices_v1 is None else found.devices_v1.mount_point
    return agent.client().gpus(), HostView.of(victim.sandbox, v1_root=v1_root)


def _check(reply: Reply, before: tuple[Any, HostView], after: tuple[Any, HostView]) -> None:
    assert reply.status < 500, reply.body
    if reply.status >= 400:
        assert set(reply.json()) >= SHAPE, reply.body
        assert after == before, reply.body


async def test_the_extension_does_what_its_document_says(
    jp_fetch: Fetch,
    jp_serverapp: ServerApp,
    http_server: object,
    jp_http_port: int,
    local_agent: LocalAgent,
    victim: SandboxProbe,
    tmp_path: Path,
) -> None:
    served = await call(jp_fetch, "GET", "openapi.json")
    assert served.status == 200, served.body
    document = tmp_path / "openapi.json"
    document.write_bytes(served.body)
    before = _state(local_agent, victim)

    outcome = await run(
        command(
            str(document),
            base_url=f"http://127.0.0.1:{jp_http_port}{jp_serverapp.base_url}",
            headers={"Authorization": f"token {jp_serverapp.identity_provider.token}"},
            exclude_paths=[STREAM],
        ),
        victim_pid=victim.sandbox.pid,
    )

    print(outcome.output)  # the CLI's report (pytest -rP shows it for a passing run)
    assert outcome.returncode == 0, outcome.output
    # Generated kernel ids name no kernel of this server: nothing reached the victim.
    assert _state(local_agent, victim) == before


async def test_hostile_bodies_are_400(
    jp_fetch: Fetch, local_agent: LocalAgent, victim: SandboxProbe
) -> None:
    for case, body in HOSTILE_BODIES:
        for route in ("attach", "detach"):
            before = _state(local_agent, victim)
            reply = await call(jp_fetch, "POST", route, raw=body)
            _check(reply, before, _state(local_agent, victim))
            assert reply.status in (400, 413), (case, route, reply.body)


async def test_hostile_http_is_never_a_5xx(
    jp_serverapp: ServerApp,
    http_server: object,
    jp_http_port: int,
    local_agent: LocalAgent,
    victim: SandboxProbe,
) -> None:
    before = _state(local_agent, victim)
    path = f"{jp_serverapp.base_url}gpu-hotplug/api/attach"
    token = f"token {jp_serverapp.identity_provider.token}"
    for case, request in raw_requests(path, token):
        status = await asyncio.to_thread(exchange, ("127.0.0.1", jp_http_port), request)
        assert status is None or 400 <= status < 500, (case, status)
    assert _state(local_agent, victim) == before
