"""An attach whose second holder's grant cannot be recorded is rolled back whole: the grant's
intent (``intend_grant``, the attach's one write after the creates) fails retryable, and the
release the service then makes deletes both holders and forgets both reservations.

Before an earlier fix, the first holder's reservation stayed in the allocator's memory after
its pod was deleted: the GPU counted as held until a restart. Since the holders' writes run
together, the same would happen if the first holder's write landed (and was remembered) after
the failure had been raised and the release made: the allocator waits for every write before
it raises. The failure is one PATCH answered 503 by the fake API server (an injected fault);
the test plays the kubelet (the holders' status in the fake API server, PodResources'
answers), so the two holders run together on demand.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from jupyter_gpu_hotplug._structs import GpuUuid, PodTarget, RequestId
from jupyter_gpu_hotplug.agent.core.errors import TargetNotReady
from jupyter_gpu_hotplug.agent.core.seams import (
    ContainerCgroups,
    ContainerKey,
    GpuRecord,
    HostContainer,
    Reservation,
)
from jupyter_gpu_hotplug.agent.kubernetes.allocator import HolderAllocator
from jupyter_gpu_hotplug.agent.kubernetes.holders import HolderSpec, holder_pod, read_holder
from jupyter_gpu_hotplug.agent.kubernetes.kube import KubeApi
from jupyter_gpu_hotplug.agent.kubernetes.node_pods import NodePods
from jupyter_gpu_hotplug.agent.kubernetes.podresources import PodDevices
from tests.k8s.apiserver.resources import PODS

from .agent import ensure_holder_priority_class
from .kube import FakeKube

pytestmark = [pytest.mark.k8s]

NS = "rollback"
NODE = "this-node"
RESOURCE = "nvidia.com/gpu"
GPUS = tuple(
    GpuRecord(GpuUuid(f"GPU-00000000-0000-4000-8000-00000000000{i}"), i, i, "simulated")
    for i in range(2)
)
REQUEST = RequestId("rollback-1")
SPEC = HolderSpec(node_name=NODE, resource_name=RESOURCE)


@dataclass
class KubeletStandIn:
    """The kubelet's side of the holders: its PodResources answers (``get``/``list``, as the
    allocator calls them) and the pod statuses it writes."""

    kube: FakeKube
    assigned: dict[tuple[str, str], str] = field(default_factory=dict)

    def get(self, namespace: str, name: str) -> PodDevices | None:
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
        spec=SPEC,
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


def holder_names(kube: FakeKube, count: int) -> Callable[[], list[str] | None]:
    def names() -> list[str] | None:
        holders = [p["metadata"]["name"] for p in kube.pods(NS) if p["metadata"]["name"] != "nb"]
        return holders if len(holders) == count else None

    return names


def recorded_gpu(kube: FakeKube, name: str) -> str | None:
    pod = kube.pod(NS, name)
    holder = None if pod is None else read_holder(pod)
    return None if holder is None else holder.uuid


async def test_a_failed_grant_record_rolls_back_both_holders_and_forgets_the_first(
    kube: FakeKube, setup: Setup
) -> None:
    target = kube.pod(NS, "nb")
    assert target is not None
    second = holder_pod(
        target,
        container="main",
        container_id=setup.container.key,
        request_id=REQUEST,
        index=1,
        spec=SPEC,
    )["metadata"]["name"]
    reserve = asyncio.create_task(
        setup.allocator.reserve(
            setup.container,
            2,
            request_id=REQUEST,
            deadline=time.monotonic() + 30,
            candidates=list(GPUS),
        )
    )
    names = await until(holder_names(kube, 2), "both holder pods are created")
    for name, gpu in zip(sorted(names, key=lambda n: n == second), GPUS, strict=True):
        setup.kubelet.admit(name, gpu.uuid)
        setup.kubelet.run(name)
    reserved = await asyncio.wait_for(reserve, 20)
    assert [entry.gpu.uuid for entry in reserved] == [gpu.uuid for gpu in GPUS]
    assert [recorded_gpu(kube, name) for name in names] == [None, None], (
        "reserve writes nothing after the creates"
    )
    kube.fail("PATCH", f"/pods/{second}")

    with pytest.raises(TargetNotReady, match="503"):
        await setup.allocator.intend_grant([gpu.uuid for gpu in GPUS])
    assert recorded_gpu(kube, next(n for n in names if n != second)) == GPUS[0].uuid, (
        "the first holder's grant was recorded before the failure"
    )
    await setup.allocator.release([gpu.uuid for gpu in GPUS])  # the service's rollback

    assert setup.allocator.all_attachments() == [], "what was recorded is forgotten"
    assert setup.lost == [], "the attach's own rollback is not a lost holder"
    for name in names:
        pod = kube.pod(NS, name)
        assert pod is None or pod["metadata"].get("deletionTimestamp"), f"{name} is deleted"
