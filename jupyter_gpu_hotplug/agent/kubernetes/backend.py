"""Kubernetes mode, assembled: the backend's parts built from the settings, and the two
reactions to the node's pod events that the periodic reconciler alone would make too slow.

Why it exists: ``runtime.py`` wires every backend into the core the same way (its allocator,
resolver, identity and hooks go into the ``Core`` when it is built; ``bind``, ``start``,
``stop``, ``close``: see ``local/backend.py`` for local mode's); what is particular to
Kubernetes lives here, most of it in its hooks (``core/hooks.py``): the node's running
containers with the device plugin's GPUs for the core's node sweep (``running.py``; a plugin's
GPU is never a stray), the pods' idle periods and the Events of idle releases, losses and
stray access:

- **a holder lost behind the agent's back** (preempted, evicted, deleted, its pod failed) means
  the GPU is no longer reserved for the container and may be handed to another pod: the core's
  loss sequence (``core/lost.py``) warns first — an Event on the pod, the notice on the
  attachment that the notebook's live stream shows — then, after the grace period, revokes
  through the service (same node rule as a detach) and releases the reservation; an Event
  says what was done;
- **a holder pod the allocator does not believe** (``trust.py``): a log line, a warning Event
  on that pod, ``gpu_hotplug_untrusted_holders_total{reason}``;
- **any change to a pod of the node** (the target pod deleted, its container restarted with a
  new id, a holder gone, a new container that may be able to open GPUs) triggers a
  reconciliation pass — with the node sweep (``core/sweep.py``: orphaned grants, stray GPU
  access) — at once instead of at the next tick; passes never overlap, and a burst of events
  costs one pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final

from ..._structs import GpuUuid, PodTarget, format_timestamp
from ...linux import cgroups
from ..core.bundle import Core
from ..core.hooks import BackendHooks, ReconcileReport, StrayNotice
from ..core.injector import InjectionFailed
from ..core.lost import LossNotice, LostGpus, TakeBack
from ..core.seams import HostContainer, Reservation
from ..core.service import AgentService
from ..settings import AgentSettings, KubernetesSettings
from .allocator import HolderAllocator
from .cri import CriClient, CriError
from .events import HOLDER_LOST, REVOKED, STRAY_ACCESS, UNTRUSTED_HOLDER, PodEvents
from .holders import HolderSpec
from .identity import TokenIdentity
from .kube import KubeApi, KubeObject
from .node_pods import NodePods
from .pod_idle import PodIdle
from .podresources import PodResourcesClient, PodResourcesError
from .resolver import PodResolver
from .running import RunningPods, plugin_gpus
from .tenancy import TenantPolicy
from .trust import Verdict

__all__ = ["KubernetesBackend"]

log = logging.getLogger(__name__)

_STOP_TIMEOUT: Final = 5.0
ORPHAN_REASON: Final = (
    "no holder pod reserves it any more (deleted or evicted while the agent was not running)"
)


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
    policy: TenantPolicy
    events: PodEvents
    pod_idle: PodIdle
    hooks: BackendHooks = field(init=False)
    """Its part in the core's passes, built with the backend and handed to ``Core.build``."""
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _wanted: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        running = RunningPods(
            pods=self.pods,
            resolver=self.resolver,
            podresources=self.podresources,
            trusted=self.allocator.trusts,
        )
        self.hooks = BackendHooks(
            running=running,
            assigned=self._plugin_gpus,
            orphans=True,
            orphan_reason=ORPHAN_REASON,
            stray_listeners=(self._tell_stray,),
            idle_period=self.pod_idle.idle_seconds,
            idle_listeners=(self.pod_idle.announce,),
            loss_listeners=(self._tell_loss,),
        )

    @property
    def suspensions(self) -> None:
        """Kubernetes mode keeps no suspended CUDA state yet (issue 39: local mode first), so
        a detach with ``keep`` is refused there, saying so."""
        return None

    @classmethod
    def create(
        cls, settings: AgentSettings, hierarchies: cgroups.CgroupHierarchies
    ) -> KubernetesBackend:
        k8s = settings.kubernetes
        assert k8s is not None, "AgentSettings checks that kubernetes mode has its settings"
        kube = KubeApi.connect(k8s.kubeconfig)
        pods = NodePods(kube, k8s.node_name, k8s.watched_namespaces)
        podresources = PodResourcesClient(k8s.pod_resources_socket)
        cri = CriClient(k8s.cri_endpoint)
        _log_runtime(cri, k8s.cri_endpoint)
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
                spec=_holder_spec(k8s),
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
            policy=TenantPolicy(
                kube,
                default_max_gpus=k8s.default_max_gpus,
                allowed_namespaces=k8s.allowed_namespaces,
                selector=k8s.allowed_namespace_selector,
            ),
            events=events,
            pod_idle=PodIdle(pods, events),
        )

    def bind(self, core: Core, *, service: AgentService, lost: LostGpus) -> None:
        """Take what the hooks act through, before the core's first reconciliation: a lost
        holder is taken back through the service and the loss sequence; the allocator reports
        lost and untrusted holders and reads the inventory. The core itself is not written
        to: its part came with ``hooks``."""
        self._service = service
        self._lost_gpus = lost
        self._queue = core.queue
        self.allocator.on_lost(self._lost)
        self.allocator.use_inventory(core.inventory.snapshot)

        def untrusted(pod: KubeObject, verdict: Verdict) -> None:
            core.metrics.untrusted_holders.labels(reason=str(verdict.reason)).inc()
            metadata = pod.get("metadata") or {}
            self.events.emit(
                PodTarget(str(metadata.get("namespace")), str(metadata.get("name"))),
                UNTRUSTED_HOLDER,
                f"the GPU hot-plug agent does not trust this pod as a GPU holder "
                f"({verdict.reason}: {verdict.detail}); nothing is granted on its word",
                warning=True,
            )

        self.allocator.on_untrusted(untrusted)

    def start(self, *, reconcile: Callable[[], Awaitable[ReconcileReport]]) -> None:
        """React to pod events from now on (after the agent's first reconciliation)."""
        self.pods.listen(self._pod_changed)
        self._spawn(self._reconcile_when_wanted(reconcile))

    def _plugin_gpus(self, container: HostContainer) -> set[GpuUuid]:
        """The GPUs the device plugin assigned to ``container`` (blocking: PodResources)."""
        target = container.target
        if not isinstance(target, PodTarget):
            return set()
        try:
            found = self.podresources.get(target.namespace, target.name)
        except PodResourcesError as e:
            raise InjectionFailed(
                f"cannot tell the device plugin's GPUs: {e}", clean=True, passing=True
            ) from e
        return plugin_gpus([] if found is None else [found], target)

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
        """Any pod of the node: a holder or a target may have gone, a container may have
        started that can open GPUs (the sweep's business). A burst costs one pass. A pod that
        ended or went may have freed GPUs — a device-plugin pod's too, which no release of
        the agent's announces — so the queue's waiters decide again."""
        self._wanted.set()
        phase = (pod.get("status") or {}).get("phase")
        if kind == "DELETED" or phase in ("Failed", "Succeeded"):
            self._queue.notify()

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
        assert entry.holder is not None, "every Kubernetes reservation has its holder pod"

        async def revoke(force: bool) -> TakeBack | None:
            return await self._service.revoker.take_back(entry, force=force)

        self._spawn(
            self._lost_gpus.handle(
                key=entry.holder,
                target=entry.target,
                gpus=[entry.gpu],
                reason=reason,
                revoke=revoke,
            )
        )

    def _tell_stray(self, notice: StrayNotice) -> None:
        """The Event of a stray access, when the core's node sweep first sees it."""
        devices = ", ".join(f"/dev/{node.name} ({node.device})" for node in notice.verdict.nodes)
        self.events.emit(
            notice.container.target,
            STRAY_ACCESS,
            f"this container can open GPU {notice.verdict.gpu.uuid} ({devices}) although "
            "neither the "
            "device plugin assigned it nor the GPU hot-plug agent granted it"
            + ("; the access is revoked" if notice.revoking else ""),
            warning=True,
        )

    def _tell_loss(self, notice: LossNotice, outcome: TakeBack | None) -> None:
        """The Events of a loss: a warning when it is announced, what was done once revoked."""
        nodes = ", ".join(f"{gpu.uuid} (/dev/nvidia{gpu.minor})" for gpu in notice.gpus)
        if outcome is None:
            self.events.emit(
                notice.target,
                HOLDER_LOST,
                f"GPU {nodes} lost its reservation: {notice.reason}; access is revoked at "
                f"{format_timestamp(notice.revoke_at)} (save your work)",
                warning=True,
            )
            return
        if outcome.gone:
            return
        if outcome.forced:
            done = "; processes holding it open were stopped"
        elif outcome.still_open:
            done = "; processes that have it open keep it until they close it: " + ", ".join(
                f"{h.command} (pid {h.pid})" for h in outcome.still_open
            )
        else:
            done = ""
        self.events.emit(
            notice.target, REVOKED, f"revoked GPU {nodes}: {notice.reason}{done}", warning=True
        )


def _holder_spec(k8s: KubernetesSettings) -> HolderSpec:
    """The holder pods' shape, from the settings."""
    return HolderSpec(
        node_name=k8s.node_name,
        resource_name=k8s.resource_name,
        image=k8s.holder_image,
        cpu=k8s.holder_cpu,
        memory=k8s.holder_memory,
        priority_class=k8s.holder_priority_class,
        pull_policy=k8s.holder_image_pull_policy,
        pull_secrets=k8s.holder_image_pull_secrets,
    )


def _log_runtime(cri: CriClient, endpoint: str) -> None:
    """Say which container runtime answers; one that does not is logged, not fatal: the
    runtime may come up after the agent, and until then targets get 422."""
    try:
        runtime = cri.version()
    except CriError as e:
        log.error("%s; pods cannot be resolved until it answers", e)
        return
    log.info(
        "container runtime: %s %s (CRI %s) at %s",
        runtime.name,
        runtime.version,
        runtime.api_version,
        endpoint,
    )
