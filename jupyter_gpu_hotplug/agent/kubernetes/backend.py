"""Kubernetes mode, assembled: the backend's parts built from the settings, and the two
reactions to the node's pod events that the periodic reconciler alone would make too slow.

Why it exists: ``runtime.py`` wires any backend into the core the same way (allocator,
resolver, identity); what is particular to Kubernetes lives here:

- **a holder lost behind the agent's back** (evicted, deleted, its pod failed) means the GPU is
  no longer reserved for the container and may be handed to another pod at once: the GPU is
  revoked from the container right away (under the target's lock, as any operation), with
  force if a process holds it open — a GPU must never stay usable by a pod that does not hold
  it — and the reservation is dropped; an Event on the pod says why;
- **any change to a pod that holds GPUs or to a holder** (the target pod deleted, its container
  restarted with a new id) triggers a reconciliation pass at once instead of at the next tick;
  passes never overlap, and a burst of events costs one pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final

from ..._structs import PodTarget
from ...linux import cgroups
from ..core.idle import IdleBook
from ..core.injector import DeviceInUse, Injector, InjectorError, TargetGone, gpu_node
from ..core.locks import TargetLocks
from ..core.reconcile import ReconcileReport
from ..core.seams import Reservation
from ..settings import AgentSettings
from .allocator import HolderAllocator
from .cri import CriClient, CriError
from .events import REVOKED, PodEvents
from .holders import LABEL_HOLDER, HolderSpec
from .identity import TokenIdentity
from .kube import KubeApi, KubeObject
from .node_pods import NodePods
from .pod_idle import PodIdle
from .podresources import PodResourcesClient
from .resolver import PodResolver

__all__ = ["KubernetesBackend"]

log = logging.getLogger(__name__)

_STOP_TIMEOUT: Final = 5.0


@dataclass
class KubernetesBackend:
    """The Kubernetes backend's parts, and its event reactions once ``start``ed."""

    kube: KubeApi
    pods: NodePods
    podresources: PodResourcesClient
    cri: CriClient
    allocator: HolderAllocator
    resolver: PodResolver
    identity: TokenIdentity
    events: PodEvents
    device_major: int
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _wanted: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    def create(
        cls, settings: AgentSettings, hierarchies: cgroups.CgroupHierarchies
    ) -> KubernetesBackend:
        k8s = settings.kubernetes
        assert k8s is not None, "AgentSettings checks that kubernetes mode has its settings"
        kube = KubeApi.connect(k8s.kubeconfig)
        pods = NodePods(kube, k8s.node_name)
        podresources = PodResourcesClient(k8s.pod_resources_socket)
        cri = CriClient(k8s.cri_endpoint)
        try:
            runtime = cri.version()
            log.info(
                "container runtime: %s %s (CRI %s) at %s",
                runtime.name,
                runtime.version,
                runtime.api_version,
                k8s.cri_endpoint,
            )
        except CriError as e:
            # Not fatal: the runtime may come up after the agent; until then targets get 422.
            log.error("%s; pods cannot be resolved until it answers", e)
        events = PodEvents(kube, pods)

        async def pod_uid(namespace: str, name: str) -> str | None:
            pod = pods.get(namespace, name) or await kube.get_pod(namespace, name)
            return None if pod is None else (pod.get("metadata") or {}).get("uid")

        return cls(
            kube=kube,
            pods=pods,
            podresources=podresources,
            cri=cri,
            allocator=HolderAllocator(
                kube=kube,
                pods=pods,
                podresources=podresources,
                spec=HolderSpec(
                    node_name=k8s.node_name,
                    resource_name=k8s.resource_name,
                    image=k8s.holder_image,
                ),
                blocking=asyncio.to_thread,
                events=events,
            ),
            resolver=PodResolver(
                kube=kube,
                cri=cri,
                node_name=k8s.node_name,
                host_proc=settings.host_proc,
                hierarchies=hierarchies,
            ),
            identity=TokenIdentity(kube, pod_uid=pod_uid),
            events=events,
            device_major=settings.device_major,
        )

    def start(
        self,
        *,
        reconcile: Callable[[], Awaitable[ReconcileReport]],
        locks: TargetLocks,
        injector: Injector,
        idle: IdleBook,
    ) -> None:
        """React to pod events from now on (after the agent's first reconciliation), and give
        the idle policy the pods' own periods and Events."""
        self._injector = injector
        self._locks = locks
        pod_idle = PodIdle(self.pods, self.events)
        idle.per_target = pod_idle.idle_seconds
        idle.listeners.append(pod_idle.announce)
        self.allocator.on_lost(self._lost)
        self.pods.listen(self._pod_changed)
        self._spawn(self._reconcile_when_wanted(reconcile))

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.events.drain()
        await self.pods.stop()

    def close(self) -> None:
        self.podresources.close()
        self.cri.close()
        self.kube.close()

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- pod events ----------------------------------------------------------------------------

    def _pod_changed(self, kind: str, pod: KubeObject) -> None:
        metadata = pod.get("metadata") or {}
        if (metadata.get("labels") or {}).get(LABEL_HOLDER) == "true":
            self._wanted.set()
            return
        key = (metadata.get("namespace"), metadata.get("name"))
        if any(
            isinstance(entry.target, PodTarget)
            and (entry.target.namespace, entry.target.name) == key
            for entry in self.allocator.all_attachments()
        ):
            self._wanted.set()

    async def _reconcile_when_wanted(
        self, reconcile: Callable[[], Awaitable[ReconcileReport]]
    ) -> None:
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            try:
                report = await reconcile()
            except Exception:
                log.exception("reconciliation after a pod event failed; the timer retries")
                continue
            if report.changed:
                log.info("reconciliation after a pod event: %s", dict(report.actions))

    # --- lost holders --------------------------------------------------------------------------

    def _lost(self, entry: Reservation, reason: str) -> None:
        self._spawn(self._revoke_lost(entry, reason))

    async def _revoke_lost(self, entry: Reservation, reason: str) -> None:
        async with self._locks.operation(entry.target):
            current = self.allocator.get(entry.gpu.uuid)
            if current is None or current.holder != entry.holder:
                return  # released meanwhile
            node = gpu_node(entry.gpu.minor, major=self.device_major)
            container = await asyncio.to_thread(self.resolver.lookup, entry.target, entry.container)
            forced = False
            if container is not None:
                try:
                    try:
                        await asyncio.to_thread(
                            self._injector.revoke, container, [node], force=False
                        )
                    except DeviceInUse:
                        forced = True
                        await asyncio.to_thread(
                            self._injector.revoke, container, [node], force=True
                        )
                except TargetGone:
                    pass
                except InjectorError as e:
                    log.error(
                        "%s lost %s (%s) but it could not be revoked: %s; the reconciler retries",
                        entry.target,
                        entry.gpu.uuid,
                        reason,
                        e,
                    )
                    return
            await self.allocator.release([entry.gpu.uuid])
        message = f"revoked GPU {entry.gpu.uuid} (/dev/nvidia{entry.gpu.minor}): {reason}" + (
            "; processes holding it open were stopped" if forced else ""
        )
        log.warning("%s: %s", entry.target, message)
        self.events.emit(entry.target, REVOKED, message, warning=True)
