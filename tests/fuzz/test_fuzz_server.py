"""Fuzzing tier, server extension: a real jupyter_server with the extension, a real local
agent subprocess, a real victim sandbox standing in for a kernel (issue 9).

The extension's bodies reuse the agent contract's schemas from ``openapi.json`` (``count``,
``wait_seconds``, ``request_id``, ``GpuUuid``) plus its own ``kernel_id``; requests are
generated (mutated towards the hostile, see ``openapi_strategies``) and the hand-written
hostile bodies and raw HTTP are sent too. Every answer must be below 500 and, when an error,
carry the extension's error shape (``error``, ``message``, ``reason``, ``retryable``); a
refused request must leave the agent's books and the victim's device access unchanged.

The examples are drawn up front (Hypothesis runs synchronously, the server on the test's
event loop), derandomized and bounded like the agent's tier.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from jupyter_server.serverapp import ServerApp
from traitlets.config import Config

from jupyter_gpu_hotplug.agent import openapi_document
from jupyter_gpu_hotplug.linux import cgroups
from tests.fixtures.agent import LocalAgent
from tests.fixtures.requirements import needs_root
from tests.fixtures.sandbox import SandboxProbe
from tests.server.api_support import Fetch, Reply, call, local_mode, sandboxes_of

from .conftest import FUZZ_EXAMPLES
from .host_view import HostView
from .hostile import HOSTILE_BODIES, exchange, raw_requests
from .openapi_strategies import HOSTILE_VALUES, Document

pytestmark = [*needs_root, pytest.mark.fuzz]

DOC = Document(json.loads(openapi_document()))
KERNEL = "kernel-victim"
SHAPE = {"error", "message", "reason", "retryable"}


def _schema(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _member(name: str) -> dict[str, Any]:
    return dict(DOC.resolve(_schema("AttachRequest"))["properties"][name])


KERNEL_IDS = st.one_of(
    st.just(KERNEL),
    st.just("unknown-kernel"),
    st.from_regex(r"[A-Za-z0-9._-]{1,20}", fullmatch=True),
)
ATTACH = {
    "type": "object",
    "properties": {
        "count": _member("count"),
        "wait_seconds": _member("wait_seconds"),
        "request_id": _member("request_id"),
        "kernel_id": {"type": "string"},
    },
    "required": ["count"],
}
DETACH = {
    "type": "object",
    "properties": {
        "uuid": {"oneOf": [_schema("GpuUuid"), {"const": "all"}]},
        "force": {"type": "boolean"},
        "kernel_id": {"type": "string"},
    },
    "required": ["uuid"],
}


def _with_kernel(body: Any, kernel_id: str) -> Any:
    if isinstance(body, dict) and isinstance(body.get("kernel_id"), str):
        return {**body, "kernel_id": kernel_id}
    return body


def _request() -> st.SearchStrategy[tuple[str, str, bytes | None, dict[str, str]]]:
    def body(schema: dict[str, Any]) -> st.SearchStrategy[bytes]:
        values = st.tuples(DOC.mutated(schema), KERNEL_IDS).map(lambda t: _with_kernel(*t))
        return values.map(
            lambda v: json.dumps(v, ensure_ascii=False).encode("utf-8", "surrogatepass")
        )

    query: st.SearchStrategy[dict[str, str]] = st.one_of(
        st.just({}),
        KERNEL_IDS.map(lambda k: {"kernel_id": k}),
        HOSTILE_VALUES.map(lambda v: {"kernel_id": str(v)}),
        st.dictionaries(st.text(min_size=1, max_size=6), st.text(max_size=6), max_size=2),
    )
    return st.one_of(
        st.tuples(st.just("POST"), st.just("attach"), body(ATTACH), st.just({})),
        st.tuples(st.just("POST"), st.just("detach"), body(DETACH), st.just({})),
        st.tuples(st.just("GET"), st.just("gpus"), st.none(), query),
        st.tuples(st.just("GET"), st.just("version"), st.none(), st.just({})),
    )


def _draw_examples() -> list[tuple[str, str, bytes | None, dict[str, str]]]:
    drawn: list[tuple[str, str, bytes | None, dict[str, str]]] = []

    @settings(settings.get_profile("fuzz"), phases=[Phase.generate])
    @given(_request())
    def collect(example: tuple[str, str, bytes | None, dict[str, str]]) -> None:
        drawn.append(example)

    collect()
    return drawn


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


async def test_generated_requests_never_5xx(
    jp_fetch: Fetch, local_agent: LocalAgent, victim: SandboxProbe
) -> None:
    examples = _draw_examples()
    assert len(examples) >= FUZZ_EXAMPLES // 2
    for method, route, body, params in examples:
        before = _state(local_agent, victim)
        reply = await call(jp_fetch, method, route, raw=body, params=params)
        _check(reply, before, _state(local_agent, victim))


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
