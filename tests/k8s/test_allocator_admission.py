"""The holder allocator learns a holder's GPU at admission, while the sandbox still starts, and
grants nothing before the holder runs.

The kubelet's device manager assigns the device when it admits the pod; the sandbox and the
container start after that, which is most of a holder's create -> Running (0.6 s on the real
node). The allocator reads PodResources and writes the GPU's annotations in that time, so that
they are off the path to the grant. These tests hold a holder between admission and Running,
which no real kubelet does on demand: the test plays the kubelet, writing the pod's status
into the fake API server and answering PodResources for it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from jupyter_gpu_hotplug._structs import GpuUuid, PodTarget
from jupyter_gpu_hotplug.agent.core.errors import InsufficientGpus
from jupyter_gpu_hotplug.agent.core.seams import (
    ContainerCgroups,
    ContainerKey,
    GpuRecord,
    HostContainer,
    Reservation,
    ReservationState,
)
from jupyter_gpu_hotplug.agent.kubernetes.allocator import HolderAllocator
from jupyter_gpu_hotplug.agent.kubernetes.holders import HolderSpec, read_holder
from jupyter_gpu_hotplug.agent.kubernetes.kube import KubeApi
from jupyter_gpu_hotplug.agent.kubernetes.node_pods import NodePods
from jupyter_gpu_hotplug.agent.kubernetes.podresources import PodDevices
from tests.k8s.apiserver.resources import PODS

from .agent import ensure_holder_priority_class
from .kube import FakeKube

pytestmark = [pytest.mark.k8s]

NS = "admission"
NODE = "this-node"
RESOURCE = "nvidia.com/gpu"
GPU = GpuRecord(GpuUuid("GPU-00000000-0000-4000-8000-000000000001"), 0, 0, "simulated")


@dataclass
class KubeletStandIn:
    """The kubelet's side of one holder: its PodResources answers (``get``/``list``, as the
    allocator calls them) and the pod statuses it writes."""

    kube: FakeKube
    assigned: dict[tuple[str, str], str] = field(default_factory=dict)
    gets: int = 0

    def get(self, namespace: str, name: str) -> PodDevices | None:
        self.gets += 1
        uuid = self.assigned.get((namespace, name))
        if uuid is None:
            return PodDevices(namespace, name, {})
        return PodDevices(namespace, name, {"hold": {RESOURCE: (uuid,)}})

    def list(self) -> list[PodDevices]:
        return [
            PodDevices(ns, name, {"hold": {RESOURCE: (uuid,)}})
            for (ns, name), uuid in self.assigned.items()
        ]

    def admit(self, name: str, uuid: str) -> None:
        """Admission: the device is assigned, the status says Pending with a start time."""
        self.assigned[(NS, name)] = uuid
        self._status(name, {"phase": "Pending", "startTime": "2026-11-27T00:00:00Z"})

    def run(self, name: str) -> None:
        self._status(name, {"phase": "Running", "startTime": "2026-11-27T00:00:00Z"})

    def fail(self, name: str) -> None:
        self._status(name, {"phase": "Failed", "reason": "StartError"})

    def _status(self, name: str, status: dict[str, Any]) -> None:
        def write() -> None:
            cluster = self.kube.server.cluster
            pod = cluster.store.find(PODS, NS, name)
            assert pod is not None
            pod["status"] = status
            cluster.replace(PODS, NS, name, pod, "status")

        self.kube.server.call(write)  # on the server's loop, which tells the watches


@dataclass
class Setup:
    allocator: HolderAllocator
    kubelet: KubeletStandIn
    container: HostContainer
    lost: list[tuple[Reservation, str]]


@pytest.fixture
async def setup(kube: FakeKube) -> AsyncIterator[Setup]:
    kube.create_namespace(NS)
    ensure_holder_priority_class(kube)
    kube.create_pod(
        NS,
        {
            "metadata": {"name": "nb"},
            "spec": {"nodeName": "elsewhere", "containers": [{"name": "main", "image": "x"}]},
        },
    )
    kubelet = KubeletStandIn(kube)
    kube_api = KubeApi(kube.client())
    pods = NodePods(kube_api, NODE)
    allocator = HolderAllocator(
        kube=kube_api,
        pods=pods,
        podresources=kubelet,  # type: ignore[arg-type]
        spec=HolderSpec(node_name=NODE, resource_name=RESOURCE),
        blocking=asyncio.to_thread,
        gone_timeout=1,
    )
    lost: list[tuple[Reservation, str]] = []
    allocator.on_lost(lambda entry, reason: lost.append((entry, reason)))
    await allocator.load()
    container = HostContainer(
        target=PodTarget(NS, "nb", "main"),
        key=ContainerKey(f"containerd://{1:064x}"),
        pid=os.getpid(),
        start_time=0,
        cgroups=ContainerCgroups(None, None),
        label=f"pod {NS}/nb",
    )
    yield Setup(allocator, kubelet, container, lost)
    await pods.stop()
    kube_api.close()


async def until(check: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + 20
    while not (found := check()):
        assert time.monotonic() < deadline, f"not within 20 s: {what}"
        await asyncio.sleep(0.02)
    return found


def holder_named(kube: FakeKube) -> Callable[[], str | None]:
    def name() -> str | None:
        holders = [p for p in kube.pods(NS) if p["metadata"]["name"] != "nb"]
        return holders[0]["metadata"]["name"] if holders else None

    return name


def recorded_gpu(kube: FakeKube, name: str) -> str | None:
    pod = kube.pod(NS, name)
    holder = None if pod is None else read_holder(pod)
    return None if holder is None else holder.uuid


async def test_the_gpu_is_recorded_at_admission_and_reserve_returns_only_once_it_runs(
    kube: FakeKube, setup: Setup
) -> None:
    reserve = asyncio.create_task(
        setup.allocator.reserve(
            setup.container,
            1,
            request_id=None,
            deadline=time.monotonic() + 30,
            candidates=[GPU],
        )
    )
    name = await until(holder_named(kube), "the holder pod is created")
    setup.kubelet.admit(name, GPU.uuid)

    await until(lambda: recorded_gpu(kube, name), "the GPU is recorded on the holder")

    assert recorded_gpu(kube, name) == GPU.uuid
    await asyncio.sleep(0.2)
    assert not reserve.done(), "nothing may be granted before the holder runs"
    setup.kubelet.run(name)
    (entry,) = await asyncio.wait_for(reserve, 20)
    assert (entry.gpu.uuid, entry.state) == (GPU.uuid, ReservationState.RESERVING)
    assert setup.kubelet.gets == 1, "learnt once, at admission"


async def test_a_holder_that_fails_after_admission_is_rolled_back_not_announced_lost(
    kube: FakeKube, setup: Setup
) -> None:
    reserve = asyncio.create_task(
        setup.allocator.reserve(
            setup.container,
            1,
            request_id=None,
            deadline=time.monotonic() + 30,
            candidates=[GPU],
        )
    )
    name = await until(holder_named(kube), "the holder pod is created")
    setup.kubelet.admit(name, GPU.uuid)
    await until(lambda: recorded_gpu(kube, name), "the GPU is recorded on the holder")

    setup.kubelet.fail(name)

    with pytest.raises(InsufficientGpus, match="StartError"):
        await asyncio.wait_for(reserve, 20)
    assert setup.allocator.all_attachments() == [], "what was learnt is forgotten"
    assert setup.lost == [], "the attach's own failure is not a lost holder"
    pod = kube.pod(NS, name)
    assert pod is None or pod["metadata"].get("deletionTimestamp"), "the holder is deleted"
