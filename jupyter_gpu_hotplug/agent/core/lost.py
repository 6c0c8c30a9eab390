"""GPUs a container can still use although nothing reserves them any more: tell, wait, revoke.

Why it exists: a reservation can lose its backing behind the agent's back — in Kubernetes a
holder pod is preempted, evicted or deleted, or it vanished while the agent was down and a
container still carries our grant (an *orphan*). The GPU may then go to another pod, so the
access must end; but a user's kernel may be half-way through hours of work on it. The rule,
the same for every such loss:

1. **tell first**: the loss is recorded as a notice (``LossBook``) that the attachments view
   carries to the notebook's live stream (``holder_lost`` on the attachment) and every
   listener hears of it (Kubernetes: an Event on the pod) — before anything is touched;
2. **wait** the grace period (``LossRules.grace_seconds``);
3. **revoke** through the service (one node rule, ``node_created``, the worker pool, the
   target's lock — an operation in flight on that target is waited for), and tell the
   listeners what was done. Processes are ended only when the policy says ``force``;
   by default (``revoke``) the access goes (no new open succeeds, the node is removed where
   the agent made it) and processes that hold the GPU open keep their descriptors.

A loss already announced is not announced twice (a second holder event, the next sweep).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Final, Protocol

from ..._structs import GpuUuid, LostHolderWire, Target, format_timestamp
from .errors import Busy, LookupFailed
from .injector import HolderInfo, InjectorError
from .metrics import AgentMetrics
from .seams import GpuRecord

__all__ = [
    "LossBook",
    "LossListener",
    "LossNotice",
    "LossRules",
    "LostGpus",
    "LostPolicy",
    "TakeBack",
]

log = logging.getLogger(__name__)

_BUSY_RETRY: Final = 0.2
"""Seconds between two tries while a caller's operation holds the target."""
_FAILED_RETRY: Final = 5.0
"""Seconds between two tries of a revoke that failed on the host."""


class LostPolicy(enum.StrEnum):
    """What happens to processes that hold a lost GPU open when its grace period ends."""

    REVOKE = "revoke"
    """Take the access (permission, and the node where the agent made it); processes keep the
    descriptors they have. Nobody's work is ended by the agent."""
    FORCE = "force"
    """End the processes that hold it open (SIGTERM, then SIGKILL), as a forced detach."""


@dataclass(frozen=True)
class LossRules:
    """The policy for lost reservations and orphaned grants."""

    grace_seconds: float = 30.0
    """How long the user is warned before the access is taken."""
    policy: LostPolicy = LostPolicy.REVOKE


@dataclass(frozen=True)
class LossNotice:
    """A loss as announced: whose GPUs, why, and when the access goes."""

    key: str
    """What identifies the loss (a holder pod, or an orphaned grant's container)."""
    target: Target
    gpus: tuple[GpuRecord, ...]
    reason: str
    revoke_at: datetime
    orphan: bool
    """No reservation backs the grant at all (found by a sweep, not told by the allocator)."""

    def wire(self) -> LostHolderWire:
        return LostHolderWire(reason=self.reason, revoke_at=format_timestamp(self.revoke_at))


@dataclass(frozen=True)
class TakeBack:
    """What a revoke of a lost GPU did."""

    gone: bool
    """The container had exited: there was nothing to take from it."""
    forced: bool
    """Processes holding the GPU open were ended (policy ``force``)."""
    still_open: tuple[HolderInfo, ...] = ()
    """Processes that keep a descriptor of it (policy ``revoke``)."""


class LossListener(Protocol):
    """Told when a loss is announced (``outcome`` None) and once it has been revoked."""

    def __call__(self, notice: LossNotice, outcome: TakeBack | None) -> None: ...


class LossBook:
    """The losses announced and not yet revoked, by GPU (the attachments view reads it), and
    who is told of them: the backend's listeners (``BackendHooks``), given at construction
    and never changed."""

    def __init__(self, listeners: Iterable[LossListener] = ()) -> None:
        self.notices: dict[GpuUuid, LossNotice] = {}
        self._listeners = tuple(listeners)

    def tell(self, notice: LossNotice, outcome: TakeBack | None) -> None:
        """Each listener hears of the loss; one that fails is logged, the others still hear."""
        for listener in self._listeners:
            try:
                listener(notice, outcome)
            except Exception:
                log.exception("a loss listener failed")

    def of(self, uuid: GpuUuid) -> LostHolderWire | None:
        notice = self.notices.get(uuid)
        return None if notice is None else notice.wire()


Revoke = Callable[[bool], Awaitable[TakeBack | None]]
"""Takes the GPUs back (``True``: with force); None when there was nothing left to take."""


@dataclass(kw_only=True, eq=False)
class LostGpus:
    """Runs the announce → grace → revoke sequence of each loss (see the module docstring)."""

    rules: LossRules
    book: LossBook
    metrics: AgentMetrics
    """Where a revoke after the grace period is counted (``gpu_hotplug_lost_revokes``)."""
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    """The wall clock the announced ``revoke_at`` is read on (a test's own)."""
    _pending: set[str] = field(default_factory=set, init=False)
    """The keys of the losses announced and not yet settled."""

    def pending(self, key: str) -> bool:
        """Whether the loss ``key`` is announced and not yet settled."""
        return key in self._pending

    async def handle(
        self,
        *,
        key: str,
        target: Target,
        gpus: Sequence[GpuRecord],
        reason: str,
        revoke: Revoke,
        orphan: bool = False,
    ) -> None:
        """Announce the loss, wait the grace period, then ``revoke``; a loss already in hand
        is left to the first call."""
        if key in self._pending:
            return
        self._pending.add(key)
        notice = LossNotice(
            key=key,
            target=target,
            gpus=tuple(gpus),
            reason=reason,
            revoke_at=self.clock() + timedelta(seconds=self.rules.grace_seconds),
            orphan=orphan,
        )
        try:
            for gpu in notice.gpus:
                self.book.notices[gpu.uuid] = notice
            log.warning(
                "%s: %s lost its reservation (%s); access is revoked in %.0f s (policy %s)",
                target,
                ", ".join(gpu.uuid for gpu in notice.gpus),
                reason,
                self.rules.grace_seconds,
                self.rules.policy,
            )
            self.book.tell(notice, None)
            await asyncio.sleep(self.rules.grace_seconds)
            outcome = await self._revoke(notice, revoke)
        finally:
            for gpu in notice.gpus:
                if self.book.notices.get(gpu.uuid) is notice:
                    del self.book.notices[gpu.uuid]
            self._pending.discard(key)
        if outcome is not None:
            if not outcome.gone:
                kind = "orphan" if notice.orphan else "holder"
                self.metrics.lost_revokes.labels(kind=kind).inc(len(notice.gpus))
            self.book.tell(notice, outcome)

    async def _revoke(self, notice: LossNotice, revoke: Revoke) -> TakeBack | None:
        force = self.rules.policy is LostPolicy.FORCE
        failures = 0
        while True:
            try:
                return await revoke(force)
            except Busy:
                await asyncio.sleep(_BUSY_RETRY)  # a caller's operation ends by itself
            except (InjectorError, LookupFailed) as e:
                # The GPU stays usable while this fails, or while its container cannot be
                # looked up: keep trying (said once, then quietly).
                failures += 1
                log.log(
                    logging.ERROR if failures == 1 else logging.DEBUG,
                    "%s: %s could not be revoked (%s): %s; trying again every %.0f s",
                    notice.target,
                    ", ".join(gpu.uuid for gpu in notice.gpus),
                    notice.reason,
                    e,
                    _FAILED_RETRY,
                )
                await asyncio.sleep(_FAILED_RETRY)
