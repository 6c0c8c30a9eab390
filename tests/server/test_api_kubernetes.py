"""Kubernetes mode: the target is the notebook's pod, named by the agent from the pod's token.

No local agent can play a Kubernetes agent, so these tests use the client tests' stub agent
(``tests.client.stub_agent``: a real HTTP server answering contract-checked canned answers)
and look at what the extension sent it. The stub can also hang an attach, which shows the
``waiting`` progress events and an attach that fails after them.
"""

from __future__ import annotations

import asyncio
import copy
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from jupyter_server.serverapp import ServerApp
from traitlets.config import Config

from tests.client.samples import ATTACHMENTS, GPUS, POD, UUID_A
from tests.client.stub_agent import StubAgent, running_stub
from tests.fixtures.waiting import eventually

from .api_support import (
    Fetch,
    SseClient,
    call,
    manager_of,
    progress_states,
    stream_path,
)

TOKEN = "pod-token.abc"


@pytest.fixture
def stub() -> Iterator[StubAgent]:
    directory = Path(tempfile.mkdtemp(prefix="gh-stub-", dir="/tmp"))
    try:
        with running_stub(directory / "agent.sock") as agent:
            agent.respond("GET", "/v1/gpus", 200, GPUS)
            agent.respond("GET", "/v1/attachments", 200, ATTACHMENTS)
            yield agent
    finally:
        shutil.rmtree(directory)


@pytest.fixture
def jp_server_config(jp_server_config: Config, stub: StubAgent, tmp_path: Path) -> Config:
    token_path = tmp_path / "token"
    token_path.write_text(TOKEN)
    settings = jp_server_config.GPUHotplug
    settings.agent_url = stub.tcp_url
    settings.token_path = str(token_path)
    settings.mode = "kubernetes"
    settings.metrics_interval = 0.05
    settings.request_timeout = 0.5
    return jp_server_config


async def test_every_operation_targets_the_pod_itself(jp_fetch: Fetch, stub: StubAgent) -> None:
    stub.respond("POST", "/v1/attachments", 201, ATTACHMENTS)
    stub.respond("DELETE", "/v1/attachments/{uuid}", 204)
    stub.respond("DELETE", "/v1/attachments", 204)

    listed = await call(jp_fetch, "GET", "gpus", params={"kernel_id": "any-kernel"})
    attached = await call(jp_fetch, "POST", "attach", {"count": 1, "kernel_id": "k"})
    one = await call(jp_fetch, "POST", "detach", {"uuid": UUID_A, "kernel_id": "k"})
    every = await call(jp_fetch, "POST", "detach", {"uuid": "all"})

    view = listed.json()
    assert (view["mode"], view["kernel_id"], view["free"], view["total"]) == (
        "kubernetes",
        "any-kernel",
        1,
        2,
    )
    assert view["simulated"] is True
    (gpu,) = view["attached"]
    assert gpu == {
        **ATTACHMENTS["attachments"][0],
        "metrics": None,
        "held_by": {"kind": "pod", "name": "jhub/jupyter-ada", "kernel_id": None},
    }
    assert attached.status == 201
    assert attached.json()["attachments"] == ATTACHMENTS["attachments"]
    assert (one.status, every.status) == (204, 204)
    sent = [(r.method, r.path, r.query) for r in stub.requests]
    # No target anywhere: the agent acts on the caller, the pod the token belongs to.
    # (The two reads of GET gpus run concurrently, in either order.)
    assert sorted(sent[:2]) == [("GET", "/v1/attachments", {}), ("GET", "/v1/gpus", {})]
    assert sent[2:] == [
        ("POST", "/v1/attachments", {}),
        ("DELETE", f"/v1/attachments/{UUID_A}", {}),
        ("DELETE", "/v1/attachments", {}),
    ]
    (post,) = [r for r in stub.requests if r.method == "POST"]
    assert post.json() == {"count": 1, "request_id": attached.json()["request_id"]}
    assert {r.headers["Authorization"] for r in stub.requests} == {f"Bearer {TOKEN}"}


async def test_waiting_progress_then_failure_reaches_every_stream(
    jp_serverapp: ServerApp,
    http_server: object,
    jp_http_port: int,
    jp_fetch: Fetch,
    stub: StubAgent,
) -> None:
    stub.hang("POST", "/v1/attachments")
    # The pod's place in the agent's queue, as the agent answers the pod's own token.
    stub.respond(
        "GET",
        "/v1/queue",
        200,
        {
            "length": 2,
            "requests": [
                {
                    "request_id": "slow-1",
                    "target": POD.to_wire(),
                    "count": 1,
                    "position": 2,
                    "queued_at": "2026-11-28T18:00:00Z",
                }
            ],
        },
    )
    token = jp_serverapp.identity_provider.token
    path = stream_path(jp_serverapp.base_url)
    early = await SseClient.connect(jp_http_port, path, token=token)

    attach = asyncio.create_task(
        call(
            jp_fetch,
            "POST",
            "attach",
            {"count": 1, "wait_seconds": 0.5, "request_id": "slow-1"},
        )
    )
    before = await early.events_until(
        lambda e: e.kind == "progress" and e.data["state"] == "waiting"
    )
    # A stream opened while the attach is in flight learns of it at once.
    late = await SseClient.connect(jp_http_port, path, token=token)
    replayed = await late.events_until(lambda e: e.kind == "progress")
    reply = await attach

    error = reply.error(504, "agent_timeout")
    assert error["retryable"] is True
    assert "did not answer the request to attach 1 GPU" in error["message"]
    assert replayed[-1].data["request_id"] == "slow-1"
    assert replayed[-1].data["state"] in ("started", "waiting")
    for stream, seen in ((early, before), (late, replayed)):
        rest = await stream.events_until(
            lambda e: e.kind == "progress" and e.data["state"] == "failed"
        )
        states = progress_states([*seen, *rest], "slow-1")
        assert states[-1] == "failed" and set(states[:-1]) <= {"started", "waiting"}
        failed = rest[-1].data
        assert (failed["error"]["status"], failed["error"]["error"]) == (504, "agent_timeout")
        assert failed["error"]["message"] == error["message"]
        await stream.close()
    assert progress_states(before, "slow-1")[:2] == ["started", "waiting"]
    waiting = [e.data for e in before if e.kind == "progress" and e.data["state"] == "waiting"]
    assert (waiting[-1]["position"], waiting[-1]["of"]) == (2, 2)
    # Asked with no target: the agent answers for the caller, the pod its token names.
    asked = [r for r in stub.requests if r.path == "/v1/queue"]
    assert asked and all(r.query == {} for r in asked)
    await eventually(lambda: not manager_of(jp_serverapp).subscriptions, "no subscription")


async def test_a_lost_holders_announcement_reaches_the_live_stream(
    jp_serverapp: ServerApp, http_server: object, jp_http_port: int, stub: StubAgent
) -> None:
    """Issue 21: while the agent announces the revoke of a GPU whose holder pod was lost,
    the stream's readings carry it on the attachment (the lab warns from it)."""
    notice = {"reason": "its holder pod ended (Preempted)", "revoke_at": "2026-11-27T05:00:00Z"}
    announced = {"attachments": [{**ATTACHMENTS["attachments"][0], "holder_lost": notice}]}
    stub.respond("GET", "/v1/attachments", 200, announced)
    stream = await SseClient.connect(
        jp_http_port, stream_path(jp_serverapp.base_url), token=jp_serverapp.identity_provider.token
    )

    seen = await stream.events_until(lambda e: e.kind == "metrics")

    (attached,) = seen[-1].data["attached"]
    assert attached["holder_lost"] == notice
    await stream.close()


async def test_a_named_gpu_is_passed_on_and_the_agents_refusal_comes_back(
    jp_fetch: Fetch, stub: StubAgent
) -> None:
    """Issue 36 item 6: in Kubernetes the device plugin picks the device, so the agent lists
    its GPUs as not selectable (the panel then offers no per-card Attach) and refuses a named
    one with 400 ``gpus``, which the extension passes on unchanged."""
    picked = copy.deepcopy(GPUS)
    for gpu in picked["gpus"]:
        gpu["selectable"] = False
    stub.respond("GET", "/v1/gpus", 200, picked)
    refusal = {
        "error": "invalid_request",
        "message": "this agent cannot attach a GPU the request names: the cluster picks the device",
        "retryable": False,
        "field": "gpus",
    }
    stub.respond("POST", "/v1/attachments", 400, refusal)

    view = (await call(jp_fetch, "GET", "gpus")).json()
    reply = await call(jp_fetch, "POST", "attach", {"count": 1, "gpus": [UUID_A]})

    assert [gpu["selectable"] for gpu in view["node"]] == [False, False]
    error = reply.error(400, "invalid_request")
    assert (error["field"], error["message"]) == ("gpus", refusal["message"])
    (post,) = [r for r in stub.requests if r.method == "POST"]
    assert post.json()["gpus"] == [UUID_A]


async def test_a_selector_is_passed_on_and_the_device_plugins_refusal_shown(
    jp_fetch: Fetch, stub: StubAgent
) -> None:
    """Issue 37: ``model`` and ``min_memory`` reach the agent as they were sent; with the
    device plugin the agent refuses them (400 naming the field), passed on unchanged."""
    refusal = {
        "error": "invalid_request",
        "message": "selecting GPUs by model or memory needs DRA (--allocation dra); the device "
        "plugin picks the device itself",
        "retryable": False,
        "field": "model",
    }
    stub.respond("POST", "/v1/attachments", 400, refusal)

    reply = await call(
        jp_fetch, "POST", "attach", {"count": 1, "model": "H100", "min_memory": 40 * 2**30}
    )

    error = reply.error(400, "invalid_request")
    assert (error["field"], error["message"]) == ("model", refusal["message"])
    (post,) = [r for r in stub.requests if r.method == "POST"]
    assert (post.json()["model"], post.json()["min_memory"]) == ("H100", 40 * 2**30)
