"""Kubernetes mode's admission of an attach when the device plugin holds GPUs (issue 38, 1):
whether a request is served, waits or is refused is decided from what the kubelet's PodResources
says is free, the one authority there — not from NVML minus the agent's own reservations, which
counts a GPU a device-plugin pod holds as free.

Only this tier can hold a node's GPUs with plain device-plugin pods on demand and count the
PodResources calls the agent makes (``KubeletSimulator.pod_resources_lists``). A device-plugin
pod is a notebook pod whose container requests ``nvidia.com/gpu``. Waits have generous upper
bounds and are never asserted; the one fixed window (``QUIET``) bounds a count, not a time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from tests.fixtures.requirements import needs_root

from ..agent.agent_process import AgentProcess
from ..agent.api_harness import Response
from ..fixtures.nvml import FakeNvmlNode
from .agent import as_pod, eventually, running_k8s_agent
from .containerd import Containerd
from .kube import FakeKube
from .kubelet import KubeletSimulator

pytestmark = [*needs_root, pytest.mark.k8s, pytest.mark.slow]

NS = "team-q"

QUIET = 2.0
"""Seconds during which nothing changes on the node while a request waits: the PodResources
calls counted over it must be a few (the waiter's periodic look), not a spin's hundreds."""

FEW_CALLS = 8
"""At most this many PodResources ``List`` calls in ``QUIET`` with nothing changing: the
waiter's periodic look (1 s) and the reconciliations the test's own changes trigger. A waiter
that polls the kubelet in a loop makes hundreds."""


@pytest.fixture
def quiet_agent(
    kube: FakeKube,
    kubelet: KubeletSimulator,
    kubelet_nvml: FakeNvmlNode,
    containerd: Containerd,
) -> Iterator[AgentProcess]:
    """The agent without its timed reconciliation (each pass lists PodResources once), so the
    calls counted are the ones the attach path makes."""
    with running_k8s_agent(
        kube, kubelet, kubelet_nvml, containerd, reconcile_interval=3600
    ) as process:
        yield process


@pytest.fixture
def background() -> Iterator[ThreadPoolExecutor]:
    """Runs the waiting ``POST``s while the test changes the node."""
    with ThreadPoolExecutor(2) as pool:
        yield pool


def plugin_pod(kubelet: KubeletSimulator, name: str, gpus: int) -> None:
    """A pod that gets ``gpus`` GPUs from the device plugin, as any GPU pod of a cluster."""
    kubelet.run_notebook_pod(NS, name, resources={"limits": {"nvidia.com/gpu": str(gpus)}})


def wait_in_background(
    pool: ThreadPoolExecutor,
    agent: AgentProcess,
    kube: FakeKube,
    pod: str,
    count: int,
) -> Future[Response]:
    """``pod`` asks for ``count`` GPUs, ready to wait 60 s; returns once it is in the queue."""
    api = as_pod(agent, kube, NS, pod)
    answer = pool.submit(api.post, "/v1/attachments", {"count": count, "wait_seconds": 60})
    eventually(
        lambda: answer.done() or api.get("/v1/queue").json()["requests"] != [],
        f"the request of {pod} waits in the queue",
    )
    assert not answer.done(), answer.result().body
    return answer


def test_a_waiter_whose_freed_gpu_the_plugin_holds_waits_without_polling(
    kube: FakeKube,
    kubelet: KubeletSimulator,
    quiet_agent: AgentProcess,
    background: ThreadPoolExecutor,
) -> None:
    """1(a): a request for 2 waits (1 free); a detach frees one more, but the other "free" one
    is a device-plugin pod's. The request must wait on quietly until a GPU really is free — not
    go round its queue turn again at once, asking PodResources each time until its deadline."""
    kubelet.run_notebook_pod(NS, "owner")
    owner = as_pod(quiet_agent, kube, NS, "owner")
    attached = owner.post("/v1/attachments", {"count": 3})
    assert attached.status == 201, attached.body
    plugin_pod(kubelet, "plugin", 1)
    kubelet.run_notebook_pod(NS, "waiter")
    waiting = wait_in_background(background, quiet_agent, kube, "waiter", 2)

    first = attached.json()["attachments"][0]["uuid"]
    assert owner.delete(f"/v1/attachments/{first}").status == 204
    before = kubelet.pod_resources_lists
    time.sleep(QUIET)
    calls = kubelet.pod_resources_lists - before
    assert not waiting.done(), waiting.result().body
    assert calls <= FEW_CALLS, f"{calls} PodResources List calls in {QUIET} s of waiting"

    kube.delete_pod(NS, "plugin")
    served = waiting.result(timeout=60)
    assert served.status == 201, served.body
    assert len(served.json()["attachments"]) == 2


def test_a_request_over_the_pods_limit_is_refused_at_once_and_never_holds_the_queue(
    kube: FakeKube,
    kubelet: KubeletSimulator,
    quiet_agent: AgentProcess,
    background: ThreadPoolExecutor,
) -> None:
    """1(b): on a node with nothing free, a pod at its max-gpus annotation asks to wait for one
    more: 403 at once, not a place in the queue from which it would hold the head and be
    refused only at its turn. A request behind it is served when a GPU frees."""
    kubelet.run_notebook_pod(NS, "capped", annotations={"gpu-hotplug.jupyter.org/max-gpus": "1"})
    capped = as_pod(quiet_agent, kube, NS, "capped")
    assert capped.post("/v1/attachments", {"count": 1}).status == 201
    plugin_pod(kubelet, "plugin", 3)

    refused = capped.post("/v1/attachments", {"count": 1, "wait_seconds": 60})
    assert (refused.status, refused.error) == (403, "forbidden"), refused.body
    assert capped.get("/v1/queue").json() == {"length": 0, "requests": []}

    kubelet.run_notebook_pod(NS, "allowed")
    waiting = wait_in_background(background, quiet_agent, kube, "allowed", 1)
    kube.delete_pod(NS, "plugin")
    served = waiting.result(timeout=60)
    assert served.status == 201, served.body


def test_a_waiting_request_on_a_node_the_plugin_holds_waits_and_is_served(
    kube: FakeKube,
    kubelet: KubeletSimulator,
    quiet_agent: AgentProcess,
    background: ThreadPoolExecutor,
) -> None:
    """1(c): every GPU of the node is a device-plugin pod's. A request that may wait waits (it
    is not answered 409 at once) and is served when the plugin pod goes away; one that may not
    wait is answered 409 at once. ``GET /v1/gpus`` says the same: every GPU ``allocated``
    (held through the device plugin), none free."""
    plugin_pod(kubelet, "plugin", len(kubelet.gpus))
    kubelet.run_notebook_pod(NS, "nb")
    api = as_pod(quiet_agent, kube, NS, "nb")
    states = {gpu["state"] for gpu in api.get("/v1/gpus").json()["gpus"]}
    assert states == {"allocated"}
    at_once = api.post("/v1/attachments", {"count": 1})
    assert (at_once.status, at_once.error) == (409, "insufficient_gpus"), at_once.body

    waiting = wait_in_background(background, quiet_agent, kube, "nb", 1)
    kube.delete_pod(NS, "plugin")
    served = waiting.result(timeout=60)
    assert served.status == 201, served.body
