"""What may this container open: one answer, and one verdict on each GPU it can open.

Why it exists: three passes ask the same question — a detach or a take-back (which nodes may
go without taking what the container keeps), the reconciler (what a container with
reservations can open beyond them) and the node sweep (what every running container can open
that nobody gave it) — and each used to answer it its own way, from two "owned" sets. The
answer is pure and lives here, once:

- a container's **entitlement** is its reservations (those recorded for its container, and
  those of its target recorded before containers were: an empty key) and what its runtime or
  device plugin assigned it (``BackendHooks``: PodResources in Kubernetes, nothing locally);
- a GPU the container can open (every node of it opens, as the kernel would answer) is
  **accounted** when it is entitled, or when every node it needs is one an entitled GPU needs
  too (the GPU node two slices share); otherwise it is an **orphan** when every grant left is
  the agent's own (our v1 entry, our marked v2 prefix: a grant whose reservation is gone) and
  a **stray** when anybody else's rule lets it in (a runtime, a hand-written device rule).

What each pass does with a verdict is its own (``reconcile.py``, ``sweep.py``); no I/O here:
the callers read the states (``Injector.status``) and the nodes (``GpuNodes``).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..._structs import GpuUuid
from ...linux.devnodes import DeviceNode
from ...linux.devrules import CharDevice
from .injector import DeviceState
from .seams import GpuRecord, HostContainer, Reservation

__all__ = ["Access", "Entitlement", "Judged", "NodesOf", "holds", "judge", "to_check"]


class Access(enum.Enum):
    """The one classification of a GPU a container can open."""

    ACCOUNTED = "accounted"
    """Entitled (reserved or assigned), or needing only what an entitled GPU needs."""
    ORPHAN = "orphan"
    """Our own grant, which no reservation backs."""
    STRAY = "stray"
    """Neither ours nor assigned: somebody else's rule lets the container open it."""


def holds(entry: Reservation, container: HostContainer) -> bool:
    """Whether ``entry`` reserves its GPU for ``container``: recorded for its container, or for
    its target by an agent that recorded no containers (two targets may share one container:
    each reservation is its container's)."""
    if entry.container:
        return entry.container == container.key
    return entry.target.key == container.target.key


@dataclass(frozen=True)
class Entitlement:
    """What one container may open (see the module docstring)."""

    reserved: tuple[GpuRecord, ...]
    """The GPUs its reservations give it."""
    assigned: frozenset[GpuUuid] = frozenset()
    """The GPUs its runtime or device plugin gave it."""

    @classmethod
    def of(
        cls,
        container: HostContainer,
        reservations: Iterable[Reservation],
        assigned: Collection[GpuUuid] = (),
    ) -> Entitlement:
        """``container``'s entitlement, from every reservation of the node."""
        reserved = tuple(entry.gpu for entry in reservations if holds(entry, container))
        return cls(reserved, frozenset(assigned))

    @property
    def uuids(self) -> frozenset[GpuUuid]:
        return frozenset(gpu.uuid for gpu in self.reserved) | self.assigned

    def keeping(
        self, leaving: Collection[GpuUuid], known: Iterable[GpuRecord] = ()
    ) -> list[GpuRecord]:
        """What the container keeps when ``leaving`` go: its other reservations, and the
        assigned GPUs among ``known`` (their nodes must survive the revoke)."""
        kept = {gpu.uuid: gpu for gpu in self.reserved if gpu.uuid not in leaving}
        for gpu in known:
            if gpu.uuid in self.assigned and gpu.uuid not in leaving:
                kept.setdefault(gpu.uuid, gpu)
        return list(kept.values())


@dataclass(frozen=True)
class Judged:
    """A GPU a container can open, with its verdict."""

    gpu: GpuRecord
    access: Access
    nodes: tuple[DeviceNode, ...]
    """Its nodes that no entitled GPU needs: what taking it back revokes (none when
    accounted)."""


NodesOf = Sequence[tuple[GpuRecord, Sequence[DeviceNode]]]
"""Each GPU of the node with the device nodes it needs in a container (none: unknown)."""


def _needed(entitlement: Entitlement, known: NodesOf) -> set[CharDevice]:
    entitled = entitlement.uuids
    return {node.device for gpu, nodes in known if gpu.uuid in entitled for node in nodes}


def to_check(entitlement: Entitlement, known: NodesOf) -> list[DeviceNode]:
    """The nodes whose state ``judge`` needs: those of every GPU not entitled, each once."""
    entitled = entitlement.uuids
    found: dict[CharDevice, DeviceNode] = {}
    for gpu, nodes in known:
        if gpu.uuid not in entitled:
            for node in nodes:
                found.setdefault(node.device, node)
    return list(found.values())


def judge(
    entitlement: Entitlement, known: NodesOf, states: Mapping[CharDevice, DeviceState]
) -> list[Judged]:
    """The verdict on each GPU of ``known`` the container can open (every node of it opens,
    per ``states``, the nodes ``to_check`` named); a GPU it cannot open, or whose nodes are
    unknown, is not judged."""
    entitled = entitlement.uuids
    needed = _needed(entitlement, known)
    verdicts = []
    for gpu, nodes in known:
        if gpu.uuid in entitled:
            verdicts.append(Judged(gpu, Access.ACCOUNTED, ()))
            continue
        if not nodes or not all(states[node.device].opens for node in nodes):
            continue
        spare = tuple(node for node in nodes if node.device not in needed)
        if not spare:
            access = Access.ACCOUNTED
        elif all(states[node.device].ours for node in spare):
            access = Access.ORPHAN
        else:
            access = Access.STRAY
        verdicts.append(Judged(gpu, access, spare))
    return verdicts
