"""cgroup v2: a container's devices as our marked prefix on its eBPF device programs, and as
entries of its systemd unit's ``DeviceAllow=`` where systemd keeps the policy.

Every device program on the container's cgroup2 directories must allow an access (logical
AND), so a grant patches each of them, on every directory from the process's leaf up to the
container's scope (:mod:`..cgroup_v2` swaps each program atomically and verifies it). Where
systemd manages the scope as a unit, it rebuilds its own program (``sd_devices``) from the
unit's list on every ``daemon-reload``: that program is systemd's to keep, not ours to
patch, and the device goes into the unit's list instead (:mod:`..systemd_units`), or the next
reload takes it away again.

Why a module of its own beside :mod:`..cgroup_v2`: that one is the eBPF mechanism on one
directory, which the sandbox runtime shares; this one is the engine's layer (systemd units,
the journal, the verdicts) and may import what the sandbox runtime must not.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from .. import cgroup_v2, systemd_units
from ..bpf import interp
from ..cgroups import CgroupMount
from ..devrules import RW, CharDevice, DeviceRule, DevType
from ..journal import Journal
from . import Verdict

__all__ = ["SYSTEMD_PROGRAMS", "ManagedUnit", "V2Controller", "program_names"]

SYSTEMD_PROGRAMS = frozenset({systemd_units.SYSTEMD_PROGRAM_NAME})
"""The programs at a unit's directory that systemd builds from its list, and we leave alone."""


def program_names(directory: Path) -> list[tuple[int, str]]:
    """The ids and names of the device programs at ``directory`` (what systemd's part needs
    to tell its rebuilt program from the old one)."""
    return [(p.id, p.name) for p in cgroup_v2.attached_programs(directory)]


@dataclass(frozen=True)
class ManagedUnit:
    """The systemd unit a container's scope is, and the systemd that keeps its list."""

    unit: systemd_units.Unit
    systemd: systemd_units.SystemdUnits

    def record(self, devices: Collection[CharDevice], journal: Journal) -> None:
        change = self.systemd.record(self.unit, devices)
        if change.changed:
            undo = partial(self.systemd.unrecord, self.unit, change.devices)
            journal.undo_with(f"DeviceAllow of {self.unit.name}", undo)
            journal.record("DeviceAllow", change.devices, self.unit.directory, change)

    def unrecord(self, devices: Collection[CharDevice], journal: Journal) -> None:
        if not self.unit.directory.is_dir():
            return  # the unit went away with the container
        change = self.systemd.unrecord(self.unit, devices)
        if change.changed:
            undo = partial(self.systemd.record, self.unit, change.devices)
            journal.undo_with(f"DeviceAllow of {self.unit.name}", undo)
            journal.record("DeviceAllow reset", change.devices, self.unit.directory, change)

    def verdicts(self, devices: Collection[CharDevice]) -> dict[CharDevice, tuple[bool, bool]]:
        """For each device: whether the unit's list allows it, and whether we added it."""
        allowed = self.systemd.allowed(self.unit, devices)
        ours = self.systemd.ours(self.unit)
        return {d: (allowed[d], systemd_units.entry_for(d).path in ours) for d in devices}


@dataclass(frozen=True)
class V2Controller:
    """The devices of a container through the device programs on its cgroup2 directories."""

    scope: Path
    """The container's own cgroup2 directory."""
    directories: tuple[Path, ...]
    """Every directory whose programs a grant patches: for a running process, from its leaf
    up to ``scope``; for a container without processes, ``scope`` and all below it."""
    unit: ManagedUnit | None = None
    """Set when ``scope`` is a systemd unit with a device policy of its own."""

    @staticmethod
    def confines(directory: Path, mount: CgroupMount | None) -> bool:
        """Whether a process in ``directory`` sits below the cgroup2 root (programs at the
        root are the host's, never ours to patch)."""
        return mount is None or directory != mount.mount_point

    @property
    def top(self) -> Path:
        return self.scope

    def granted(self, devices: Collection[CharDevice]) -> dict[CharDevice, Verdict]:
        attached = [(d, at) for d in self.directories if (at := cgroup_v2.attached_programs(d))]
        programs = [p for _, at in attached for p in at]
        # systemd's programs are judged by the unit's list, not by our prefix.
        ours = [
            frozenset.intersection(*(p.granted for p in kept))
            for d, at in attached
            if (kept := [p for p in at if p.name not in self._left_to_systemd(d)])
        ]
        unit = self.unit.verdicts(devices) if self.unit is not None else {}
        verdicts = {}
        for device in devices:
            granted = all(device.rule() in s for s in ours) if ours else None
            allows, unit_ours = unit.get(device, (None, False))
            verdicts[device] = Verdict(
                granted,
                _programs_allow(programs, device),
                ours=bool(granted),
                unit_allows=allows,
                unit_ours=unit_ours,
            )
        return verdicts

    def grant(self, devices: Collection[CharDevice], journal: Journal) -> None:
        wanted = {d.rule() for d in devices}
        for directory in self.directories:
            self._grant_at(directory, wanted, journal)
        if self.unit is not None:
            self.unit.record(devices, journal)

    def revoke(self, devices: Collection[CharDevice], journal: Journal) -> None:
        wanted = {d.rule() for d in devices}
        for directory in self.directories:
            self._revoke_at(directory, wanted, journal)
        if self.unit is not None:
            self.unit.unrecord(devices, journal)

    def _grant_at(self, directory: Path, wanted: set[DeviceRule], journal: Journal) -> None:
        leave = self._left_to_systemd(directory)
        rules = wanted - cgroup_v2.granted_devices(directory, leave=leave)
        if not rules:
            return
        change = cgroup_v2.grant(directory, rules, leave=leave)
        if change.changed:
            journal.undo_with(
                f"v2 revoke on {directory}", partial(cgroup_v2.revoke, directory, rules)
            )
            journal.record("v2 allow", sorted(rules, key=str), directory, change)

    def _revoke_at(self, directory: Path, wanted: set[DeviceRule], journal: Journal) -> None:
        if not directory.is_dir():
            return  # the container's cgroup went away with its last process
        leave = self._left_to_systemd(directory)
        drop = wanted & cgroup_v2.granted_devices(directory, leave=leave)
        if not drop:
            return
        change = cgroup_v2.revoke(directory, drop)
        journal.undo_with(
            f"v2 re-grant on {directory}", partial(cgroup_v2.grant, directory, drop, leave=leave)
        )
        journal.record("v2 revoke", sorted(drop, key=str), directory, change)

    def _left_to_systemd(self, directory: Path) -> frozenset[str]:
        """The programs at ``directory`` that are not ours to patch: systemd's, on its unit."""
        if self.unit is not None and directory == self.unit.unit.directory:
            return SYSTEMD_PROGRAMS
        return frozenset()


def _programs_allow(programs: Sequence[cgroup_v2.ProgramInfo], device: CharDevice) -> bool | None:
    """What the kernel would answer for opening ``device`` read-write, running every program
    (``bpf.interp``); None with no program, or one that cannot be read as a device program."""
    if not programs:
        return None
    verdicts = [
        interp.allows(p.code, DevType.CHAR, RW, device.major, device.minor) for p in programs
    ]
    if False in verdicts:
        return False
    return None if None in verdicts else True
