"""Make the ledger and the host agree again: at start-up, and then every few seconds.

Why it exists: the service keeps the two in step while it runs, but a crash (``kill -9``, power
loss) can stop an operation between any two steps, targets exit without telling anyone, and
something else on the host (systemd re-applying a unit's device list, DESIGN §5) can take a
grant away. The rules, per target in the ledger, each run under the target's lock so that no
operation in flight is disturbed:

- the target process is gone (or its pid now names another process): release its GPUs;
- ``reserving`` (an attach cut short): undo any partial grant and release — unless a process of
  the target already has the GPU open, in which case the attach is finished instead (taking a
  GPU from a process using it would break it);
- ``releasing`` (a detach cut short): finish it without force; if a process has the GPU open,
  the release is cancelled and the GPU stays attached (a user's detach can force it);
- ``granted`` but no longer usable: grant it again;
- a GPU the target can reach although the ledger gives it to nobody there: revoke it.

Each repair is logged and counted (``gpu_hotplug_reconcile_actions_total{action}``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field

from .._structs import GpuUuid, PidTarget, TargetKey
from .books import Books
from .injector import DeviceInUse, InjectionFailed, Injector, InjectorError, TargetGone, gpu_node
from .inventory import Inventory
from .ledger import EntryState, GpuRecord, LedgerEntry
from .locks import TargetLocks
from .metrics import AgentMetrics
from .resolver import ContainerId, Resolver
from .workers import Workers

__all__ = ["ReconcileReport", "Reconciler"]

log = logging.getLogger(__name__)


@dataclass
class ReconcileReport:
    """What one pass did: action name → the GPUs it applied to."""

    actions: dict[str, list[str]] = field(default_factory=lambda: collections.defaultdict(list))
    skipped_busy: list[TargetKey] = field(default_factory=list)
    """Targets with an operation in flight, left for the next pass."""
    failures: list[str] = field(default_factory=list)

    def add(self, action: str, what: str) -> None:
        self.actions[action].append(what)

    @property
    def changed(self) -> bool:
        return any(self.actions.values())


class Reconciler:
    """One reconciliation pass over the ledger (``run_once``), and the periodic loop."""

    def __init__(
        self,
        *,
        books: Books,
        inventory: Inventory,
        injector: Injector,
        resolver: Resolver,
        locks: TargetLocks,
        metrics: AgentMetrics,
        workers: Workers,
        device_major: int,
    ) -> None:
        self._books = books
        self._inventory = inventory
        self._injector = injector
        self._resolver = resolver
        self._locks = locks
        self._metrics = metrics
        self._workers = workers
        self._major = device_major

    async def run_once(self) -> ReconcileReport:
        """Reconcile every target of the ledger once."""
        report = ReconcileReport()
        entries = self._books.attachments()
        targets = {entry.target.key: entry.target for entry in entries}
        containers: dict[TargetKey, ContainerId | None] = {}
        for key, target in targets.items():
            if isinstance(target, PidTarget):
                containers[key] = await self._container(target)
        known = await self._known_gpus()
        for target in targets.values():
            if not isinstance(target, PidTarget):
                report.failures.append(f"{target}: not a local-mode target")
                continue
            with self._locks.reconciling(target) as held:
                if not held:
                    report.skipped_busy.append(target.key)
                    continue
                try:
                    await self._target(target, containers, known, report)
                except InjectorError as e:
                    report.failures.append(f"{target}: {e}")
                    log.error("reconciling %s failed: %s; retrying on the next pass", target, e)
        for action, items in report.actions.items():
            self._metrics.reconcile_actions.labels(action=action).inc(len(items))
        return report

    async def _container(self, target: PidTarget) -> ContainerId | None:
        resolved = await self._workers.host(self._resolver.lookup, target)
        return None if resolved is None else resolved.container

    async def _known_gpus(self) -> list[GpuRecord]:
        """Every GPU the node has or had: the live inventory and the ledger's memory."""
        snapshot = await self._workers.host(self._inventory.snapshot)
        records = {gpu.uuid: gpu for gpu in await self._books.known_gpus()}
        for gpu in snapshot.gpus:
            records[gpu.uuid] = GpuRecord(gpu.uuid, gpu.index, gpu.minor, gpu.name)
        return list(records.values())

    async def _target(
        self,
        target: PidTarget,
        containers: dict[TargetKey, ContainerId | None],
        known: list[GpuRecord],
        report: ReconcileReport,
    ) -> None:
        # Read again under the lock: an operation may have finished since the pass began.
        rows = self._books.attachments(target)
        if not rows:
            return
        container = await self._container(target)
        containers[target.key] = container
        if container is None:
            await self._books.release([row.gpu.uuid for row in rows])
            for row in rows:
                report.add("released_gone", row.gpu.uuid)
            log.warning(
                "released %s: %s has exited",
                ", ".join(row.gpu.uuid for row in rows),
                target,
            )
            return
        try:
            for row in rows:
                if row.state is EntryState.RESERVING:
                    await self._reserving(target, row, report)
                elif row.state is EntryState.RELEASING:
                    await self._releasing(target, row, report)
                else:
                    await self._granted(target, row, report)
            await self._strays(target, container, containers, known, report)
        except TargetGone:
            # It exited during the pass; the next pass releases it.
            report.failures.append(f"{target}: exited during reconciliation")

    async def _reserving(
        self, target: PidTarget, row: LedgerEntry, report: ReconcileReport
    ) -> None:
        node = gpu_node(row.gpu.minor, major=self._major)
        try:
            await self._workers.host(self._injector.revoke, target, [node], force=False)
        except DeviceInUse as e:
            await self._books.mark_granted([row.gpu.uuid])
            report.add("finished_attach", row.gpu.uuid)
            log.warning(
                "finished the interrupted attach of %s to %s: %s already use it",
                row.gpu.uuid,
                target,
                ", ".join(f"{h.command}[{h.pid}]" for h in e.holders),
            )
            return
        await self._books.release([row.gpu.uuid])
        report.add("rolled_back_attach", row.gpu.uuid)
        log.warning("rolled back the interrupted attach of %s to %s", row.gpu.uuid, target)

    async def _releasing(
        self, target: PidTarget, row: LedgerEntry, report: ReconcileReport
    ) -> None:
        node = gpu_node(row.gpu.minor, major=self._major)
        try:
            await self._workers.host(self._injector.revoke, target, [node], force=False)
        except (DeviceInUse, InjectionFailed) as e:
            if isinstance(e, InjectionFailed) and not e.clean:
                raise
            await self._books.cancel_release([row.gpu.uuid])
            report.add("cancelled_release", row.gpu.uuid)
            log.warning(
                "could not finish the interrupted detach of %s from %s (%s); it stays attached",
                row.gpu.uuid,
                target,
                e,
            )
            return
        await self._books.release([row.gpu.uuid])
        report.add("finished_detach", row.gpu.uuid)
        log.warning("finished the interrupted detach of %s from %s", row.gpu.uuid, target)

    async def _granted(self, target: PidTarget, row: LedgerEntry, report: ReconcileReport) -> None:
        node = gpu_node(row.gpu.minor, major=self._major)
        (state,) = await self._workers.host(self._injector.status, target, [node])
        if state.usable:
            return
        await self._workers.host(self._injector.grant, target, [node])
        report.add("regranted", row.gpu.uuid)
        log.warning("%s had lost access to %s; granted it again", target, row.gpu.uuid)

    async def _strays(
        self,
        target: PidTarget,
        container: ContainerId,
        containers: dict[TargetKey, ContainerId | None],
        known: list[GpuRecord],
        report: ReconcileReport,
    ) -> None:
        """Revoke GPUs the target's container can reach that the ledger gives to no target
        in that container (two targets may share one container: each keeps its own)."""
        owned: set[GpuUuid] = set()
        for entry in self._books.attachments():
            other = entry.target
            if other.key not in containers and isinstance(other, PidTarget):
                containers[other.key] = await self._container(other)
            if other.key == target.key or containers.get(other.key) == container:
                owned.add(entry.gpu.uuid)
        others = [gpu for gpu in known if gpu.uuid not in owned]
        if not others:
            return
        nodes = [gpu_node(gpu.minor, major=self._major) for gpu in others]
        states = await self._workers.host(self._injector.status, target, nodes)
        stray = [
            (gpu, node)
            for gpu, node, state in zip(others, nodes, states, strict=True)
            if state.exposed
        ]
        if not stray:
            return
        try:
            await self._workers.host(
                self._injector.revoke, target, [node for _, node in stray], force=False
            )
        except DeviceInUse as e:
            report.failures.append(f"{target}: unrecorded GPU access in use by {e.holders}")
            log.error(
                "%s can use %s without a ledger entry, and processes hold it open (%s); "
                "detach it with force to end this",
                target,
                ", ".join(gpu.uuid for gpu, _ in stray),
                ", ".join(f"{h.command}[{h.pid}]" for h in e.holders),
            )
            return
        for gpu, _ in stray:
            report.add("revoked_unrecorded", gpu.uuid)
        log.warning(
            "revoked %s from %s: access without a ledger entry",
            ", ".join(gpu.uuid for gpu, _ in stray),
            target,
        )

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
