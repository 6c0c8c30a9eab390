"""The hot-plug engine: make devices usable by a running container, and take them back.

Boundary: a process id (the container's init, in the pid namespace of ``host_proc``)
and device nodes. It knows nothing of Kubernetes, Jupyter, GPUs' UUIDs or who owns
what — the agent decides *which* devices a container may have; this module makes
the kernel agree, in the right order, and undoes everything when a step fails.

A device is usable inside a container when three things hold, and the engine
manages all three:

1. the v1 ``devices`` cgroup allows it (hybrid and v1 hosts) — :mod:`.cgroup_v1`;
2. every eBPF device program on the container's cgroup2 directories allows it
   (hybrid and v2 hosts) — :mod:`.cgroup_v2`;
3. a node for it exists in the container's ``/dev`` — :mod:`.devnodes`.

Where systemd manages the container's cgroup as a unit (the systemd cgroup driver), the
grant is also recorded in the unit's ``DeviceAllow=`` (:mod:`.systemd_units`), or systemd
takes it away again on its next ``daemon-reload``.

Grant applies them in that order, so the node never appears before access is
allowed. Revoke checks who holds the device open first (an open fd survives any
revocation), then removes the node and the permissions, and checks again to close
the window in which a process could have opened it meanwhile.

The NVIDIA control nodes (``nvidiactl``, ``nvidia-uvm*``) that a container lacks are
added with the first GPU and left in place on revoke: without a GPU node and its
cgroup permission they give access to no GPU, and removing them could break a
container whose runtime put them there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Final, Literal

from . import busy, cgroup_v1, cgroup_v2, cgroups, devnodes, procfs, systemd_units
from .bpf import interp
from .devnodes import DeviceNode
from .devrules import RW, CharDevice, DevType, effective_access

__all__ = [
    "BUSY_SCAN_SECONDS",
    "STEP_ERRORS",
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
    v1_scope: Path | None
    """The v1 directory that gets allows (and all below it); None without v1 devices."""
    v2_dirs: tuple[Path, ...]
    """cgroup2 directories from the process's leaf up to the container scope."""
    unit: systemd_units.Unit | None = None
    """The systemd unit the container scope is, when systemd keeps its device policy."""

    def leave_programs(self, directory: Path) -> frozenset[str]:
        """Device programs not ours to patch at ``directory``: systemd's, on its unit."""
        if self.unit is not None and directory == self.unit.directory:
            return _SYSTEMD_PROGRAMS
        return frozenset()

    @property
    def cgroup_dirs(self) -> tuple[Path, ...]:
        """Every directory whose processes belong to the container (for busy scans)."""
        tops = [self.v1_scope, self.v2_dirs[-1] if self.v2_dirs else None]
        return tuple(dict.fromkeys(d for d in tops if d is not None))


@dataclass(frozen=True)
class DeviceStatus:
    """How usable one device is inside a container right now."""

    device: CharDevice
    v1_allowed: bool | None
    """None when the host has no v1 devices controller."""
    v2_granted: bool | None
    """Whether our prefix grants it on every program; None when no program restricts it."""
    node: bool
    v2_allowed: bool | None = None
    """Whether every device program on the container's cgroups allows it (read and write),
    whoever wrote them (``bpf.interp``); None when no program restricts it or one cannot be
    read as a device program."""
    v1_ours: bool = False
    """The v1 list holds the very entry this engine writes for it (``c M:m rw``, no ``m``;
    runtimes write ``rwm`` for the devices they give, and wildcards for ``all``)."""

    systemd_allowed: bool | None = None
    """Whether the unit's ``DeviceAllow=`` allows it; None when no systemd unit keeps a
    device policy for the container."""
    systemd_ours: bool = False
    """Whether that entry is one we added."""

    @property
    def opens(self) -> bool:
        """A confining controller allows it and none denies it, whoever's rule it is."""
        verdicts = (self.v1_allowed, self.v2_allowed)
        return True in verdicts and False not in verdicts

    @property
    def ours(self) -> bool:
        """The access looks like this engine's own grant (our marked v2 prefix, or our v1
        entry), rather than a runtime's or a device plugin's."""
        return bool(self.v2_granted) or self.v1_ours

    @property
    def usable(self) -> bool:
        """Usable now, and still after systemd rebuilds the unit's device program."""
        return (
            self.node
            and self.v1_allowed is not False
            and self.v2_granted is not False
            and self.systemd_allowed is not False
        )

    @property
    def exposed(self) -> bool:
        """Any trace of access — what a revoke must clean up."""
        return self.node or bool(self.v1_allowed) or bool(self.v2_granted) or self.systemd_ours


@dataclass(frozen=True)
class GrantResult:
    """What a grant changed, for the caller's record and log."""

    container: Container
    devices: tuple[DeviceNode, ...]
    nodes_created: tuple[str, ...]
    v1_writes: tuple[cgroup_v1.Write, ...]
    v2_changes: tuple[cgroup_v2.GrantChange, ...]


@dataclass(frozen=True)
class RevokeResult:
    """What a revoke changed, including any process it ended (with ``force``)."""

    container: Container
    devices: tuple[DeviceNode, ...]
    nodes_removed: tuple[str, ...]
    v1_writes: tuple[cgroup_v1.Write, ...]
    v2_changes: tuple[cgroup_v2.GrantChange, ...]
    terminated: tuple[busy.Termination, ...] = ()
    target_gone: bool = False
    """The target process ended during the call (``force`` can end it)."""


@dataclass
class _Undo:
    """A stack of compensating actions, run newest first when a step fails."""

    steps: list[tuple[str, Callable[[], object]]] = field(default_factory=list)

    def push(self, what: str, action: Callable[[], object]) -> None:
        self.steps.append((what, action))

    def run(self) -> list[str]:
        failures = []
        for what, action in reversed(self.steps):
            try:
                action()
            except Exception as e:  # every failure is reported to the caller, none hidden
                log.error("rollback step failed: %s: %s", what, e)
                failures.append(f"{what}: {e}")
        self.steps.clear()
        return failures


STEP_ERRORS = (
    cgroup_v1.CgroupV1Error,
    cgroup_v2.CgroupV2Error,
    devnodes.DevNodeError,
    cgroups.CgroupError,
    busy.BusyError,
    systemd_units.SystemdUnitError,
    OSError,
)
"""Errors of the mechanisms below the engine that mean "this step failed", as opposed to a
bug; the engine wraps them in grant and revoke, and a caller of its reads meets them as they
are."""


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
            systemd_units.SystemdUnits.for_host(_program_names) if systemd == "detect" else systemd
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
        try:
            found = cgroups.process_cgroups(
                pid, hierarchies=self.hierarchies, host_proc=self.host_proc
            )
        except cgroups.CgroupNotFoundError as e:
            raise TargetGoneError(str(e)) from e
        except cgroups.CgroupError as e:
            raise EngineError(f"cannot read the cgroups of process {pid}: {e}") from e
        v2_dirs: tuple[Path, ...] = ()
        if found.unified is not None and self._confined_v2(found.unified):
            scope = self._scope(found.unified, self.hierarchies.unified, unified_scope, pid)
            v2_dirs = tuple(cgroups.cgroup_dirs_to_patch_v2(found.unified, scope=scope))
        v1_scope = None
        if found.devices_v1 is not None and self._confined_v1(found.devices_v1):
            mount = self.hierarchies.devices_v1
            v1_scope = self._scope(found.devices_v1, mount, devices_v1_scope, pid)
        unit = self._unit_of(v2_dirs[-1]) if v2_dirs else None
        return Container(pid, who.start_time, found, v1_scope, v2_dirs, unit)

    def _unit_of(self, directory: Path) -> systemd_units.Unit | None:
        mount = self.hierarchies.unified
        if self.systemd is None or mount is None:
            return None
        relative = directory.relative_to(mount.mount_point)
        return self.systemd.unit_of(directory, control_group=PurePosixPath(mount.root) / relative)

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

    def _confined_v1(self, directory: Path) -> bool:
        """Whether the v1 devices controller restricts this cgroup at all.

        The root cgroup, and any cgroup still in deny-list mode (``a *:* rwm`` in its
        list, as for a privileged container), allow every device: there is nothing to
        grant there, and a deny written there would hit every process below it — for
        the root, the whole host. Such a layer is left alone.
        """
        mount = self.hierarchies.devices_v1
        if mount is not None and directory == mount.mount_point:
            return False
        rules = cgroup_v1.read_allow_list(directory)
        return not any(rule.type is DevType.ALL for rule in rules)

    def _confined_v2(self, leaf: Path) -> bool:
        """Whether the process sits below the cgroup2 root (programs there are the
        host's, never ours to patch)."""
        mount = self.hierarchies.unified
        return mount is None or leaf != mount.mount_point

    def status(self, container: Container, devices: Iterable[DeviceNode]) -> list[DeviceStatus]:
        """The current state of each device in ``container`` (reconciliation reads this)."""
        self._check_alive(container)
        present = {node.name: node.device for node in self._nodes(container)}
        devices = list(devices)
        attached = [
            (d, found) for d in container.v2_dirs if (found := cgroup_v2.attached_programs(d))
        ]
        programs = [at for _, at in attached]
        # systemd's own programs are judged by the unit's list below, not by our prefix.
        v2_sets = [
            frozenset.intersection(*(p.granted for p in kept))
            for d, at in attached
            if (kept := [p for p in at if p.name not in container.leave_programs(d)])
        ]
        v1_rules = (
            cgroup_v1.read_allow_list(container.v1_scope)
            if container.v1_scope is not None
            else None
        )
        unit_allowed: dict[CharDevice, bool] = {}
        ours: frozenset[str] = frozenset()
        if container.unit is not None and self.systemd is not None:
            unit_allowed = self.systemd.allowed(container.unit, [n.device for n in devices])
            ours = self.systemd.ours(container.unit)
        statuses = []
        for node in devices:
            device = node.device
            v1 = (
                effective_access(v1_rules, DevType.CHAR, device.major, device.minor) & RW == RW
                if v1_rules is not None
                else None
            )
            mine = v1_rules is not None and device.rule(RW) in v1_rules
            v2 = all(device.rule() in s for s in v2_sets) if v2_sets else None
            node_ok = present.get(node.name) == device
            statuses.append(
                DeviceStatus(
                    device,
                    v1,
                    v2,
                    node_ok,
                    v1_ours=mine,
                    v2_allowed=_v2_allows(programs, device),
                    systemd_allowed=unit_allowed.get(device),
                    systemd_ours=systemd_units.entry_for(device).path in ours,
                )
            )
        return statuses

    def holders_by_device(
        self, container: Container, devices: Iterable[CharDevice]
    ) -> dict[CharDevice, list[busy.Holder]]:
        """For each of ``devices``, the processes of the container that hold it open; one
        walk of the container's processes and their fds for all of them, within
        ``busy_scan_seconds`` (:class:`ScanTimedOut` past them)."""
        try:
            return busy.find_holders_by_device(
                [d for d in container.cgroup_dirs if d.is_dir()],
                devices,
                proc=self.host_proc,
                extra_holders=self.extra_holders,
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
        wanted = tuple(devices) + self._missing_control_nodes(container)
        chars = [node.device for node in wanted]
        undo = _Undo()
        v1_writes: list[cgroup_v1.Write] = []
        v2_changes: list[cgroup_v2.GrantChange] = []
        created: list[str] = []
        try:
            if container.v1_scope is not None:
                scope = container.v1_scope
                new = [c for c in chars if cgroup_v1.allowed(scope, c) & RW != RW]
                if new:
                    undo.push(f"v1 deny {new} on {scope}", lambda: cgroup_v1.revoke(scope, new))
                    v1_writes += cgroup_v1.grant(scope, new).writes
                    _log_change("v1 allow", container, new, scope)
            for directory in container.v2_dirs:
                leave = container.leave_programs(directory)
                rules = {c.rule() for c in chars} - cgroup_v2.granted_devices(
                    directory, leave=leave
                )
                if not rules:
                    continue
                change = cgroup_v2.grant(directory, rules, leave=leave)
                if change.changed:
                    undo.push(
                        f"v2 revoke on {directory}", partial(cgroup_v2.revoke, directory, rules)
                    )
                    v2_changes.append(change)
                    _log_change("v2 allow", container, sorted(rules, key=str), directory)
            if container.unit is not None and self.systemd is not None:
                unit, units = container.unit, self.systemd
                recorded = units.record(unit, chars)
                if recorded.changed:
                    undo.push(
                        f"DeviceAllow of {unit.name}",
                        partial(units.unrecord, unit, recorded.devices),
                    )
                    _log_change("DeviceAllow", container, recorded.devices, unit.directory)
            self._check_alive(container)
            for node in wanted:
                if self._create(container, node):
                    undo.push(f"remove /dev/{node.name}", partial(self._remove, container, node))
                    created.append(node.name)
                    _log_change("mknod", container, [node.device], Path("/dev") / node.name)
        except (*STEP_ERRORS, TargetGoneError) as e:
            failures = undo.run()
            if isinstance(e, TargetGoneError) and not failures:
                raise
            raise InjectionError(
                f"granting {_names(wanted)} to process {container.pid} failed: {e}",
                rollback_errors=failures,
            ) from e
        return GrantResult(container, wanted, tuple(created), tuple(v1_writes), tuple(v2_changes))

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
        left as it was and the caller's record stays true.

        ``leave_open`` (without ``force``): take the permission and the nodes even while
        processes hold the device open; they keep their open fds and nobody is ended (the
        policy for a GPU whose reservation was lost behind the agent's back: new opens fail,
        running work is not killed).

        ``force`` may end the target process itself. The permissions are then still
        taken from its cgroups (other processes may live on in them); its device nodes
        went with its mount namespace. ``target_gone`` in the result says so.
        """
        container = self._container(target)
        wanted = tuple(devices)
        terminated = self._clear_holders(container, wanted, force=force, leave_open=leave_open)
        undo = _Undo()
        removed: list[str] = []
        v1_writes: list[cgroup_v1.Write] = []
        v2_changes: list[cgroup_v2.GrantChange] = []
        gone = not self._alive(container)
        try:
            for node in () if gone else wanted:
                if node.name in keep_nodes:
                    continue
                try:
                    if not self._remove(container, node):
                        continue
                except devnodes.ContainerGoneError:
                    gone = True  # ended by force a moment ago: its /dev is gone too
                    break
                undo.push(f"recreate /dev/{node.name}", partial(self._create, container, node))
                removed.append(node.name)
                _log_change("unlink", container, [node.device], Path("/dev") / node.name)
            rules = {node.device.rule() for node in wanted}
            for directory in container.v2_dirs:
                if not directory.is_dir():
                    continue  # the container's cgroup went away with its last process
                leave = container.leave_programs(directory)
                drop = rules & cgroup_v2.granted_devices(directory, leave=leave)
                if not drop:
                    continue
                change = cgroup_v2.revoke(directory, drop)
                undo.push(f"v2 re-grant on {directory}", partial(cgroup_v2.grant, directory, drop))
                v2_changes.append(change)
                _log_change("v2 revoke", container, sorted(drop, key=str), directory)
            scope = container.v1_scope
            if scope is not None and scope.is_dir():
                # Only what is allowed now: a deny for anything else changes nothing
                # and could take away a device the runtime gave the container itself.
                was = [n.device for n in wanted if cgroup_v1.allowed(scope, n.device) & RW]
                if was:
                    v1_writes += cgroup_v1.revoke(scope, was).writes
                    undo.push(f"v1 re-allow {was} on {scope}", partial(cgroup_v1.grant, scope, was))
                    _log_change("v1 deny", container, was, scope)
            unit = container.unit
            if unit is not None and self.systemd is not None and unit.directory.is_dir():
                units = self.systemd
                dropped = units.unrecord(unit, [n.device for n in wanted])
                if dropped.changed:
                    undo.push(
                        f"DeviceAllow of {unit.name}", partial(units.record, unit, dropped.devices)
                    )
                    _log_change("DeviceAllow reset", container, dropped.devices, unit.directory)
            late = [] if leave_open and not force else self._holders_of(container, wanted)
            if late and not force:
                raise DeviceBusyError(late)
            if late:
                terminated += self._terminate(late)
        except (DeviceBusyError, ScanTimedOut):
            failures = undo.run()
            if failures:
                raise InjectionError(
                    "a process opened the device during revoke, or the scan ran past its deadline",
                    rollback_errors=failures,
                ) from None
            raise
        except (*STEP_ERRORS, TargetGoneError) as e:
            failures = undo.run()
            raise InjectionError(
                f"revoking {_names(wanted)} from process {container.pid} failed: {e}",
                rollback_errors=failures,
            ) from e
        return RevokeResult(
            container,
            wanted,
            tuple(removed),
            tuple(v1_writes),
            tuple(v2_changes),
            terminated,
            target_gone=gone or not self._alive(container),
        )

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
        ever takes away).
        """
        chars = [node.device for node in devices]
        try:
            self._check_empty(devices_v1=devices_v1, unified=unified)
            v1_mount = self.hierarchies.devices_v1
            if devices_v1 is not None and v1_mount is not None:
                scope = v1_mount.directory_of(devices_v1)
                if scope.is_dir() and self._confined_v1(scope):
                    was = [c for c in chars if cgroup_v1.allowed(scope, c) & RW]
                    if was:
                        cgroup_v1.revoke(scope, was)
                        _log_withdraw("v1 deny", was, scope)
            v2_mount = self.hierarchies.unified
            if unified is not None and v2_mount is not None:
                top = v2_mount.directory_of(unified)
                if top.is_dir() and self._confined_v2(top):
                    unit = self._unit_of(top)
                    if unit is not None and self.systemd is not None:
                        dropped = self.systemd.unrecord(unit, chars)
                        if dropped.changed:
                            _log_withdraw("DeviceAllow reset", dropped.devices, top)
                    rules = {c.rule() for c in chars}
                    for directory in [top, *cgroups.descendants(top)]:
                        leave = _SYSTEMD_PROGRAMS if unit is not None and directory == top else ()
                        drop = rules & cgroup_v2.granted_devices(directory, leave=leave)
                        if drop:
                            cgroup_v2.revoke(directory, drop)
                            _log_withdraw("v2 revoke", sorted(drop, key=str), directory)
        except STEP_ERRORS as e:
            raise InjectionError(
                f"withdrawing {_names(devices)} from the empty cgroups {devices_v1}, {unified} "
                f"failed: {e}",
                rollback_errors=["a withdraw is not rolled back"],
            ) from e

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
        who = procfs.identity(container.pid, proc=self.host_proc)
        return who is not None and who.start_time == container.start_time

    def _check_alive(self, container: Container) -> None:
        if not self._alive(container):
            raise TargetGoneError(f"process {container.pid} has exited")

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

    def _holders_of(self, container: Container, nodes: Sequence[DeviceNode]) -> list[busy.Holder]:
        """Every process that holds any of ``nodes`` open, once, by pid."""
        found: dict[int, busy.Holder] = {}
        for holders in self.holders_by_device(container, [n.device for n in nodes]).values():
            for holder in holders:
                found.setdefault(holder.pid, holder)
        return sorted(found.values(), key=lambda h: h.pid)

    def _clear_holders(
        self, container: Container, nodes: Sequence[DeviceNode], *, force: bool, leave_open: bool
    ) -> tuple[busy.Termination, ...]:
        if leave_open and not force:
            return ()  # whoever holds it open keeps it: nothing to look for, nobody to end
        try:
            holding = self._holders_of(container, nodes)
        except busy.BusyError as e:
            raise InjectionError(f"cannot tell whether the device is in use: {e}") from e
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


def _container_scope(leaf: Path) -> Path:
    """The container's own cgroup for a process whose cgroup is ``leaf`` (see
    :data:`CRUN_INNER_CGROUP`)."""
    return leaf.parent if leaf.name == CRUN_INNER_CGROUP else leaf


_SYSTEMD_PROGRAMS = frozenset({systemd_units.SYSTEMD_PROGRAM_NAME})


def _program_names(directory: Path) -> list[tuple[int, str]]:
    return [(p.id, p.name) for p in cgroup_v2.attached_programs(directory)]


def _v2_allows(
    programs: Sequence[Sequence[cgroup_v2.ProgramInfo]], device: CharDevice
) -> bool | None:
    """What the programs on every directory answer for opening ``device`` read-write."""
    if not programs:
        return None
    verdicts = [
        interp.allows(p.code, DevType.CHAR, RW, device.major, device.minor)
        for at in programs
        for p in at
    ]
    if False in verdicts:
        return False
    return None if None in verdicts else True


def _names(nodes: Iterable[DeviceNode]) -> str:
    return ", ".join(f"/dev/{n.name}" for n in nodes)


def _log_withdraw(action: str, devices: Iterable[object], where: Path) -> None:
    log.info(
        "host change: %s %s for an empty cgroup at %s",
        action,
        " ".join(str(d) for d in devices),
        where,
        extra={"hotplug_action": action, "path": str(where)},
    )


def _log_change(action: str, container: Container, devices: Iterable[object], where: Path) -> None:
    """Every change to a host is logged, in one greppable shape."""
    log.info(
        "host change: %s %s for pid %d at %s",
        action,
        " ".join(str(d) for d in devices),
        container.pid,
        where,
        extra={"hotplug_action": action, "pid": container.pid, "path": str(where)},
    )
