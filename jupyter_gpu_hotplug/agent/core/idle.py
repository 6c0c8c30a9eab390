"""The idle policy's shared state: the policy, what requests asked for, warnings, releases.

Why it exists apart from the pass that applies it (``idle_releaser.py``, where the policy is
explained): the service reads and writes this state at attach and detach, the bundle
(``bundle.py``) holds one book for all of its users, and the releaser acts through the bundle —
kept in one module, the bundle and the releaser imported each other. Here are only the values
and the book, over the seams; the backend's part (a per-target period, listeners) comes in at
construction (``hooks.py``).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import datetime

from ..._structs import GpuUuid, Target, TargetKey
from .seams import Reservation

__all__ = [
    "IdleBook",
    "IdleListener",
    "IdlePeriod",
    "IdlePolicy",
    "IdleReason",
    "IdleRelease",
    "IdleWarning",
]

_HISTORY: int = 20
"""Releases remembered per target."""


class IdleReason(enum.StrEnum):
    IDLE = "idle"
    """Unused for the whole idle period (or the hand-over period: ``handover_seconds``)."""
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
    handover_seconds: float = 0.0
    """While a request waits for GPUs, a GPU held idle (a CUDA context NVML sees at 0 %) is
    due after this long instead of the whole idle period, where the target can be suspended
    (its state kept); 0: never earlier. It shortens a policy that is on, never turns one on."""

    def __post_init__(self) -> None:
        for name in ("idle_seconds", "warning_seconds", "max_lease_seconds", "handover_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")

    @property
    def enabled(self) -> bool:
        return self.idle_seconds > 0 or self.max_lease_seconds > 0

    def idle_period(self, *, handover: bool) -> float:
        """How long a GPU must be unused to fall due for being idle (0: never): the idle
        period, or the hand-over period where that applies (``handover``) and is shorter."""
        if handover and self.handover_seconds and self.enabled:
            return min(self.idle_seconds or self.handover_seconds, self.handover_seconds)
        return self.idle_seconds

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


IdlePeriod = Callable[[Target], float | None]
"""A backend's idle period for a target (Kubernetes: the pod's annotation); None: none."""
IdleListener = Callable[[IdleWarning | IdleRelease], None]
"""Told of each warning and release (Kubernetes: Events on the pod)."""


class IdleBook:
    """What the service and the releaser share: per-attachment policies asked for at attach,
    warnings in force, and recent releases. Touched only on the event loop's thread.

    The backend's part (its per-target period and its listeners, ``BackendHooks``) is given
    at construction and never changed: nothing joins the book afterwards."""

    def __init__(
        self,
        policy: IdlePolicy | None = None,
        *,
        per_target: IdlePeriod | None = None,
        listeners: Iterable[IdleListener] = (),
    ) -> None:
        self.policy = IdlePolicy() if policy is None else policy
        """The agent's setting."""
        self.requested: dict[GpuUuid, float] = {}
        """Idle periods asked for by attach requests (applied only when stricter)."""
        self.warnings: dict[GpuUuid, IdleWarning] = {}
        self.releases: dict[TargetKey, deque[IdleRelease]] = {}
        self._per_target = per_target
        """The backend's period, applied only when stricter; read at every pass, so a changed
        setting holds without a restart."""
        self._listeners = tuple(listeners)

    def warning_of(self, entry: Reservation) -> IdleWarning | None:
        """The warning in force for this attachment (never one left by an earlier holder)."""
        warning = self.warnings.get(entry.gpu.uuid)
        return warning if warning is not None and warning.target == entry.target else None

    def policy_for(self, entry: Reservation) -> IdlePolicy:
        policy = self.policy.stricter(self.requested.get(entry.gpu.uuid))
        return (
            policy if self._per_target is None else policy.stricter(self._per_target(entry.target))
        )

    def tell(self, event: IdleWarning | IdleRelease) -> None:
        for listener in self._listeners:
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
