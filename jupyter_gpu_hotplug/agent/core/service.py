"""Orchestration of every backend: attach, detach and the entry points of the agent's views.

Why it exists: an attach touches three things that can each fail — the allocator (who owns
what), the host (device cgroups and nodes, through the ``Injector``) and NVML (which GPUs
exist) — and the product's promise is that a GPU is never usable by a container without a
reservation, never held by two containers, and never lost from the pool. The backend's parts
come in through the seams (``seams.py``): ``Resolver`` (request → ``HostContainer``),
``Identity`` (may this caller do this on that container?) and ``Allocator``; this module
knows nothing else of a backend. It orders the steps so that each durable write comes
*before* the host change it announces, and coordinates the modules that do each job:

- ``attach_checks``: what a request may get and what no waiting can fix (pure functions);
- ``admission``: serve, queue or refuse, over one ``Availability`` (pure);
- ``grant``: the host half of an attach, and its rollback;
- ``views``: the read endpoints' answers (the service resolves and authorizes their target).

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
This is decided here only (``attach_checks.repeated``), under the target's lock; allocators
just record ids.

Waiting (every mode): an attach that gives ``wait_seconds`` and finds too few GPUs it may take
joins the node's FIFO queue (``queue.py``) and lets go of its target's lock while it waits, so
a waiting request never blocks its target's other operations; one that does not wait is
refused at once (409) unless enough are free beyond what the queue's head holds
(``WaitQueue.held``). "Free" has one authority, ``Allocator.available`` (Kubernetes:
PodResources, so the device plugin's GPUs are not free); the decision is
``admission.decide``'s, at the request and at each change the queue wakes its waiters for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal

from ..._structs import (
    AttachmentList,
    GpuList,
    GpuUuid,
    IdleReleaseList,
    QueueView,
    RequestId,
    TargetRef,
)
from ...linux.devnodes import DeviceNode
from . import views
from .admission import Availability, Demand, Limit, Queue, Refuse, Serve, decide
from .attach_checks import (
    candidate_records,
    check_selectable,
    check_shape,
    limits_of,
    named_taken,
    queue_kind,
    repeated,
    taken_by_another,
    with_profile,
)
from .bundle import Core
from .errors import (
    AgentError,
    Busy,
    InsufficientGpus,
    LookupFailed,
    NotFound,
    TargetNotReady,
)
from .grant import attach_error, grant_reserved
from .injector import (
    InjectorError,
)
from .inventory import InventorySnapshot
from .meter import Measure, OperationMeter
from .queue import Waiter
from .revoke import Revoker
from .seams import (
    AttachRequest,
    Caller,
    HostContainer,
    Reservation,
    Suspension,
    Verb,
)
from .suspend import Suspender

__all__ = ["AgentService", "ServiceConfig"]

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


class AgentService:
    """Attach and detach for every backend; every public method is a coroutine for the API."""

    def __init__(self, core: Core, *, config: ServiceConfig) -> None:
        self.core = core
        """The seams and the state shared with the reconciler and the idle releaser."""
        self._config = config
        self._meter = OperationMeter()
        self.revoker = Revoker(core, label=self._label)
        """Every take-back: a detach here, and the loss sequence's and node sweep's."""
        self.suspender = Suspender(core, self.revoker)
        """A detach with ``keep`` and the resume of the next attach (``suspend.py``)."""

    async def wait_idle(self) -> None:
        """Return once no attach or detach is running (new ones may start later)."""
        await self._meter.wait_idle()

    def _measured(self, kind: Literal["attach", "detach"]) -> AbstractContextManager[Measure]:
        """One attach or detach, in flight while it runs, then counted and timed (``meter``)."""
        return self._meter.measured(self.core.metrics, kind)

    def _nodes_of(self, entries: Sequence[Reservation]) -> list[list[DeviceNode]]:
        """The nodes of each entry (``InjectorError`` when a slice's cannot be told)."""
        return [self.core.nodes.of(entry.gpu) for entry in entries]

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

    # --- views (views.py answers; the service resolves and authorizes their target) -------------

    async def gpus(self, caller: Caller) -> GpuList:
        """The node's GPUs as ``caller`` may see them (``views.gpu_list``)."""
        return await views.gpu_list(self.core, caller, plain_profile=self._config.mig_profile)

    async def refresh_gpu_metrics(self) -> None:
        """``gpu_hotplug_gpus`` re-read before a scrape (``views.refresh_gpu_counts``)."""
        await views.refresh_gpu_counts(self.core)

    async def attachments(self, caller: Caller, ref: TargetRef | None) -> AttachmentList:
        """The target's attachments (granted, or being released: still usable)."""
        container = await self._target(caller, ref, "get")
        listed = views.attachment_list(self.core, container.target)
        suspension = await self.suspender.find(container.target)
        if suspension is not None:
            listed["suspended"] = views.suspended_of(suspension)
        return listed

    async def idle_releases(self, caller: Caller, ref: TargetRef | None) -> IdleReleaseList:
        """What the idle policy took back from the target lately, oldest first."""
        container = await self._target(caller, ref, "get")
        return views.idle_release_list(self.core, container.target)

    async def queued(self, caller: Caller, ref: TargetRef | None) -> QueueView:
        """The target's requests waiting in the queue, with their positions."""
        container = await self._target(caller, ref, "get")
        return views.queue_view(self.core.queue, container.target)

    async def cancel_queued(
        self, caller: Caller, request_id: RequestId, ref: TargetRef | None
    ) -> None:
        """Cancel the target's waiting request ``request_id`` (``views.cancel_waiting``):
        the caller needs the right to delete on the target, as for a detach."""
        container = await self._target(caller, ref, "delete")
        views.cancel_waiting(self.core.queue, container.target, request_id)

    # --- attach ----------------------------------------------------------------------------------

    async def attach(self, caller: Caller, request: AttachRequest) -> AttachmentList:
        """Attach ``request.count`` GPUs to the request's target (201 body).

        One pass: resolve and authorize, then under the target's lock decide once — a repeated
        request id is answered with its first attachments, else ``_decide`` serves, queues (a
        request that may wait) or refuses it — then reserve, grant and record (at once, or at
        the waiter's turn, under the lock again).
        """
        with self._measured("attach"):
            check_selectable(request, selectable=self.core.allocator.selectable)
            request = with_profile(request, self._config.mig_profile)
            deadline = time.monotonic() + request.wait_seconds
            container, snapshot, unready = await self.core.workers.host(
                self._attach_inputs, caller, request.target
            )
            await self.core.identity.authorize(caller, "create", container)
            async with self.core.locks.operation(container.target):
                earlier = repeated(request, self.core.allocator.attachments_of(container.target))
                if earlier is not None:
                    log.info(
                        "request %s for %s repeated: returning its attachments",
                        request.request_id,
                        container.target,
                    )
                    return AttachmentList(attachments=[views.attachment_of(e) for e in earlier])
                suspension = await self.suspender.find(container.target)
                if suspension is not None:
                    return await self._resume(container, request, suspension, deadline)
                decision = await self._decide(caller, container, request, snapshot, unready)
                if isinstance(decision, Serve):
                    return await self._attach_locked(container, request, snapshot, deadline)
                waiter = self.core.queue.join(
                    container,
                    request.count,
                    request_id=request.request_id,
                    deadline=deadline,
                    kind=queue_kind(request),
                )
            return await self._attach_in_turn(container, request, waiter)

    async def _decide(
        self,
        caller: Caller,
        container: HostContainer,
        request: AttachRequest,
        snapshot: InventorySnapshot,
        unready: TargetNotReady | None,
    ) -> Serve | Queue:
        """The decision on a new request, under its target's lock: the backend's policy says
        whether the target may have GPUs and how many its group may hold, the request's shape
        and named GPUs are checked (``attach_checks``), and ``admission.decide`` weighs one
        ``Availability``; a refusal is raised."""
        policy = self.core.policy
        group = None if policy is None else await policy.gpu_limit(container)
        total = check_shape(request, snapshot)
        if unready is not None:  # read in the first trip; refused before anything is reserved
            raise unready
        own = limits_of(
            container.key,
            per_container=self._config.max_gpus_per_target,
            group=group,
            reservations=self.core.allocator.all_attachments(),
            waiters=self.core.queue.waiters,
        )
        availability = await self._availability(request, snapshot, total=total, limits=own)
        free = availability.free
        taken = named_taken(request, container.key, snapshot, self.core.allocator.get, free=free)
        if taken is not None:
            gpu, entry = taken
            seen = await self.core.identity.may_see(caller, entry.target)
            raise taken_by_another(request, gpu, entry, free=free, seen=seen)
        decision = decide(Demand(request.count, may_wait=request.queued), availability)
        if isinstance(decision, Refuse):
            raise decision.error
        return decision

    async def _attach_in_turn(
        self, container: HostContainer, request: AttachRequest, waiter: Waiter
    ) -> AttachmentList:
        """Wait for ``waiter``'s turn (outside the target's lock: a waiting request never
        blocks its target's other operations), then attach. It was admitted when it joined,
        and counts towards its container's limits while it waits (``attach_checks.limits``).
        It decides again only at a change of the node (``WaitQueue.wait``), never in a loop
        of its own."""
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
                    request, snapshot, total=check_shape(request, snapshot), waiter=waiter
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
        candidates = candidate_records(snapshot, request)
        free = len(await self.core.allocator.available(candidates))
        held = self.core.queue.held(queue_kind(request), free, waiter)
        return Availability(total=total, free=free, held=held, limits=limits)

    async def _alive(self, container: HostContainer) -> bool:
        """Whether a waiting request's target still runs; one that cannot be looked up now
        (``LookupFailed``) waits on: a slow API server or runtime is no exit."""
        core = self.core
        try:
            found = await core.workers.host(core.resolver.lookup, container.target, container.key)
        except LookupFailed as e:
            log.info("%s waits on: whether it still runs is not known now (%s)", container, e)
            return True
        return found is not None

    def _attach_inputs(
        self, caller: Caller, ref: TargetRef | None
    ) -> tuple[HostContainer, InventorySnapshot, TargetNotReady | None]:
        """The target's container, the node's GPUs and ``Core.unready``, in one trip.

        Both reads are made before the target's lock is taken: the inventory lists the node's
        GPUs, not who owns them (the allocator says that, under the lock, and decides); the
        driver check's refusal is raised only where the attach decides (``_decide``).
        """
        container = self._resolve(caller, ref)
        return container, self.core.inventory.snapshot(), self.core.unready(container)

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
        decision (``attach``); the host half and its rollback are ``grant.grant_reserved``'s."""
        entries = await self._reserve(container, request, snapshot, deadline, waiter=waiter)
        await self.core.checkpoints.reach("after_reserve")
        try:
            per_entry = self._nodes_of(entries)
        except InjectorError as e:
            await self.core.release([entry.gpu.uuid for entry in entries])
            raise attach_error(container, e) from e
        granted = await grant_reserved(self.core, container, entries, per_entry)
        self.core.idle.request([entry.gpu.uuid for entry in granted], request.idle_release_seconds)
        log.info(
            "attached %s to %s%s",
            ", ".join(f"{e.gpu.uuid} (/dev/nvidia{e.gpu.minor})" for e in granted),
            container,
            self._label,
        )
        return AttachmentList(attachments=[views.attachment_of(entry) for entry in granted])

    async def _resume(
        self,
        container: HostContainer,
        request: AttachRequest,
        suspension: Suspension,
        deadline: float,
    ) -> AttachmentList:
        """The attach of a suspended target: the GPUs ``Suspender.placement`` picks (of the
        suspended model, the same ones first; the request's count and selection give way to
        them), attached as a request naming them is, then its processes resumed on them; a
        failed resume detaches them again and the target stays suspended."""
        snapshot = await self.core.workers.host(self.core.inventory.snapshot)
        wanted = AttachRequest(
            count=len(suspension.gpus),
            target=request.target,
            wait_seconds=0,
            request_id=request.request_id,
        )
        free = await self.core.allocator.available(candidate_records(snapshot, wanted))
        chosen = self.suspender.placement(suspension, snapshot, {gpu.uuid for gpu in free})
        named = dataclasses.replace(wanted, gpus=chosen)
        attached = await self._attach_locked(container, named, snapshot, deadline)
        try:
            await self.suspender.resume(container, suspension, chosen)
        except AgentError:
            entries = [entry for e in chosen if (entry := self.core.allocator.get(e)) is not None]
            await self.revoker.detach_locked(container, entries, force=False)
            raise
        return attached

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
            candidates=candidate_records(snapshot, request),
        )
        self.core.queue.served(queue_kind(request), waiter)
        return entries

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
                await self.revoker.detach_gone(caller, entry.target, [entry])
                return
            await self.core.identity.authorize(caller, "delete", container)
            async with self.core.locks.operation(entry.target):
                await self.revoker.detach_locked(container, [entry], force=force)

    async def detach_all(
        self, caller: Caller, ref: TargetRef | None, *, force: bool, keep: bool = False
    ) -> None:
        """Detach every GPU of the target (nothing attached: nothing to do); with ``keep``,
        its CUDA processes are suspended first and resumed by its next attach
        (``Suspender.suspend``)."""
        with self._measured("detach") as measure:
            container = await self._target(caller, ref, "delete")
            async with self.core.locks.operation(container.target):
                entries = self.core.allocator.attachments_of(container.target)
                measure.gpus = len(entries)
                if entries and keep:
                    await self.suspender.suspend(container, entries)
                elif entries:
                    await self.revoker.detach_locked(container, entries, force=force)

    async def suspend_idle(self, container: HostContainer) -> list[Reservation]:
        """Suspend a target for the idle policy, keeping its CUDA state, and release all its
        GPUs; the caller holds the target (as the reconciler does). What was released, or
        nothing, with nothing changed, when the suspend was refused (logged: the next idle
        period tries again)."""
        entries = self.core.allocator.attachments_of(container.target)
        if not entries:
            return []
        try:
            await self.suspender.suspend(container, entries)
        except AgentError as e:
            log.warning("idle suspend of %s refused: %s", container, e)
            return []
        return entries

    async def release_unused(self, entry: Reservation, container: HostContainer) -> bool:
        """Detach one GPU for the idle policy, without force; the caller holds the target (as
        the reconciler does). False, with nothing changed, when the GPU turned out to be in
        use or could not be taken back cleanly (the next pass looks again)."""
        if self.core.allocator.get(entry.gpu.uuid) != entry:
            return False  # changed since the pass read it
        try:
            await self.revoker.detach_locked(container, [entry], force=False)
        except Busy:
            return False
        except AgentError as e:
            log.warning("idle release of %s from %s failed: %s", entry.gpu.uuid, container, e)
            return False
        return True
