"""Orchestration of every backend: attach, detach and the views of GPUs and attachments.

Why it exists: an attach touches three things that can each fail — the allocator (who owns
what), the host (device cgroups and nodes, through the ``Injector``) and NVML (which GPUs
exist) — and the product's promise is that a GPU is never usable by a container without a
reservation, never held by two containers, and never lost from the pool. The backend's parts
come in through the seams (``seams.py``): ``Resolver`` (request → ``HostContainer``),
``Identity`` (may this caller do this on that container?) and ``Allocator``; this module
knows nothing else of a backend. It orders the steps so that each durable write comes
*before* the host change it announces, rolls back everything on a failure, and leaves what it
cannot undo in a state the reconciler finishes.

Attach: resolve the target (and read the node's GPUs, in the same trip to the thread pool),
authorize it → per-target lock → decide once (a repeated request id, then ``admission.decide``
over one ``Availability``: serve, queue or refuse) → ``reserve`` (``reserving``) → ``grant``
→ ``mark_granted``.
Detach: resolve and authorize → lock → ``begin_release`` (``releasing``) → ``revoke``
(refused while processes hold the GPU, unless ``force``; answered 503 with ``retry_after``
when the scan for them runs past its deadline) → ``release``; a refused revoke is undone
with ``cancel_release``.

Concurrency: one operation at a time per target; a second one on the same target is answered
409 ``busy`` at once (retryable) rather than queued, so a client never waits behind an operation
it cannot see, while one that meets the reconciler waits the few milliseconds it takes (see
``locks``); operations on different targets run in parallel. Blocking work runs in threads,
never on the event loop: ``/proc``, NVML and the engine in a pool (see ``workers``); the
allocator's reads come from memory.

Idempotency: an attach with a ``request_id`` that this target already used returns the earlier
attachments instead of attaching again (a client retrying after a timeout gets no second GPU).
This is decided here only (``_served``), under the target's lock; allocators just record ids.

Waiting (every mode): an attach that gives ``wait_seconds`` and finds too few GPUs it may take
joins the node's FIFO queue (``queue.py``) and lets go of its target's lock while it waits, so
a waiting request never blocks its target's other operations; one that does not wait is
refused at once (409) unless enough are free beyond what the queue's head holds
(``WaitQueue.held``). "Free" has one authority, ``Allocator.available`` (Kubernetes:
PodResources, so the device plugin's GPUs are not free); the decision is
``admission.decide``'s, at the request and at each change the queue wakes its waiters for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from ..._structs import (
    Attachment,
    AttachmentList,
    GpuInfo,
    GpuList,
    GpuUuid,
    IdleReleaseList,
    IdleReleaseRecord,
    IdleReleaseWire,
    LostHolderWire,
    ProcessInfo,
    QueuedRequest,
    QueueView,
    RequestId,
    Target,
    TargetRef,
    format_timestamp,
)
from ...linux.devnodes import DeviceNode
from .admission import Availability, Demand, Limit, Queue, Refuse, Serve, decide
from .bundle import Core
from .devices import flat
from .driver_files import DriverFilesFailed
from .errors import (
    AgentError,
    Busy,
    Forbidden,
    InsufficientGpus,
    InvalidRequest,
    NotFound,
    TargetNotReady,
    Unavailable,
)
from .idle import IdleWarning
from .injector import (
    DeviceInUse,
    HolderInfo,
    InjectionFailed,
    InjectorError,
    ScanUnfinished,
    TargetGone,
)
from .inventory import GpuDevice, InventorySnapshot
from .lost import TakeBack
from .queue import Waiter
from .seams import (
    AttachRequest,
    Caller,
    ContainerKey,
    GpuLimit,
    GpuRecord,
    HostContainer,
    Reservation,
    ReservationState,
    Verb,
)

__all__ = ["AgentService", "ServiceConfig", "attachment_of"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceConfig:
    """The settings the service itself needs."""

    max_gpus_per_target: int
    simulated: bool = False
    """Only for log lines: every change is labelled SIMULATED when the GPUs are."""
    mig_profile: str | None = None
    """The one MIG profile this agent hands out (Kubernetes mode with a MIG resource name:
    every holder requests a slice of it), so every attach takes slices of it; ``None``: a
    request takes whole GPUs unless it names a profile."""


@dataclass
class _Measure:
    """What an operation reports about itself for its metrics."""

    gpus: int = 1
    """How many GPUs it concerned (detach counts per GPU)."""


def attachment_of(
    entry: Reservation,
    warning: IdleWarning | None = None,
    lost: LostHolderWire | None = None,
) -> Attachment:
    """The wire form of a reservation, with the idle policy's warning if one is in force and
    the announced revoke of a lost reservation if there is one."""
    moment = entry.granted_at or entry.created_at
    attachment = Attachment(
        uuid=entry.gpu.uuid,
        index=entry.gpu.index,
        minor=entry.gpu.minor,
        name=entry.gpu.name,
        device=f"/dev/nvidia{entry.gpu.minor}",
        target=entry.target.to_wire(),
        holder=entry.holder,
        attached_at=format_timestamp(moment),
    )
    if warning is not None:
        attachment["idle_release"] = IdleReleaseWire(
            reason=warning.reason.value, release_at=format_timestamp(warning.release_at)
        )
    if lost is not None:
        attachment["holder_lost"] = lost
    return attachment


def _processes(holders: Sequence[HolderInfo]) -> list[ProcessInfo]:
    return [ProcessInfo(pid=h.pid, command=h.command) for h in holders]


class AgentService:
    """Attach and detach for every backend; every public method is a coroutine for the API."""

    def __init__(self, core: Core, *, config: ServiceConfig) -> None:
        self.core = core
        """The seams and the state shared with the reconciler and the idle releaser."""
        self._config = config
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def _operation(self) -> Iterator[None]:
        """Count an attach or detach as in flight (metric, and ``wait_idle`` for shutdown)."""
        self._in_flight += 1
        self._idle.clear()
        self.core.metrics.in_flight.inc()
        try:
            yield
        finally:
            self.core.metrics.in_flight.dec()
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no attach or detach is running (new ones may start later)."""
        await self._idle.wait()

    @contextlib.contextmanager
    def _measured(self, kind: Literal["attach", "detach"]) -> Iterator[_Measure]:
        """One attach or detach: in flight while it runs, then counted by result and timed."""
        measure = _Measure()
        started = time.monotonic()
        result = "internal_error"
        counter, histogram = (
            (self.core.metrics.attach_total, self.core.metrics.attach_duration)
            if kind == "attach"
            else (self.core.metrics.detach_total, self.core.metrics.detach_duration)
        )
        with self._operation():
            try:
                yield measure
                result = "success"
            except AgentError as e:
                result = e.code
                raise
            finally:
                counter.labels(result=result).inc(measure.gpus)
                histogram.observe(time.monotonic() - started)

    def _nodes_of(self, entries: Sequence[Reservation]) -> list[list[DeviceNode]]:
        """The nodes of each entry (``InjectorError`` when a slice's cannot be told)."""
        return [self.core.nodes.of(entry.gpu) for entry in entries]

    def _revocable(
        self, container: HostContainer, entries: Sequence[Reservation]
    ) -> list[list[DeviceNode]]:
        """The nodes taking ``entries`` back revokes from ``container`` (``GpuNodes.revocable``)."""
        return self.core.nodes.revocable(
            [entry.gpu for entry in entries],
            container=container.key,
            reservations=self.core.allocator.all_attachments(),
        )

    @property
    def _label(self) -> str:
        return " (SIMULATED)" if self._config.simulated else ""

    # --- targets ---------------------------------------------------------------------------------

    async def _target(self, caller: Caller, ref: TargetRef | None, verb: Verb) -> HostContainer:
        """The container a request means, resolved and authorized for ``caller``."""
        container = await self.core.workers.host(self._resolve, caller, ref)
        await self.core.identity.authorize(caller, verb, container)
        return container

    def _resolve(self, caller: Caller, ref: TargetRef | None) -> HostContainer:
        """Resolve ``ref``, or "the caller itself" when it is None (blocking: in the pool)."""
        return self.core.resolver.resolve(
            self.core.identity.self_target(caller) if ref is None else ref
        )

    # --- views -----------------------------------------------------------------------------------

    async def gpus(self, caller: Caller) -> GpuList:
        """Every healthy GPU of the node, ``attached`` if the ledger gives it to a target —
        named only to a caller who may see that target (``Identity.may_see``): to anyone
        else it is taken by nobody named (``target`` null). One held by nobody the agent
        knows and not free either (``Allocator.available``: a device-plugin pod's) is
        ``allocated``: the same "free" an attach is decided on."""
        snapshot = await self.core.workers.host(self.core.inventory.snapshot)
        entries = self.core.allocator.all_attachments()
        owners = {entry.gpu.uuid: entry for entry in entries}
        free = await self._free_of(snapshot)
        self._count_gpus(snapshot, owners.keys(), free)
        seen = {
            target: await self.core.identity.may_see(caller, target)
            for target in {entry.target for entry in entries}
        }
        return GpuList(
            gpus=[
                GpuInfo(
                    uuid=gpu.uuid,
                    index=gpu.index,
                    minor=gpu.minor,
                    name=gpu.name,
                    memory_total=gpu.memory_total,
                    state="attached"
                    if gpu.uuid in owners
                    else "free"
                    if gpu.uuid in free
                    else "allocated",
                    target=owners[gpu.uuid].target.to_wire()
                    if gpu.uuid in owners and seen[owners[gpu.uuid].target]
                    else None,
                    simulated=gpu.simulated,
                    selectable=self.core.allocator.selectable
                    and (gpu.whole or gpu.mig is not None),
                    kind=gpu.kind,
                    plain_attach=_serves(gpu, self._config.mig_profile),
                )
                for gpu in snapshot.gpus
            ]
        )

    async def refresh_gpu_metrics(self) -> None:
        """Re-read inventory, reservations and what is free into ``gpu_hotplug_gpus`` (before
        each scrape: exact when read, free between scrapes); while the allocator cannot say
        what is free, the last counts stay."""
        snapshot = await self.core.workers.host(self.core.inventory.snapshot)
        owned = {entry.gpu.uuid for entry in self.core.allocator.all_attachments()}
        try:
            free = await self._free_of(snapshot)
        except AgentError as e:
            log.debug("GPU counts not refreshed: %s", e)
            return
        self._count_gpus(snapshot, owned, free)

    async def _free_of(self, snapshot: InventorySnapshot) -> set[GpuUuid]:
        """Which of the node's GPUs are free (``Allocator.available``, the one authority)."""
        records = [_record(gpu) for gpu in snapshot.gpus]
        return {gpu.uuid for gpu in await self.core.allocator.available(records)}

    def _count_gpus(
        self, snapshot: InventorySnapshot, owned: Collection[GpuUuid], free: Collection[GpuUuid]
    ) -> None:
        attached = sum(1 for gpu in snapshot.gpus if gpu.uuid in owned)
        available = sum(1 for gpu in snapshot.gpus if gpu.uuid in free and gpu.uuid not in owned)
        self.core.metrics.set_gpu_counts(
            {
                "free": available,
                "attached": attached,
                "allocated": len(snapshot.gpus) - attached - available,
                "lost": len(snapshot.lost),
            }
        )

    async def attachments(self, caller: Caller, ref: TargetRef | None) -> AttachmentList:
        """The target's attachments (granted, or being released: still usable)."""
        container = await self._target(caller, ref, "get")
        entries = self.core.allocator.attachments_of(container.target)
        return AttachmentList(
            attachments=[
                attachment_of(
                    entry, self.core.idle.warning_of(entry), self.core.losses.of(entry.gpu.uuid)
                )
                for entry in entries
                if entry.state is not ReservationState.RESERVING
            ]
        )

    async def idle_releases(self, caller: Caller, ref: TargetRef | None) -> IdleReleaseList:
        """What the idle policy took back from the target lately, oldest first."""
        container = await self._target(caller, ref, "get")
        return IdleReleaseList(
            releases=[
                IdleReleaseRecord(
                    uuid=release.uuid,
                    target=release.target.to_wire(),
                    reason=release.reason.value,
                    released_at=format_timestamp(release.released_at),
                )
                for release in self.core.idle.releases_of(container.target)
            ]
        )

    # --- attach ----------------------------------------------------------------------------------

    async def attach(self, caller: Caller, request: AttachRequest) -> AttachmentList:
        """Attach ``request.count`` GPUs to the request's target (201 body).

        One pass: resolve and authorize, then under the target's lock decide once — a repeated
        request id is answered with its first attachments, the backend's policy says whether
        the target may have GPUs and how many its group may hold, and ``admission.decide``
        over one ``Availability`` serves, queues (a request that may wait) or refuses it —
        then reserve, grant and record (at once, or at the waiter's turn, under the lock again).
        """
        with self._measured("attach"):
            if request.gpus and not self.core.allocator.selectable:
                raise InvalidRequest(
                    "this agent cannot attach a GPU the request names: the cluster picks the "
                    "device (the kubelet's device plugin chooses the GPU of each holder pod)",
                    field="gpus",
                    hint='leave "gpus" out and give only count; GET /v1/gpus marks such GPUs '
                    '"selectable": false',
                )
            request = self._profiled(request)
            deadline = time.monotonic() + request.wait_seconds
            container, snapshot = await self.core.workers.host(
                self._attach_inputs, caller, request.target
            )
            await self.core.identity.authorize(caller, "create", container)
            async with self.core.locks.operation(container.target):
                served = self._served(container.target, request)
                if served is not None:
                    return served
                policy = self.core.policy
                limit = None if policy is None else await policy.gpu_limit(container)
                total = self._check_shape(request, snapshot)
                # Before anything is reserved or queued: a GPU it could not use is refused.
                # (Before the availability is read: nothing awaited comes between that read
                # and the reservation, so what the queue's head holds is what it holds then.)
                await self.core.workers.host(self.core.driver_files.check, container)
                availability = await self._availability(
                    request, snapshot, total=total, limits=self._limits(container, limit)
                )
                await self._check_named_free(caller, container, request, snapshot, availability)
                decision = decide(Demand(request.count, may_wait=request.queued), availability)
                if isinstance(decision, Refuse):
                    raise decision.error
                if isinstance(decision, Serve):
                    return await self._attach_locked(container, request, snapshot, deadline)
                waiter = self.core.queue.join(
                    container,
                    request.count,
                    request_id=request.request_id,
                    deadline=deadline,
                    kind=_kind(request),
                )
            return await self._attach_in_turn(container, request, waiter)

    async def _attach_in_turn(
        self, container: HostContainer, request: AttachRequest, waiter: Waiter
    ) -> AttachmentList:
        """Wait for ``waiter``'s turn (outside the target's lock: a waiting request never
        blocks its target's other operations), then attach. It was admitted when it joined,
        and counts towards its container's limits while it waits (``_limits``). It decides
        again only at a change of the node (``WaitQueue.wait``), never in a loop of its own."""
        log.info(
            "%s waits for %d GPU(s): number %d in the queue",
            container,
            request.count,
            self.core.queue.position(waiter),
        )
        demand = Demand(request.count, may_wait=True, waiting=True)
        free = 0
        try:
            while True:
                await self.core.queue.wait(
                    waiter,
                    free=free,
                    alive=lambda: self._alive(container),
                    wait_seconds=request.wait_seconds,
                )
                # The node may have changed while it waited: hand out what NVML sees now.
                snapshot = await self.core.workers.host(self.core.inventory.snapshot)
                availability = await self._availability(
                    request, snapshot, total=self._check_shape(request, snapshot), waiter=waiter
                )
                free = availability.free
                decision = decide(demand, availability)
                if isinstance(decision, Refuse):
                    raise decision.error
                if isinstance(decision, Queue):
                    continue
                # Its target's lock only to attach: a waiter that merely looks never makes
                # its target's other operations busy.
                async with self.core.locks.operation(container.target):
                    with contextlib.suppress(InsufficientGpus):
                        # Refused all the same (another took the GPU first: a device-plugin
                        # pod, a request that fits): wait for the next change, as at a Queue.
                        return await self._attach_locked(
                            container, request, snapshot, waiter.deadline, waiter=waiter
                        )
        finally:
            self.core.queue.leave(waiter)

    def _profiled(self, request: AttachRequest) -> AttachRequest:
        """``request`` with the agent's MIG profile, where it hands out only that one."""
        profile = self._config.mig_profile
        if profile is None or request.mig == profile:
            return request
        if request.mig is None:
            return replace(request, mig=profile)
        raise InvalidRequest(
            f"this agent hands out MIG slices of profile {profile} only, not {request.mig}",
            field="mig",
            hint=f'leave "mig" out or give "{profile}"',
        )

    @staticmethod
    def _candidates(snapshot: InventorySnapshot, request: AttachRequest) -> list[GpuDevice]:
        """What a request may get: the GPUs it names (``_check_shape`` checked that they can be
        handed out), else whole GPUs, or the MIG slices of its profile."""
        if request.gpus:
            return [gpu for gpu in snapshot.gpus if gpu.uuid in request.gpus]
        return [gpu for gpu in snapshot.gpus if _serves(gpu, request.mig)]

    @classmethod
    def _records(cls, snapshot: InventorySnapshot, request: AttachRequest) -> list[GpuRecord]:
        """``_candidates`` as the allocator takes them."""
        return [_record(gpu) for gpu in cls._candidates(snapshot, request)]

    async def _availability(
        self,
        request: AttachRequest,
        snapshot: InventorySnapshot,
        *,
        total: int,
        limits: tuple[Limit, ...] = (),
        waiter: Waiter | None = None,
    ) -> Availability:
        """The node as one decision sees it: what is free from the allocator, the one
        authority (read once), less what the queue's head holds against ``waiter`` (None: a
        request not in the queue)."""
        free = len(await self.core.allocator.available(self._records(snapshot, request)))
        held = self.core.queue.held(_kind(request), free, waiter)
        return Availability(total=total, free=free, held=held, limits=limits)

    def _limits(self, container: HostContainer, limit: GpuLimit | None) -> tuple[Limit, ...]:
        """The container's limits as the backend resolved them: the agent's per-container
        setting, and its group's (``TargetPolicy``: a pod's ``max-gpus``), each with what the
        group holds and its waiting requests will take (``_held``)."""
        own = Limit(
            count=self._config.max_gpus_per_target,
            held=self._held(lambda key, _: key == container.key),
        )
        if limit is None:
            return (own,)
        group = Limit(
            count=limit.count,
            held=self._held(lambda _, target: limit.covers(target)),
            source=limit.source,
        )
        return (own, group)

    async def _alive(self, container: HostContainer) -> bool:
        core = self.core
        found = await core.workers.host(core.resolver.lookup, container.target, container.key)
        return found is not None

    def _check_shape(self, request: AttachRequest, snapshot: InventorySnapshot) -> int:
        """How many GPUs of the kind asked for the node has in all (``Availability.total``),
        once what the request names can be handed out (``_check_named``) and, for MIG slices,
        the node has slices of its profile (else 409, not retryable: no wait helps)."""
        if request.gpus:
            return _check_named(request, snapshot)
        if request.mig is None:
            return len(self._candidates(snapshot, request)) + len(snapshot.lost)
        total = len(self._candidates(snapshot, request))
        if total == 0:
            profiles = sorted({g.mig.profile or "?" for g in snapshot.gpus if g.mig})
            raise InsufficientGpus(
                free=0,
                requested=request.count,
                hint=f"this node has no MIG slice of profile {request.mig}: its slices are "
                f"{', '.join(profiles)}"
                if profiles
                else f"this node has no MIG slice of profile {request.mig}: no GPU of "
                "this node is in MIG mode",
                retryable=False,
            )
        return total

    async def _check_named_free(
        self,
        caller: Caller,
        container: HostContainer,
        request: AttachRequest,
        snapshot: InventorySnapshot,
        availability: Availability,
    ) -> None:
        """Refuse a request naming a GPU that is taken, saying by whom as far as ``caller``
        may know (``Identity.may_see``: another tenant is "another container", never named):
        one already the target's own never frees for it (not retryable); one of someone else
        is refused at once unless the request may wait (then it waits for that GPU)."""
        devices = {gpu.uuid: gpu for gpu in snapshot.gpus}
        for uuid in request.gpus:
            entry = self.core.allocator.get(uuid)
            if entry is None:
                continue
            what = _describe(devices[uuid])
            free = availability.free
            if entry.container == container.key:
                raise InsufficientGpus(
                    free=free,
                    requested=request.count,
                    message=f"{what} is already attached to {entry.target}",
                    hint="it is yours already; name another GPU, or leave gpus out",
                    retryable=False,
                )
            if not request.queued:
                seen = await self.core.identity.may_see(caller, entry.target)
                raise InsufficientGpus(
                    free=free,
                    requested=request.count,
                    message=f"{what} is attached to "
                    f"{entry.target if seen else 'another container'}",
                    hint="name a free GPU, or ask with wait_seconds to wait until this one is free",
                )

    def _held(self, covers: Callable[[ContainerKey, Target], bool]) -> int:
        """The GPUs the containers ``covers`` picks hold, and will take at their waiting
        requests' turns (each was admitted when it joined the queue, not again at its turn)."""
        held = sum(
            1 for e in self.core.allocator.all_attachments() if covers(e.container, e.target)
        )
        return held + sum(
            w.count for w in self.core.queue.waiters if covers(w.container.key, w.container.target)
        )

    async def queued(self, caller: Caller, ref: TargetRef | None) -> QueueView:
        """The target's requests waiting in the queue, with their positions."""
        container = await self._target(caller, ref, "get")
        waiters = self.core.queue.waiters
        return QueueView(
            length=len(waiters),
            requests=[
                QueuedRequest(
                    request_id=waiter.request_id,
                    target=waiter.target.to_wire(),
                    count=waiter.count,
                    position=position,
                    queued_at=format_timestamp(waiter.queued_at),
                )
                for position, waiter in enumerate(waiters, start=1)
                if waiter.target.key == container.target.key
            ],
        )

    async def cancel_queued(
        self, caller: Caller, request_id: RequestId, ref: TargetRef | None
    ) -> None:
        """Cancel the target's waiting request ``request_id`` (its ``POST`` answers that it
        was cancelled). Only the named target's (or the caller's own): request ids are chosen
        by clients, and a cancel reaching every waiter with the id, any container's, let one
        container cancel another's wait (issue 25)."""
        container = await self._target(caller, ref, "delete")
        waiters = [
            waiter
            for waiter in self.core.queue.find(request_id)
            if waiter.target.key == container.target.key
        ]
        if not waiters:
            raise NotFound("queued request", request_id)
        for waiter in waiters:
            self.core.queue.cancel(waiter)
            log.info("queued request %s for %s cancelled", request_id, waiter.target)

    def _attach_inputs(
        self, caller: Caller, ref: TargetRef | None
    ) -> tuple[HostContainer, InventorySnapshot]:
        """The target's container and the node's GPUs, in one trip to the pool.

        The inventory is read before the target's lock is taken: it lists the node's GPUs,
        not who owns them (the allocator says that, under the lock, and decides).
        """
        return self._resolve(caller, ref), self.core.inventory.snapshot()

    async def _attach_locked(
        self,
        container: HostContainer,
        request: AttachRequest,
        snapshot: InventorySnapshot,
        deadline: float,
        *,
        waiter: Waiter | None = None,
    ) -> AttachmentList:
        """Reserve, grant, record: the attach itself, under the target's lock, after the
        decision (``attach``)."""
        entries = await self._reserve(container, request, snapshot, deadline, waiter=waiter)
        await self.core.checkpoints.reach("after_reserve")
        granted = await self._grant(container, entries)
        self.core.idle.request([entry.gpu.uuid for entry in granted], request.idle_release_seconds)
        log.info(
            "attached %s to %s%s",
            ", ".join(f"{e.gpu.uuid} (/dev/nvidia{e.gpu.minor})" for e in granted),
            container,
            self._label,
        )
        return AttachmentList(attachments=[attachment_of(entry) for entry in granted])

    async def _reserve(
        self,
        container: HostContainer,
        request: AttachRequest,
        snapshot: InventorySnapshot,
        deadline: float,
        *,
        waiter: Waiter | None,
    ) -> list[Reservation]:
        """``request.count`` GPUs (or slices) of ``snapshot`` reserved for ``container``, once
        ``admission.decide`` said to serve it (what the queue's head holds included)."""
        self.core.nodes.learn(snapshot)
        entries = await self.core.allocator.reserve(
            container,
            request.count,
            request_id=request.request_id,
            deadline=deadline,
            candidates=self._records(snapshot, request),
        )
        self.core.queue.served(_kind(request), waiter)
        return entries

    async def _grant(
        self, container: HostContainer, entries: list[Reservation]
    ) -> list[Reservation]:
        """Make the reserved GPUs usable in ``container`` and record it (``mark_granted``);
        on any failure the reservation is rolled back (``_undo_reservation``)."""
        uuids = [entry.gpu.uuid for entry in entries]
        try:
            per_entry = self._nodes_of(entries)
        except InjectorError as e:
            await self.core.release(uuids)
            raise _attach_error(container, e) from e
        nodes = flat(per_entry)
        try:
            await self._intend_grant(container, entries, per_entry)
            await self.core.checkpoints.reach("after_intent")
            created = await self.core.workers.host(self.core.injector.grant, container, nodes)
            await self.core.workers.host(self.core.driver_files.provide, container, nodes)
        except InjectorError as e:
            await self._undo_reservation(container, uuids, nodes, clean=_is_clean(e))
            raise _attach_error(container, e) from e
        except DriverFilesFailed as e:
            await self._undo_reservation(container, uuids, nodes, clean=False)
            raise TargetNotReady(
                f"the GPU could not be made usable in {container}: {e}",
                hint="nothing was left attached; see the agent's log",
                retryable=False,
            ) from e
        except BaseException:
            await self._undo_reservation(container, uuids, nodes, clean=False)
            raise
        await self.core.checkpoints.reach("after_grant")
        try:
            granted = await self.core.allocator.mark_granted(
                uuids,
                nodes_created=[
                    entry.gpu.uuid
                    for entry, own in zip(entries, per_entry, strict=True)
                    if all(node.name in created for node in own)
                ],
            )
        except BaseException:
            await self._undo_reservation(container, uuids, nodes, clean=False)
            raise
        await self.core.checkpoints.reach("after_mark_granted")
        return granted

    async def _intend_grant(
        self,
        container: HostContainer,
        entries: Sequence[Reservation],
        per_entry: Sequence[Sequence[DeviceNode]],
    ) -> None:
        """Record, before the grant, that it is about to happen and which reservations' nodes
        it makes (all of their nodes absent now), so a crash after the ``mknod`` leaves them
        known as ours (``Allocator.intend_grant``)."""
        nodes = flat(per_entry)
        states = await self.core.workers.host(self.core.injector.status, container, nodes)
        absent = {node.name for node, state in zip(nodes, states, strict=True) if not state.node}
        making = [
            entry.gpu.uuid
            for entry, own in zip(entries, per_entry, strict=True)
            if all(node.name in absent for node in own)
        ]
        await self.core.allocator.intend_grant(
            [entry.gpu.uuid for entry in entries], nodes_created=making
        )

    def _served(self, target: Target, request: AttachRequest) -> AttachmentList | None:
        """The answer to a retried request, or None for a new one: the one idempotency check
        of the agent (allocators record request ids and never interpret them), run under the
        target's lock so that no two attaches with one request id reserve twice."""
        request_id, count = request.request_id, request.count
        if request_id is None:
            return None
        earlier = [
            entry
            for entry in self.core.allocator.attachments_of(target)
            if entry.request_id == request_id
        ]
        if not earlier:
            return None
        if len(earlier) != count:
            raise InvalidRequest.request_id_reused(request_id, used=len(earlier), requested=count)
        if any(entry.state is ReservationState.RESERVING for entry in earlier):
            # Left by a crash and not yet reconciled: neither done nor undone.
            raise Busy.operation_in_progress(str(target))
        log.info("request %s for %s repeated: returning its attachments", request_id, target)
        return AttachmentList(attachments=[attachment_of(entry) for entry in earlier])

    async def _undo_reservation(
        self, target: HostContainer, uuids: list[GpuUuid], nodes: list[DeviceNode], *, clean: bool
    ) -> None:
        """Roll an attach back after its grant failed or was not recorded.

        ``clean``: the host is known to be as before, so only the reservation goes. Otherwise
        the devices are revoked first; if even that fails the reservation stays, still
        ``reserving``, for the reconciler: releasing it would leave a GPU usable by a
        container that the allocator does not know holds it.
        """
        if not clean:
            try:
                # Which nodes the failed grant created is unknown: none is removed (without
                # the permission, a node left behind opens nothing).
                await self.core.workers.host(
                    self.core.injector.revoke,
                    target,
                    nodes,
                    force=False,
                    keep_nodes=[node.name for node in nodes],
                )
            except TargetGone:
                log.info("%s exited during the attach; nothing left to revoke", target)
            except InjectorError as e:
                log.error(
                    "attach of %s to %s failed and its grant could not be undone (%s); the "
                    "reservation stays for the reconciler",
                    ", ".join(uuids),
                    target,
                    e,
                )
                return
        await self.core.release(uuids)

    # --- detach ----------------------------------------------------------------------------------

    async def detach(self, caller: Caller, uuid: GpuUuid, *, force: bool) -> None:
        """Detach one GPU from whichever container has it (the caller must be allowed to act
        on that container)."""
        with self._measured("detach"):
            entry = self.core.allocator.get(uuid)
            if entry is None:
                raise NotFound("attachment", uuid)
            container = await self.core.workers.host(
                self.core.resolver.current, entry.target, entry.container
            )
            if container is None:
                await self._detach_gone(caller, entry.target, [entry])
                return
            await self.core.identity.authorize(caller, "delete", container)
            async with self.core.locks.operation(entry.target):
                await self._detach_locked(container, [entry], force=force)

    async def detach_all(self, caller: Caller, ref: TargetRef | None, *, force: bool) -> None:
        """Detach every GPU of the target (nothing attached: nothing to do)."""
        with self._measured("detach") as measure:
            container = await self._target(caller, ref, "delete")
            async with self.core.locks.operation(container.target):
                entries = self.core.allocator.attachments_of(container.target)
                measure.gpus = len(entries)
                if entries:
                    await self._detach_locked(container, entries, force=force)

    async def release_unused(self, entry: Reservation, container: HostContainer) -> bool:
        """Detach one GPU for the idle policy, without force; the caller holds the target (as
        the reconciler does). False, with nothing changed, when the GPU turned out to be in
        use or could not be taken back cleanly (the next pass looks again)."""
        if self.core.allocator.get(entry.gpu.uuid) != entry:
            return False  # changed since the pass read it
        try:
            await self._detach_locked(container, [entry], force=False)
        except Busy:
            return False
        except AgentError as e:
            log.warning("idle release of %s from %s failed: %s", entry.gpu.uuid, container, e)
            return False
        return True

    # --- lost reservations (lost.py decides when) -------------------------------------------------

    async def take_back(self, entry: Reservation, *, force: bool) -> TakeBack | None:
        """Revoke a GPU whose reservation lost its backing (a holder pod gone) and release
        the reservation: the same node rule, ``node_created`` and pool as a detach, under the
        target's lock (``Busy`` while a caller's operation holds it). None when the
        reservation changed meanwhile (detached, re-attached)."""
        async with self.core.locks.operation(entry.target):
            current = self.core.allocator.get(entry.gpu.uuid)
            if current is None or current.holder != entry.holder:
                return None
            container = await self.core.workers.host(
                self.core.resolver.lookup, current.target, current.container
            )
            outcome = TakeBack(gone=True, forced=False)
            if container is not None:
                per_entry = self._revocable(container, [current])
                outcome = await self._revoke_unbacked(
                    container, per_entry, keep=_not_created([current], per_entry), force=force
                )
            await self.core.release([current.gpu.uuid])
        return outcome

    async def take_back_orphan(
        self,
        container: HostContainer,
        gpus: Sequence[GpuRecord],
        *,
        force: bool,
        spare: Collection[str] = (),
    ) -> TakeBack | None:
        """Revoke from ``container`` the access to ``gpus`` that no reservation backs (an
        orphaned grant: its holder vanished while the agent was down; or a stray one). No
        record says the agent made their nodes, so the nodes stay and their permission goes;
        the nodes named in ``spare`` are not touched (what the container got elsewhere still
        needs them). None when a reservation for the container appeared meanwhile."""
        async with self.core.locks.operation(container.target):
            reserved = {
                entry.gpu.uuid
                for entry in self.core.allocator.all_attachments()
                if entry.container == container.key
            }
            gpus = [gpu for gpu in gpus if gpu.uuid not in reserved]
            if not gpus:
                return None
            per_gpu = [
                [node for node in nodes if node.name not in spare]
                for nodes in self.core.nodes.revocable(
                    gpus,
                    container=container.key,
                    reservations=self.core.allocator.all_attachments(),
                )
            ]
            keep = [node.name for nodes in per_gpu for node in nodes]
            return await self._revoke_unbacked(container, per_gpu, keep=keep, force=force)

    async def _revoke_unbacked(
        self,
        container: HostContainer,
        per_gpu: Sequence[Sequence[DeviceNode]],
        *,
        keep: Sequence[str],
        force: bool,
    ) -> TakeBack:
        """Revoke without a user's consent: with ``force`` the holders are ended; otherwise
        the access goes and the processes keep what they have open."""
        nodes = flat(per_gpu)
        try:
            holders = await self.core.workers.host(self.core.injector.holders, container, nodes)
        except InjectionFailed as e:
            # Only for the record of who keeps it open: the access goes all the same.
            log.warning("cannot tell who holds %s open in %s: %s", nodes, container, e)
            holders = []
        except TargetGone:
            return TakeBack(gone=True, forced=False)
        try:
            await self.core.workers.host(
                self.core.injector.revoke,
                container,
                nodes,
                force=force,
                keep_nodes=keep,
                leave_open=True,
            )
        except TargetGone:
            return TakeBack(gone=True, forced=False)
        log.warning(
            "revoked %s from %s%s%s",
            ", ".join(node.name for node in nodes),
            container,
            " (forced)" if force and holders else "",
            self._label,
        )
        return TakeBack(
            gone=False,
            forced=force and bool(holders),
            still_open=() if force else tuple(holders),
        )

    async def _detach_gone(
        self, caller: Caller, target: Target, entries: list[Reservation]
    ) -> None:
        """The container has no process left: its GPUs only need to leave the allocator."""
        if not caller.privileged:
            raise Forbidden(
                f"{target} has exited, so no caller can show it is theirs",
                hint="the agent releases the GPUs of exited processes by itself shortly",
            )
        async with self.core.locks.operation(target):
            remains = await self.core.workers.host(self.core.resolver.remains, entries[0].container)
            if remains is not None:
                try:
                    nodes = flat(self._nodes_of(entries))
                    await self.core.workers.host(self.core.injector.withdraw, remains, nodes)
                except InjectorError as e:
                    raise TargetNotReady(
                        f"the GPU could not be taken from the empty cgroups of {target}: {e}",
                        hint="the GPU stays reserved; the agent tries again by itself",
                        retryable=True,
                    ) from e
            await self.core.release([entry.gpu.uuid for entry in entries])
        log.info("released %s of exited %s", ", ".join(e.gpu.uuid for e in entries), target)

    async def _detach_locked(
        self, container: HostContainer, entries: Sequence[Reservation], *, force: bool
    ) -> None:
        """Detach ``entries`` from ``container``, the caller holding the target's lock: mark
        them ``releasing``, revoke, release (``_revoke_detached`` says what a refused revoke
        leaves)."""
        if any(entry.state is ReservationState.RESERVING for entry in entries):
            raise Busy.operation_in_progress(str(container.target))
        per_entry = self._detach_nodes(container, entries)
        uuids = [entry.gpu.uuid for entry in entries]
        await self.core.allocator.begin_release(uuids)
        await self.core.checkpoints.reach("after_begin_release")
        await self._revoke_detached(container, entries, per_entry, force=force)
        await self.core.checkpoints.reach("after_revoke")
        await self.core.release(uuids)
        if not self.core.allocator.attachments_of(container.target):
            await self._withdraw_driver_files(container)
        log.info(
            "detached %s from %s%s%s",
            ", ".join(uuids),
            container,
            " (forced)" if force else "",
            self._label,
        )

    async def _withdraw_driver_files(self, container: HostContainer) -> None:
        """Its last GPU gone, the driver's files go too; a failure is logged, never the
        detach's (the GPU is already taken back), and the reconciler's sweep retries."""
        try:
            await self.core.workers.host(self.core.driver_files.withdraw, container)
        except Exception:
            log.exception("taking the driver's files from %s failed; the sweep retries", container)

    def _detach_nodes(
        self, container: HostContainer, entries: Sequence[Reservation]
    ) -> list[list[DeviceNode]]:
        """The nodes a detach of ``entries`` revokes (422 when a slice's cannot be told)."""
        try:
            return self._revocable(container, entries)
        except InjectionFailed as e:
            raise TargetNotReady(
                f"the GPU could not be taken from {container}: {e}",
                hint="the GPU is still attached; see the agent's log",
                retryable=False,
            ) from e

    async def _revoke_detached(
        self,
        container: HostContainer,
        entries: Sequence[Reservation],
        per_entry: Sequence[Sequence[DeviceNode]],
        *,
        force: bool,
    ) -> None:
        """Revoke the ``releasing`` entries' nodes. Refused with the host unchanged (in use,
        a scan past its deadline, a clean failure): the release is cancelled, the GPUs stay
        attached and the refusal is raised. Failed half-way: the entries stay ``releasing``
        for the reconciler. The container gone: nothing left to revoke."""
        uuids = [entry.gpu.uuid for entry in entries]
        try:
            await self.core.workers.host(
                self.core.injector.revoke,
                container,
                flat(per_entry),
                force=force,
                keep_nodes=_not_created(entries, per_entry),
            )
        except TargetGone:
            log.info("%s exited during the detach; releasing its record", container)
        except DeviceInUse as e:
            await self.core.allocator.cancel_release(uuids)
            raise Busy.gpus_in_use(uuids, _processes(e.holders)) from e
        except ScanUnfinished as e:
            await self.core.allocator.cancel_release(uuids)
            raise Unavailable(
                f"could not tell in time whether {', '.join(uuids)} is in use in {container}: {e}",
                retry_after=math.ceil(e.seconds),
                hint="nothing was changed; try again (a container with very many processes "
                "and open files takes long to scan)",
            ) from e
        except InjectionFailed as e:
            if e.clean:
                await self.core.allocator.cancel_release(uuids)
                raise TargetNotReady(
                    f"the GPU could not be taken from {container}: {e}",
                    hint="the GPU is still attached; try again, and see the agent's log",
                    retryable=False,
                ) from e
            raise TargetNotReady(
                f"taking the GPU from {container} failed half-way: {e}",
                hint="the agent finishes the release by itself; see its log",
                retryable=True,
            ) from e


def _serves(gpu: GpuDevice, mig: str | None) -> bool:
    """Whether an attach of ``count`` for MIG profile ``mig`` (``None``: whole GPUs) may get
    ``gpu``. The one rule for what an attach not naming its GPUs gets, and so for what
    ``GET /v1/gpus`` calls ``plain_attach`` (with the agent's own profile, ``_profiled``)."""
    if mig is None:
        return gpu.whole
    return gpu.mig is not None and gpu.mig.profile == mig


def _record(gpu: GpuDevice) -> GpuRecord:
    """A GPU of the inventory as the allocator takes it."""
    return GpuRecord(gpu.uuid, gpu.index, gpu.minor, gpu.name)


def _kind(request: AttachRequest) -> str | None:
    """What a request waits for in the queue (``Waiter.kind``): its named GPUs, or whole GPUs,
    or slices of its MIG profile."""
    return ",".join(sorted(request.gpus)) if request.gpus else request.mig


def _describe(gpu: GpuDevice) -> str:
    """A GPU as a person finds it in the panel and ``nvidia-smi``: by its index."""
    if gpu.mig is None:
        return f"GPU {gpu.index} ({gpu.uuid})"
    return f"MIG slice {gpu.uuid} of GPU {gpu.index}"


def _check_named(request: AttachRequest, snapshot: InventorySnapshot) -> int:
    """How many GPUs a request naming its GPUs may get (all it names), once each is known to
    be a healthy GPU of the node (else 404 ``gpu``) that can be handed out alone: a whole GPU,
    or a MIG slice, of ``request.mig``'s profile when it gives one (else 400 ``gpus``)."""
    devices = {gpu.uuid: gpu for gpu in snapshot.gpus}
    for uuid in request.gpus:
        gpu = devices.get(uuid)
        if gpu is None:
            raise NotFound(
                "gpu",
                uuid,
                hint="list the node's GPUs (GET /v1/gpus) and name one of them"
                + (f"; {len(snapshot.lost)} GPU(s) of the node are lost" if snapshot.lost else ""),
            )
        if gpu.mig is None and not gpu.whole:
            raise InvalidRequest(
                f"{_describe(gpu)} is in MIG mode: it is handed out only as its MIG slices",
                field="gpus",
                hint="name one of its slices (MIG-...) instead",
            )
        if request.mig is not None and (gpu.mig is None or gpu.mig.profile != request.mig):
            raise InvalidRequest(
                f"{_describe(gpu)} is not a MIG slice of profile {request.mig}",
                field="gpus",
                hint='leave "mig" out: a MIG- UUID names its slice by itself',
            )
    return len(request.gpus)


def _not_created(
    entries: Sequence[Reservation], nodes: Sequence[Sequence[DeviceNode]]
) -> list[str]:
    """The nodes a release must leave in place: those the agent did not create."""
    return [
        node.name
        for entry, own in zip(entries, nodes, strict=True)
        if not entry.node_created
        for node in own
    ]


def _is_clean(error: InjectorError) -> bool:
    """Whether a failed grant left the host as it was."""
    if isinstance(error, InjectionFailed):
        return error.clean
    return isinstance(error, TargetGone)


def _attach_error(target: HostContainer, error: InjectorError) -> AgentError:
    if isinstance(error, TargetGone):
        return NotFound(
            "process",
            str(target.pid),
            hint="the process exited during the attach; nothing was left behind",
        )
    return TargetNotReady(
        f"the GPU could not be made usable in {target}: {error}",
        hint="nothing was left attached; check that the target is a running container with a "
        "normal /dev, and see the agent's log",
        retryable=False,
    )
