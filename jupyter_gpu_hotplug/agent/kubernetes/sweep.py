"""Every running container of the node against what it may open: orphaned grants, stray GPUs.

Why it exists: the reconciler visits only the containers that have reservations, so two kinds
of access escape it, and both let a GPU be used by a pod that does not hold it:

- **an orphan**: a grant of ours (our v1 entry or our marked v2 prefix) that no reservation
  backs — its holder pod was deleted, evicted or garbage-collected while the agent was down
  (a rolling update, an OOM kill), and the allocator, rebuilt from the surviving holders, does
  not know it. It is taken back by the core's loss sequence (``core/lost.py``: an Event first,
  the grace period, then the revoke, counted as ``gpu_hotplug_lost_revokes_total{kind="orphan"}``);
- **a stray**: a container whose device cgroup lets it open an NVIDIA GPU that neither the
  device plugin assigned to it (PodResources) nor the agent granted — a misconfigured runtime
  (the container toolkit in jit-cdi mode treats ``NVIDIA_VISIBLE_DEVICES=none`` like ``all``),
  a hand-written device rule. It is reported (an Event on the pod when first seen, the gauge
  ``gpu_hotplug_stray_gpu_access``, a log line naming pod and device) and, with
  ``--stray-policy=revoke``, its permission is taken (the nodes stay: they are not ours).

Devices the device plugin assigned to a container are never touched, whatever the runtime
made of them. What "can open" means is what the kernel would answer: the v1 ``devices.list``
(where runc writes its rules on v1 and hybrid hosts) and, on cgroup v2, every device program
attached to the container's cgroups run for that device (``linux/bpf/interp.py``); an
unconfined (privileged) container is not judged. A stray that only a runtime's v2 program
allows is reported but cannot be revoked (the agent edits only its own marked prefix).

A pass reads the node's pods from the watch's cache, each container's process and cgroups
through CRI (as the resolver does for any target), PodResources once, and the device state of
each container once; it runs at start-up, with every reconciliation (the timer) and after pod
events.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from ..._structs import GpuUuid, PodTarget
from ...linux.devnodes import DeviceNode
from ..core.bundle import Core
from ..core.errors import AgentError
from ..core.hooks import ReconcileReport
from ..core.injector import DeviceState, InjectionFailed, InjectorError
from ..core.lost import LostGpus, TakeBack
from ..core.seams import ContainerKey, GpuRecord, HostContainer
from ..core.service import AgentService
from .events import STRAY_ACCESS, PodEvents
from .kube import KubeObject
from .node_pods import NodePods
from .podresources import PodDevices, PodResourcesClient, PodResourcesError, device_uuid
from .resolver import PodResolver

__all__ = ["NodeSweep", "plugin_gpus"]

log = logging.getLogger(__name__)

ORPHAN_REASON = (
    "no holder pod reserves it any more (deleted or evicted while the agent was not running)"
)

Spawn = Callable[[Awaitable[None]], None]
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


@dataclass
class _Found:
    """What one container can open that nothing accounts for."""

    container: HostContainer
    spare: frozenset[str]
    """Nodes the container needs for what is accounted for (a plugin's or reserved slice's
    GPU node): never revoked with an orphan or a stray."""
    orphans: list[GpuRecord] = field(default_factory=list)
    strays: list[tuple[GpuRecord, list[DeviceNode]]] = field(default_factory=list)


class NodeSweep:
    """One pass over the node's running containers (``run``; see the module docstring)."""

    def __init__(
        self,
        core: Core,
        *,
        pods: NodePods,
        resolver: PodResolver,
        podresources: PodResourcesClient,
        service: AgentService,
        lost: LostGpus,
        events: PodEvents,
        revoke_strays: bool,
        spawn: Spawn,
        trusted: Trusted,
    ) -> None:
        self._core = core
        self._pods = pods
        self._resolver = resolver
        """The core's resolver, as the Kubernetes one: it lists the node's running containers."""
        self._podresources = podresources
        self._service = service
        self._lost = lost
        self._events = events
        self._revoke_strays = revoke_strays
        self._spawn = spawn
        self._trusted = trusted
        """Holders the sweep skips: only those the allocator believes (a pod that merely
        carries the holder label is swept like any other: issue 31, finding 4)."""
        self._reported: set[tuple[ContainerKey, GpuUuid]] = set()
        """Stray access already announced by an Event (one per container and GPU)."""

    async def run(self, known: Sequence[GpuRecord], report: ReconcileReport) -> None:
        """Check every running container of the node once."""
        try:
            assigned = await self._core.workers.host(self._podresources.list)
        except PodResourcesError as e:
            # Without it a plugin's GPU cannot be told from a stray: judge nothing this pass.
            report.failures.append(f"node sweep: {e}")
            log.error("node sweep skipped: %s", e)
            return
        nodes = {gpu.uuid: self._nodes_of(gpu) for gpu in known}
        found = []
        for pod in self._pods.pods():
            if self._trusted(pod):
                continue  # the plugin gave it its GPU
            for target in _running_containers(pod):
                container = await self._core.workers.host(self._resolve, pod, target)
                if container is None:
                    continue
                try:
                    found.append(
                        await self._check(container, known, nodes, plugin_gpus(assigned, target))
                    )
                except InjectorError as e:
                    log.debug("node sweep: %s not checked: %s", container, e)
        strays = 0
        seen: set[tuple[ContainerKey, GpuUuid]] = set()
        for item in found:
            if item.orphans:
                self._orphaned(item, report)
            for gpu, gpu_nodes in item.strays:
                strays += 1
                seen.add((item.container.key, gpu.uuid))
                await self._stray(item, gpu, gpu_nodes, report)
        self._reported &= seen
        self._core.metrics.stray_gpu_access.set(strays)

    def _nodes_of(self, gpu: GpuRecord) -> list[DeviceNode]:
        try:
            return self._core.nodes.of(gpu)
        except InjectionFailed:
            return []  # a slice NVML no longer lists: nothing to look for

    def _resolve(self, pod: KubeObject, target: PodTarget) -> HostContainer | None:
        try:
            return self._resolver.running(pod, target)
        except AgentError as e:
            # Not running after all, a VM sandbox, the host's mount namespace (the agent's
            # own pod): nothing a grant of ours could be in.
            log.debug("node sweep: %s skipped: %s", target, e)
            return None

    async def _check(
        self,
        container: HostContainer,
        known: Sequence[GpuRecord],
        nodes: dict[GpuUuid, list[DeviceNode]],
        plugin: set[GpuUuid],
    ) -> _Found:
        """Sort what ``container`` can open: accounted for (the plugin's, our reservations'),
        orphaned (our grant, no reservation) or stray (somebody else's grant)."""
        reserved = {
            entry.gpu.uuid
            for entry in self._core.allocator.all_attachments()
            if entry.container == container.key
        }
        accounted = plugin | reserved
        needed = {node.name for uuid in accounted for node in nodes.get(uuid, [])}
        checked = [gpu for gpu in known if nodes[gpu.uuid] and gpu.uuid not in accounted]
        flat_nodes = list({node.name: node for gpu in checked for node in nodes[gpu.uuid]}.values())
        found = _Found(container, frozenset(needed))
        if not flat_nodes:
            return found
        states = await self._core.workers.host(self._core.injector.status, container, flat_nodes)
        by_name: dict[str, DeviceState] = {
            node.name: state for node, state in zip(flat_nodes, states, strict=True)
        }
        for gpu in checked:
            own = nodes[gpu.uuid]
            if not all(by_name[node.name].opens for node in own):
                continue
            if all(node.name in needed for node in own):
                continue  # e.g. the node of a GPU whose slice the container holds
            if all(by_name[node.name].ours for node in own if node.name not in needed):
                found.orphans.append(gpu)
            else:
                found.strays.append((gpu, [node for node in own if node.name not in needed]))
        return found

    def _orphaned(self, item: _Found, report: ReconcileReport) -> None:
        container, gpus = item.container, item.orphans
        key = f"orphan:{container.key}:{','.join(sorted(gpu.uuid for gpu in gpus))}"
        if self._lost.pending(key):
            return
        for gpu in gpus:
            report.add("orphan_found", gpu.uuid)

        async def revoke(force: bool) -> TakeBack | None:
            return await self._service.take_back_orphan(
                container, gpus, force=force, spare=item.spare
            )

        self._spawn(
            self._lost.handle(
                key=key,
                target=container.target,
                gpus=gpus,
                reason=ORPHAN_REASON,
                revoke=revoke,
                orphan=True,
            )
        )

    async def _stray(
        self, item: _Found, gpu: GpuRecord, nodes: list[DeviceNode], report: ReconcileReport
    ) -> None:
        container = item.container
        devices = ", ".join(f"/dev/{node.name} ({node.device})" for node in nodes)
        first = (container.key, gpu.uuid) not in self._reported
        if first:
            self._reported.add((container.key, gpu.uuid))
            report.add("stray_found", gpu.uuid)
            log.warning(
                "stray GPU access: %s can open %s of %s, which neither the device plugin "
                "assigned to it nor the agent granted",
                container,
                devices,
                gpu.uuid,
            )
            self._events.emit(
                container.target,
                STRAY_ACCESS,
                f"this container can open GPU {gpu.uuid} ({devices}) although neither the "
                "device plugin assigned it nor the GPU hot-plug agent granted it"
                + ("; the access is revoked" if self._revoke_strays else ""),
                warning=True,
            )
        if not self._revoke_strays:
            return
        try:
            await self._service.take_back_orphan(container, [gpu], force=False, spare=item.spare)
            after = await self._core.workers.host(self._core.injector.status, container, nodes)
            if any(state.opens for state in after):
                raise InjectionFailed(
                    "a runtime's own device program still allows it (the agent edits only "
                    "its own marked prefix)",
                    clean=True,
                )
        except (InjectorError, AgentError) as e:
            # A v1 wildcard ('c 195:* rwm'), which a deny cannot narrow, or a runtime's v2
            # program: said once, the Event and the gauge keep reporting it.
            report.failures.append(f"{container}: stray {gpu.uuid} not revoked: {e}")
            if first:
                log.error("stray GPU access of %s to %s cannot be revoked: %s", container, gpu, e)
            return
        report.add("revoked_stray", gpu.uuid)


def _running_containers(pod: KubeObject) -> list[PodTarget]:
    """The containers of ``pod`` that run now."""
    metadata = pod.get("metadata") or {}
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return [
        PodTarget(str(metadata.get("namespace")), str(metadata.get("name")), str(s["name"]))
        for s in statuses
        if s.get("name") and "running" in (s.get("state") or {}) and s.get("containerID")
    ]
