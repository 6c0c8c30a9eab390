"""systemd's record of a container's devices: the unit's ``DeviceAllow=`` list.

Boundary: a cgroup2 *directory* the engine resolved (the container's scope) and device
numbers. It finds out whether systemd manages that directory as a unit, and keeps our grants
in the unit's ``DeviceAllow=`` (runtime only) over D-Bus. It knows nothing of containers,
pods or GPUs.

Why it exists: with the systemd cgroup driver (containerd ``SystemdCgroup = true``, podman,
kubeadm's default) every container is a systemd scope with ``DevicePolicy=strict`` and a
``DeviceAllow=`` list. Whenever systemd re-realizes the unit's cgroup (``systemctl
daemon-reload``, ``daemon-reexec``, any ``set-property``, a runtime's ``update``) it attaches
its own device program, built from that list, *beside* ours — and since every program must
allow an access, a device we granted by patching the eBPF programs alone is denied again
(NVIDIA's "Failed to initialize NVML: Unknown Error" after a reload). So a grant also adds the
device to the list; then systemd's program allows it too. The list alone grants nothing (the
runtime's program still denies), so this is a second record beside the program patch of
:mod:`.cgroup_v2`, never a replacement for it.

How ours are told from the runtime's: systemd can append to the list or reset it, but not
remove one entry. What we added (and the access an entry had before we widened it) is noted
in an extended attribute of the unit's cgroup directory (``trusted.`` namespace: root only,
and gone with the cgroup, like the unit's own ``trusted.invocation_id``). A revoke resets the
list to exactly what it holds minus our additions, so nothing the runtime put there is lost.

Why D-Bus (``jeepney``, pure Python) rather than ``systemctl set-property``: the reset and the
new list go in *one* ``SetUnitProperties`` call, so systemd never sees a half-written list;
answers are typed values, not text to parse; errors have names (``NoSuchUnit``); no process
per call; and a pod needs only the bus socket, not a ``systemctl`` matching the host's
systemd.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Final, Protocol

from .devrules import CharDevice

__all__ = [
    "SYSTEMD_PROGRAM_NAME",
    "AllowEntry",
    "DbusUnitBus",
    "RecordChange",
    "SystemdUnitError",
    "SystemdUnits",
    "Unit",
    "UnitBus",
    "UnitProperties",
    "reset_list",
]

log = logging.getLogger(__name__)

SYSTEMD_RUN_DIR: Final = Path("/run/systemd/system")
"""Exists iff systemd runs as pid 1 (what ``sd_booted()`` checks)."""
SYSTEMD_PROGRAM_NAME: Final = "sd_devices"
"""The name systemd gives the device programs it builds from ``DeviceAllow=``
(src/core/bpf-devices.c); on a unit it manages, such a program is systemd's to rebuild."""
INVOCATION_XATTR: Final = "trusted.invocation_id"
"""systemd tags each unit's cgroup with the unit's current invocation id (since v235)."""
RECORD_XATTR: Final = "trusted.gpu_hotplug.device_allow"
"""Our note of the entries we added: ``{path: access the entry had before us, or ""}``."""
UNIT_SUFFIXES: Final = {".scope": "Scope", ".slice": "Slice"}
"""Unit types a container's cgroup can be, and their D-Bus interface (``org.freedesktop.systemd1.``
plus this)."""
GRANT_ACCESS: Final = "rw"
REALIZE_TIMEOUT: Final = 10.0
"""How long a grant waits for systemd to rebuild its program after the list changed (it does
so on its next event-loop turn; the bound only matters for a stuck systemd)."""
_POLL: Final = 0.05


class SystemdUnitError(Exception):
    """Talking to systemd failed, or the unit does not hold what was written."""


@dataclass(frozen=True)
class AllowEntry:
    """One ``DeviceAllow=`` entry: a device path (or ``char-*`` class) and its ``rwm`` access."""

    path: str
    access: str

    def covers(self, other: AllowEntry) -> bool:
        return self.path == other.path and set(other.access) <= set(self.access)

    def key(self) -> tuple[str, frozenset[str]]:
        return self.path, frozenset(self.access)


def entry_for(device: CharDevice) -> AllowEntry:
    """The entry a grant adds: ``/dev/char/M:m``, which systemd resolves without a node on
    the host (the same form runc writes for the spec's devices)."""
    return AllowEntry(f"/dev/char/{device.major}:{device.minor}", GRANT_ACCESS)


def _merge_access(*accesses: str) -> str:
    joined = set("".join(accesses))
    return "".join(c for c in "rwm" if c in joined)


def reset_list(current: Sequence[AllowEntry], ours: Mapping[str, str]) -> list[AllowEntry]:
    """The list a revoke writes: ``current`` without our additions in ``ours`` (an entry we
    only widened gets its former access back); every other entry stays, in its order."""
    result = []
    for entry in current:
        if entry.path not in ours:
            result.append(entry)
        elif ours[entry.path]:
            result.append(AllowEntry(entry.path, ours[entry.path]))
    return result


@dataclass(frozen=True)
class UnitProperties:
    """What systemd says about a unit, as far as devices are concerned."""

    control_group: str
    invocation_id: str
    """Hex, as in the cgroup's ``trusted.invocation_id``."""
    device_policy: str
    device_allow: tuple[AllowEntry, ...]


class UnitBus(Protocol):
    """systemd's manager interface, as far as this module uses it."""

    def properties(self, name: str) -> UnitProperties | None:
        """The unit's properties; None when systemd knows no such unit."""

    def device_allow(self, name: str) -> tuple[AllowEntry, ...]:
        """The unit's ``DeviceAllow=`` list now."""

    def set_device_allow(self, name: str, entries: Sequence[AllowEntry], *, reset: bool) -> None:
        """Append ``entries`` (runtime only); with ``reset``, replace the list by them, in one
        call."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class Unit:
    """A container cgroup that is a systemd unit with a device policy to keep."""

    name: str
    directory: Path


@dataclass(frozen=True)
class RecordChange:
    """What one :meth:`SystemdUnits.record` or ``unrecord`` wrote to a unit's list."""

    unit: Unit
    devices: tuple[CharDevice, ...]
    """The devices whose entries were added (record) or taken out (unrecord)."""

    @property
    def changed(self) -> bool:
        return bool(self.devices)


class SystemdUnits:
    """Finds a container's unit and keeps our devices in its ``DeviceAllow=`` list.

    ``bus`` is a factory for the D-Bus seam (one connection per operation, so the engine's
    worker threads share nothing); ``programs`` lists the names of the device programs
    attached at a directory (the engine passes :mod:`.cgroup_v2`'s reader).
    """

    def __init__(
        self,
        *,
        bus: Callable[[], UnitBus],
        programs: Callable[[Path], Sequence[tuple[int, str]]],
        realize_timeout: float = REALIZE_TIMEOUT,
    ) -> None:
        self._bus = bus
        self._programs = programs
        self._realize_timeout = realize_timeout

    @classmethod
    def for_host(
        cls,
        programs: Callable[[Path], Sequence[tuple[int, str]]],
        *,
        run_dir: Path = SYSTEMD_RUN_DIR,
    ) -> SystemdUnits | None:
        """The host's systemd over the system bus, or None when systemd is not pid 1 (or the
        D-Bus library of the ``agent`` extra is missing: then the reconciler alone restores
        what a reload takes away, and the log says so)."""
        if not run_dir.is_dir():
            return None
        if importlib.util.find_spec("jeepney") is None:
            log.warning(
                "systemd is pid 1 but jeepney is not installed (pip install "
                "'jupyter-gpu-hotplug[agent]'): grants are not recorded in the containers' "
                "units, and a daemon-reload takes them away until the next reconcile"
            )
            return None
        return cls(bus=DbusUnitBus, programs=programs)

    # ---- which unit ----------------------------------------------------------------------

    def unit_of(self, directory: Path, *, control_group: PurePosixPath) -> Unit | None:
        """The unit whose cgroup ``directory`` is (``control_group``: its path in the
        hierarchy), if systemd manages it *and* restricts its devices; else None.

        Names are not trusted: the directory must carry systemd's invocation-id tag, and
        systemd must name a unit of that name whose control group and invocation id are these
        very ones. A unit without a device policy (``auto`` and an empty list) is left alone:
        adding an entry there would *start* restricting it.
        """
        name = directory.name
        if PurePosixPath(name).suffix not in UNIT_SUFFIXES:
            return None
        tag = _read_xattr(directory, INVOCATION_XATTR)
        if tag is None:
            return None
        with closing(self._bus()) as bus:
            props = bus.properties(name)
        if props is None:
            return None
        if props.control_group != str(control_group) or props.invocation_id != tag:
            log.warning(
                "cgroup %s is named like unit %s but systemd places that unit at %s (invocation "
                "%s, the cgroup says %s); not treating it as the unit",
                control_group,
                name,
                props.control_group,
                props.invocation_id,
                tag,
            )
            return None
        if props.device_policy == "auto" and not props.device_allow:
            return None
        return Unit(name, directory)

    # ---- grant, revoke, status -----------------------------------------------------------

    def record(self, unit: Unit, devices: Iterable[CharDevice]) -> RecordChange:
        """Add ``devices`` to the unit's list (those it does not allow ``rw`` yet), note them
        as ours, verify, and wait until systemd's rebuilt program is in place."""
        with closing(self._bus()) as bus:
            return self._record(bus, unit, devices)

    def _record(self, bus: UnitBus, unit: Unit, devices: Iterable[CharDevice]) -> RecordChange:
        current = bus.device_allow(unit.name)
        ours = self._ours(unit)
        added: list[CharDevice] = []
        entries: list[AllowEntry] = []
        for device in dict.fromkeys(devices):
            wanted = entry_for(device)
            existing = next((e for e in current if e.path == wanted.path), None)
            if existing is not None and existing.covers(wanted):
                continue
            before = existing.access if existing is not None else ""
            ours.setdefault(wanted.path, before)
            added.append(device)
            entries.append(AllowEntry(wanted.path, _merge_access(before, wanted.access)))
        if not entries:
            return RecordChange(unit, ())
        systemd_programs = self._systemd_programs(unit)
        # The note first: a crash between the two leaves a note of an entry that may be
        # missing, which a revoke skips; the reverse would leave an entry nobody removes.
        self._write_ours(unit, ours)
        bus.set_device_allow(unit.name, entries, reset=False)
        now = bus.device_allow(unit.name)
        missing = [e for e in [*current, *entries] if not any(n.covers(e) for n in now)]
        if missing:
            raise SystemdUnitError(
                f"{unit.name}: DeviceAllow is {_render(now)} after adding {_render(entries)}; "
                f"missing {_render(missing)}"
            )
        self._wait_rebuilt(unit, systemd_programs)
        return RecordChange(unit, tuple(added))

    def unrecord(self, unit: Unit, devices: Iterable[CharDevice]) -> RecordChange:
        """Take our entries for ``devices`` out of the unit's list: reset it to what it holds
        minus them, verify that exactly that is left, and drop them from our note."""
        ours = self._ours(unit)
        wanted = {entry_for(d).path: d for d in devices}
        taking = {path: ours[path] for path in wanted if path in ours}
        if not taking:
            return RecordChange(unit, ())
        with closing(self._bus()) as bus:
            current = bus.device_allow(unit.name)
            target = reset_list(current, taking)
            bus.set_device_allow(unit.name, target, reset=True)
            now = bus.device_allow(unit.name)
        if sorted(e.key() for e in now) != sorted(e.key() for e in target):
            raise SystemdUnitError(
                f"{unit.name}: DeviceAllow is {_render(now)} after the reset, expected "
                f"{_render(target)}"
            )
        for path in taking:
            del ours[path]
        self._write_ours(unit, ours)
        return RecordChange(unit, tuple(wanted[p] for p in taking))

    def allowed(self, unit: Unit, devices: Iterable[CharDevice]) -> dict[CharDevice, bool]:
        """For each device: whether the unit's list allows it ``rw`` (whoever put it there)."""
        with closing(self._bus()) as bus:
            current = bus.device_allow(unit.name)
        return {d: any(e.covers(entry_for(d)) for e in current) for d in devices}

    def ours(self, unit: Unit) -> frozenset[str]:
        """The entry paths our note says we added."""
        return frozenset(self._ours(unit))

    # ---- helpers -------------------------------------------------------------------------

    def _systemd_programs(self, unit: Unit) -> set[int]:
        return {pid for pid, name in self._programs(unit.directory) if name == SYSTEMD_PROGRAM_NAME}

    def _wait_rebuilt(self, unit: Unit, before: set[int]) -> None:
        """Until none of systemd's programs from before the change is attached: systemd
        attaches the rebuilt one and then detaches its predecessor. Without one there is
        nothing to wait for (its next program is built from the new list)."""
        deadline = time.monotonic() + self._realize_timeout
        while before & self._systemd_programs(unit):
            if time.monotonic() >= deadline:
                raise SystemdUnitError(
                    f"{unit.name}: systemd did not rebuild its device program within "
                    f"{self._realize_timeout:g} s of the DeviceAllow change"
                )
            time.sleep(_POLL)

    def _ours(self, unit: Unit) -> dict[str, str]:
        raw = _read_xattr(unit.directory, RECORD_XATTR)
        if raw is None:
            return {}
        try:
            note = json.loads(raw)
        except ValueError as e:
            raise SystemdUnitError(f"{unit.directory}: unreadable {RECORD_XATTR}: {e}") from e
        if not isinstance(note, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in note.items()
        ):
            raise SystemdUnitError(f"{unit.directory}: malformed {RECORD_XATTR}: {raw!r}")
        return note

    def _write_ours(self, unit: Unit, ours: Mapping[str, str]) -> None:
        try:
            if ours:
                os.setxattr(unit.directory, RECORD_XATTR, json.dumps(dict(ours)).encode())
            else:
                os.removexattr(unit.directory, RECORD_XATTR)
        except OSError as e:
            if not ours and e.errno == errno.ENODATA:
                return
            raise SystemdUnitError(f"{unit.directory}: cannot write {RECORD_XATTR}: {e}") from e


def _read_xattr(directory: Path, name: str) -> str | None:
    try:
        return os.getxattr(directory, name).decode()
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.ENOENT):
            return None
        raise SystemdUnitError(f"cannot read {name} of {directory}: {e}") from e


def _render(entries: Iterable[AllowEntry]) -> str:
    return "[" + ", ".join(f"{e.path} {e.access}" for e in entries) + "]"


# ---- D-Bus ---------------------------------------------------------------------------------

_MANAGER_PATH: Final = "/org/freedesktop/systemd1"
_MANAGER: Final = "org.freedesktop.systemd1.Manager"
_UNIT: Final = "org.freedesktop.systemd1.Unit"
_NO_SUCH_UNIT: Final = "org.freedesktop.systemd1.NoSuchUnit"
_CALL_TIMEOUT: Final = 30.0


class DbusUnitBus:
    """:class:`UnitBus` over the system bus, one connection per instance.

    ``jeepney`` is imported here, on first use: hosts without systemd never load it.
    """

    def __init__(self) -> None:
        from jeepney.io.blocking import open_dbus_connection

        try:
            self._conn = open_dbus_connection(bus="SYSTEM")
        except (OSError, ValueError) as e:
            raise SystemdUnitError(f"cannot connect to the system bus: {e}") from e

    def close(self) -> None:
        self._conn.close()

    def _call(self, path: str, interface: str, method: str, signature: str, *body: Any) -> Any:
        from jeepney import DBusAddress, DBusErrorResponse, new_method_call
        from jeepney.wrappers import unwrap_msg

        address = DBusAddress(path, bus_name="org.freedesktop.systemd1", interface=interface)
        message = new_method_call(address, method, signature, body)
        try:
            return unwrap_msg(self._conn.send_and_get_reply(message, timeout=_CALL_TIMEOUT))
        except DBusErrorResponse as e:
            if e.name == _NO_SUCH_UNIT:
                raise _NoSuchUnit(str(e.data)) from e
            raise SystemdUnitError(f"systemd refused {method} on {path}: {e.name}: {e.data}") from e
        except (OSError, TimeoutError) as e:
            raise SystemdUnitError(f"systemd did not answer {method}: {e}") from e

    def _unit_path(self, name: str) -> str:
        (path,) = self._call(_MANAGER_PATH, _MANAGER, "GetUnit", "s", name)
        return str(path)

    def _get(self, path: str, interface: str, prop: str) -> Any:
        ((_signature, value),) = self._call(
            path, "org.freedesktop.DBus.Properties", "Get", "ss", interface, prop
        )
        return value

    def properties(self, name: str) -> UnitProperties | None:
        try:
            path = self._unit_path(name)
        except _NoSuchUnit:
            return None
        kind = _interface(name)
        return UnitProperties(
            control_group=str(self._get(path, kind, "ControlGroup")),
            invocation_id=bytes(self._get(path, _UNIT, "InvocationID")).hex(),
            device_policy=str(self._get(path, kind, "DevicePolicy")),
            device_allow=_entries(self._get(path, kind, "DeviceAllow")),
        )

    def device_allow(self, name: str) -> tuple[AllowEntry, ...]:
        try:
            path = self._unit_path(name)
        except _NoSuchUnit as e:
            raise SystemdUnitError(f"systemd knows no unit {name} (any more)") from e
        return _entries(self._get(path, _interface(name), "DeviceAllow"))

    def set_device_allow(self, name: str, entries: Sequence[AllowEntry], *, reset: bool) -> None:
        listed = ("a(ss)", [(e.path, e.access) for e in entries])
        empty: tuple[str, list[tuple[str, str]]] = ("a(ss)", [])
        assignments = [("DeviceAllow", empty)] if reset else []
        if entries or not reset:
            assignments.append(("DeviceAllow", listed))
        self._call(_MANAGER_PATH, _MANAGER, "SetUnitProperties", "sba(sv)", name, True, assignments)


class _NoSuchUnit(SystemdUnitError):
    pass


def _interface(name: str) -> str:
    return "org.freedesktop.systemd1." + UNIT_SUFFIXES[PurePosixPath(name).suffix]


def _entries(value: Iterable[tuple[str, str]]) -> tuple[AllowEntry, ...]:
    return tuple(AllowEntry(str(path), str(access)) for path, access in value)
