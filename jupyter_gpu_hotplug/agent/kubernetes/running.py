"""The node's running containers, as the core's node sweep judges them (``BackendHooks.running``).

Why it exists: the sweep itself is the core's (``core/sweep.py``: orphaned grants, stray GPU
access, one entitlement for every mode); what only Kubernetes can say is which containers run
on the node and which GPUs the device plugin assigned each. This module answers that: the
node's pods from the watch's cache, each running container's process and cgroups through CRI
(as the resolver does for any target), and PodResources once per pass — without it a plugin's
GPU cannot be told from a stray, so the pass judges nothing (the error goes up to the sweep).
Holder pods the allocator believes are left out (the plugin gave them their GPU; a pod that
merely carries the holder label is swept like any other: issue 31, finding 4), and so is what
no grant of ours could be in: a VM sandbox, the host's mount namespace (the agent's own pod).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..._structs import GpuUuid, PodTarget
from ..core.errors import AgentError
from ..core.hooks import RunningContainer
from ..core.seams import HostContainer, Reservation
from .kube import KubeObject
from .node_pods import NodePods
from .podresources import PodDevices, PodResourcesClient, device_uuid
from .resolver import PodResolver

__all__ = ["RunningPods", "plugin_gpus"]

log = logging.getLogger(__name__)

Trusted = Callable[[KubeObject], bool]
"""Whether a pod is a holder the allocator believes (``HolderAllocator.trusts``)."""


def plugin_gpus(pods: Sequence[PodDevices], target: PodTarget) -> set[GpuUuid]:
    """The GPUs (UUIDs) the device plugin assigned to ``target``'s container, of any
    resource (whole GPUs, MIG slices, shared replicas)."""
    return {
        GpuUuid(device_uuid(device))
        for pod in pods
        if (pod.namespace, pod.name) == (target.namespace, target.name)
        for resource in pod.containers.get(target.container or "", {}).values()
        for device in resource
    }


@dataclass(frozen=True)
class RunningPods:
    """``BackendHooks.running`` for Kubernetes (see the module docstring)."""

    pods: NodePods
    resolver: PodResolver
    """The core's resolver, as the Kubernetes one: it resolves a pod's running container."""
    podresources: PodResourcesClient
    trusted: Trusted

    def __call__(self, reservations: Sequence[Reservation]) -> list[RunningContainer]:
        """Every running container of the node but trusted holders, with the plugin's GPUs
        (blocking: CRI, PodResources). ``PodResourcesError`` when PodResources does not
        answer. The reservations are not needed: CRI names each container's own cgroups."""
        assigned = self.podresources.list()
        found = []
        for pod in self.pods.pods():
            if self.trusted(pod):
                continue  # the plugin gave it its GPU
            for target in _running_containers(pod):
                container = self._resolve(pod, target)
                if container is not None:
                    found.append(
                        RunningContainer(container, frozenset(plugin_gpus(assigned, target)))
                    )
        return found

    def _resolve(self, pod: KubeObject, target: PodTarget) -> HostContainer | None:
        try:
            return self.resolver.running(pod, target)
        except AgentError as e:
            # Not running after all, a VM sandbox, the host's mount namespace (the agent's
            # own pod): nothing a grant of ours could be in.
            log.debug("node sweep: %s skipped: %s", target, e)
            return None


def _running_containers(pod: KubeObject) -> list[PodTarget]:
    """The containers of ``pod`` that run now."""
    metadata = pod.get("metadata") or {}
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return [
        PodTarget(str(metadata.get("namespace")), str(metadata.get("name")), str(s["name"]))
        for s in statuses
        if s.get("name") and "running" in (s.get("state") or {}) and s.get("containerID")
    ]
