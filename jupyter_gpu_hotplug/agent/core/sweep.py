"""Every running container of the node against what it may open: orphaned grants, stray GPUs.

Why it exists: the reconciler visits only the containers that have reservations, so two kinds
of access escape it, and both let a GPU be used by a container that does not hold it:

- **an orphan**: a grant of ours (our v1 entry or our marked v2 prefix) that no reservation
  backs — in Kubernetes its holder pod was deleted, evicted or garbage-collected while the
  agent was down, and the allocator, rebuilt from the surviving holders, does not know it. It
  is taken back by the core's loss sequence (``lost.py``: the user is told first, the grace
  period, then the revoke, counted as ``gpu_hotplug_lost_revokes_total{kind="orphan"}``);
- **a stray**: a container whose device cgroup lets it open an NVIDIA GPU that neither its
  runtime or device plugin assigned to it nor the agent granted — a misconfigured runtime (the
  container toolkit in jit-cdi mode treats ``NVIDIA_VISIBLE_DEVICES=none`` like ``all``), a
  hand-written device rule, a sandbox given a GPU behind the agent's back. It is reported (the
  backend's stray listeners when first seen — Kubernetes: an Event on the pod —, the gauge
  ``gpu_hotplug_stray_gpu_access``, a log line naming the container and the device) and, with
  ``--stray-policy=revoke``, its permission is taken (the nodes stay: they are not ours).

What a container may open and the verdict on each GPU it can open are ``entitlement.py``'s,
the one answer detach and take-back use too; what a running container is, and what its runtime
or plugin assigned it, is the backend's (``BackendHooks.running``). Assigned devices are never
touched, whatever the runtime made of them. "Can open" is what the kernel would answer: the v1
``devices.list`` and, on cgroup v2, every device program attached to the container's cgroups
run for that device (``linux/bpf/interp.py``); an unconfined (privileged) container opens
everything and is not judged. A stray that only a runtime's v2 program allows is reported but
cannot be revoked (the agent edits only its own marked prefix).

A pass asks the backend once for the running containers and reads the device state of each
once; it runs at the end of every reconciliation (at start-up, on the timer, and in
Kubernetes mode after pod events).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..._structs import GpuUuid
from ...linux.devrules import CharDevice
from .bundle import Core
from .entitlement import Access, Entitlement, Judged, NodesOf, judge, to_check
from .errors import AgentError
from .hooks import ReconcileReport, RunningContainer, StrayNotice
from .injector import DeviceState, InjectionFailed, InjectorError
from .lost import LostGpus, TakeBack
from .revoke import Revoker
from .seams import ContainerKey, GpuRecord, HostContainer

__all__ = ["NodeSweep"]

log = logging.getLogger(__name__)


Spawn = Callable[[Coroutine[Any, Any, None]], None]
States = dict[CharDevice, DeviceState]


async def judged(
    core: Core,
    container: HostContainer,
    nodes: NodesOf,
    assigned: Collection[GpuUuid] = (),
) -> tuple[list[Judged], States]:
    """The verdict on each GPU of ``nodes`` that ``container`` can open (``entitlement.py``),
    its entitlement read now, and the states of the nodes it was judged by: the one
    judgement of the node sweep and of the reconciler (blocking reads in the host's pool)."""
    entitlement = Entitlement.of(container, core.allocator.all_attachments(), assigned)
    checked = to_check(entitlement, nodes)
    if not checked:
        return judge(entitlement, nodes, {}), {}
    states = await core.workers.host(core.injector.status, container, checked)
    by_device = {node.device: state for node, state in zip(checked, states, strict=True)}
    return judge(entitlement, nodes, by_device), by_device


@dataclass
class NodeSweep:
    """One pass over the node's running containers (``run``; see the module docstring)."""

    core: Core
    revoker: Revoker
    """Every take-back goes through it (the one node rule)."""
    lost: LostGpus
    """The loss sequence an orphan goes through."""
    revoke_strays: bool
    """``--stray-policy=revoke``."""
    spawn: Spawn
    """Runs a loss sequence beside the agent (ended when it stops)."""
    _reported: set[tuple[ContainerKey, GpuUuid]] = field(default_factory=set, init=False)
    """Stray access already announced (once per container and GPU)."""

    async def run(self, known: Sequence[GpuRecord], report: ReconcileReport) -> None:
        """Judge every running container of the node once."""
        try:
            running = await self.core.workers.host(
                self.core.hooks.running, self.core.allocator.all_attachments()
            )
        except Exception as e:
            # Without it an assigned GPU cannot be told from a stray: judge nothing this pass.
            report.failures.append(f"node sweep: {e}")
            log.error("node sweep skipped: %s", e)
            return
        nodes = self.core.nodes.known(known)
        strays: list[tuple[RunningContainer, Judged]] = []
        for item in running:
            try:
                verdicts, _ = await judged(self.core, item.container, nodes, item.assigned)
            except InjectorError as e:
                log.debug("node sweep: %s not judged: %s", item.container, e)
                continue
            verdicts = [v for v in verdicts if v.access is not Access.ACCOUNTED]
            orphans = [v for v in verdicts if v.access is Access.ORPHAN]
            if orphans and self.core.hooks.orphans:
                self._orphaned(item, [v.gpu for v in orphans], known, report)
                verdicts = [v for v in verdicts if v.access is not Access.ORPHAN]
            strays += [(item, v) for v in verdicts]
        seen = {(item.container.key, verdict.gpu.uuid) for item, verdict in strays}
        for item, verdict in strays:
            await self._stray(item, verdict, known, report)
        self._reported &= seen
        self.core.metrics.stray_gpu_access.set(len(strays))

    def _orphaned(
        self,
        item: RunningContainer,
        gpus: list[GpuRecord],
        known: Sequence[GpuRecord],
        report: ReconcileReport,
    ) -> None:
        container = item.container
        key = f"orphan:{container.key}:{','.join(sorted(gpu.uuid for gpu in gpus))}"
        if self.lost.pending(key):
            return
        for gpu in gpus:
            report.add("orphan_found", gpu.uuid)

        async def revoke(force: bool) -> TakeBack | None:
            return await self.revoker.take_back_orphan(
                container, gpus, force=force, assigned=item.assigned, known=known
            )

        self.spawn(
            self.lost.handle(
                key=key,
                target=container.target,
                gpus=gpus,
                reason=self.core.hooks.orphan_reason,
                revoke=revoke,
                orphan=True,
            )
        )

    async def _stray(
        self,
        item: RunningContainer,
        verdict: Judged,
        known: Sequence[GpuRecord],
        report: ReconcileReport,
    ) -> None:
        container, gpu = item.container, verdict.gpu
        first = (container.key, gpu.uuid) not in self._reported
        if first:
            self._reported.add((container.key, gpu.uuid))
            self._announce(StrayNotice(container, verdict, self.revoke_strays))
            report.add("stray_found", gpu.uuid)
        if not self.revoke_strays:
            return
        try:
            await self.revoker.take_back_orphan(
                container, [gpu], force=False, assigned=item.assigned, known=known
            )
            after = await self.core.workers.host(
                self.core.injector.status, container, list(verdict.nodes)
            )
            if any(state.opens for state in after):
                raise InjectionFailed(
                    "a runtime's own device program still allows it (the agent edits only "
                    "its own marked prefix)",
                    clean=True,
                )
        except (InjectorError, AgentError) as e:
            # A v1 wildcard ('c 195:* rwm'), which a deny cannot narrow, or a runtime's v2
            # program: said once, the listeners and the gauge keep reporting it.
            report.failures.append(f"{container}: stray {gpu.uuid} not revoked: {e}")
            if first:
                log.error("stray GPU access of %s to %s cannot be revoked: %s", container, gpu, e)
            return
        report.add("revoked_stray", gpu.uuid)

    def _announce(self, notice: StrayNotice) -> None:
        """The log line, then each stray listener (one that fails is logged, the others
        still hear)."""
        log.warning(
            "stray GPU access: %s can open %s of %s, which neither its runtime or device "
            "plugin assigned to it nor the agent granted",
            notice.container,
            ", ".join(f"/dev/{node.name} ({node.device})" for node in notice.verdict.nodes),
            notice.verdict.gpu.uuid,
        )
        for listener in self.core.hooks.stray_listeners:
            try:
                listener(notice)
            except Exception:
                log.exception("a stray listener failed")
