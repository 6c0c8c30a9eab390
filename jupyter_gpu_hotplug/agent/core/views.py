"""What the agent's read endpoints show: the node's GPUs, a target's attachments, idle releases
and waiting requests, rendered from the core's books into the wire contract.

Why it exists: these answers change nothing (cancelling a waiting request only takes it out of
the queue, never touches the host or a reservation), so they need none of an attach's ordering,
locks or rollback. Kept apart from the service, each is a function of the books it is given:
the service (``service.py``) resolves and authorizes the target, then hands it here. The one
rule they share with an attach is what counts as free, ``Allocator.available``: ``GET
/v1/gpus`` and the ``gpu_hotplug_gpus`` metric say "free" exactly where an attach would find a
GPU free.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

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
    QueuedRequest,
    QueueView,
    RequestId,
    SuspendedWire,
    Target,
    format_timestamp,
)
from .attach_checks import as_record, serves
from .bundle import Core
from .errors import AgentError, NotFound
from .idle import IdleWarning
from .inventory import InventorySnapshot
from .metrics import AgentMetrics
from .queue import WaitQueue
from .seams import Caller, Reservation, ReservationState, Suspension

__all__ = [
    "attachment_list",
    "attachment_of",
    "cancel_waiting",
    "gpu_list",
    "idle_release_list",
    "queue_view",
    "refresh_gpu_counts",
]

log = logging.getLogger(__name__)


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


async def gpu_list(core: Core, caller: Caller, *, plain_profile: str | None) -> GpuList:
    """Every healthy GPU of the node, ``attached`` if the ledger gives it to a target — named
    only to a caller who may see that target (``Identity.may_see``): to anyone else it is
    taken by nobody named (``target`` null). One held by nobody the agent knows and not free
    either (``Allocator.available``: a device-plugin pod's) is ``allocated``: the same "free"
    an attach is decided on. ``plain_attach``: what an attach of a count alone gets, with the
    agent's own MIG profile ``plain_profile``."""
    snapshot = await core.workers.host(core.inventory.snapshot)
    entries = core.allocator.all_attachments()
    owners = {entry.gpu.uuid: entry for entry in entries}
    free = await _free_of(core, snapshot)
    _count_gpus(core.metrics, snapshot, owners.keys(), free)
    seen = {
        target: await core.identity.may_see(caller, target)
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
                selectable=core.allocator.selectable and (gpu.whole or gpu.mig is not None),
                kind=gpu.kind,
                plain_attach=serves(gpu, plain_profile),
            )
            for gpu in snapshot.gpus
        ]
    )


async def refresh_gpu_counts(core: Core) -> None:
    """Re-read inventory, reservations and what is free into ``gpu_hotplug_gpus`` (before each
    scrape: exact when read, free between scrapes); while the allocator cannot say what is
    free, the last counts stay."""
    snapshot = await core.workers.host(core.inventory.snapshot)
    owned = {entry.gpu.uuid for entry in core.allocator.all_attachments()}
    try:
        free = await _free_of(core, snapshot)
    except AgentError as e:
        log.debug("GPU counts not refreshed: %s", e)
        return
    _count_gpus(core.metrics, snapshot, owned, free)


async def _free_of(core: Core, snapshot: InventorySnapshot) -> set[GpuUuid]:
    """Which of the node's GPUs are free (``Allocator.available``, the one authority)."""
    records = [as_record(gpu) for gpu in snapshot.gpus]
    return {gpu.uuid for gpu in await core.allocator.available(records)}


def _count_gpus(
    metrics: AgentMetrics,
    snapshot: InventorySnapshot,
    owned: Collection[GpuUuid],
    free: Collection[GpuUuid],
) -> None:
    attached = sum(1 for gpu in snapshot.gpus if gpu.uuid in owned)
    available = sum(1 for gpu in snapshot.gpus if gpu.uuid in free and gpu.uuid not in owned)
    metrics.set_gpu_counts(
        {
            "free": available,
            "attached": attached,
            "allocated": len(snapshot.gpus) - attached - available,
            "lost": len(snapshot.lost),
        }
    )


def attachment_list(core: Core, target: Target) -> AttachmentList:
    """The target's attachments (granted, or being released: still usable), each with its
    idle warning and its lost holder's announced revoke."""
    return AttachmentList(
        attachments=[
            attachment_of(entry, core.idle.warning_of(entry), core.losses.of(entry.gpu.uuid))
            for entry in core.allocator.attachments_of(target)
            if entry.state is not ReservationState.RESERVING
        ]
    )


def suspended_of(suspension: Suspension) -> SuspendedWire:
    """A suspended target's kept state as the API shows it."""
    return SuspendedWire(
        state=suspension.state.value,
        model=suspension.model,
        uuids=[gpu.uuid for gpu in suspension.gpus],
        pids=list(suspension.pids),
        host_memory=suspension.host_memory,
    )


def idle_release_list(core: Core, target: Target) -> IdleReleaseList:
    """What the idle policy took back from the target lately, oldest first."""
    return IdleReleaseList(
        releases=[
            IdleReleaseRecord(
                uuid=release.uuid,
                target=release.target.to_wire(),
                reason=release.reason.value,
                released_at=format_timestamp(release.released_at),
            )
            for release in core.idle.releases_of(target)
        ]
    )


def queue_view(queue: WaitQueue, target: Target) -> QueueView:
    """The target's requests waiting in the queue, with their places in the whole queue."""
    waiters = queue.waiters
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
            if waiter.target.key == target.key
        ],
    )


def cancel_waiting(queue: WaitQueue, target: Target, request_id: RequestId) -> None:
    """Cancel the target's waiting request ``request_id`` (its ``POST`` answers that it was
    cancelled); 404 when it has none. Only that target's: request ids are chosen by clients,
    and a cancel reaching every waiter with the id, any container's, let one container cancel
    another's wait (issue 25)."""
    waiters = [waiter for waiter in queue.find(request_id) if waiter.target.key == target.key]
    if not waiters:
        raise NotFound("queued request", request_id)
    for waiter in waiters:
        queue.cancel(waiter)
        log.info("queued request %s for %s cancelled", request_id, waiter.target)
