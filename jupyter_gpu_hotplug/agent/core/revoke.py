"""Taking GPUs back from containers: a user's detach, the idle policy's release, a lost
reservation, an orphaned or stray grant.

Why it exists: every way a GPU leaves a container must follow the same rules — the nodes
revoked are those the container's entitlement no longer needs (``entitlement.py``, through
``GpuNodes.revocable``: never the GPU node a slice it keeps shares, whether the slice is
reserved or the device plugin assigned it — on cgroup v1 a deny removes the entry whoever
added it, so revoking that node would take the plugin's slice too), a node is removed only
where the agent recorded that it made it (``Reservation.node_created``), each durable write
comes before the host change it announces, and a refused revoke leaves the reservation as it
was. The service (a user's detach), the idle releaser, the loss sequence (``lost.py``) and the
node sweep (``sweep.py``) all take GPUs back through one ``Revoker``.

Detach: ``begin_release`` (``releasing``) → ``revoke`` (refused while processes hold the GPU,
unless ``force``; answered 503 with ``retry_after`` when the scan for them runs past its
deadline) → ``release``; a refused revoke is undone with ``cancel_release``. A take-back
without a user's consent (a lost holder, an orphan, a stray) never refuses: with ``force`` the
holders are ended, otherwise the access goes and processes keep what they have open.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Collection, Sequence

from ..._structs import GpuUuid, ProcessInfo, Target
from ...linux.devnodes import DeviceNode
from .attach_checks import as_record
from .bundle import Core
from .devices import flat, is_mig
from .entitlement import Entitlement
from .errors import Busy, Forbidden, TargetNotReady, Unavailable
from .injector import (
    DeviceInUse,
    HolderInfo,
    InjectionFailed,
    InjectorError,
    ScanUnfinished,
    TargetGone,
)
from .lost import TakeBack
from .seams import Caller, GpuRecord, HostContainer, Reservation, ReservationState

__all__ = ["Revoker"]

log = logging.getLogger(__name__)


class Revoker:
    """Every take-back of the core (see the module docstring)."""

    def __init__(self, core: Core, *, label: str = "") -> None:
        self._core = core
        self._label = label
        """Appended to each log line of a change (`` (SIMULATED)`` when the GPUs are)."""

    async def revocable(
        self, container: HostContainer, leaving: Sequence[GpuRecord]
    ) -> list[list[DeviceNode]]:
        """The nodes taking each of ``leaving`` back from ``container`` revokes: never one
        that its other reservations or what it was assigned need (``_revoked_nodes``).
        ``InjectionFailed`` (clean) when a slice's nodes, or what the container was
        assigned, cannot be told."""
        assigned, known = await self._assigned(container, leaving)
        entitlement = Entitlement.of(container, self._core.allocator.all_attachments(), assigned)
        return self._revoked_nodes(entitlement, leaving, known)

    def _revoked_nodes(
        self, entitlement: Entitlement, leaving: Sequence[GpuRecord], known: Sequence[GpuRecord]
    ) -> list[list[DeviceNode]]:
        """The one rule of every take-back: the nodes of each of ``leaving`` that nothing
        ``entitlement`` keeps needs (its other reservations; its assigned GPUs among
        ``known``)."""
        kept = entitlement.keeping({gpu.uuid for gpu in leaving}, known)
        return self._core.nodes.revocable(leaving, keeping=kept)

    async def _assigned(
        self, container: HostContainer, leaving: Sequence[GpuRecord]
    ) -> tuple[Collection[GpuUuid], list[GpuRecord]]:
        """What the runtime or device plugin assigned ``container`` (``BackendHooks``), with
        the records of those NVML lists now. Asked only when a slice leaves: a whole GPU's
        one node is needed by no other GPU (a GPU in MIG mode is never handed out whole),
        so only a slice can share a node with what the container was assigned."""
        if not any(is_mig(gpu.uuid) for gpu in leaving):
            return (), []
        assigned = await self._core.workers.host(self._core.hooks.assigned, container)
        if not assigned:
            return (), []
        snapshot = await self._core.workers.host(self._core.inventory.snapshot)
        self._core.nodes.learn(snapshot)
        return assigned, [as_record(gpu) for gpu in snapshot.gpus if gpu.uuid in assigned]

    async def revoke(
        self,
        container: HostContainer,
        nodes: Sequence[DeviceNode],
        *,
        force: bool,
        keep: Collection[str],
        leave_open: bool = False,
    ) -> None:
        """``Injector.revoke`` in the host's pool: every revoke of the core goes through here
        (``keep``: the nodes that stay, their permission gone)."""
        revoke = functools.partial(
            self._core.injector.revoke, force=force, keep_nodes=keep, leave_open=leave_open
        )
        await self._core.workers.host(revoke, container, nodes)

    # --- a user's detach, the idle policy's release -------------------------------------------

    async def detach_locked(
        self, container: HostContainer, entries: Sequence[Reservation], *, force: bool
    ) -> None:
        """Detach ``entries`` from ``container``, the caller holding the target's lock: mark
        them ``releasing``, revoke, release (``_revoke_detached`` says what a refused revoke
        leaves)."""
        if any(entry.state is ReservationState.RESERVING for entry in entries):
            raise Busy.operation_in_progress(str(container.target))
        per_entry = await self._detach_nodes(container, entries)
        uuids = [entry.gpu.uuid for entry in entries]
        held = self._core.allocator.attachments_of(container.target)
        last = {entry.gpu.uuid for entry in held} <= set(uuids)
        await self._core.allocator.begin_release(uuids)
        await self._core.checkpoints.reach("after_begin_release")
        withdrawn = await self._revoke_detached(
            container, entries, per_entry, force=force, last=last
        )
        await self._core.checkpoints.reach("after_revoke")
        await self._core.release(uuids)
        if not withdrawn and not self._core.allocator.attachments_of(container.target):
            await self._core.workers.host(self._core.withdraw_files, container)
        log.info(
            "detached %s from %s%s%s",
            ", ".join(uuids),
            container,
            " (forced)" if force else "",
            self._label,
        )

    async def detach_gone(self, caller: Caller, target: Target, entries: list[Reservation]) -> None:
        """The container has no process left: its GPUs only need to leave the allocator."""
        if not caller.privileged:
            raise Forbidden(
                f"{target} has exited, so no caller can show it is theirs",
                hint="the agent releases the GPUs of exited processes by itself shortly",
            )
        async with self._core.locks.operation(target):
            remains = await self._core.workers.host(
                self._core.resolver.remains, entries[0].container
            )
            if remains is not None:
                try:
                    nodes = flat(self._core.nodes.of(entry.gpu) for entry in entries)
                    await self._core.workers.host(self._core.injector.withdraw, remains, nodes)
                except InjectorError as e:
                    raise TargetNotReady(
                        f"the GPU could not be taken from the empty cgroups of {target}: {e}",
                        hint="the GPU stays reserved; the agent tries again by itself",
                        retryable=True,
                    ) from e
            await self._core.release([entry.gpu.uuid for entry in entries])
        log.info("released %s of exited %s", ", ".join(e.gpu.uuid for e in entries), target)

    async def _detach_nodes(
        self, container: HostContainer, entries: Sequence[Reservation]
    ) -> list[list[DeviceNode]]:
        """The nodes a detach of ``entries`` revokes: 422 when a slice's cannot be told, 503
        when what the container was assigned cannot be read just now (nothing changed)."""
        try:
            return await self.revocable(container, [entry.gpu for entry in entries])
        except InjectionFailed as e:
            if e.passing:
                raise Unavailable(
                    f"the GPU could not be taken from {container} now: {e}",
                    retry_after=1,
                    hint="nothing was changed and the GPU is still attached; try again",
                ) from e
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
        last: bool,
    ) -> bool:
        """Revoke the ``releasing`` entries' nodes, and with the ``last`` GPUs of the container
        its driver's files in the same trip (``Core.revoke_detached``); whether they were
        withdrawn. Refused with the host unchanged (in use, a scan past its deadline, a clean
        failure): the release is cancelled, the GPUs stay attached and the refusal is raised.
        Failed half-way: the entries stay ``releasing`` for the reconciler. The container
        gone: nothing left to revoke."""
        uuids = [entry.gpu.uuid for entry in entries]
        try:
            await self._core.workers.host(
                self._core.revoke_detached,
                container,
                flat(per_entry),
                force=force,
                keep_nodes=_not_created(entries, per_entry),
                withdraw=last,
            )
        except TargetGone:
            log.info("%s exited during the detach; releasing its record", container)
            return False
        except DeviceInUse as e:
            await self._core.allocator.cancel_release(uuids)
            raise Busy.gpus_in_use(uuids, _processes(e.holders)) from e
        except ScanUnfinished as e:
            await self._core.allocator.cancel_release(uuids)
            raise Unavailable(
                f"could not tell in time whether {', '.join(uuids)} is in use in {container}: {e}",
                retry_after=math.ceil(e.seconds),
                hint="nothing was changed; try again (a container with very many processes "
                "and open files takes long to scan)",
            ) from e
        except InjectionFailed as e:
            if e.clean:
                await self._core.allocator.cancel_release(uuids)
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
        return last

    # --- without a user's consent (lost.py decides when) --------------------------------------

    async def take_back(self, entry: Reservation, *, force: bool) -> TakeBack | None:
        """Revoke a GPU whose reservation lost its backing (a holder pod gone) and release
        the reservation: the same node rule, ``node_created`` and pool as a detach, under the
        target's lock (``Busy`` while a caller's operation holds it). None when the
        reservation changed meanwhile (detached, re-attached)."""
        async with self._core.locks.operation(entry.target):
            current = self._core.allocator.get(entry.gpu.uuid)
            if current is None or current.holder != entry.holder:
                return None
            container = await self._core.workers.host(
                self._core.resolver.lookup, current.target, current.container
            )
            outcome = TakeBack(gone=True, forced=False)
            if container is not None:
                per_entry = await self.revocable(container, [current.gpu])
                outcome = await self._revoke_unbacked(
                    container, per_entry, keep=_not_created([current], per_entry), force=force
                )
            await self._core.release([current.gpu.uuid])
        return outcome

    async def take_back_orphan(
        self,
        container: HostContainer,
        gpus: Sequence[GpuRecord],
        *,
        force: bool,
        assigned: Collection[GpuUuid] = (),
        known: Sequence[GpuRecord] = (),
    ) -> TakeBack | None:
        """Revoke from ``container`` the access to ``gpus`` that nothing entitles it to (an
        orphaned grant: its holder vanished while the agent was down; or a stray one), keeping
        what it is entitled to (its reservations; ``assigned``, the runtime's or plugin's,
        among ``known``). No record says the agent made their nodes, so the nodes stay and
        their permission goes. None when a reservation for them appeared meanwhile."""
        async with self._core.locks.operation(container.target):
            entitlement = Entitlement.of(
                container, self._core.allocator.all_attachments(), assigned
            )
            gpus = [gpu for gpu in gpus if gpu.uuid not in entitlement.uuids]
            if not gpus:
                return None
            per_gpu = self._revoked_nodes(entitlement, gpus, known)
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
            holders = await self._core.workers.host(self._core.injector.holders, container, nodes)
        except InjectionFailed as e:
            # Only for the record of who keeps it open: the access goes all the same.
            log.warning("cannot tell who holds %s open in %s: %s", nodes, container, e)
            holders = []
        except TargetGone:
            return TakeBack(gone=True, forced=False)
        try:
            await self.revoke(container, nodes, force=force, keep=keep, leave_open=True)
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


def _processes(holders: Sequence[HolderInfo]) -> list[ProcessInfo]:
    return [ProcessInfo(pid=h.pid, command=h.command) for h in holders]


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
