"""Idle release: GPUs come back by themselves from targets that stopped using them.

Why it exists, in the agent rather than a client: an attached GPU that nobody uses is the
expensive failure mode of hot-plug (a forgotten notebook holds it for days), and only the agent
sees every attachment whichever client made it (toolbar, magic, CLI, REST). So the agent
watches each granted GPU and releases it when, for the whole idle period, no process of the
target's container held it open *and* NVML saw no utilisation; optionally a lease also ends at
a maximum age. A GPU in use is never released: the release itself goes through the ordinary
detach path without ``force``, whose busy check refuses while any process holds the device.

Held but unused (issue 39): a process that once used CUDA holds its GPU open for good (every
PyTorch kernel does), so the rule above would never free it. Where the agent can keep a
kernel's CUDA state (``suspend``: local mode, a driver with the checkpoint API, and
``--idle-held=suspend``, the default), a GPU its target holds while NVML reads exactly 0 % for
the whole period is idle too; when every GPU of the target is due, the target is suspended
(``Suspender.suspend``: its state kept in host memory) and all its GPUs go back. Its next
attach resumes it. A refused suspend (the budget, a process the driver cannot checkpoint) is
logged and changes nothing; the next try comes after another whole idle period.

Hand-over (``handover_seconds``): while a request waits in the queue, a GPU held idle falls
due after the hand-over period instead of the whole idle period, so a kernel that sits on a
GPU with an idle context is suspended (nothing of it lost) and the waiting request gets the
GPU, rather than waiting out an idle period of an hour. Only where a policy is on and the
target can be suspended: a GPU nobody holds keeps its idle period (its release would end the
attachment, which nothing waiting entitles the agent to shorten).

Before a release, a *warning* is recorded for the attachment (``warning_seconds`` ahead): the
API shows it on the attachment (``idle_release``), where the server extension's stream and the
``%gpu`` magic read it, it is logged, and the book's listeners hear of it (Kubernetes mode:
an Event on the pod). Any use in the meantime cancels it. A release is
logged, counted (``gpu_hotplug_idle_releases_total{reason}``) and kept in a short history per
target (``GET /v1/idle-releases``), so a user who finds the GPU gone learns why.

Policy: the agent's settings give the default (off unless set: see ``docs/usage.md`` for why).
A request may ask for a *stricter* policy for the GPUs it attaches (a shorter idle period, or
one at all when the agent has none), never a laxer one — the platform's setting is a promise to
the other users of the node. A backend may add a stricter period per target the same way
(Kubernetes mode: a pod annotation the platform sets), read at each pass. A request's
per-attachment choice is kept in memory: a restarted agent applies its own setting (and the
annotations), and idle periods start again (they are never shortened by a restart).

Whose idle time: the attachment's — one GPU granted to one container at one moment — never
the GPU's. A GPU released and given to the next holder starts a new idle period and carries no
warning of the last one (before issue 25, the next holder inherited the idle time: B lost a GPU
3 s after getting it). The pass keys its state by ``attachment_id``, and a release forgets it.

Timing: one pass every ``interval`` seconds (a few), so a release comes at most one interval
after it is due; the pass reads NVML once for all GPUs and scans each target's processes for
open fds (the same scan as a detach's busy check). Clocks are injected, so tests move time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime, timedelta

from ..._structs import GpuUuid
from .bundle import Core
from .errors import LookupFailed
from .idle import IdleBook, IdlePolicy, IdleReason, IdleRelease, IdleWarning
from .injector import HolderInfo, InjectorError
from .seams import ContainerKey, HostContainer, Reservation, ReservationState

__all__ = ["IdleReleaser", "SuspendIdle", "Usage", "attachment_id"]

log = logging.getLogger(__name__)

Usage = Callable[[], Mapping[GpuUuid, int | None]]
"""GPU utilisation in percent by UUID, read from NVML (blocking); ``None``: NVML cannot say."""

AttachmentId = tuple[GpuUuid, ContainerKey, datetime | None]


def attachment_id(entry: Reservation) -> AttachmentId:
    """One attachment: a GPU granted to one container at one moment (module docstring)."""
    return entry.gpu.uuid, entry.container, entry.granted_at


ReleaseUnused = Callable[[Reservation, HostContainer], Awaitable[bool]]
"""Detach one reservation without force; False when the GPU turned out to be in use."""
SuspendIdle = Callable[[HostContainer], Awaitable[list[Reservation]]]
"""Suspend the container's target, keeping its CUDA state, and release all its GPUs (the
caller holds the target); what it released, empty when it could not (nothing changed)."""


class IdleReleaser:
    """The background pass that applies the idle policy (see the module docstring)."""

    def __init__(
        self,
        core: Core,
        *,
        usage: Usage,
        release: ReleaseUnused,
        suspend: SuspendIdle | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._core = core
        self._usage = usage
        self._release = release
        self._suspend = suspend
        """Where set, a GPU its target holds but NVML sees unused counts as idle too, and
        when it is due the whole target is suspended (``SuspendIdle``)."""
        self._clock = clock
        self._wall = wall
        self._idle_since: dict[AttachmentId, float] = {}
        self._in_use: set[AttachmentId] = set()
        """The attachments found in use when last looked at (``_is_due`` of a target's
        other GPUs: the one working now was "idle since" its last look too)."""

    @property
    def _book(self) -> IdleBook:
        return self._core.idle

    async def run_once(self) -> list[IdleRelease]:
        """One pass over every granted attachment; returns what it released."""
        entries = [
            entry
            for entry in self._core.allocator.all_attachments()
            if entry.state is ReservationState.GRANTED
        ]
        current = {attachment_id(entry) for entry in entries}
        for gone in [key for key in self._idle_since if key not in current]:
            del self._idle_since[gone]
        self._in_use &= current
        uuids = {entry.gpu.uuid for entry in entries}
        for uuid in [*self._book.warnings, *self._book.requested]:
            if uuid not in uuids:
                self._book.forget(uuid)
        for entry in entries:
            if self._book.warnings.get(entry.gpu.uuid) is not self._book.warning_of(entry):
                del self._book.warnings[entry.gpu.uuid]  # an earlier holder's
        watched = [entry for entry in entries if self._book.policy_for(entry).enabled]
        if not watched:
            return []
        usage = await self._core.workers.host(self._usage)
        released = []
        for entry in watched:
            with self._core.locks.reconciling(entry.target) as held:
                if not held:
                    continue  # an operation is running on it: look again next pass
                try:
                    done = await self._consider(entry, usage)
                except (InjectorError, LookupFailed) as e:
                    log.warning("idle check of %s skipped: %s", entry.gpu.uuid, e)
                    continue
            released.extend(done)
        return released

    async def held_gpus(self) -> dict[GpuUuid, tuple[int, ...]]:
        """The granted GPUs that a process of their container holds open right now, each with
        the pids (as this agent sees them) that hold it: the device-node scan alone, without
        NVML. The simulation asks this to decide which simulated GPUs work and which
        processes NVML lists on them; NVML's answer there is the simulation's own output."""
        held: dict[GpuUuid, tuple[int, ...]] = {}
        for entry in self._core.allocator.all_attachments():
            if entry.state is not ReservationState.GRANTED:
                continue
            try:
                container = await self._container(entry)
                # The scan alone: NVML's list is the simulation's own output here, and
                # counting it kept a process listed after it let go of the GPU.
                holders = (
                    [] if container is None else await self._holders(entry, container, nvml=False)
                )
            except (InjectorError, LookupFailed) as e:
                log.debug("cannot tell whether %s is held: %s", entry.gpu.uuid, e)
                continue
            if holders:
                held[entry.gpu.uuid] = tuple(sorted({holder.pid for holder in holders}))
        return held

    async def _container(self, entry: Reservation) -> HostContainer | None:
        core = self._core
        return await core.workers.host(core.resolver.lookup, entry.target, entry.container)

    async def _holders(
        self, entry: Reservation, container: HostContainer, *, nvml: bool = True
    ) -> list[HolderInfo]:
        nodes = self._core.nodes.of(entry.gpu)
        return await self._core.workers.host(
            self._core.injector.holders, container, nodes, nvml=nvml
        )

    async def run_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.run_once()
            except Exception:
                # The next pass tries again; a broken pass must not end the loop.
                log.exception("idle release pass failed")

    async def _consider(
        self, entry: Reservation, usage: Mapping[GpuUuid, int | None]
    ) -> list[IdleRelease]:
        uuid, key = entry.gpu.uuid, attachment_id(entry)
        if self._core.allocator.get(uuid) != entry:
            return []  # released since the pass read it (a suspend takes all of a target's)
        container = await self._container(entry)
        if container is None:
            return []  # gone: the reconciler releases it
        holders = await self._holders(entry, container)
        now = self._clock()
        # Held but unused (NVML says 0 %, not "cannot say"): an idle CUDA context, which
        # only a suspend can take the GPU from.
        held_idle = bool(holders) and self._suspend is not None and usage.get(uuid) == 0
        if (holders and not held_idle) or (usage.get(uuid) or 0) > 0:
            self._idle_since[key] = now
            self._in_use.add(key)
            if self._book.warnings.pop(uuid, None) is not None:
                log.info("%s of %s is in use again: idle release called off", uuid, entry.target)
            return []
        since = self._idle_since.setdefault(key, now)
        self._in_use.discard(key)
        policy = self._book.policy_for(entry)
        handover = held_idle and self._others_wait(entry)
        due = self._due(entry, policy, idle_for=now - since, handover=handover)
        if due is None:
            return []
        reason, remaining = due
        if remaining > 0:
            if remaining <= policy.warning_seconds and uuid not in self._book.warnings:
                self._warn(entry, reason, remaining)
            elif remaining > policy.warning_seconds and uuid in self._book.warnings:
                # Announced for a hand-over whose waiting request has gone: not due so soon.
                del self._book.warnings[uuid]
                log.info("%s of %s: the hand-over is called off", uuid, entry.target)
            return []
        if held_idle:
            return await self._suspended(entry, container, reason, policy)
        if not await self._release(entry, container):
            self._restart(entry)
            return []
        return [self._released(entry, reason, policy)]

    async def _suspended(
        self, entry: Reservation, container: HostContainer, reason: IdleReason, policy: IdlePolicy
    ) -> list[IdleRelease]:
        """Suspend the target of a held, unused, due GPU — once every GPU of the target is
        due: a suspend takes them all, and one still in use must not be stopped."""
        assert self._suspend is not None
        others = [e for e in self._core.allocator.attachments_of(entry.target) if e != entry]
        handover = self._others_wait(entry)
        if not all(self._is_due(other, handover=handover) for other in others):
            return []  # the last of them to fall due suspends the target
        released = await self._suspend(container)
        if not released:
            self._restart(entry)  # refused (logged): try again after a whole idle period
            return []
        return [
            self._released(gone, reason, policy, kept=True, handover=handover) for gone in released
        ]

    def _is_due(self, entry: Reservation, *, handover: bool) -> bool:
        key = attachment_id(entry)
        since = self._idle_since.get(key)
        if since is None or key in self._in_use:
            return False
        policy = self._book.policy_for(entry)
        due = self._due(entry, policy, idle_for=self._clock() - since, handover=handover)
        return due is not None and due[1] <= 0

    def _others_wait(self, entry: Reservation) -> bool:
        """Whether a request of another container waits for GPUs (the hand-over's cue; a
        target's own request is never served by suspending the target)."""
        return any(waiter.container.key != entry.container for waiter in self._core.queue.waiters)

    def _restart(self, entry: Reservation) -> None:
        """The release did not happen: its idle period starts again, its warning goes."""
        self._idle_since[attachment_id(entry)] = self._clock()
        self._book.warnings.pop(entry.gpu.uuid, None)

    def _released(
        self,
        entry: Reservation,
        reason: IdleReason,
        policy: IdlePolicy,
        *,
        kept: bool = False,
        handover: bool = False,
    ) -> IdleRelease:
        """Record, announce, count and log an idle release."""
        uuid = entry.gpu.uuid
        release = IdleRelease(uuid, entry.target, reason, self._wall())
        self._idle_since.pop(attachment_id(entry), None)
        self._book.forget(uuid)
        self._book.record(release)
        self._book.tell(release)
        self._core.metrics.idle_releases.labels(reason=str(reason)).inc()
        how = " (suspended: its CUDA state is kept for the next attach)" if kept else ""
        why = _explain(reason, policy, handover=handover)
        log.warning("released %s from %s: %s%s", uuid, entry.target, why, how)
        return release

    def _due(
        self, entry: Reservation, policy: IdlePolicy, *, idle_for: float, handover: bool = False
    ) -> tuple[IdleReason, float] | None:
        """The first reason that will release this unused GPU, and the seconds until then
        (``handover``: it is held idle while another's request waits)."""
        candidates = []
        period = policy.idle_period(handover=handover)
        if period:
            candidates.append((period - idle_for, IdleReason.IDLE))
        if policy.max_lease_seconds and entry.granted_at is not None:
            ends = entry.granted_at + timedelta(seconds=policy.max_lease_seconds)
            candidates.append(((ends - self._wall()).total_seconds(), IdleReason.LEASE))
        if not candidates:
            return None
        remaining, reason = min(candidates)
        return reason, remaining

    def _warn(self, entry: Reservation, reason: IdleReason, remaining: float) -> None:
        warning = IdleWarning(
            entry.gpu.uuid, entry.target, reason, self._wall() + timedelta(seconds=remaining)
        )
        self._book.warnings[entry.gpu.uuid] = warning
        self._book.tell(warning)
        self._core.metrics.idle_warnings.labels(reason=str(reason)).inc()
        log.warning(
            "%s of %s will be released in %.0f s unless it is used (%s)",
            entry.gpu.uuid,
            entry.target,
            remaining,
            reason,
        )


def _explain(reason: IdleReason, policy: IdlePolicy, *, handover: bool) -> str:
    if reason is IdleReason.IDLE:
        period = policy.idle_period(handover=handover)
        if period != policy.idle_seconds:
            return f"unused for {period:g} s while a request of another kernel waited for GPUs"
        return f"unused for {period:g} s"
    return f"its lease of {policy.max_lease_seconds:g} s ended and nothing used it"
