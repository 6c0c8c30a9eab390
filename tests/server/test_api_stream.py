"""``GET gpu-hotplug/api/stream``: server-sent events of metrics and attach progress.

A real server and a real local agent; the stream is read over a plain socket
(``SseClient``) so each test decides when the client leaves, and then checks that the
server-side reader (the request's task) has ended and no subscription is left.
"""

from __future__ import annotations

import asyncio
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from jupyter_server.serverapp import ServerApp
from traitlets.config import Config

from jupyter_gpu_hotplug._structs import PidRef
from jupyter_gpu_hotplug.client import InsufficientGpus
from tests.fixtures.agent import LocalAgent
from tests.fixtures.nvml import FakeNvml
from tests.fixtures.requirements import needs_root
from tests.fixtures.sandbox import SandboxFactory, SandboxProbe
from tests.fixtures.waiting import DEADLINE, eventually

from .api_support import (
    Event,
    Fetch,
    NoAgent,
    Reply,
    SseClient,
    call,
    local_mode,
    manager_of,
    progress_states,
    sandboxes_of,
    stream_path,
)

# Starts real servers or toolchains: left out of the fast default run (conftest.py).
pytestmark = pytest.mark.slow


@pytest.fixture
def jp_server_config(jp_server_config: Config, agent_url: str, token_path: Path | None) -> Config:
    return local_mode(
        jp_server_config, agent_url=agent_url, token_path=token_path, metrics_interval=0.05
    )


@dataclass(frozen=True)
class Served:
    """The test server as a client of the stream needs it."""

    app: ServerApp
    port: int

    async def connect(self, kernel_id: str | None = None) -> SseClient:
        return await SseClient.connect(
            self.port,
            stream_path(self.app.base_url, kernel_id),
            token=self.app.identity_provider.token,
        )


@pytest.fixture
def served(jp_serverapp: ServerApp, http_server: object, jp_http_port: int) -> Served:
    """The server listening (``http_server``) on ``jp_http_port``."""
    return Served(jp_serverapp, jp_http_port)


async def _open(served: Served, kernel_id: str | None = None) -> SseClient:
    client = await served.connect(kernel_id)
    assert client.status == 200
    assert client.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert client.headers["cache-control"] == "no-cache, no-store"
    return client


async def test_metrics_arrive_and_disconnect_ends_the_server_side(served: Served) -> None:
    manager = manager_of(served.app)
    client = await _open(served)

    first, second = await client.next_event(), await client.next_event()

    for event in (first, second):
        assert event is not None and event.kind == "metrics"
        assert (event.data["free"], event.data["total"], event.data["attached"]) == (2, 2, [])
        assert [(g["index"], g["state"], g["mine"]) for g in event.data["node"]] == [
            (0, "free", False),
            (1, "free", False),
        ]
    (subscription,) = manager.subscriptions
    assert subscription.task is not None and not subscription.task.done()

    await client.close()

    await eventually(lambda: not manager.subscriptions, "the subscription is gone")
    await eventually(subscription.task.done, "the stream's task has ended")
    assert subscription.task.exception() is None


async def test_metrics_carry_pcie_and_nvlink_traffic(
    served: Served, local_agent: LocalAgent, server_nvml: FakeNvml
) -> None:
    """Issue 36 (what nvdashboard charts besides utilisation): every GPU's metrics carry its
    PCIe traffic in bytes/s, and NVLink traffic only where the GPU has NVLinks — null, never
    0, on a GPU without them, so the panel can leave its chart out."""
    linked, unlinked = local_agent.gpus()
    local_agent.update_gpu(
        linked.uuid, pcie_tx=1_000, pcie_rx=3_000, nvlinks=18, nvlink_tx=2 * 10**6, nvlink_rx=10**6
    )
    client = await _open(served)

    events = [await client.next_event() for _ in range(3)]
    await client.close()

    readings = []
    for event in events:
        assert event is not None and event.kind == "metrics"
        readings.append({gpu["uuid"]: gpu["metrics"] for gpu in event.data["node"]})
    last = readings[-1]
    assert (last[linked.uuid]["pcie_tx"], last[linked.uuid]["pcie_rx"]) == (1_024_000, 3_072_000)
    assert last[linked.uuid]["nvlink_tx"] > last[linked.uuid]["nvlink_rx"] > 0
    assert (last[unlinked.uuid]["pcie_tx"], last[unlinked.uuid]["pcie_rx"]) == (0, 0)
    for reading in readings:
        assert (reading[unlinked.uuid]["nvlink_tx"], reading[unlinked.uuid]["nvlink_rx"]) == (
            None,
            None,
        )


async def test_server_shutdown_ends_open_streams(served: Served, jp_fetch: Fetch) -> None:
    manager = manager_of(served.app)
    clients = [await _open(served) for _ in range(2)]
    for client in clients:
        assert (await client.next_event()) is not None
    subscriptions = manager.subscriptions

    await manager.close()  # what the extension does when the server stops

    assert manager.subscriptions == frozenset()
    for client in clients:
        await client.body()  # the server ended the response: the read reaches the end
        await client.close()
    tasks = [subscription.task for subscription in subscriptions]
    await eventually(lambda: all(t is not None and t.done() for t in tasks), "the tasks end")
    late = await call(jp_fetch, "GET", "gpus")
    late.error(503, "shutting_down")


async def test_unknown_kernel_is_404_before_any_event(served: Served) -> None:
    client = await served.connect("nope")

    assert client.status == 404
    assert client.headers["content-type"].startswith("application/json")
    assert b'"error": "not_found"' in await client.body()
    await client.close()
    assert manager_of(served.app).subscriptions == frozenset()


async def test_stream_ends_when_its_kernel_goes_away(
    served: Served, local_agent: LocalAgent
) -> None:
    sandboxes = sandboxes_of(served.app)
    # The agent refuses its own pid as a target: metrics for this kernel are error events.
    kernel_id = sandboxes.register("k", local_agent.pid)
    client = await _open(served, kernel_id)
    refused = await client.next_event()
    assert refused is not None and refused.kind == "error"
    assert (refused.data["status"], refused.data["error"]) == (403, "forbidden")

    del sandboxes.pids[kernel_id]
    events = await client.events_until(lambda e: e.data.get("error") == "not_found")

    assert events[-1].data["status"] == 404
    assert await client.next_event() is None  # the server ended the stream
    await client.close()
    await eventually(lambda: not manager_of(served.app).subscriptions, "no subscription")


class TestAgentDown(NoAgent):
    async def test_errors_are_events_and_the_stream_goes_on(self, served: Served) -> None:
        client = await _open(served)

        first, second = await client.next_event(), await client.next_event()

        for event in (first, second):
            assert event is not None and event.kind == "error"
            assert (event.data["status"], event.data["error"]) == (503, "agent_unavailable")
            assert event.data["message"].startswith("No GPU agent on this node")
        await client.close()


@needs_root
async def test_progress_of_an_attach_then_metrics_show_the_gpu(
    served: Served,
    jp_fetch: Fetch,
    sandbox: SandboxProbe,
) -> None:
    kernel_id = sandboxes_of(served.app).register("kernel-a", sandbox.pid)
    other = sandboxes_of(served.app).register("kernel-b", sandbox.pid)
    client = await _open(served, kernel_id)
    elsewhere = await _open(served, other)

    reply = await call(
        jp_fetch, "POST", "attach", {"count": 1, "kernel_id": kernel_id, "request_id": "req-1"}
    )
    assert reply.status == 201

    events = await client.events_until(
        lambda e: e.kind == "progress" and e.data["state"] in ("attached", "failed")
    )
    states = progress_states(events, "req-1")
    assert states[0] == "started" and states[-1] == "attached"
    assert set(states[1:-1]) <= {"waiting"}
    done = events[-1].data
    assert (done["kernel_id"], done["count"]) == (kernel_id, 1)
    assert done["attachments"] == reply.json()["attachments"]
    shown = await client.events_until(lambda e: e.kind == "metrics" and e.data["attached"])
    assert shown[-1].data["attached"][0]["uuid"] == done["attachments"][0]["uuid"]

    # Another kernel's stream gets that kernel's metrics but not this attach's progress.
    seen = [await elsewhere.next_event() for _ in range(3)]
    assert all(event is not None and event.kind == "metrics" for event in seen)
    for stream in (client, elsewhere):
        await stream.close()
    await eventually(lambda: not manager_of(served.app).subscriptions, "no subscription")


async def _agent_requests(agent: LocalAgent) -> int:
    """API requests the agent has answered so far (its own ``/metrics`` counter; scrapes not
    counted)."""

    def scrape() -> str:
        request = urllib.request.Request(
            f"{agent.tcp_url}/metrics", headers={"Authorization": f"Bearer {agent.token}"}
        )
        with urllib.request.urlopen(request, timeout=DEADLINE) as response:
            return str(response.read().decode())

    total = 0.0
    for line in (await asyncio.to_thread(scrape)).splitlines():
        if line.startswith("gpu_hotplug_http_requests_total{") and 'route="/metrics"' not in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


@pytest.mark.parametrize("tabs", [1, 12])
async def test_open_streams_share_one_upstream_poll(
    served: Served, local_agent: LocalAgent, tabs: int
) -> None:
    """However many tabs watch a kernel, each poll asks the agent twice: the node's GPUs and
    the kernel's attachments (the agent refuses this one, which costs the same request)."""
    manager = manager_of(served.app)
    kernel_id = sandboxes_of(served.app).register("k", local_agent.pid)
    clients = [await _open(served, kernel_id) for _ in range(tabs)]
    clients += [await _open(served) for _ in range(tabs)]  # the node's counts only: no request
    for client in clients:
        assert (await client.next_event()) is not None
    polls, requests = manager.hub.polls, await _agent_requests(local_agent)

    await eventually(lambda: manager.hub.polls >= polls + 20, "twenty more polls")

    requests = await _agent_requests(local_agent) - requests
    polls = manager.hub.polls - polls
    # A poll in flight at either end may be counted on one side only.
    assert 2 * (polls - 1) <= requests <= 2 * (polls + 1), (tabs, polls, requests)
    for client in clients:
        await client.close()
    await eventually(lambda: not manager.subscriptions, "no subscription")
    assert not manager.hub.polling


@needs_root
async def test_a_waiting_attach_shows_its_place_and_can_be_cancelled(
    served: Served, jp_fetch: Fetch, sandbox: SandboxProbe
) -> None:
    """Both GPUs taken: a second kernel's attach waits in the agent's queue, its progress says
    where; cancelled it fails and leaves the queue; a waiter is served when a GPU frees."""
    holder = sandboxes_of(served.app).register("kernel-h", sandbox.pid)
    waiter = sandboxes_of(served.app).register("kernel-w", sandbox.pid)
    taken = await call(jp_fetch, "POST", "attach", {"count": 2, "kernel_id": holder})
    assert taken.status == 201
    client = await _open(served, waiter)

    async def attach(request_id: str) -> tuple[asyncio.Task[Reply], Event]:
        body = {"count": 1, "kernel_id": waiter, "wait_seconds": 60, "request_id": request_id}
        task = asyncio.create_task(call(jp_fetch, "POST", "attach", body))
        events = await client.events_until(
            lambda e: (
                e.kind == "progress" and e.data["request_id"] == request_id and "position" in e.data
            )
        )
        return task, events[-1]

    pending, waiting = await attach("wait-1")
    assert waiting.data["state"] == "waiting"
    assert (waiting.data["position"], waiting.data["of"]) == (1, 1)
    # The readings carry the queue, for the panel: the waiting kernel, its place and deadline.
    reading = await client.events_until(
        lambda e: e.kind == "metrics" and any(q["position"] == 1 for q in e.data["queue"])
    )
    (queued,) = reading[-1].data["queue"]
    assert (queued["request_id"], queued["kernel_id"], queued["count"]) == ("wait-1", waiter, 1)
    assert queued["held_by"] == {"kind": "kernel", "name": f"kernel {waiter}", "kernel_id": waiter}
    assert queued["deadline"] > reading[-1].data["taken_at"]

    unknown = await call(
        jp_fetch, "POST", "cancel", {"request_id": "not-waiting", "kernel_id": waiter}
    )
    assert unknown.error(404, "not_found")["message"].startswith("no attach request not-waiting")
    cancelled = await call(
        jp_fetch, "POST", "cancel", {"request_id": "wait-1", "kernel_id": waiter}
    )
    assert cancelled.status == 204
    refused = await asyncio.wait_for(pending, DEADLINE)
    assert "cancel" in refused.error(409, "insufficient_gpus")["message"]
    failed = await client.events_until(
        lambda e: e.kind == "progress" and e.data["state"] == "failed"
    )
    assert failed[-1].data["request_id"] == "wait-1"

    served_later, _ = await attach("wait-2")
    first = taken.json()["attachments"][0]["uuid"]
    released = await call(jp_fetch, "POST", "detach", {"uuid": first, "kernel_id": holder})
    assert released.status == 204
    reply = await asyncio.wait_for(served_later, DEADLINE)
    assert reply.status == 201
    assert [a["uuid"] for a in reply.json()["attachments"]] == [first]
    await call(jp_fetch, "POST", "detach", {"uuid": "all", "kernel_id": holder})
    await client.close()


@needs_root
async def test_a_wait_started_past_this_server_is_in_the_same_queue(
    served: Served,
    jp_fetch: Fetch,
    local_agent: LocalAgent,
    sandbox: SandboxProbe,
    sandbox_factory: SandboxFactory,
) -> None:
    """Issue 36, item 5: a wait of ``%gpu attach 1 --wait`` (or the command line) goes from
    the kernel to the agent, past this server, and was missing from the panel's queue, the
    toolbar and the status bar. The readings now carry it (no deadline: only the agent
    knows it), and the server's cancel takes it out of the queue."""
    holder = sandboxes_of(served.app).register("kernel-h", sandbox.pid)
    other = sandbox_factory()
    waiter = sandboxes_of(served.app).register("kernel-w", other.pid)
    taken = await call(jp_fetch, "POST", "attach", {"count": 2, "kernel_id": holder})
    assert taken.status == 201
    client = await _open(served, waiter)
    agent = local_agent.client()
    pending = asyncio.create_task(
        asyncio.to_thread(
            agent.attach, 1, target=PidRef(other.pid), wait_seconds=60, request_id="magic-1"
        )
    )

    reading = await client.events_until(
        lambda e: e.kind == "metrics" and any(q["request_id"] == "magic-1" for q in e.data["queue"])
    )
    (queued,) = reading[-1].data["queue"]
    assert (queued["kernel_id"], queued["count"], queued["position"], queued["of"]) == (
        waiter,
        1,
        1,
        1,
    )
    assert queued["deadline"] is None

    cancelled = await call(
        jp_fetch, "POST", "cancel", {"request_id": "magic-1", "kernel_id": waiter}
    )
    assert cancelled.status == 204
    with pytest.raises(InsufficientGpus):
        await asyncio.wait_for(pending, DEADLINE)
    await client.events_until(lambda e: e.kind == "metrics" and e.data["queue"] == [])
    await call(jp_fetch, "POST", "detach", {"uuid": "all", "kernel_id": holder})
    await client.close()
