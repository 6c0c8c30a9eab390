"""Idle release: GPUs come back by themselves from targets that stopped using them.

Why it exists, in the agent rather than a client: an attached GPU that nobody uses is the
expensive failure mode of hot-plug (a forgotten notebook holds it for days), and only the agent
sees every attachment whichever client made it (toolbar, magic, CLI, REST). So the agent
watches each granted GPU and releases it when, for the whole idle period, no process of the
target's container held it open *and* NVML saw no utilisation; optionally a lease also ends at
a maximum age. A GPU in use is never released: the release itself goes through the ordinary
detach path without ``force``, whose busy check refuses while any process holds the device.

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
import enum
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from ..._structs import GpuUuid, Target, TargetKey
from .injector import HolderInfo, InjectorError
from .seams import (
    ContainerKey,
    HostContainer,
    Reservation,
    ReservationState,
)

if TYPE_CHECKING:
    # The bundle holds this module's IdleBook; the releaser only needs the bundle's type.
    from .bundle import Core

__all__ = [
    "IdleBook",
    "IdlePolicy",
    "IdleReason",
    "IdleRelease",
    "IdleReleaser",
    "IdleWarning",
    "Usage",
    "attachment_id",
]

log = logging.getLogger(__name__)

Usage = Callable[[], Mapping[GpuUuid, int | None]]
"""GPU utilisation in percent by UUID, read from NVML (blocking); ``None``: NVML cannot say."""

_HISTORY: int = 20
"""Releases remembered per target."""

AttachmentId = tuple[GpuUuid, ContainerKey, datetime | None]


def attachment_id(entry: Reservation) -> AttachmentId:
    """One attachment: a GPU granted to one container at one moment (module docstring)."""
    return entry.gpu.uuid, entry.container, entry.granted_at


class IdleReason(enum.StrEnum):
    IDLE = "idle"
    """Unused for the whole idle period."""
    LEASE = "lease"
    """The maximum lease ran out (and nothing used the GPU at that moment)."""


@dataclass(frozen=True)
class IdlePolicy:
    """When an attached GPU goes back; ``0`` switches a part off."""

    idle_seconds: float = 0.0
    """Release after this long without use; 0: never for being idle."""
    warning_seconds: float = 60.0
    """Warn this long before a release (a release is never earlier because of it)."""
    max_lease_seconds: float = 0.0
    """Release an unused GPU once it has been attached this long; 0: no maximum."""

    def __post_init__(self) -> None:
        for name in ("idle_seconds", "warning_seconds", "max_lease_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")

    @property
    def enabled(self) -> bool:
        return self.idle_seconds > 0 or self.max_lease_seconds > 0

    def stricter(self, idle_seconds: float | None) -> IdlePolicy:
        """This policy with a request's idle period, if that one is stricter (shorter, or
        any when this policy has none); a laxer request changes nothing."""
        if idle_seconds is None or idle_seconds <= 0:
            return self
        if self.idle_seconds and idle_seconds >= self.idle_seconds:
            return self
        return replace(self, idle_seconds=idle_seconds)


@dataclass(frozen=True)
class IdleWarning:
    """An attachment that will be released unless it is used before ``release_at``."""

    uuid: GpuUuid
    target: Target
    reason: IdleReason
    release_at: datetime


@dataclass(frozen=True)
class IdleRelease:
    """An attachment the policy released."""

    uuid: GpuUuid
    target: Target
    reason: IdleReason
    released_at: datetime


@dataclass
class IdleBook:
    """What the service and the releaser share: per-attachment policies asked for at attach,
    warnings in force, and recent releases. Touched only on the event loop's thread."""

    policy: IdlePolicy = field(default_factory=IdlePolicy)
    """The agent's setting."""
    requested: dict[GpuUuid, float] = field(default_factory=dict)
    """Idle periods asked for by attach requests (applied only when stricter)."""
    warnings: dict[GpuUuid, IdleWarning] = field(default_factory=dict)
    releases: dict[TargetKey, deque[IdleRelease]] = field(default_factory=dict)
    per_target: Callable[[Target], float | None] = lambda target: None
    """The backend's idle period for a target (Kubernetes: the pod's annotation), applied
    only when stricter; read at every pass, so a changed setting holds without a restart."""
    listeners: list[Callable[[IdleWarning | IdleRelease], None]] = field(default_factory=list)
    """Told of each warning and release (Kubernetes: Events on the pod)."""

    def warning_of(self, entry: Reservation) -> IdleWarning | None:
        """The warning in force for this attachment (never one left by an earlier holder)."""
        warning = self.warnings.get(entry.gpu.uuid)
        return warning if warning is not None and warning.target == entry.target else None

    def policy_for(self, entry: Reservation) -> IdlePolicy:
        return self.policy.stricter(self.requested.get(entry.gpu.uuid)).stricter(
            self.per_target(entry.target)
        )

    def tell(self, event: IdleWarning | IdleRelease) -> None:
        for listener in self.listeners:
            listener(event)

    def request(self, uuids: list[GpuUuid], idle_seconds: float | None) -> None:
        """Remember an attach request's idle period for its GPUs."""
        for uuid in uuids:
            if idle_seconds is None:
                self.requested.pop(uuid, None)
            else:
                self.requested[uuid] = idle_seconds

    def forget(self, uuid: GpuUuid) -> None:
        """The attachment is gone (released by anyone): drop what is known of it."""
        self.requested.pop(uuid, None)
        self.warnings.pop(uuid, None)

    def record(self, release: IdleRelease) -> None:
        history = self.releases.setdefault(release.target.key, deque(maxlen=_HISTORY))
        history.append(release)

    def releases_of(self, target: Target) -> list[IdleRelease]:
        return list(self.releases.get(target.key, ()))


ReleaseUnused = Callable[[Reservation, HostContainer], Awaitable[bool]]
"""Detach one reservation without force; False when the GPU turned out to be in use."""


class IdleReleaser:
    """The background pass that applies the idle policy (see the module docstring)."""

    def __init__(
        self,
        core: Core,
        *,
        usage: Usage,
        release: ReleaseUnused,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._core = core
        self._usage = usage
        self._release = release
        self._clock = clock
        self._wall = wall
        self._idle_since: dict[AttachmentId, float] = {}

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
                except InjectorError as e:
                    log.warning("idle check of %s skipped: %s", entry.gpu.uuid, e)
                    continue
            if done is not None:
                released.append(done)
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
            container = await self._container(entry)
            try:
                holders = [] if container is None else await self._holders(entry, container)
            except InjectorError as e:
                log.debug("cannot tell whether %s is held: %s", entry.gpu.uuid, e)
                continue
            if holders:
                held[entry.gpu.uuid] = tuple(sorted({holder.pid for holder in holders}))
        return held

    async def _container(self, entry: Reservation) -> HostContainer | None:
        core = self._core
        return await core.workers.host(core.resolver.lookup, entry.target, entry.container)

    async def _holders(self, entry: Reservation, container: HostContainer) -> list[HolderInfo]:
        nodes = self._core.nodes.of(entry.gpu)
        return await self._core.workers.host(self._core.injector.holders, container, nodes)

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
    ) -> IdleRelease | None:
        uuid, key = entry.gpu.uuid, attachment_id(entry)
        container = await self._container(entry)
        if container is None:
            return None  # gone: the reconciler releases it
        holders = await self._holders(entry, container)
        now = self._clock()
        if holders or (usage.get(uuid) or 0) > 0:
            self._idle_since[key] = now
            if self._book.warnings.pop(uuid, None) is not None:
                log.info("%s of %s is in use again: idle release called off", uuid, entry.target)
            return None
        since = self._idle_since.setdefault(key, now)
        policy = self._book.policy_for(entry)
        due = self._due(entry, policy, idle_for=now - since)
        if due is None:
            return None
        reason, remaining = due
        if remaining > 0:
            if remaining <= policy.warning_seconds and uuid not in self._book.warnings:
                self._warn(entry, reason, remaining)
            return None
        if not await self._release(entry, container):
            self._idle_since[key] = self._clock()  # opened just now: it is in use
            self._book.warnings.pop(uuid, None)
            return None
        release = IdleRelease(uuid, entry.target, reason, self._wall())
        self._idle_since.pop(key, None)
        self._book.forget(uuid)
        self._book.record(release)
        self._book.tell(release)
        self._core.metrics.idle_releases.labels(reason=str(reason)).inc()
        log.warning("released %s from %s: %s", uuid, entry.target, _explain(reason, policy))
        return release

    def _due(
        self, entry: Reservation, policy: IdlePolicy, *, idle_for: float
    ) -> tuple[IdleReason, float] | None:
        """The first reason that will release this unused GPU, and the seconds until then."""
        candidates = []
        if policy.idle_seconds:
            candidates.append((policy.idle_seconds - idle_for, IdleReason.IDLE))
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


def _explain(reason: IdleReason, policy: IdlePolicy) -> str:
    if reason is IdleReason.IDLE:
        return f"unused for {policy.idle_seconds:g} s"
    return f"its lease of {policy.max_lease_seconds:g} s ended and nothing used it"
