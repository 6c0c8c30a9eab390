"""What a backend adds to the core, declared once: ``BackendHooks``, handed to ``Core.build``.

Why it exists: the core serves every backend through its seams (``seams.py``), but a backend
also has a say in four of the core's own passes — the node sweep (``sweep.py``: which
containers run on the node, and what their runtime or device plugin gave them: never strays),
the idle period a target's platform asks for, and who hears of idle warnings, idle releases,
lost reservations and stray access. The
Kubernetes backend used to join the core by writing five of its attributes after construction,
which held only because ``runtime.py`` called it before the first pass. Now the backend
builds one frozen ``BackendHooks`` and the core is built with it: the idle book and the loss
book take their part at construction, the reconciler reads the rest from the bundle, and no
attribute of the core is written afterwards. The defaults add nothing: no container is swept,
none was assigned a GPU, nobody else is told.

``ReconcileReport`` lives here, not in ``reconcile.py``, because a sweep writes to it: the
hooks sit below the bundle, which sits below the reconciler.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from ..._structs import GpuUuid, Target, TargetKey
from .entitlement import Judged
from .idle import IdleListener, IdlePeriod
from .lost import LossListener
from .seams import HostContainer, Reservation

__all__ = [
    "Assigned",
    "BackendHooks",
    "ReconcileReport",
    "Running",
    "RunningContainer",
    "StrayListener",
    "StrayNotice",
]


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


@dataclass(frozen=True)
class RunningContainer:
    """A running container of the node, as the node sweep judges it."""

    container: HostContainer
    assigned: frozenset[GpuUuid] = frozenset()
    """What its runtime or device plugin gave it: part of its entitlement, never touched."""


Running = Callable[[Sequence[Reservation]], Sequence[RunningContainer]]
"""Every running container of the node that a grant of ours could be in, with what it was
assigned (blocking), given the node's reservations (local mode: a process in a child cgroup
of a reserved container is that container). Raises when that cannot be told this time (a
device plugin's GPU could not be told from a stray): the sweep then judges nothing."""
Assigned = Callable[[HostContainer], Collection[GpuUuid]]
"""The GPUs one container got outside the agent (a device plugin's): never strays (blocking)."""


@dataclass(frozen=True)
class StrayNotice:
    """A container that can open a GPU nothing entitles it to and no grant of ours gave
    (``verdict``: the GPU and its nodes), and whether the stray policy takes it away."""

    container: HostContainer
    verdict: Judged
    revoking: bool


StrayListener = Callable[[StrayNotice], None]
"""Told once of each stray access (per container and GPU) when it is first seen."""


def _nothing_assigned(container: HostContainer) -> Collection[GpuUuid]:
    return ()


def _none_running(reservations: Sequence[Reservation]) -> Sequence[RunningContainer]:
    return ()


def _no_period(target: Target) -> float | None:
    return None


@dataclass(frozen=True)
class BackendHooks:
    """A backend's part in the core's passes (see the module docstring); the defaults add
    nothing."""

    running: Running = _none_running
    """The node sweep's containers (local: every container process of the host that the
    resolver would accept as a target; Kubernetes: the node's pods' running containers but
    trusted holders, with what PodResources says the device plugin gave them)."""
    assigned: Assigned = _nothing_assigned
    """What the runtime or the device plugin gave one container (the reconciler's question,
    for a container with reservations)."""
    orphans: bool = False
    """Whether a grant of the agent's can outlive its reservation while the agent is down
    (Kubernetes: a holder pod deleted or evicted meanwhile) — then an ours-looking grant that
    no reservation backs is an orphan, taken back by the loss sequence. Local mode's ledger
    removes a row only after the revoke, so there such a grant is somebody else's (another
    agent's, a hand-written ``c 195:N rw`` — the rule NVIDIA's legacy runtime hook also
    writes on cgroup v1): judged a stray, reported, and revoked only by the stray policy."""
    orphan_reason: str = "no reservation backs it any more"
    """Why an orphaned grant is taken back, as the user is told (the loss sequence)."""
    stray_listeners: tuple[StrayListener, ...] = ()
    """Told of each stray access when first seen (Kubernetes: an Event on the pod)."""
    idle_period: IdlePeriod = _no_period
    """A target's idle period (Kubernetes: the pod's annotation), applied only when stricter."""
    idle_listeners: tuple[IdleListener, ...] = ()
    """Told of each idle warning and release (Kubernetes: Events on the pod)."""
    loss_listeners: tuple[LossListener, ...] = ()
    """Told of each lost reservation, announced and revoked (Kubernetes: Events on the pod)."""
