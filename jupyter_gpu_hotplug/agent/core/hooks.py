"""What a backend adds to the core, declared once: ``BackendHooks``, handed to ``Core.build``.

Why it exists: the core serves every backend through its seams (``seams.py``), but a backend
also has a say in four of the core's own passes — the reconciler's node-wide sweeps, the GPUs a
container got outside the agent (a device plugin's: never strays), the idle period a target's
platform asks for, and who hears of idle warnings, idle releases and lost reservations. The
Kubernetes backend used to join the core by writing five of its attributes after construction,
which held only because ``runtime.py`` called it before the first pass. Now the backend
builds one frozen ``BackendHooks`` and the core is built with it: the idle book and the loss
book take their part at construction, the reconciler reads the rest from the bundle, and no
attribute of the core is written afterwards. The defaults are local mode's: nothing to add.

``ReconcileReport`` lives here, not in ``reconcile.py``, because a sweep writes to it: the
hooks sit below the bundle, which sits below the reconciler.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field

from ..._structs import GpuUuid, Target, TargetKey
from .idle import IdleListener, IdlePeriod
from .lost import LossListener
from .seams import GpuRecord, HostContainer

__all__ = ["Assigned", "BackendHooks", "ReconcileReport", "Sweep"]


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


Sweep = Callable[[Sequence[GpuRecord], ReconcileReport], Awaitable[None]]
"""A backend's pass over the whole node, given every GPU the node has or had."""
Assigned = Callable[[HostContainer], Collection[GpuUuid]]
"""The GPUs a container got outside the agent (a device plugin's): never strays (blocking)."""


def _nothing_assigned(container: HostContainer) -> Collection[GpuUuid]:
    return ()


def _no_period(target: Target) -> float | None:
    return None


@dataclass(frozen=True)
class BackendHooks:
    """A backend's part in the core's passes (see the module docstring); the defaults add
    nothing (local mode)."""

    sweeps: tuple[Sweep, ...] = ()
    """Node-wide passes, run at the end of every reconciliation (Kubernetes: orphaned grants
    and stray GPU access)."""
    assigned: Assigned = _nothing_assigned
    """What the runtime or the device plugin gave each container."""
    idle_period: IdlePeriod = _no_period
    """A target's idle period (Kubernetes: the pod's annotation), applied only when stricter."""
    idle_listeners: tuple[IdleListener, ...] = ()
    """Told of each idle warning and release (Kubernetes: Events on the pod)."""
    loss_listeners: tuple[LossListener, ...] = ()
    """Told of each lost reservation, announced and revoked (Kubernetes: Events on the pod)."""
