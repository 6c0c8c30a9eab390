"""Make the allocator and the host agree again: at start-up, and then every few seconds.

Why it exists: the service keeps the two in step while it runs, but a crash (``kill -9``, power
loss) can stop an operation between any two steps, targets exit without telling anyone, and
something else on the host (systemd re-applying a unit's device list, DESIGN §5) can take a
grant away. One reconciler serves every backend, through the seams only. The rules, per target
with reservations, each run under the target's lock so that no operation in flight is disturbed:

- the owner of a grant is the container: when the target process is gone but its container
  lives on (``Resolver.current`` finds it under another process, same key), the reservations
  are re-bound to it and stay — the container can still open the GPU, so returning it to the
  pool would let a second container have it too; when the container was replaced (a new key:
  a restarted Kubernetes container), the GPUs are granted to the new one and re-bound;
- the container has no process left: whatever grant its leftover (empty) cgroups still carry
  is withdrawn (``Resolver.remains``, ``Injector.withdraw``), then the GPUs are released;
- ``reserving`` (an attach cut short): undo any partial grant and release — unless a process of
  the container already has the GPU open, in which case the attach is finished instead (taking
  a GPU from a process using it would break it);
- ``releasing`` (a detach cut short): finish it without force; if a process has the GPU open,
  the release is cancelled and the GPU stays attached (a user's detach can force it);
- ``granted`` but no longer usable: grant it again;
- a GPU the container can open although its entitlement (``entitlement.py``: its own
  reservations, and what the backend's runtime or device plugin gave it,
  ``BackendHooks.assigned``) does not give it: revoke the permission at once.

Then the node sweep (``sweep.py``) judges every running container of the node the backend
lists (``BackendHooks.running``): grants of ours that no reservation backs (the loss sequence
takes them back) and GPU access nobody gave (reported; revoked with ``--stray-policy=revoke``).

Device nodes are removed only where the reservation records that the agent created them
(``Reservation.node_created``, recorded as intent before the ``mknod``, so an attach cut short
after it still knows the node is its own): a node of unknown origin is left, without its
permission.

Each repair is logged and counted (``gpu_hotplug_reconcile_actions_total{action}``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable

from ..._structs import GpuUuid, Target
from ...linux.devnodes import DeviceNode
from .bundle import Core
from .devices import flat
from .driver_files import DriverFilesFailed
from .entitlement import Access
from .errors import LookupFailed
from .hooks import ReconcileReport
from .injector import (
    DeviceInUse,
    InjectionFailed,
    InjectorError,
    TargetGone,
)
from .revoke import Revoker
from .seams import (
    ContainerKey,
    GpuRecord,
    HostContainer,
    Reservation,
    ReservationState,
)
from .suspend import Suspender
from .sweep import NodeSweep, judged

__all__ = ["Reconciler"]

log = logging.getLogger(__name__)


class Reconciler:
    """One reconciliation pass over the reservations (``run_once``), and the periodic loop."""

    def __init__(
        self, core: Core, *, sweep: NodeSweep | None = None, suspender: Suspender | None = None
    ) -> None:
        self._core = core
        """The seams and the state shared with the service (its locks, its node rule, its
        queue: a pass that freed GPUs wakes the waiters)."""
        self._revoker = Revoker(core)
        """The one revoke rule (``GpuNodes.revocable`` over the container's entitlement)."""
        self._sweep = sweep
        """The node sweep, run at the end of every pass (``sweep.py``); None: none (tests of
        the reservations alone)."""
        self._suspender = suspender
        """Forgets the suspensions of targets that exited, at every pass (``suspend.py``);
        None: none (tests of the reservations alone)."""

    async def run_once(self) -> ReconcileReport:
        """Reconcile every target with reservations once."""
        report = ReconcileReport()
        entries = self._core.allocator.all_attachments()
        targets = {entry.target.key: entry.target for entry in entries}
        known = await self._known_gpus()
        for target in targets.values():
            with self._core.locks.reconciling(target) as held:
                if not held:
                    report.skipped_busy.append(target.key)
                    continue
                try:
                    await self._target(target, known, report)
                except InjectorError as e:
                    report.failures.append(f"{target}: {e}")
                    log.error("reconciling %s failed: %s; retrying on the next pass", target, e)
                except Exception as e:
                    # Whatever one target's host state does to us (a container can shape its
                    # cgroups at will), the others are still reconciled and the agent starts.
                    report.failures.append(f"{target}: {e}")
                    log.exception("reconciling %s failed; retrying on the next pass", target)
        if self._sweep is not None:
            try:
                await self._sweep.run(known, report)
            except Exception as e:
                report.failures.append(f"node sweep: {e}")
                log.exception("the node sweep failed; retrying on the next pass")
        await self._sweep_driver_files(report)
        if self._suspender is not None:
            try:
                await self._suspender.forget_gone(report)
            except Exception as e:
                report.failures.append(f"suspensions: {e}")
                log.exception("forgetting the suspensions of exited targets failed")
        for action, items in report.actions.items():
            self._core.metrics.reconcile_actions.labels(action=action).inc(len(items))
        if report.changed:
            self._core.queue.notify()
        return report

    async def _sweep_driver_files(self, report: ReconcileReport) -> None:
        """Driver files given to containers that hold no GPU any more (a detach that could
        not finish them, a ``kill -9`` between the grant and its record) are taken back."""
        holding = {entry.container for entry in self._core.allocator.all_attachments()}
        try:
            undone = await self._core.workers.host(self._core.driver_files.sweep, holding)
        except Exception as e:
            report.failures.append(f"driver files sweep: {e}")
            log.exception("the driver files sweep failed; retrying on the next pass")
            return
        for record in undone:
            report.add("driver_files_removed", record)

    async def _known_gpus(self) -> list[GpuRecord]:
        """Every GPU the node has or had: the live inventory, the lost ones as last seen, and
        those of the reservations."""
        snapshot = await self._core.workers.host(self._core.inventory.snapshot)
        self._core.nodes.learn(snapshot)
        records = {entry.gpu.uuid: entry.gpu for entry in self._core.allocator.all_attachments()}
        seen = [*snapshot.gpus, *(lost.last_known for lost in snapshot.lost if lost.last_known)]
        for gpu in seen:
            records[gpu.uuid] = GpuRecord(gpu.uuid, gpu.index, gpu.minor, gpu.name)
        return list(records.values())

    async def _target(
        self, target: Target, known: list[GpuRecord], report: ReconcileReport
    ) -> None:
        # Read again under the lock: an operation may have finished since the pass began.
        by_container: dict[ContainerKey, list[Reservation]] = collections.defaultdict(list)
        for row in self._core.allocator.attachments_of(target):
            by_container[row.container].append(row)
        for key, rows in by_container.items():
            try:
                container = await self._holder(target, key, rows, report)
            except LookupFailed as e:
                # Not known to be gone: its GPUs stay as they are until a pass can tell.
                report.failures.append(f"{target}: cannot be looked up now: {e}")
                log.warning("%s cannot be looked up now (%s); next pass", target, e)
                continue
            if container is None:
                continue
            try:
                for row in rows:
                    if row.state is ReservationState.RESERVING:
                        await self._reserving(container, row, report)
                    elif row.state is ReservationState.RELEASING:
                        await self._releasing(container, row, report)
                    else:
                        await self._granted(container, row, report)
                await self._driver_files(container, rows, report)
                await self._unentitled(container, known, report)
            except TargetGone:
                # It exited during the pass; the next pass finds out what is left of it.
                report.failures.append(f"{target}: exited during reconciliation")

    async def _holder(
        self, target: Target, key: ContainerKey, rows: list[Reservation], report: ReconcileReport
    ) -> HostContainer | None:
        """The container that holds ``rows`` now, re-bound if it changed; None when there is
        none any more (then the rows are released, after any leftover grant is withdrawn)."""
        found = await self._core.workers.host(self._core.resolver.lookup, target, key)
        if found is not None:
            return found
        uuids = [row.gpu.uuid for row in rows]
        current = await self._core.workers.host(self._core.resolver.current, target, key)
        if current is not None and current.key == key:
            await self._core.allocator.rebind(uuids, current)
            for uuid in uuids:
                report.add("rebound", uuid)
            log.warning(
                "%s has exited but its container lives on: %s stay attached to it, now through %s",
                target,
                ", ".join(uuids),
                current,
            )
            return current
        if current is not None:
            nodes = flat(self._core.nodes.of(row.gpu) for row in rows)
            await self._core.workers.host(self._core.injector.grant, current, nodes)
            await self._core.allocator.rebind(uuids, current)
            # The new container has the GPU's nodes; its driver files follow in _target.
            for uuid in uuids:
                report.add("reinjected", uuid)
            log.warning("%s was replaced: granted %s to %s", target, ", ".join(uuids), current)
            return current
        remains = await self._core.workers.host(self._core.resolver.remains, key)
        if remains is not None:
            # Its cgroups outlived it and still carry the grant: withdraw it first (a failure
            # keeps the reservation for the next pass).
            nodes = flat(self._core.nodes.of(row.gpu) for row in rows)
            await self._core.workers.host(self._core.injector.withdraw, remains, nodes)
            for uuid in uuids:
                report.add("withdrew_remains", uuid)
            log.warning("withdrew %s from the empty cgroups of %s", ", ".join(uuids), target)
        await self._core.release(uuids)
        for uuid in uuids:
            report.add("released_gone", uuid)
        log.warning("released %s: %s has exited", ", ".join(uuids), target)
        return None

    async def _take_back(self, container: HostContainer, row: Reservation) -> None:
        """Revoke ``row``'s GPU from ``container`` without force. Device nodes are removed
        only when the agent created them (for an attach cut short: when it recorded, before
        the ``mknod``, that it was about to)."""
        (nodes,) = await self._revoker.revocable(container, [row.gpu])
        keep = [] if row.node_created else [node.name for node in nodes]
        await self._revoker.revoke(container, nodes, force=False, keep=keep)

    async def _reserving(
        self, container: HostContainer, row: Reservation, report: ReconcileReport
    ) -> None:
        """An attach cut short: rolled back, unless the container already uses the GPU (then
        it is finished: taking it away would break a running program)."""
        await self._settle(
            container,
            row,
            report,
            refused=(DeviceInUse,),
            keep=self._core.allocator.mark_granted,
            kept="finished_attach",
            ended="rolled_back_attach",
        )

    async def _releasing(
        self, container: HostContainer, row: Reservation, report: ReconcileReport
    ) -> None:
        """A detach cut short: finished, unless the revoke is refused with the host unchanged
        (in use, a clean failure: then the GPU stays attached)."""
        await self._settle(
            container,
            row,
            report,
            refused=(DeviceInUse, InjectionFailed),
            keep=self._core.allocator.cancel_release,
            kept="cancelled_release",
            ended="finished_detach",
        )

    async def _settle(
        self,
        container: HostContainer,
        row: Reservation,
        report: ReconcileReport,
        *,
        refused: tuple[type[InjectorError], ...],
        keep: Callable[[list[GpuUuid]], Awaitable[object]],
        kept: str,
        ended: str,
    ) -> None:
        """The one way an interrupted operation ends: take ``row``'s GPU back and release it
        (``ended``), or — the take-back refused with the host unchanged — ``keep`` it attached
        (``kept``). A failure that changed the host half-way is raised for the next pass."""
        try:
            await self._take_back(container, row)
        except refused as e:
            if isinstance(e, InjectionFailed) and not e.clean:
                raise
            await keep([row.gpu.uuid])
            _settled(report, kept, row, container, _why(e))
            return
        await self._core.release([row.gpu.uuid])
        _settled(report, ended, row, container)

    async def _granted(
        self, container: HostContainer, row: Reservation, report: ReconcileReport
    ) -> None:
        nodes = self._core.nodes.of(row.gpu)
        states = await self._core.workers.host(self._core.injector.status, container, nodes)
        if all(state.usable for state in states):
            return
        await self._core.workers.host(self._core.injector.grant, container, nodes)
        report.add("regranted", row.gpu.uuid)
        log.warning("%s had lost access to %s; granted it again", container, row.gpu.uuid)

    async def _driver_files(
        self, container: HostContainer, rows: list[Reservation], report: ReconcileReport
    ) -> None:
        """A container holding GPUs has the driver's files (a replaced container, the one
        after a restart, gets them here; one that still has them costs a few ``stat``s)."""
        granted = [row for row in rows if row.state is ReservationState.GRANTED]
        if not granted or self._core.allocator.get(granted[0].gpu.uuid) is None:
            return
        nodes = flat(self._core.nodes.of(row.gpu) for row in granted)
        try:
            await self._core.workers.host(self._core.driver_files.provide, container, nodes)
        except DriverFilesFailed as e:
            report.failures.append(f"{container}: {e}")
            log.error("the driver's files could not be given to %s: %s", container, e)

    async def _unentitled(
        self, container: HostContainer, known: list[GpuRecord], report: ReconcileReport
    ) -> None:
        """Revoke at once what the container can open beyond its entitlement
        (``entitlement.py``: its own reservations — two targets may share one container, each
        keeps its own — and what its runtime or device plugin gave it), wherever the grant is
        one a revoke takes (``permitted``); the node sweep reports the rest."""
        assigned = await self._core.workers.host(self._core.hooks.assigned, container)
        nodes = self._core.nodes.known(known)
        verdicts, by_device = await judged(self._core, container, nodes, assigned)
        unentitled = [
            (verdict.gpu, node)
            for verdict in verdicts
            if verdict.access is not Access.ACCOUNTED
            for node in verdict.nodes
            if by_device[node.device].permitted
        ]
        if unentitled:
            await self._revoke_unrecorded(container, unentitled, report)

    async def _revoke_unrecorded(
        self,
        container: HostContainer,
        unentitled: list[tuple[GpuRecord, DeviceNode]],
        report: ReconcileReport,
    ) -> None:
        uuids = list(dict.fromkeys(gpu.uuid for gpu, _ in unentitled))
        nodes = flat([node] for _, node in unentitled)
        try:
            # Unrecorded: nothing says the agent made these nodes, so they stay; the
            # permission goes.
            await self._revoker.revoke(
                container, nodes, force=False, keep=[node.name for node in nodes]
            )
        except DeviceInUse as e:
            report.failures.append(f"{container}: unrecorded GPU access in use by {e.holders}")
            log.error(
                "%s can use %s without a reservation, and processes hold it open (%s); "
                "detach it with force to end this",
                container,
                ", ".join(uuids),
                ", ".join(f"{h.command}[{h.pid}]" for h in e.holders),
            )
            return
        for uuid in uuids:
            report.add("revoked_unrecorded", uuid)
        log.warning("revoked %s from %s: access without a reservation", ", ".join(uuids), container)

    async def run_forever(self, interval: float) -> None:
        """Reconcile every ``interval`` seconds until cancelled; a failed pass is logged."""
        while True:
            await asyncio.sleep(interval)
            try:
                report = await self.run_once()
            except Exception:
                log.exception("reconciliation pass failed; retrying in %.0f s", interval)
                continue
            if report.changed:
                log.info("reconciliation: %s", dict(report.actions))


_SETTLED = {
    "finished_attach": "finished the interrupted attach of %s to %s: %s",
    "rolled_back_attach": "rolled back the interrupted attach of %s to %s",
    "cancelled_release": "could not finish the interrupted detach of %s from %s (%s); it "
    "stays attached",
    "finished_detach": "finished the interrupted detach of %s from %s",
}
"""How each end of an interrupted attach or detach is told in the log (its report key)."""


def _settled(
    report: ReconcileReport, outcome: str, row: Reservation, container: HostContainer, *why: object
) -> None:
    """Report and log how an interrupted operation on ``row`` ended: every such end is both
    a count in the pass's report and a warning naming the GPU and the container."""
    report.add(outcome, row.gpu.uuid)
    log.warning(_SETTLED[outcome], row.gpu.uuid, container, *why)


def _why(error: InjectorError) -> str:
    """Why a take-back was refused, for the log: who uses the GPU, or the failure."""
    if isinstance(error, DeviceInUse):
        users = ", ".join(f"{h.command}[{h.pid}]" for h in error.holders)
        return f"{users} already use it"
    return str(error)
