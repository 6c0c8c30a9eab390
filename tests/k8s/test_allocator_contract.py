"""The Kubernetes allocator (holder pods) passes the same ``Allocator`` contract as the local
ledger: against the fake API server, with the simulated kubelet admitting holders (as real
containerd pods) and serving PodResources. Each ``open()`` is a fresh allocator over the same
holder pods, as after an agent restart. The contract suite has no real-node counterpart."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest

from jupyter_gpu_hotplug._structs import GpuUuid, PodTarget
from jupyter_gpu_hotplug.agent.core.seams import (
    Allocator,
    ContainerCgroups,
    ContainerKey,
    GpuRecord,
    HostContainer,
)
from jupyter_gpu_hotplug.agent.kubernetes.allocator import HolderAllocator
from jupyter_gpu_hotplug.agent.kubernetes.holders import HolderSpec
from jupyter_gpu_hotplug.agent.kubernetes.kube import KubeApi
from jupyter_gpu_hotplug.agent.kubernetes.node_pods import NodePods
from jupyter_gpu_hotplug.agent.kubernetes.podresources import PodResourcesClient
from tests.fixtures.requirements import needs_root

from ..agent.allocator_contract import AllocatorContract, AllocatorSetup
from .agent import ensure_holder_priority_class
from .kube import FakeKube
from .kubelet import KubeletSimulator

pytestmark = [*needs_root, pytest.mark.k8s, pytest.mark.slow]

NS = "contract"


def _target_pod(name: str) -> dict[str, Any]:
    """A target pod for the allocator alone: bound to another node, so no kubelet runs it."""
    return {
        "metadata": {"name": name},
        "spec": {
            "nodeName": "elsewhere",
            "containers": [{"name": "main", "image": "quay.io/jupyter/base-notebook:latest"}],
        },
    }


class TestHolderAllocator(AllocatorContract):
    @pytest.fixture
    async def allocator_setup(
        self, kube: FakeKube, kubelet: KubeletSimulator
    ) -> AsyncIterator[AllocatorSetup]:
        kube.create_namespace(NS)
        ensure_holder_priority_class(kube)
        candidates = [
            GpuRecord(GpuUuid(gpu.id), index, gpu.minor, "simulated")
            for index, gpu in enumerate(kubelet.gpus)
        ]
        containers = []
        for index in range(len(candidates) + 1):
            kube.create_pod(NS, _target_pod(f"t{index}"))
            containers.append(
                HostContainer(
                    target=PodTarget(NS, f"t{index}", "main"),
                    key=ContainerKey(f"containerd://{index:064x}"),
                    pid=os.getpid(),
                    start_time=0,
                    cgroups=ContainerCgroups(None, None),
                    label=f"pod {NS}/t{index}",
                )
            )
        opened: list[tuple[KubeApi, NodePods, PodResourcesClient]] = []

        async def open_allocator() -> Allocator:
            kube_api = KubeApi(kube.client())
            pods = NodePods(kube_api, kubelet.node_name)
            podresources = PodResourcesClient(kubelet.pod_resources_socket)
            opened.append((kube_api, pods, podresources))
            return HolderAllocator(
                kube=kube_api,
                pods=pods,
                podresources=podresources,
                spec=HolderSpec(node_name=kubelet.node_name),
                blocking=asyncio.to_thread,
                gone_timeout=60,
            )

        yield AllocatorSetup(
            open=open_allocator,
            containers=containers,
            candidates=candidates,
            finishes_intended=True,
        )
        for kube_api, pods, podresources in opened:
            await pods.stop()
            podresources.close()
            kube_api.close()
