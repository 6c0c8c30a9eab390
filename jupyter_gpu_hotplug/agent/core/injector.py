"""The seam between the agent's orchestration and the host: make GPUs usable in a target.

Why a Protocol here: the service decides *which* devices a target gets and keeps the books;
how the kernel is made to agree (device cgroups, eBPF, device nodes) is the hot-plug engine's
business (``linux/engine.py``). The service talks only to ``Injector`` and sees only this
module's errors, so it is unit-tested against an in-memory fake and never imports the Linux
mechanics; ``EngineInjector`` is the one adapter that does.

Targets are ``HostContainer`` values (a live process of the container, pid *and* start time,
from the resolver): every call first checks that the pid still names the same process, so a
GPU can never be granted to a newcomer that inherited a dead target's pid. This module is the
one place where the engine's (Linux) errors become the agent's.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from ...linux import devnodes
from ...linux.devnodes import DeviceNode
from ...linux.devrules import CharDevice
from ...linux.engine import (
    STEP_ERRORS,
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
    "ScanUnfinished",
    "TargetGone",
    "gpu_node",
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
    otherwise its state is unknown and must be reconciled."""

    def __init__(self, message: str, *, clean: bool) -> None:
        super().__init__(message)
        self.clean = clean


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


class Injector(Protocol):
    """Grants and revokes device nodes in running targets. Calls block; run them in a thread."""

    def grant(self, target: HostContainer, devices: Sequence[DeviceNode]) -> frozenset[str]:
        """Make ``devices`` usable in ``target``, all or nothing (idempotent); the names of
        the nodes it created (those that were not there before)."""

    def revoke(
        self,
        target: HostContainer,
        devices: Sequence[DeviceNode],
        *,
        force: bool,
        keep_nodes: Collection[str] = (),
        leave_open: bool = False,
    ) -> None:
        """Take ``devices`` away; ``DeviceInUse`` while held open unless ``force`` (which
        ends the holders) or ``leave_open`` (the access goes, processes keep the fds they
        have). The nodes named in ``keep_nodes`` stay (the agent did not create them); their
        permission goes. On failure the target keeps what it had."""

    def withdraw(self, cgroups: ContainerCgroups, devices: Sequence[DeviceNode]) -> None:
        """Take the permissions for ``devices`` from the cgroups of a container that has no
        process left (``Resolver.remains``); ``InjectionFailed`` (not clean) on failure."""

    def status(self, target: HostContainer, devices: Sequence[DeviceNode]) -> list[DeviceState]:
        """The state of each of ``devices`` in ``target``, in the order given."""

    def holders(self, target: HostContainer, devices: Sequence[DeviceNode]) -> list[HolderInfo]:
        """Processes of ``target``'s container that hold any of ``devices`` open, by pid."""


# What a read (inspect, status, holders) can meet: the engine's own errors and those of the
# mechanisms below it, which the engine wraps only in grant and revoke.
_HOST_ERRORS = (EngineError, *STEP_ERRORS)


class EngineInjector:
    """``Injector`` over the hot-plug engine of ``linux/engine.py``."""

    def __init__(self, engine: HotplugEngine) -> None:
        self._engine = engine

    def _container(self, target: HostContainer) -> Container:
        try:
            # The container's cgroups, not the process's own: it may sit in a child cgroup.
            container = self._engine.inspect(
                target.pid,
                devices_v1_scope=target.cgroups.devices_v1,
                unified_scope=target.cgroups.unified,
            )
        except TargetGoneError as e:
            raise TargetGone(f"{target} has exited") from e
        except _HOST_ERRORS as e:
            raise InjectionFailed(f"cannot inspect {target}: {e}", clean=True) from e
        if container.start_time != target.start_time:
            raise TargetGone(f"{target} has exited (its pid now names another process)")
        return container

    def grant(self, target: HostContainer, devices: Sequence[DeviceNode]) -> frozenset[str]:
        container = self._container(target)
        try:
            return frozenset(self._engine.grant(container, devices).nodes_created)
        except EngineError as e:
            raise _change_failed(target, "grant", e) from e

    def revoke(
        self,
        target: HostContainer,
        devices: Sequence[DeviceNode],
        *,
        force: bool,
        keep_nodes: Collection[str] = (),
        leave_open: bool = False,
    ) -> None:
        container = self._container(target)
        try:
            self._engine.revoke(
                container, devices, force=force, keep_nodes=keep_nodes, leave_open=leave_open
            )
        except DeviceBusyError as e:
            raise DeviceInUse([HolderInfo(h.pid, h.comm) for h in e.holders]) from e
        except ScanTimedOut as e:
            raise ScanUnfinished(f"{target}: {e}", seconds=e.seconds) from e
        except EngineError as e:
            raise _change_failed(target, "revoke", e) from e

    def withdraw(self, cgroups: ContainerCgroups, devices: Sequence[DeviceNode]) -> None:
        try:
            self._engine.withdraw(
                devices_v1=cgroups.devices_v1, unified=cgroups.unified, devices=devices
            )
        except EngineError as e:
            raise InjectionFailed(str(e), clean=False) from e

    def status(self, target: HostContainer, devices: Sequence[DeviceNode]) -> list[DeviceState]:
        container = self._container(target)
        try:
            states = self._engine.status(container, devices)
        except (TargetGoneError, devnodes.ContainerGoneError) as e:
            raise TargetGone(f"{target} has exited") from e
        except _HOST_ERRORS as e:
            raise InjectionFailed(f"cannot read the devices of {target}: {e}", clean=True) from e
        return [
            DeviceState(
                s.device,
                usable=s.usable,
                exposed=s.exposed,
                permitted=bool(s.v1_allowed) or bool(s.v2_granted),
                node=s.node,
                ours=s.ours,
                opens=s.opens,
            )
            for s in states
        ]

    def holders(self, target: HostContainer, devices: Sequence[DeviceNode]) -> list[HolderInfo]:
        container = self._container(target)
        found: dict[int, HolderInfo] = {}
        try:
            held = self._engine.holders_by_device(container, [node.device for node in devices])
            for holders in held.values():
                for holder in holders:
                    found.setdefault(holder.pid, HolderInfo(holder.pid, holder.comm))
        except ScanTimedOut as e:
            raise ScanUnfinished(f"{target}: {e}", seconds=e.seconds) from e
        except _HOST_ERRORS as e:
            raise InjectionFailed(
                f"cannot tell whether the GPU is in use in {target}: {e}", clean=True
            ) from e
        return [found[pid] for pid in sorted(found)]


def _change_failed(target: HostContainer, operation: str, error: EngineError) -> InjectorError:
    """A failed grant or revoke as the service needs it: whether the host is as before."""
    if isinstance(error, TargetGoneError):
        return TargetGone(f"{target} exited during the {operation}")
    if isinstance(error, InjectionError):
        return InjectionFailed(str(error), clean=not error.rollback_errors)
    return InjectionFailed(str(error), clean=True)
