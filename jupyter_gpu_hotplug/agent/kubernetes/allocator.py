"""The Kubernetes allocator: each hot-attached GPU is held by a holder pod (``holders.py``).

Why it exists: in Kubernetes the kubelet's device manager, not the agent, decides which GPU is
free. To take one, the agent creates a holder pod that requests it, waits (on the node's pod
watch, never by polling) until the holder runs or is refused, and asks PodResources which
device it got. The holder pods are the durable state: ``load`` rebuilds every reservation from
their labels and annotations, so a restarted agent knows exactly what it had, and a holder
that was never told its GPU (the agent died before the grant's intent was written) is
deleted — no container was ever granted that GPU.

The writes, each the fewest a crash allows (the API server's PATCH costs ≈ 12 ms on a real
node, more than the rest of the agent's own work; ``docs/performance.md``), and the crash each
one is there for (``tests/k8s/test_agent_crash.py`` kills the agent at every step):

- attach, **create** (``reserving``, the target, its container, the request id): the
  reservation itself — killed after it, the restarted agent finds the holder; one that knows no
  GPU is deleted (nothing was granted), and the kubelet frees its device;
- attach, **one PATCH** per holder, all together, before the grant (``intend_grant``): the GPU
  PodResources named, ``granted`` and since when, and whether the grant is about to make the
  GPU's device nodes. Killed after it — before, during or after the grant, before the answer —
  the restarted agent *finishes* the attach: the reconciler grants what is not granted, and the
  release removes exactly the nodes this write claims. No write follows the grant
  (``mark_granted`` writes only when the grant did not do what was intended). Rolling back
  instead would need a second PATCH after the grant, to tell a finished attach from one cut
  short: the cost of at-most-once, which a client gets without it by sending a request id
  (a retry is answered with the finished attach);
- detach, **PATCH** ``releasing`` before the revoke (``begin_release``): killed after the
  revoke, the restarted agent finishes the release instead of granting the GPU again. Without
  it the holders would still be consistent (the GPU granted where it is held), but a detach a
  user, the idle policy or the queue asked for would be undone by a crash — the GPU handed back
  to a container whose owner gave it up, a waiter kept waiting — to save one write of a path
  that waits for the holder's deletion anyway;
- detach, **delete** (by uid), after the revoke: the kubelet frees the GPU once it is gone.

Refusals are decided before anything is created where the node lets us see them (PodResources'
count of free devices, ``available``: the core's attach decision reads the same; the pod's
``max-gpus`` annotation is the tenant policy's, ``tenancy.py``, checked once by the core) and
otherwise by the cluster: a holder the kubelet cannot admit (Unschedulable, or ``Failed`` at
admission) means ``insufficient_gpus``; the namespace's ResourceQuota, which the API server
enforces when a holder is created, means ``forbidden`` with the API server's message, which
names the quota; a deadline means ``timeout``. Every refusal deletes whatever holders the
request created and waits until they are gone: nothing is left behind.

Holder pods are ordinary pods that a tenant may forge or patch where the holder-protection
admission policy is not installed (issue 31): ``load`` believes a holder only once it passes
``trust.vet`` (above all: the kubelet's PodResources names exactly its annotated GPU for that
pod), and one GPU has one owner — a second holder claiming a GPU is a conflict, reported, never
an overwrite. A holder that fails is not believed (its GPU is granted to no one on its word),
and is reported: a log line, an Event on it, ``gpu_hotplug_untrusted_holders_total{reason}``.
While the agent runs, it keeps what it wrote itself and never re-reads a holder's annotations
as the truth. A holder whose label someone removed is still the agent's to release: ``load`` finds
it by its annotations and vets it like any other, its state is kept in memory (the agent's
admission policy refuses annotating a pod without the label), and the agent deletes it (the
policy lets the agent delete a pod of the holder image carrying its annotations).

Holder pods can also disappear behind the agent's back (evicted, deleted by someone, their
node drained): ``on_lost`` is told at once — and at ``load`` of a holder that ended while the
agent was away — so the backend can take that GPU back (``core/lost.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, Final

from ..._structs import (
    GpuUuid,
    PodTarget,
    RequestId,
    Target,
    parse_timestamp,
    target_from_key,
)
from ..core.errors import (
    Busy,
    Forbidden,
    InsufficientGpus,
    InvalidRequest,
    NotFound,
    TargetNotReady,
    Timeout,
    Unavailable,
)
from ..core.inventory import GpuDevice, InventorySnapshot
from ..core.seams import (
    ContainerKey,
    GpuRecord,
    HostContainer,
    Reservation,
    ReservationState,
    Transition,
    plan_transition,
)
from .events import ATTACHED, DETACHED, REINJECTED, PodEvents
from .holders import (
    ANNOTATION_CONTAINER_ID,
    ANNOTATION_GRANTED_AT,
    ANNOTATION_NODE_CREATED,
    ANNOTATION_STATE,
    ANNOTATION_TARGET,
    LABEL_HOLDER,
    Holder,
    HolderSpec,
    gpu_annotations,
    holder_pod,
    read_holder,
)
from .kube import KubeApi, KubeConflict, KubeError, KubeForbidden, KubeObject
from .node_pods import NodePods
from .podresources import PodDevices, PodResourcesClient, PodResourcesError, device_uuid
from .trust import Distrust, Verdict, trusted_container_id, vet

__all__ = ["HolderAllocator"]

log = logging.getLogger(__name__)

_GONE_TIMEOUT: Final = 60.0
"""How long a release waits for deleted holders to disappear (the kubelet counts a GPU as
used until its holder is gone)."""

Blocking = Callable[..., Awaitable[Any]]
"""Runs a blocking call off the event loop (the core's ``Workers.host``)."""
Lost = Callable[[Reservation, str], None]
"""Told when a holder disappears (or fails) while its reservation stands, with the reason."""
Untrusted = Callable[[KubeObject, Verdict], None]
"""Told of each holder pod that is not believed (once per pod), with why."""


class HolderAllocator:
    """``Allocator`` over holder pods (see the module docstring)."""

    selectable = False
    """A holder pod asks for *a* GPU and the kubelet's device plugin picks which: a request
    naming GPUs cannot be honoured (the service refuses it before anything is created)."""

    def __init__(
        self,
        *,
        kube: KubeApi,
        pods: NodePods,
        podresources: PodResourcesClient,
        spec: HolderSpec,
        blocking: Blocking,
        events: PodEvents | None = None,
        gone_timeout: float = _GONE_TIMEOUT,
    ) -> None:
        self._events = events
        self._kube = kube
        self._pods = pods
        self._podresources = podresources
        self._spec = spec
        self._blocking = blocking
        self._gone_timeout = gone_timeout
        self._entries: dict[GpuUuid, Reservation] = {}
        self._holders: dict[GpuUuid, Holder] = {}
        self._deleting: set[tuple[str, str]] = set()
        """Holders this agent is deleting: their disappearance is no loss."""
        self._lost: Lost | None = None
        self._untrusted: Untrusted | None = None
        self._reported: set[str] = set()
        """Uids of the holder pods reported as untrusted (each is reported once)."""
        self._inventory: Callable[[], InventorySnapshot] | None = None
        self._loaded = False

    def on_lost(self, callback: Lost) -> None:
        self._lost = callback

    def on_untrusted(self, callback: Untrusted) -> None:
        self._untrusted = callback

    def use_inventory(self, snapshot: Callable[[], InventorySnapshot]) -> None:
        """NVML's GPUs (blocking), against which ``load`` checks a holder's minor and index;
        without it only PodResources is checked."""
        self._inventory = snapshot

    # --- reads ---------------------------------------------------------------------------------

    def attachments_of(self, target: Target) -> list[Reservation]:
        return sorted(
            (entry for entry in self._entries.values() if entry.target == target),
            key=_order,
        )

    def all_attachments(self) -> list[Reservation]:
        return sorted(self._entries.values(), key=_order)

    def get(self, uuid: GpuUuid) -> Reservation | None:
        return self._entries.get(uuid)

    def holder_of(self, uuid: GpuUuid) -> Holder | None:
        return self._holders.get(uuid)

    def trusts(self, pod: KubeObject) -> bool:
        """Whether ``pod`` is a holder this agent believes (the node sweep leaves those alone:
        the device plugin gave them their GPU). A pod merely labelled as a holder is not."""
        metadata = pod.get("metadata") or {}
        return any(
            (holder.namespace, holder.name, holder.uid)
            == (metadata.get("namespace"), metadata.get("name"), metadata.get("uid"))
            for holder in self._holders.values()
        )

    async def check(self) -> None:
        """The kubelet answers PodResources (the node-local half of the durable state)."""
        await self._blocking(self._podresources.list)

    # --- load ----------------------------------------------------------------------------------

    async def load(self) -> None:
        await self._pods.start()
        if not self._loaded:
            self._pods.listen(self._on_pod)
            self._loaded = True
        self._entries.clear()
        self._holders.clear()
        # Fail closed: without the kubelet's word, no holder is believed (the agent's start
        # fails and is retried).
        assigned: list[PodDevices] = await self._blocking(self._podresources.list)
        devices = {(pod.namespace, pod.name): pod for pod in assigned}
        gpus = await self._known_gpus()
        confirmed: list[tuple[KubeObject, Holder]] = []
        ended: list[tuple[KubeObject, Holder]] = []
        unfinished: list[Holder] = []
        for pod in self._pods.pods():
            metadata = pod.get("metadata") or {}
            # A holder someone unlabelled is still the agent's to release: it is looked for by
            # its annotations too, and believed on the same terms.
            labelled = (metadata.get("labels") or {}).get(LABEL_HOLDER) == "true"
            if not labelled and ANNOTATION_TARGET not in (metadata.get("annotations") or {}):
                continue
            holder = read_holder(pod, labelled=False)
            if holder is not None and holder.deleting:
                continue
            target_pod = (
                None
                if holder is None
                else self._pods.get(holder.target.namespace, holder.target.name)
            )
            verdict = vet(
                pod,
                holder,
                target_pod=target_pod,
                devices=devices.get((holder.namespace, holder.name)) if holder else None,
                resource_name=self._spec.resource_name,
                gpus=gpus,
                ended=_ended(pod) is not None,
            )
            if verdict is not None:
                self._distrust(pod, verdict)
                continue
            assert holder is not None, "vet believes no unreadable holder"
            holder = replace(holder, container_id=trusted_container_id(holder, target_pod))
            if holder.uuid is None or holder.minor is None:
                unfinished.append(holder)
            else:
                (ended if _ended(pod) is not None else confirmed).append((pod, holder))
        # One GPU, one owner: the holders the kubelet confirms first, the oldest first; a
        # second claim is a conflict, never an overwrite.
        for pod, holder in [*sorted(confirmed, key=_age), *sorted(ended, key=_age)]:
            assert holder.uuid is not None
            owner = self._holders.get(holder.uuid)
            if owner is not None:
                self._distrust(
                    pod, Verdict(Distrust.CONFLICT, f"{owner.ref} holds {holder.uuid} already")
                )
                continue
            entry = self._remember(holder)
            reason = _ended(pod)
            if reason is not None and self._lost is not None:
                # It ended while the agent was away (evicted): no pod event will say so now.
                self._lost(entry, reason)
        if unfinished:
            log.warning(
                "deleting %d holder pod(s) whose attach never learnt its GPU: %s",
                len(unfinished),
                ", ".join(holder.ref for holder in unfinished),
            )
            await self._delete_and_wait(unfinished, timeout=self._gone_timeout)
        log.info("holder pods on this node: %d reservation(s)", len(self._entries))

    async def _known_gpus(self) -> Mapping[GpuUuid, GpuDevice]:
        """NVML's GPUs by UUID, those it lost included as last seen."""
        if self._inventory is None:
            return {}
        snapshot: InventorySnapshot = await self._blocking(self._inventory)
        seen = [*snapshot.gpus, *(lost.last_known for lost in snapshot.lost if lost.last_known)]
        return {gpu.uuid: gpu for gpu in seen}

    def _distrust(self, pod: KubeObject, verdict: Verdict) -> None:
        """Believe nothing ``pod`` says; report it once."""
        metadata = pod.get("metadata") or {}
        uid = str(metadata.get("uid") or "")
        if uid in self._reported:
            return
        self._reported.add(uid)
        log.warning(
            "not trusting holder pod %s/%s (%s): %s; its GPU is granted to no one on its word",
            metadata.get("namespace"),
            metadata.get("name"),
            verdict.reason,
            verdict.detail,
        )
        if self._untrusted is not None:
            self._untrusted(pod, verdict)

    def _forget(self, pods: Collection[tuple[str, str]]) -> None:
        """Drop what was learnt of these holder pods: an attach rolled back after recording
        the GPU of some of its holders (another holder's annotation failed)."""
        for uuid, holder in list(self._holders.items()):
            if (holder.namespace, holder.name) in pods:
                self._holders.pop(uuid)
                self._entries.pop(uuid, None)

    def _remember(self, holder: Holder, *, state: ReservationState | None = None) -> Reservation:
        """Keep ``holder`` and its reservation, in ``state`` (by default: the reservation's
        state in memory, else the holder's; see "state changes" below)."""
        assert holder.uuid is not None and holder.minor is not None
        known = self._entries.get(holder.uuid)
        if state is None:
            state = holder.state if known is None else known.state
        entry = Reservation(
            gpu=GpuRecord(holder.uuid, holder.index or 0, holder.minor, holder.gpu_name),
            target=holder.target,
            container=ContainerKey(holder.container_id),
            state=state,
            request_id=holder.request_id,
            created_at=holder.created_at,
            granted_at=None if state is ReservationState.RESERVING else holder.granted_at,
            holder=holder.ref,
            node_created=holder.node_created,
        )
        self._entries[holder.uuid] = entry
        self._holders[holder.uuid] = holder
        return entry

    # --- reserve -------------------------------------------------------------------------------

    async def reserve(
        self,
        container: HostContainer,
        count: int,
        *,
        request_id: RequestId | None,
        deadline: float,
        candidates: Sequence[GpuRecord],
    ) -> list[Reservation]:
        try:
            return await self._reserve_checked(
                container, count, request_id=request_id, deadline=deadline, candidates=candidates
            )
        except (PodResourcesError, KubeError) as e:
            # The node's kubelet or the API server did not answer (what was created is rolled
            # back already): the cluster's trouble, not a bug of the agent's, and passing.
            raise TargetNotReady(
                f"GPUs cannot be reserved for {container.target} now: {e}",
                hint="the node's kubelet or the API server did not answer; try again shortly",
            ) from e

    async def _reserve_checked(
        self,
        container: HostContainer,
        count: int,
        *,
        request_id: RequestId | None,
        deadline: float,
        candidates: Sequence[GpuRecord],
    ) -> list[Reservation]:
        target = container.target
        if not isinstance(target, PodTarget) or target.container is None:
            raise InvalidRequest(f"{target} is not a pod's container", field="target")
        wait_seconds = max(0.0, deadline - time.monotonic())
        if wait_seconds <= 0:
            raise Timeout(f"no time left to reserve GPUs for {target}", wait_seconds=0)
        pod = await self._target_pod(target, container)
        free = await self.available(candidates)
        if len(free) < count:
            raise InsufficientGpus(free=len(free), requested=count)
        bodies = [
            holder_pod(
                pod,
                container=target.container,
                container_id=container.key,
                request_id=request_id,
                index=index,
                spec=self._spec,
            )
            for index in range(count)
        ]
        created: list[KubeObject] = []
        try:
            return await self._reserve(target, bodies, created, deadline, wait_seconds, candidates)
        except BaseException:
            holders = [h for h in map(read_holder, created) if h is not None]
            await asyncio.shield(self._delete_and_wait(holders, timeout=self._gone_timeout))
            self._forget({(h.namespace, h.name) for h in holders})
            raise

    async def _target_pod(self, target: PodTarget, container: HostContainer) -> KubeObject:
        """The target pod from the node's live view when that view already shows the container
        the resolver just found (same uid-bearing object, current enough), else from the API."""
        pod = self._pods.get(target.namespace, target.name)
        statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or []
        if not any(status.get("containerID") == container.key for status in statuses):
            pod = await self._kube.get_pod(target.namespace, target.name)
        if pod is None:
            raise NotFound("pod", f"{target.namespace}/{target.name}")
        return pod

    async def available(
        self, candidates: Sequence[GpuRecord], *, ignore: Collection[tuple[str, str]] = ()
    ) -> list[GpuRecord]:
        """The candidates no pod on the node holds (but those in ``ignore``), as PodResources
        tells — the device plugin's own pods included — and no holder of ours is taking (a
        holder not yet running is in no PodResources answer). 503 while the kubelet does not
        answer: without its word nothing is known free."""
        try:
            pods: list[PodDevices] = await self._blocking(self._podresources.list)
        except PodResourcesError as e:
            raise Unavailable(
                f"which GPUs are free cannot be told now: {e}",
                retry_after=1,
                hint="the node's kubelet did not answer PodResources; try again shortly",
            ) from e
        used = {
            device_uuid(device)
            for pod in pods
            if (pod.namespace, pod.name) not in ignore
            for device in pod.device_ids(self._spec.resource_name)
        }
        return [gpu for gpu in candidates if gpu.uuid not in used and gpu.uuid not in self._entries]

    async def _reserve(
        self,
        target: PodTarget,
        bodies: list[KubeObject],
        created: list[KubeObject],
        deadline: float,
        wait_seconds: float,
        candidates: Sequence[GpuRecord],
    ) -> list[Reservation]:
        namespace = target.namespace
        started = time.monotonic()
        results = await asyncio.gather(
            *(self._kube.create_pod(namespace, body) for body in bodies), return_exceptions=True
        )
        failure: BaseException | None = None
        for result in results:
            if isinstance(result, BaseException):
                failure = failure or result
                continue
            created.append(result)
            self._pods.remember(result)
        if isinstance(failure, KubeForbidden):
            raise Forbidden(
                f"a holder pod for {target} was refused: {failure}",
                hint="a ResourceQuota of the namespace (named above) or a policy forbids it",
            ) from failure
        if isinstance(failure, KubeConflict):
            raise Busy.operation_in_progress(str(target)) from failure
        if failure is not None:
            raise failure
        names = [body["metadata"]["name"] for body in bodies]
        outcome = await self._pods.wait_for(
            lambda: _settled(self._pods, namespace, names), deadline=deadline
        )
        if outcome is None:
            raise Timeout(
                f"the holder pod(s) for {target} did not run within {wait_seconds:.0f} s",
                wait_seconds=wait_seconds,
            )
        log.info(
            "holder pod(s) %s for %s: %s after %.1f ms (create to Running or refused)",
            ", ".join(f"{namespace}/{name}" for name in names),
            target,
            "refused" if outcome else "running",
            (time.monotonic() - started) * 1000,
        )
        if outcome:
            # This request's own holders are about to go: what they hold counts as free.
            free = await self.available(candidates, ignore={(namespace, name) for name in names})
            raise InsufficientGpus(
                free=len(free),
                requested=len(bodies),
                hint=f"the kubelet refused a holder pod: {outcome}",
            )
        return await self._learn_gpus(target, created, candidates)

    async def _learn_gpus(
        self, target: PodTarget, created: list[KubeObject], candidates: Sequence[GpuRecord]
    ) -> list[Reservation]:
        """Ask PodResources which GPU each running holder got, and remember it (in memory: it
        is written with the grant's intent, ``intend_grant``). A holder is taken as the agent
        created it (the API server's answer to the create), never from the node's view, which
        another principal may have patched since."""
        by_uuid = {gpu.uuid: gpu for gpu in candidates}
        learnt: list[Holder] = []
        for pod in created:
            holder = read_holder(pod)
            assert holder is not None, "the agent creates readable holders"
            devices: PodDevices | None = await self._blocking(
                self._podresources.get, target.namespace, holder.name
            )
            ids = [] if devices is None else devices.device_ids(self._spec.resource_name)
            uuids = {device_uuid(device) for device in ids}
            if len(uuids) != 1:
                raise InsufficientGpus(
                    free=0,
                    requested=len(created),
                    hint=f"the kubelet reports devices {ids} for holder {holder.name}, not one "
                    f"{self._spec.resource_name}",
                )
            (uuid,) = uuids
            gpu = by_uuid.get(GpuUuid(uuid))
            if gpu is None or uuid in self._entries or any(h.uuid == uuid for h in learnt):
                raise InsufficientGpus(
                    free=0,
                    requested=len(created),
                    hint=f"the device plugin gave holder {holder.name} the device {uuid}, which "
                    "this node's NVML does not list or which is held already: check the agent's "
                    "resource name and the device plugin's configuration",
                )
            learnt.append(
                replace(holder, uuid=gpu.uuid, index=gpu.index, minor=gpu.minor, gpu_name=gpu.name)
            )
        return sorted(map(self._remember, learnt), key=_order)

    # --- state changes -------------------------------------------------------------------------
    #
    # The holder's annotations are what a restarted agent rebuilds from; the reservation in
    # memory is what this agent acts on. They differ in one place: from ``intend_grant`` to
    # ``mark_granted`` the holder already says ``granted`` (the one write of an attach after
    # the create) while the reservation is still ``reserving`` (a detach meanwhile is 409, a
    # failed grant is rolled back). Every other change writes the state it makes.

    async def _write(
        self, uuid: GpuUuid, annotations: dict[str, str], *, state: ReservationState
    ) -> Reservation:
        """Record ``annotations`` on ``uuid``'s holder (none: no request) and make ``state``
        its reservation's state in memory."""
        holder = self._holders[uuid]
        if annotations:
            holder = await self._record(holder, annotations)
        return self._remember(holder, state=state)

    async def _set_state(
        self, uuids: Collection[GpuUuid], transition: Transition
    ) -> list[Reservation]:
        """Move the reservations as ``transition`` says (``seams.TRANSITIONS``: refused before
        any holder is touched), writing the new state on each holder that does not say it."""
        plan = plan_transition(transition, uuids, self._entries.get)
        changed = await _settled_all(
            self._write(
                uuid,
                {} if self._holders[uuid].state is state else {ANNOTATION_STATE: str(state)},
                state=state,
            )
            for uuid, state in plan.items()
        )
        return sorted(changed, key=_order)

    async def _record(self, holder: Holder, annotations: dict[str, str]) -> Holder:
        """Write ``annotations`` on the holder; the holder as the agent now knows it.

        What the agent wrote is what it believes: the API server's answer is not read back
        as the truth (another principal may have patched the pod meanwhile; ``load`` vets
        whatever is there at the next start). A holder whose label someone removed is still
        the agent's (same pod, by uid), but its own admission policy refuses annotating it:
        the state is kept in memory only, and the release deletes the pod."""
        try:
            pod = await self._kube.annotate_pod(holder.namespace, holder.name, annotations)
        except KubeForbidden:
            if not await self._unlabelled(holder):
                raise
            log.warning(
                "holder pod %s lost its label %s: %s kept in memory only",
                holder.ref,
                LABEL_HOLDER,
                annotations,
            )
        else:
            self._pods.remember(pod)
        return _recorded(holder, annotations)

    async def _unlabelled(self, holder: Holder) -> bool:
        """The holder pod is still there (the same pod, by uid) without its holder label."""
        pod = await self._kube.get_pod(holder.namespace, holder.name)
        metadata = (pod or {}).get("metadata") or {}
        return (
            pod is not None
            and metadata.get("uid") == holder.uid
            and (metadata.get("labels") or {}).get(LABEL_HOLDER) != "true"
        )

    async def intend_grant(
        self, uuids: Collection[GpuUuid], *, nodes_created: Collection[GpuUuid] = ()
    ) -> None:
        """The one write of an attach after the holder's create, made before the grant and
        for all its holders at once: the GPU PodResources named, ``granted`` with its time,
        and whether the grant is about to make the GPU's device nodes.

        Why ``granted`` already: an agent killed from here on restarts with the attach
        *finished* — the reconciler grants the GPU to the container again if the grant did
        not happen (``Reconciler._granted``), and removes the nodes on release only if this
        write says they are the agent's. Nothing of that needs a second write after the grant
        (``mark_granted`` writes only where the grant's outcome differs from this intent), and
        nothing is unsafe: the holder keeps the GPU from every other pod, and the container
        it names is the one the GPU is granted to. Killed before this write, the holder has no
        GPU recorded and a restarted agent deletes it — no grant had begun."""
        now = _timestamp()
        intended = [
            uuid
            for uuid in uuids
            if (entry := self._entries.get(uuid)) is not None
            and entry.state is ReservationState.RESERVING
        ]
        try:
            await _settled_all(
                self._write(
                    uuid,
                    _grant_record(self._holders[uuid], now, created=uuid in nodes_created),
                    state=ReservationState.RESERVING,
                )
                for uuid in intended
            )
        except KubeError as e:
            # Passing trouble of the API server, as in ``reserve``; the service rolls the
            # attach back (every holder goes, written or not).
            raise TargetNotReady(
                f"the grant of {', '.join(intended)} cannot be recorded now: {e}",
                hint="the API server did not answer; try again shortly",
            ) from e

    async def mark_granted(
        self, uuids: Collection[GpuUuid], *, nodes_created: Collection[GpuUuid] = ()
    ) -> list[Reservation]:
        plan = plan_transition(Transition.MARK_GRANTED, uuids, self._entries.get)
        now = _timestamp()
        attached = {
            uuid for uuid in plan if self._entries[uuid].state is ReservationState.RESERVING
        }

        def annotations(uuid: GpuUuid) -> dict[str, str]:
            holder, created = self._holders[uuid], uuid in nodes_created
            if uuid not in attached:
                return {}  # a cancelled release: granted already, as it was
            if holder.state is not ReservationState.GRANTED:
                # No intent written (an older agent's holder the reconciler finishes).
                return _grant_record(holder, now, created=created)
            if holder.node_created is not created:
                # The grant did not do what ``intend_grant`` recorded (a node appeared or went
                # between the check and the mknod): the release must know the truth.
                return {ANNOTATION_NODE_CREATED: _flag(created)}
            return {}

        granted = await _settled_all(
            self._write(uuid, annotations(uuid), state=ReservationState.GRANTED) for uuid in plan
        )
        for entry in granted:
            if entry.gpu.uuid in attached:
                self._event(entry, ATTACHED, "attached")
        return sorted(granted, key=_order)

    def _event(self, entry: Reservation, reason: str, verb: str, *, warning: bool = False) -> None:
        if self._events is not None:
            container = getattr(entry.target, "container", None)
            self._events.emit(
                entry.target,
                reason,
                f"{verb} GPU {entry.gpu.uuid} (/dev/nvidia{entry.gpu.minor}) "
                f"{'to' if reason != DETACHED else 'from'} container {container}, "
                f"held by pod {entry.holder}",
                warning=warning,
            )

    async def begin_release(self, uuids: Collection[GpuUuid]) -> list[Reservation]:
        return await self._set_state(uuids, Transition.BEGIN_RELEASE)

    async def cancel_release(self, uuids: Collection[GpuUuid]) -> list[Reservation]:
        return await self._set_state(uuids, Transition.CANCEL_RELEASE)

    async def rebind(
        self, uuids: Collection[GpuUuid], container: HostContainer
    ) -> list[Reservation]:
        moved = {
            uuid
            for uuid in uuids
            if (e := self._entries.get(uuid)) and e.container != container.key
        }
        annotations = {
            ANNOTATION_CONTAINER_ID: container.key,
            ANNOTATION_TARGET: container.target.key,
        }
        rebound: list[Reservation] = []
        for uuid in uuids:
            holder = self._holders.get(uuid)
            if holder is None:
                raise NotFound("attachment", uuid)
            entry = self._remember(await self._record(holder, annotations))
            rebound.append(entry)
            if uuid in moved:
                self._event(entry, REINJECTED, "re-injected")
        return rebound

    async def release(self, uuids: Collection[GpuUuid]) -> None:
        holders = [self._holders[uuid] for uuid in uuids if uuid in self._holders]
        await self._delete_and_wait(holders, timeout=self._gone_timeout)
        for uuid in uuids:
            entry = self._entries.pop(uuid, None)
            self._holders.pop(uuid, None)
            if entry is not None and entry.state is not ReservationState.RESERVING:
                self._event(entry, DETACHED, "detached")

    async def _delete_and_wait(self, holders: Sequence[Holder], *, timeout: float) -> None:
        """Delete the holders (only the very pods we know, by uid) and wait until they are gone
        from the node's view; a holder still there after ``timeout`` is logged."""
        if not holders:
            return
        keys = {(h.namespace, h.name) for h in holders}
        self._deleting |= keys
        try:
            await asyncio.gather(
                *(self._kube.delete_pod(h.namespace, h.name, uid=h.uid or None) for h in holders)
            )

            def all_gone() -> bool | None:
                gone = all(
                    self._pods.get(h.namespace, h.name) is None or _replaced(self._pods, h)
                    for h in holders
                )
                return True if gone else None

            await self._pods.wait_for(all_gone, deadline=time.monotonic() + timeout)
            still = [
                h.ref
                for h in holders
                if self._pods.get(h.namespace, h.name) is not None and not _replaced(self._pods, h)
            ]
            if still:
                log.warning("holder pod(s) still terminating after %.0f s: %s", timeout, still)
        finally:
            self._deleting -= keys

    # --- holders lost behind our back ----------------------------------------------------------

    def _on_pod(self, kind: str, pod: KubeObject) -> None:
        metadata = pod.get("metadata") or {}
        key = (str(metadata.get("namespace", "")), str(metadata.get("name", "")))
        if key in self._deleting:
            return
        for uuid, holder in list(self._holders.items()):
            if (holder.namespace, holder.name) != key:
                continue
            if holder.uid and metadata.get("uid") and metadata.get("uid") != holder.uid:
                continue
            if kind == "DELETED":
                reason = "its holder pod was deleted"
            elif metadata.get("deletionTimestamp"):
                reason = "its holder pod is being deleted"
            elif (ended := _ended(pod)) is not None:
                reason = ended
            else:
                continue
            entry = self._entries.get(uuid)
            if entry is not None and self._lost is not None:
                self._lost(entry, reason)


def _ended(pod: KubeObject) -> str | None:
    """Why a holder pod is over (evicted, failed), or None while it stands."""
    status = pod.get("status") or {}
    if status.get("phase") in ("Failed", "Succeeded"):
        return f"its holder pod ended ({status.get('reason') or status.get('phase')})"
    return None


async def _settled_all(calls: Iterable[Awaitable[Reservation]]) -> list[Reservation]:
    """Run ``calls`` together and wait for every one of them; the first failure is raised
    only then, so that no write lands (and is remembered) after its caller rolled back."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return [result for result in results if not isinstance(result, BaseException)]


def _timestamp() -> str:
    """Now, as a holder's ``granted-at`` records it."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _flag(value: bool) -> str:
    return "true" if value else "false"


def _grant_record(holder: Holder, now: str, *, created: bool) -> dict[str, str]:
    """What a holder records of its grant: its GPU, ``granted`` since ``now``, and whether the
    agent makes (made) the GPU's device nodes in the container."""
    assert holder.uuid is not None and holder.index is not None and holder.minor is not None
    return {
        **gpu_annotations(
            uuid=holder.uuid, index=holder.index, minor=holder.minor, name=holder.gpu_name
        ),
        ANNOTATION_STATE: str(ReservationState.GRANTED),
        ANNOTATION_GRANTED_AT: now,
        ANNOTATION_NODE_CREATED: _flag(created),
    }


def _recorded(holder: Holder, annotations: Mapping[str, str]) -> Holder:
    """``holder`` with the annotations the agent has just written."""
    changes: dict[str, Any] = {}
    if ANNOTATION_STATE in annotations:
        changes["state"] = ReservationState(annotations[ANNOTATION_STATE])
    if ANNOTATION_GRANTED_AT in annotations:
        changes["granted_at"] = parse_timestamp(annotations[ANNOTATION_GRANTED_AT])
    if ANNOTATION_NODE_CREATED in annotations:
        changes["node_created"] = annotations[ANNOTATION_NODE_CREATED] == "true"
    if ANNOTATION_CONTAINER_ID in annotations:
        changes["container_id"] = annotations[ANNOTATION_CONTAINER_ID]
    if ANNOTATION_TARGET in annotations:
        target = target_from_key(annotations[ANNOTATION_TARGET])
        assert isinstance(target, PodTarget), "the agent records pod targets only"
        changes["target"] = target
    return replace(holder, **changes)


def _age(found: tuple[KubeObject, Holder]) -> tuple[datetime, str]:
    """Oldest first: the holder that claimed a GPU first keeps it."""
    return found[1].created_at, found[1].ref


def _order(entry: Reservation) -> tuple[int, str]:
    return entry.gpu.index, entry.gpu.uuid


def _replaced(pods: NodePods, holder: Holder) -> bool:
    """A pod of that name exists, but it is another one (a new uid)."""
    pod = pods.get(holder.namespace, holder.name)
    uid = (pod or {}).get("metadata", {}).get("uid")
    return pod is not None and bool(holder.uid) and bool(uid) and uid != holder.uid


def _settled(pods: NodePods, namespace: str, names: list[str]) -> str | None:
    """ "" when every holder runs, the reason when one never will, None while undecided."""
    running = 0
    for name in names:
        pod = pods.get(namespace, name)
        if pod is None:
            return f"holder pod {namespace}/{name} was deleted"
        holder = read_holder(pod)
        if holder is None:
            return f"holder pod {namespace}/{name} is not a holder any more"
        if holder.deleting:
            return f"holder pod {namespace}/{name} is being deleted"
        if holder.unschedulable is not None:
            return f"holder pod {namespace}/{name}: {holder.unschedulable}"
        if holder.phase == "Running":
            running += 1
    return "" if running == len(names) else None
