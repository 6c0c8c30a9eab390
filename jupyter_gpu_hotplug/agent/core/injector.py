"""The seam between the agent's orchestration and the host: make GPUs usable in a target.

Why a Protocol here: the service decides *which* devices a target gets and keeps the books;
how the kernel is made to agree (device cgroups, eBPF, device nodes) is the hot-plug engine's
business (``linux/engine.py``). The service, the reconciler and the backends talk only to
``Injector`` and see only this module's types and errors, so they are unit-tested against an
in-memory fake (``tests/agent/fakes.py``) that raises exactly what the real one does, and only
this module drives the engine (an import-linter contract keeps it so).

``EngineInjector`` is the one adapter, and the one translation boundary between the two error
hierarchies of the call chain below the API: the engine's (``EngineError``, every mechanism's
error chained) and the core's (``InjectorError``, classified by what the core can do about it;
the service turns those into API errors in ``errors.py``). Every call runs the engine inside
one ``_translated`` block, and ``translate`` is the whole table:

============================  =====================================================
engine (``linux.engine``)      core (this module)
============================  =====================================================
``DeviceBusyError``            ``DeviceInUse`` (holders as ``HolderInfo``): nothing
                               changed, ``force`` would end them
``ScanTimedOut``               ``ScanUnfinished`` (``seconds``): nothing changed, a
                               retry may finish
``TargetGoneError``            ``TargetGone``: the process exited (or left its
                               container); nothing is left behind
``InjectionError``             ``InjectionFailed``, ``clean`` when its rollback left
                               nothing behind (``rollback_errors`` empty)
any other ``EngineError``      ``InjectionFailed(clean=True)``: a read or a refusal
                               that changed nothing
============================  =====================================================

The types are translated too: the engine's ``DeviceStatus`` (per cgroup version) becomes the
``DeviceState`` the core reasons with, its holders ``HolderInfo``.

Targets are ``HostContainer`` values (a live process of the container, pid *and* start time,
from the resolver): every call first checks that the pid still names the same process, so a
GPU can never be granted to a newcomer that inherited a dead target's pid.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, Required, TypedDict, Unpack

from ...linux.devnodes import DeviceNode
from ...linux.devrules import CharDevice
from ...linux.engine import (
    Container,
    DeviceBusyError,
    EngineError,
    HotplugEngine,
    InjectionError,
    ScanTimedOut,
    TargetGoneError,
)
from .seams import ContainerCgroups, HostContainer

__all__ = [
    "DeviceInUse",
    "DeviceState",
    "EngineInjector",
    "HolderInfo",
    "InjectionFailed",
    "Injector",
    "InjectorError",
    "Revocation",
    "ScanUnfinished",
    "TargetGone",
    "gpu_node",
    "translate",
]


class InjectorError(Exception):
    """Base of what an ``Injector`` raises."""


class TargetGone(InjectorError):
    """The target process has exited, or its pid now names another process."""


class DeviceInUse(InjectorError):
    """Processes of the target hold a device open and ``force`` was not given.

    Nothing was changed: the devices are still usable by the target.
    """

    def __init__(self, holders: Sequence[HolderInfo]) -> None:
        listed = ", ".join(f"{h.command} (pid {h.pid})" for h in holders)
        super().__init__(f"device in use by {listed}")
        self.holders = tuple(holders)


class ScanUnfinished(InjectorError):
    """The scan for processes holding the devices ran past its deadline (after ``seconds``);
    nothing was changed, and trying again later may find it done sooner."""

    def __init__(self, message: str, *, seconds: float) -> None:
        super().__init__(message)
        self.seconds = seconds


class InjectionFailed(InjectorError):
    """A step failed. ``clean``: everything begun was undone and the target is as it was;
    otherwise its state is unknown and must be reconciled. ``passing``: what failed was a
    service that should answer again shortly (the kubelet's PodResources), so the same
    request may succeed when retried."""

    def __init__(self, message: str, *, clean: bool, passing: bool = False) -> None:
        super().__init__(message)
        self.clean = clean
        self.passing = passing


@dataclass(frozen=True)
class HolderInfo:
    """A process that keeps a device busy."""

    pid: int
    command: str


@dataclass(frozen=True)
class DeviceState:
    """How far one device reaches into a target right now."""

    device: CharDevice
    usable: bool
    """Node present and every device controller allows it: the target can open it."""
    exposed: bool
    """Any trace of access (node or permission): what a revoke must clean up."""
    permitted: bool
    """A device controller lets the target open it (whether or not the node is there)."""
    node: bool
    """The node is in the target's ``/dev`` (whether or not the cgroups allow it)."""
    ours: bool = False
    """The permission looks like the agent's own grant (not a runtime's or a device plugin's):
    what the orphan sweep takes back without a reservation."""
    opens: bool = False
    """The container's own device policy lets it open the device, by whoever's rule (the v1
    list, or every v2 program run as the kernel would), and some controller confines it (an
    unconfined, privileged container opens everything and is not counted)."""


def gpu_node(minor: int, *, major: int) -> DeviceNode:
    """The node of GPU ``minor``: ``/dev/nvidia<minor>``, char ``major:minor``."""
    return DeviceNode(f"nvidia{minor}", CharDevice(major, minor))


class Revocation(TypedDict, total=False):
    """How ``Injector.revoke`` takes devices away: declared once, for the protocol and every
    injector, and handed to the engine as it is (which gives what is left out its default)."""

    force: Required[bool]
    """End the processes that hold the devices open (else ``DeviceInUse`` while any does)."""
    keep_nodes: Collection[str]
    """Nodes that stay (the agent did not create them); their permission goes all the same.
    None by default."""
    leave_open: bool
    """The access goes while processes keep the fds they have (a take-back without consent);
    off by default."""


class Injector(Protocol):
    """Grants and revokes device nodes in running targets. Calls block; run them in a thread."""

    def grant(self, target: HostContainer, devices: Sequence[DeviceNode]) -> frozenset[str]:
        """Make ``devices`` usable in ``target``, all or nothing (idempotent); the names of
        the nodes it created (those that were not there before)."""

    def revoke(
        self, target: HostContainer, devices: Sequence[DeviceNode], **how: Unpack[Revocation]
    ) -> None:
        """Take ``devices`` away, ``how`` says (``Revocation``); ``DeviceInUse`` while held
        open unless ``force`` or ``leave_open``. On failure the target keeps what it had."""

    def withdraw(self, cgroups: ContainerCgroups, devices: Sequence[DeviceNode]) -> None:
        """Take the permissions for ``devices`` from the cgroups of a container that has no
        process left (``Resolver.remains``); ``InjectionFailed`` on failure (``clean`` only
        when nothing was taken: a process still lives in them)."""

    def status(self, target: HostContainer, devices: Sequence[DeviceNode]) -> list[DeviceState]:
        """The state of each of ``devices`` in ``target``, in the order given."""

    def present(self, target: HostContainer, devices: Sequence[DeviceNode]) -> frozenset[str]:
        """The names of ``devices`` whose node is in ``target``'s ``/dev`` now (``status``'s
        ``node``, without reading the cgroups: what an attach asks before its grant)."""

    def holders(
        self, target: HostContainer, devices: Sequence[DeviceNode], *, nvml: bool = True
    ) -> list[HolderInfo]:
        """Processes of ``target``'s container that hold any of ``devices`` open, by pid;
        with ``nvml``, also those NVML lists on them (the busy check's whole answer)."""


class EngineInjector:
    """``Injector`` over the hot-plug engine of ``linux/engine.py``: the one translation
    between the host's types and errors and the core's (see the module's docstring)."""

    def __init__(self, engine: HotplugEngine) -> None:
        self._engine = engine

    def grant(self, target: HostContainer, devices: Sequence[DeviceNode]) -> frozenset[str]:
        with _translated(target):
            container = self._container(target)
            return frozenset(self._engine.grant(container, devices).nodes_created)

    def revoke(
        self, target: HostContainer, devices: Sequence[DeviceNode], **how: Unpack[Revocation]
    ) -> None:
        with _translated(target):
            self._engine.revoke(self._container(target), devices, **how)

    def withdraw(self, cgroups: ContainerCgroups, devices: Sequence[DeviceNode]) -> None:
        with _translated(cgroups):
            self._engine.withdraw(
                devices_v1=cgroups.devices_v1, unified=cgroups.unified, devices=devices
            )

    def status(self, target: HostContainer, devices: Sequence[DeviceNode]) -> list[DeviceState]:
        with _translated(target):
            states = self._engine.status(self._container(target), devices)
        return [
            DeviceState(
                s.device,
                usable=s.usable,
                exposed=s.exposed,
                permitted=s.permitted,
                node=s.node,
                ours=s.ours,
                opens=s.opens,
            )
            for s in states
        ]

    def present(self, target: HostContainer, devices: Sequence[DeviceNode]) -> frozenset[str]:
        with _translated(target):
            return self._engine.nodes_present(target.pid, target.start_time, devices)

    def holders(
        self, target: HostContainer, devices: Sequence[DeviceNode], *, nvml: bool = True
    ) -> list[HolderInfo]:
        with _translated(target):
            held = self._engine.holders_by_device(
                self._container(target), [node.device for node in devices], extra=nvml
            )
        found = {h.pid: HolderInfo(h.pid, h.comm) for holders in held.values() for h in holders}
        return [found[pid] for pid in sorted(found)]

    def _container(self, target: HostContainer) -> Container:
        """The engine's view of ``target``: the container's cgroups, not the process's own
        (it may sit in a child cgroup), and the very process the resolver saw."""
        container = self._engine.inspect(
            target.pid,
            devices_v1_scope=target.cgroups.devices_v1,
            unified_scope=target.cgroups.unified,
        )
        if container.start_time != target.start_time:
            raise TargetGone(f"{target} has exited (its pid now names another process)")
        return container


def translate(error: EngineError, where: object) -> InjectorError:
    """The table of the module's docstring: the core's error for one of the engine's."""
    match error:
        case DeviceBusyError():
            return DeviceInUse([HolderInfo(h.pid, h.comm) for h in error.holders])
        case ScanTimedOut():
            return ScanUnfinished(f"{where}: {error}", seconds=error.seconds)
        case TargetGoneError():
            return TargetGone(f"{where} has exited")
        case InjectionError():  # its message names the devices and the process already
            return InjectionFailed(str(error), clean=not error.rollback_errors)
        case _:
            return InjectionFailed(f"{where}: {error}", clean=True)


@contextmanager
def _translated(where: object) -> Iterator[None]:
    """Raise the core's error for any error of the engine's, the engine's chained."""
    try:
        yield
    except EngineError as e:
        raise translate(e, where) from e
