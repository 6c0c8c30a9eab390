"""The hot-plug engine: make devices usable by a running container, and take them back.

Boundary: a process id (the container's init, in the pid namespace of ``host_proc``)
and device nodes. It knows nothing of Kubernetes, Jupyter, GPUs' UUIDs or who owns
what — the agent decides *which* devices a container may have; this module makes
the kernel agree, in the right order, and undoes everything when a step fails.

A device is usable inside a container when three things hold, and the engine
manages all three:

1. the v1 ``devices`` cgroup allows it (hybrid and v1 hosts);
2. every eBPF device program on the container's cgroup2 directories allows it
   (hybrid and v2 hosts) — and, where systemd manages the container's cgroup as a unit
   (the systemd cgroup driver), so does the unit's ``DeviceAllow=``, or systemd takes the
   grant away again on its next ``daemon-reload``;
3. a node for it exists in the container's ``/dev`` — :mod:`.devnodes`.

The first two are the container's *device controllers*, one per cgroup version
(:mod:`.device_controllers`: ``v1`` over :mod:`.cgroup_v1`, ``v2`` over :mod:`.cgroup_v2`
and :mod:`.systemd_units`), chosen once when the engine inspects the container; the engine
itself holds what is the same for every version: the device nodes, the order of the steps
and their rollback (:mod:`.journal`), the busy checks (:mod:`.busy`) and the check that the
target is still the process it was.

Grant applies them in that order, so the node never appears before access is
allowed. Revoke checks who holds the device open first (an open fd survives any
revocation), then removes the node and the permissions (the controllers in reverse
order), and checks again to close the window in which a process could have opened it
meanwhile.

The NVIDIA control nodes (``nvidiactl``, ``nvidia-uvm*``) that a container lacks are
added with the first GPU and left in place on revoke: without a GPU node and its
cgroup permission they give access to no GPU, and removing them could break a
container whose runtime put them there.

Every error the engine raises is an :class:`EngineError`, with the mechanism's own error
chained.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Final, Literal

from . import busy, cgroup_v1, cgroup_v2, cgroups, devnodes, procfs, systemd_units
from .device_controllers import DeviceController, Verdict
from .device_controllers.v1 import V1Controller
from .device_controllers.v2 import ManagedUnit, V2Controller, program_names
from .devnodes import DeviceNode
from .devrules import CharDevice
from .journal import Change, Journal

__all__ = [
    "BUSY_SCAN_SECONDS",
    "Container",
    "DeviceBusyError",
    "DeviceStatus",
    "EngineError",
    "GrantResult",
    "HotplugEngine",
    "InjectionError",
    "RevokeResult",
    "ScanTimedOut",
    "TargetGoneError",
]

log = logging.getLogger(__name__)

CRUN_INNER_CGROUP = "container"
"""crun (and runc with systemd delegation) runs the workload one level below the
container's cgroup, in ``<scope>/container``; the runtime's device program sits on
the scope."""


class EngineError(Exception):
    """Base of everything the engine raises; the mechanism's own error is chained."""


class TargetGoneError(EngineError):
    """The target process does not exist (any more), or its pid now names another one."""


class InjectionError(EngineError):
    """A step of a grant or revoke failed; everything done before it was rolled back.

    ``rollback_errors`` lists what could not be undone (empty when the host is back
    as it was); the agent must treat a non-empty list as "state unknown, reconcile".
    """

    def __init__(self, message: str, *, rollback_errors: Sequence[str] = ()) -> None:
        if rollback_errors:
            message += "; ROLLBACK INCOMPLETE: " + "; ".join(rollback_errors)
        super().__init__(message)
        self.rollback_errors = tuple(rollback_errors)


class DeviceBusyError(EngineError):
    """Processes of the container hold a device open and ``force`` was not given."""

    def __init__(self, holders: Sequence[busy.Holder]) -> None:
        listed = ", ".join(f"{h.comm} (pid {h.pid})" for h in holders)
        super().__init__(f"device in use by {listed}")
        self.holders = tuple(holders)


class ScanTimedOut(EngineError):
    """The scan for processes holding the devices ran past its deadline: nothing changed."""

    def __init__(self, timeout: busy.ScanTimeout, *, seconds: float) -> None:
        super().__init__(f"{timeout} ({seconds:g} s)")
        self.seconds = seconds


BUSY_SCAN_SECONDS: Final = 15.0
"""How long one scan of a container's processes for open devices may take (issue 25: 500
processes x 2,000 fds took 25-45 s); past it a revoke stops, having changed nothing."""


@dataclass(frozen=True)
class Container:
    """What the engine needs to know about a target, read fresh from the host."""

    pid: int
    start_time: int
    cgroups: cgroups.ProcessCgroups
    v1: V1Controller | None
    """Its v1 ``devices`` cgroup; None without v1 devices, or where that cgroup confines
    nothing (the root, a privileged container's)."""
    v2: V2Controller | None
    """Its cgroup2 directories (and systemd unit); None where it sits in the cgroup2 root."""

    @property
    def controllers(self) -> tuple[DeviceController, ...]:
        """The device controllers that confine it, in the order a grant applies them."""
        return tuple(c for c in (self.v1, self.v2) if c is not None)

    @property
    def v1_scope(self) -> Path | None:
        """The v1 directory that gets allows (and all below it)."""
        return self.v1.scope if self.v1 is not None else None

    @property
    def cgroup_dirs(self) -> tuple[Path, ...]:
        """Every directory whose processes belong to the container (for busy scans)."""
        return tuple(dict.fromkeys(c.top for c in self.controllers))


@dataclass(frozen=True)
class DeviceStatus:
    """How usable one device is inside a container right now."""

    device: CharDevice
    node: bool
    """A node for it is in the container's ``/dev``."""
    v1: Verdict | None = None
    """What the v1 list says; None when no v1 devices cgroup confines the container."""
    v2: Verdict | None = None
    """What the device programs (and the unit) say; None when no cgroup2 directory does."""

    @property
    def verdicts(self) -> tuple[Verdict, ...]:
        return tuple(v for v in (self.v1, self.v2) if v is not None)

    @property
    def v1_allowed(self) -> bool | None:
        return self.v1.allows if self.v1 is not None else None

    @property
    def v2_allowed(self) -> bool | None:
        """Whether every device program allows it, whoever wrote them (``bpf.interp``)."""
        return self.v2.allows if self.v2 is not None else None

    @property
    def permitted(self) -> bool:
        """Some controller's grant lets the container open it (node or not)."""
        return any(v.granted for v in self.verdicts)

    @property
    def opens(self) -> bool:
        """A confining controller allows it and none denies it, whoever's rule it is."""
        verdicts = [v.allows for v in self.verdicts]
        return True in verdicts and False not in verdicts

    @property
    def ours(self) -> bool:
        """The access looks like this engine's own grant (our marked v2 prefix, or our v1
        entry), rather than a runtime's or a device plugin's."""
        return any(v.ours for v in self.verdicts)

    @property
    def usable(self) -> bool:
        """Usable now, and still after systemd rebuilds the unit's device program."""
        return self.node and all(
            v.granted is not False and v.unit_allows is not False for v in self.verdicts
        )

    @property
    def exposed(self) -> bool:
        """Any trace of access — what a revoke must clean up."""
        return self.node or any(bool(v.granted) or v.unit_ours for v in self.verdicts)


class _ControllerChanges:
    """The device controllers' reports in a result, by cgroup version."""

    changes: tuple[Change, ...]

    @property
    def v1_writes(self) -> tuple[cgroup_v1.Write, ...]:
        return tuple(w for c in self.changes if isinstance(c, cgroup_v1.V1Change) for w in c.writes)

    @property
    def v2_changes(self) -> tuple[cgroup_v2.GrantChange, ...]:
        return tuple(c for c in self.changes if isinstance(c, cgroup_v2.GrantChange))


@dataclass(frozen=True)
class GrantResult(_ControllerChanges):
    """What a grant changed, for the caller's record and log."""

    container: Container
    devices: tuple[DeviceNode, ...]
    nodes_created: tuple[str, ...]
    changes: tuple[Change, ...]


@dataclass(frozen=True)
class RevokeResult(_ControllerChanges):
    """What a revoke changed, including any process it ended (with ``force``)."""

    container: Container
    devices: tuple[DeviceNode, ...]
    nodes_removed: tuple[str, ...]
    changes: tuple[Change, ...]
    terminated: tuple[busy.Termination, ...] = ()
    target_gone: bool = False
    """The target process ended during the call (``force`` can end it)."""


_STEP_ERRORS = (
    cgroup_v1.CgroupV1Error,
    cgroup_v2.CgroupV2Error,
    devnodes.DevNodeError,
    cgroups.CgroupError,
    busy.BusyError,
    systemd_units.SystemdUnitError,
    OSError,
)
"""Errors of the mechanisms below the engine that mean "this step failed", as opposed to a
bug; the engine raises them as its own (:class:`InjectionError` from a change, a plain
:class:`EngineError` from a read), the mechanism's error chained."""


@contextmanager
def _reading(what: str) -> Iterator[None]:
    """A read of the host that fails raises :class:`EngineError` (nothing was changed)."""
    try:
        yield
    except _STEP_ERRORS as e:
        raise EngineError(f"cannot read {what}: {e}") from e


class HotplugEngine:
    """Grant and revoke devices in running containers on this host.

    ``host_proc`` is the procfs whose pids targets are given in (``/proc`` on the host;
    the host's procfs mounted elsewhere when the agent runs in a pod);
    ``hierarchies`` are the cgroup mounts as seen by us (discovered when None);
    ``extra_holders`` adds a second source of "who uses this device" (NVML's running
    processes) to the fd scan; ``control_nodes`` are the NVIDIA control nodes to add
    with the first GPU (read from the host when None); ``systemd`` keeps grants in the units
    of containers that systemd manages (``"detect"``: the host's systemd when it is pid 1).
    """

    def __init__(
        self,
        *,
        host_proc: Path = procfs.PROC,
        hierarchies: cgroups.CgroupHierarchies | None = None,
        extra_holders: busy.ExtraHolders | None = None,
        control_nodes: Sequence[DeviceNode] | None = None,
        terminate_grace: float = 5.0,
        busy_scan_seconds: float = BUSY_SCAN_SECONDS,
        systemd: systemd_units.SystemdUnits | Literal["detect"] | None = "detect",
    ) -> None:
        self.host_proc = host_proc
        self.hierarchies = hierarchies or cgroups.discover(host_proc=host_proc)
        self.extra_holders = extra_holders
        self.control_nodes = (
            tuple(control_nodes)
            if control_nodes is not None
            else tuple(devnodes.nvidia_control_devices(proc_devices=host_proc / "devices"))
        )
        self.terminate_grace = terminate_grace
        self.busy_scan_seconds = busy_scan_seconds
        self.systemd = (
            systemd_units.SystemdUnits.for_host(program_names) if systemd == "detect" else systemd
        )

    # ---- inspection ------------------------------------------------------------------

    def inspect(
        self, pid: int, *, devices_v1_scope: str | None = None, unified_scope: str | None = None
    ) -> Container:
        """Read the target's identity and cgroups; :class:`TargetGoneError` if it is gone.

        A container is a cgroup subtree, and its process may sit anywhere below the top (it
        can make child cgroups of its own): the ``*_scope`` paths (as ``/proc/<pid>/cgroup``
        names them) say where the container's cgroups begin, so that grants, revocations
        and busy scans cover the whole subtree. A process no longer below them has left the
        container (:class:`TargetGoneError`). Without them, the process's own cgroup is the
        container's (crun's inner leaf folded into its scope).
        """
        who = procfs.identity(pid, proc=self.host_proc)
        if who is None:
            raise TargetGoneError(f"process {pid} does not exist")
        with _reading(f"the cgroups of process {pid}"):
            try:
                found = cgroups.process_cgroups(
                    pid, hierarchies=self.hierarchies, host_proc=self.host_proc
                )
            except cgroups.CgroupNotFoundError as e:
                raise TargetGoneError(str(e)) from e
            in_v2 = self._v2_controller(found.unified, unified_scope, pid)
            in_v1 = self._v1_controller(found.devices_v1, devices_v1_scope, pid)
        return Container(pid, who.start_time, found, in_v1, in_v2)

    def _v1_controller(self, leaf: Path | None, given: str | None, pid: int) -> V1Controller | None:
        mount = self.hierarchies.devices_v1
        if leaf is None or not V1Controller.confines(leaf, mount):
            return None
        return V1Controller(self._scope(leaf, mount, given, pid))

    def _v2_controller(self, leaf: Path | None, given: str | None, pid: int) -> V2Controller | None:
        mount = self.hierarchies.unified
        if leaf is None or not V2Controller.confines(leaf, mount):
            return None
        scope = self._scope(leaf, mount, given, pid)
        directories = tuple(cgroups.cgroup_dirs_to_patch_v2(leaf, scope=scope))
        return V2Controller(scope, directories, self._managed_unit(scope))

    def _managed_unit(self, scope: Path) -> ManagedUnit | None:
        """The systemd unit the cgroup2 directory ``scope`` is, if systemd keeps its devices."""
        mount = self.hierarchies.unified
        if self.systemd is None or mount is None:
            return None
        control_group = PurePosixPath(mount.root) / scope.relative_to(mount.mount_point)
        unit = self.systemd.unit_of(scope, control_group=control_group)
        return ManagedUnit(unit, self.systemd) if unit is not None else None

    @staticmethod
    def _scope(leaf: Path, mount: cgroups.CgroupMount | None, given: str | None, pid: int) -> Path:
        """The container's top directory in one hierarchy, for a process in ``leaf``."""
        if given is None or mount is None:
            return _container_scope(leaf)
        try:
            scope = mount.directory_of(given)
        except cgroups.CgroupError as e:
            raise EngineError(f"the container's cgroup {given!r} is not usable: {e}") from e
        if leaf != scope and scope not in leaf.parents:
            raise TargetGoneError(f"process {pid} has left its container's cgroup {scope}")
        return scope

    def status(self, container: Container, devices: Iterable[DeviceNode]) -> list[DeviceStatus]:
        """The current state of each device in ``container`` (reconciliation reads this)."""
        self._check_alive(container)
        nodes = list(devices)
        chars = [node.device for node in nodes]
        with _reading(f"the devices of process {container.pid}"):
            present = {node.name: node.device for node in self._nodes(container)}
            in_v1 = container.v1.granted(chars) if container.v1 is not None else {}
            in_v2 = container.v2.granted(chars) if container.v2 is not None else {}
        return [
            DeviceStatus(
                node.device,
                present.get(node.name) == node.device,
                in_v1.get(node.device),
                in_v2.get(node.device),
            )
            for node in nodes
        ]

    def nodes_present(
        self, pid: int, start_time: int, devices: Iterable[DeviceNode]
    ) -> frozenset[str]:
        """The names of ``devices`` whose node (that name, that number) is in the ``/dev`` of
        process ``pid`` — the very process that started at ``start_time``, checked before
        and after the listing, so a newcomer with a dead target's pid is never read.

        Why not :meth:`status`: an attach asks this once before its grant (which nodes will it
        make?), and only the nodes matter; :meth:`inspect` and the cgroup reads of
        :meth:`status` (the v1 list, every device program read back and run) were half of
        what the agent added to an attach.
        """
        self._check_same(pid, start_time)
        try:
            with _reading(f"the devices of process {pid}"):
                listed = devnodes.list_nodes(pid, proc=self.host_proc)
        except devnodes.ContainerGoneError as e:
            raise TargetGoneError(str(e)) from e
        self._check_same(pid, start_time)
        present = {node.name: node.device for node in listed}
        return frozenset(node.name for node in devices if present.get(node.name) == node.device)

    def holders_by_device(
        self, container: Container, devices: Iterable[CharDevice], *, extra: bool = True
    ) -> dict[CharDevice, list[busy.Holder]]:
        """For each of ``devices``, the processes of the container that hold it open (and,
        with ``extra``, those ``extra_holders`` names); one walk of the container's processes
        and their fds for all of them, within ``busy_scan_seconds`` (:class:`ScanTimedOut`
        past them)."""
        with _reading(f"which processes of process {container.pid}'s container hold devices"):
            return self._scan(container, devices, extra=extra)

    def _scan(
        self, container: Container, devices: Iterable[CharDevice], *, extra: bool = True
    ) -> dict[CharDevice, list[busy.Holder]]:
        try:
            return busy.find_holders_by_device(
                [d for d in container.cgroup_dirs if d.is_dir()],
                devices,
                proc=self.host_proc,
                extra_holders=self.extra_holders if extra else None,
                deadline=time.monotonic() + self.busy_scan_seconds,
            )
        except busy.ScanTimeout as e:
            raise ScanTimedOut(e, seconds=self.busy_scan_seconds) from e

    # ---- grant -----------------------------------------------------------------------

    def grant(self, target: int | Container, devices: Sequence[DeviceNode]) -> GrantResult:
        """Make ``devices`` usable in the running container, all or nothing.

        Idempotent: what is already granted is left as it is (and not taken back by a
        rollback). Raises :class:`TargetGoneError` or :class:`InjectionError`; in both
        cases the host is as it was before the call.
        """
        container = self._container(target)
        journal = Journal.for_process(container.pid)
        wanted = tuple(devices)
        try:
            wanted += self._missing_control_nodes(container)
            for controller in container.controllers:
                controller.grant([node.device for node in wanted], journal)
            self._check_alive(container)
            created = self._create_nodes(container, wanted, journal)
        except (*_STEP_ERRORS, TargetGoneError) as e:
            failures = journal.roll_back()
            if isinstance(e, TargetGoneError) and not failures:
                raise
            raise InjectionError(
                f"granting {_names(wanted)} to process {container.pid} failed: {e}",
                rollback_errors=failures,
            ) from e
        return GrantResult(container, wanted, created, tuple(journal.changes))

    def _create_nodes(
        self, container: Container, nodes: Sequence[DeviceNode], journal: Journal
    ) -> tuple[str, ...]:
        """Make ``nodes`` in the container's ``/dev``; the names of those that were not
        there (only they are removed on a rollback)."""
        created: list[str] = []
        for node in nodes:
            if self._create(container, node):
                journal.undo_with(
                    f"remove /dev/{node.name}", partial(self._remove, container, node)
                )
                journal.record("mknod", [node.device], Path("/dev") / node.name)
                created.append(node.name)
        return tuple(created)

    # ---- revoke ----------------------------------------------------------------------

    def revoke(
        self,
        target: int | Container,
        devices: Sequence[DeviceNode],
        *,
        force: bool = False,
        keep_nodes: Collection[str] = (),
        leave_open: bool = False,
    ) -> RevokeResult:
        """Take ``devices`` away from the running container.

        The nodes named in ``keep_nodes`` stay in the container's ``/dev`` (their permission
        goes all the same): nodes this engine did not create — the runtime's — are not its to
        delete, and without the permission they open nothing.

        Refuses with :class:`DeviceBusyError` while a process of the container holds one
        open, unless ``force``: then those processes get SIGTERM, and SIGKILL after the
        grace period. On any failure the devices are granted again, so the container is
        left as it was and the caller's record stays true. ``leave_open`` (without
        ``force``): take the permission and the nodes even while processes hold the device
        open; they keep their open fds and nobody is ended (the policy for a GPU whose
        reservation was lost behind the agent's back).

        ``force`` may end the target process itself. The permissions are then still
        taken from its cgroups (other processes may live on in them); its device nodes
        went with its mount namespace. ``target_gone`` in the result says so.
        """
        container = self._container(target)
        wanted = tuple(devices)
        try:
            ended = self._end_holders(container, wanted, force=force, leave_open=leave_open)
        except busy.BusyError as e:
            raise InjectionError(f"cannot tell whether the device is in use: {e}") from e
        journal = Journal.for_process(container.pid)
        try:
            removed, gone = self._remove_nodes(container, wanted, keep_nodes, journal)
            for controller in reversed(container.controllers):
                controller.revoke([node.device for node in wanted], journal)
            # Again: a process may have opened a device between the first look and now.
            ended += self._end_holders(container, wanted, force=force, leave_open=leave_open)
        except (DeviceBusyError, ScanTimedOut):
            _roll_back_for_busy(journal)
            raise
        except (*_STEP_ERRORS, TargetGoneError) as e:
            failures = journal.roll_back()
            raise InjectionError(
                f"revoking {_names(wanted)} from process {container.pid} failed: {e}",
                rollback_errors=failures,
            ) from e
        gone = gone or not self._alive(container)
        changes = tuple(journal.changes)
        return RevokeResult(container, wanted, removed, changes, ended, target_gone=gone)

    def _remove_nodes(
        self,
        container: Container,
        nodes: Sequence[DeviceNode],
        keep: Collection[str],
        journal: Journal,
    ) -> tuple[tuple[str, ...], bool]:
        """Unlink ``nodes`` but those in ``keep`` from the container's ``/dev``: the names
        removed, and whether the container is gone (``force`` may have ended it a moment
        ago: its ``/dev`` went with it, and there is nothing left to unlink)."""
        if not self._alive(container):
            return (), True
        removed: list[str] = []
        for node in nodes:
            if node.name in keep:
                continue
            try:
                if not self._remove(container, node):
                    continue
            except devnodes.ContainerGoneError:
                return tuple(removed), True
            journal.undo_with(f"recreate /dev/{node.name}", partial(self._create, container, node))
            journal.record("unlink", [node.device], Path("/dev") / node.name)
            removed.append(node.name)
        return tuple(removed), False

    # ---- withdraw --------------------------------------------------------------------

    def withdraw(
        self, *, devices_v1: str | None, unified: str | None, devices: Sequence[DeviceNode]
    ) -> None:
        """Take the permissions for ``devices`` from the cgroups of a container that has no
        process left (paths as ``/proc/<pid>/cgroup`` named them, scopes already folded).

        An empty cgroup keeps its device rules and programs, and a process moved into it
        later would get them: they must go before the device is handed to anyone else. Its
        nodes went with its mount namespace. A cgroup that is gone already is skipped. Raises
        :class:`InjectionError` when a write fails (nothing is rolled back: a withdraw only
        ever takes away, so its journal is only a log).
        """
        journal = Journal("an empty cgroup")
        try:
            self._check_empty(devices_v1=devices_v1, unified=unified)
            for controller in self._leftovers(devices_v1=devices_v1, unified=unified):
                controller.revoke([node.device for node in devices], journal)
        except _STEP_ERRORS as e:
            raise InjectionError(
                f"withdrawing {_names(devices)} from the empty cgroups {devices_v1}, {unified} "
                f"failed: {e}",
                rollback_errors=["a withdraw is not rolled back"],
            ) from e

    def _leftovers(self, *, devices_v1: str | None, unified: str | None) -> list[DeviceController]:
        """The controllers of an empty container's cgroups that still confine it, in the
        order of a revoke; in cgroup2 the whole subtree (its processes are gone from every
        level, so no leaf says where to stop)."""
        found: list[DeviceController] = []
        v2_mount, v1_mount = self.hierarchies.unified, self.hierarchies.devices_v1
        if unified is not None and v2_mount is not None:
            top = v2_mount.directory_of(unified)
            if top.is_dir() and V2Controller.confines(top, v2_mount):
                subtree = (top, *cgroups.descendants(top))
                found.append(V2Controller(top, subtree, self._managed_unit(top)))
        if devices_v1 is not None and v1_mount is not None:
            scope = v1_mount.directory_of(devices_v1)
            if scope.is_dir() and V1Controller.confines(scope, v1_mount):
                found.append(V1Controller(scope))
        return found

    def _check_empty(self, *, devices_v1: str | None, unified: str | None) -> None:
        """Refuse a withdraw while any process lives anywhere below the container's cgroups
        (one may have moved into a child cgroup of its own): it can still use the device."""
        for mount, path in (
            (self.hierarchies.devices_v1, devices_v1),
            (self.hierarchies.unified, unified),
        ):
            if mount is None or path is None:
                continue
            top = mount.directory_of(path)
            if top.is_dir() and (members := cgroups.pids_in_cgroup(top, recursive=True)):
                raise InjectionError(
                    f"the cgroups {path} are not empty (processes {members[:8]} live below "
                    "them): nothing is withdrawn while the container can still use it"
                )

    # ---- helpers ---------------------------------------------------------------------

    def _container(self, target: int | Container) -> Container:
        if isinstance(target, Container):
            self._check_alive(target)
            return target
        return self.inspect(target)

    def _alive(self, container: Container) -> bool:
        return self._same(container.pid, container.start_time)

    def _same(self, pid: int, start_time: int) -> bool:
        who = procfs.identity(pid, proc=self.host_proc)
        return who is not None and who.start_time == start_time

    def _check_alive(self, container: Container) -> None:
        self._check_same(container.pid, container.start_time)

    def _check_same(self, pid: int, start_time: int) -> None:
        if not self._same(pid, start_time):
            raise TargetGoneError(f"process {pid} has exited")

    def _create(self, container: Container, node: DeviceNode) -> bool:
        return devnodes.ensure_node(
            container.pid, node.name, node.device, mode=node.mode, proc=self.host_proc
        )

    def _remove(self, container: Container, node: DeviceNode) -> bool:
        return devnodes.remove_node(
            container.pid, node.name, expect=node.device, proc=self.host_proc
        )

    def _nodes(self, container: Container) -> list[DeviceNode]:
        try:
            return devnodes.list_nodes(container.pid, proc=self.host_proc)
        except devnodes.ContainerGoneError as e:
            raise TargetGoneError(str(e)) from e

    def _missing_control_nodes(self, container: Container) -> tuple[DeviceNode, ...]:
        if not self.control_nodes:
            return ()
        present = {node.name: node.device for node in self._nodes(container)}
        return tuple(n for n in self.control_nodes if present.get(n.name) != n.device)

    def _end_holders(
        self, container: Container, nodes: Sequence[DeviceNode], *, force: bool, leave_open: bool
    ) -> tuple[busy.Termination, ...]:
        """Look for processes that hold ``nodes`` open: :class:`DeviceBusyError` when there
        are any, or with ``force`` end them; with ``leave_open`` (and no ``force``) whoever
        holds one keeps it, so there is nothing to look for and nobody to end."""
        if leave_open and not force:
            return ()
        found: dict[int, busy.Holder] = {}
        for holders in self._scan(container, [n.device for n in nodes]).values():
            for holder in holders:
                found.setdefault(holder.pid, holder)
        holding = sorted(found.values(), key=lambda h: h.pid)
        if not holding:
            return ()
        if not force:
            raise DeviceBusyError(holding)
        return self._terminate(holding)

    def _terminate(self, holders: Sequence[busy.Holder]) -> tuple[busy.Termination, ...]:
        log.warning(
            "host change: terminating %s (force)",
            ", ".join(f"{h.comm}[{h.pid}]" for h in holders),
        )
        result = busy.terminate(holders, grace=self.terminate_grace, proc=self.host_proc)
        if not result.all_gone:
            raise InjectionError(f"processes {list(result.survivors)} survived SIGKILL")
        return (result,)


def _roll_back_for_busy(journal: Journal) -> None:
    """Undo a revoke that a late holder (or a scan past its deadline) stopped; the caller
    then raises that error — unless the host could not be put back."""
    failures = journal.roll_back()
    if failures:
        raise InjectionError(
            "a process opened the device during revoke, or the scan ran past its deadline",
            rollback_errors=failures,
        ) from None


def _container_scope(leaf: Path) -> Path:
    """The container's own cgroup for a process whose cgroup is ``leaf`` (see
    :data:`CRUN_INNER_CGROUP`)."""
    return leaf.parent if leaf.name == CRUN_INNER_CGROUP else leaf


def _names(nodes: Iterable[DeviceNode]) -> str:
    return ", ".join(f"/dev/{n.name}" for n in nodes)
