"""The unit record of a grant (``linux/systemd_units.py``) against an in-memory systemd,
alone and as the v2 device controller's part (``linux/device_controllers/v2.py``).

The real systemd is in the VM tier (``tests/vm``); here the D-Bus seam is a fake that keeps a
unit's ``DeviceAllow=`` list the way systemd does (an assignment appends, or replaces the
access of the entry with the same path; an empty one resets the list), so the list arithmetic
is proven on every host: what the runtime put in the list is never lost, and nothing of ours
stays. The note of our entries is a real extended attribute (``trusted.``: root).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jupyter_gpu_hotplug.linux.device_controllers.v2 import ManagedUnit, V2Controller
from jupyter_gpu_hotplug.linux.devrules import CharDevice
from jupyter_gpu_hotplug.linux.engine import DeviceStatus
from jupyter_gpu_hotplug.linux.journal import Journal
from jupyter_gpu_hotplug.linux.systemd_units import (
    INVOCATION_XATTR,
    RECORD_XATTR,
    SYSTEMD_PROGRAM_NAME,
    AllowEntry,
    RecordChange,
    SystemdUnitError,
    SystemdUnits,
    Unit,
    UnitProperties,
    entry_for,
    reset_list,
)
from tests.fixtures.requirements import needs_root

INVOCATION = "0123456789abcdef0123456789abcdef"
RUNC_LIST = (
    AllowEntry("/dev/char/1:3", "rwm"),
    AllowEntry("/dev/char/1:5", "rwm"),
    AllowEntry("/dev/char/5:2", "rwm"),
    AllowEntry("char-pts", "rwm"),
    AllowEntry("char-*", "m"),
    AllowEntry("block-*", "m"),
)
"""What runc's systemd driver gives a container scope (OCI defaults)."""
GPU0, GPU1 = CharDevice(195, 0), CharDevice(195, 1)


@dataclass
class FakeSystemd:
    """One unit's device properties, changed the way systemd 252 changes them."""

    name: str = "cri-containerd-abc.scope"
    control_group: str = "/kubepods.slice/cri-containerd-abc.scope"
    policy: str = "strict"
    entries: list[AllowEntry] = field(default_factory=lambda: list(RUNC_LIST))
    drop_writes: bool = False
    calls: list[tuple[tuple[AllowEntry, ...], bool]] = field(default_factory=list)
    opened: int = 0
    closed: int = 0

    def connect(self) -> FakeSystemd:
        self.opened += 1
        return self

    def properties(self, name: str) -> UnitProperties | None:
        if name != self.name:
            return None
        return UnitProperties(self.control_group, INVOCATION, self.policy, tuple(self.entries))

    def device_allow(self, name: str) -> tuple[AllowEntry, ...]:
        return tuple(self.entries)

    def set_device_allow(self, name: str, entries: Sequence[AllowEntry], *, reset: bool) -> None:
        self.calls.append((tuple(entries), reset))
        if self.drop_writes:
            return
        if reset:
            self.entries = []
        for entry in entries:
            same = [i for i, e in enumerate(self.entries) if e.path == entry.path]
            if same:
                self.entries[same[0]] = entry
            else:
                self.entries.append(entry)

    def close(self) -> None:
        self.closed += 1


@dataclass
class FakePrograms:
    """Device program ids at the unit: systemd's is replaced one call after a change."""

    systemd: FakeSystemd
    rebuild_after: int = 1
    seen: int = 0

    def __call__(self, directory: Path) -> list[tuple[int, str]]:
        self.seen += 1
        version = len(self.systemd.calls) if self.seen > self.rebuild_after else 0
        return [(10, "runc"), (100 + version, SYSTEMD_PROGRAM_NAME)]


@pytest.fixture
def systemd() -> FakeSystemd:
    return FakeSystemd()


@pytest.fixture
def units(systemd: FakeSystemd) -> SystemdUnits:
    return SystemdUnits(bus=systemd.connect, programs=FakePrograms(systemd), realize_timeout=5)


@pytest.fixture
def unit(tmp_path: Path, systemd: FakeSystemd) -> Unit:
    directory = tmp_path / systemd.name
    directory.mkdir()
    return Unit(systemd.name, directory)


def note(unit: Unit) -> str | None:
    try:
        return os.getxattr(unit.directory, RECORD_XATTR).decode()
    except OSError:
        return None


# ---- the list arithmetic (everywhere) ----------------------------------------------------

_paths = st.sampled_from(
    [*(f"/dev/char/{m}:{n}" for m in (1, 5, 136, 195) for n in (0, 1, 3)), "char-pts", "char-*"]
)
_access = st.sampled_from(["r", "w", "m", "rw", "rm", "wm", "rwm"])


@given(
    runtime=st.lists(st.tuples(_paths, _access), unique_by=lambda e: e[0]),
    ours=st.lists(st.tuples(st.integers(0, 7)), unique=True, max_size=4),
)
def test_a_reset_gives_back_exactly_the_runtimes_list(
    runtime: list[tuple[str, str]], ours: list[tuple[int]]
) -> None:
    before = [AllowEntry(p, a) for p, a in runtime]
    current = list(before)
    note: dict[str, str] = {}
    for (minor,) in ours:  # what record() does for each device
        entry = entry_for(CharDevice(195, minor))
        existing = next((e for e in current if e.path == entry.path), None)
        if existing is not None and existing.covers(entry):
            continue
        note[entry.path] = existing.access if existing else ""
        merged = "".join(c for c in "rwm" if c in (existing.access if existing else "") + "rw")
        if existing is not None:
            current[current.index(existing)] = AllowEntry(entry.path, merged)
        else:
            current.append(AllowEntry(entry.path, merged))

    assert reset_list(current, note) == before


# ---- record and unrecord over the fake bus (root: trusted xattrs) -------------------------


@needs_root
def test_record_adds_ours_and_unrecord_restores_the_runtimes_list(
    units: SystemdUnits, unit: Unit, systemd: FakeSystemd
) -> None:
    recorded = units.record(unit, [GPU0, GPU1])

    assert recorded.devices == (GPU0, GPU1)
    assert systemd.entries == [*RUNC_LIST, entry_for(GPU0), entry_for(GPU1)]
    assert units.allowed(unit, [GPU0, GPU1, CharDevice(195, 2)]) == {
        GPU0: True,
        GPU1: True,
        CharDevice(195, 2): False,
    }
    assert units.ours(unit) == {"/dev/char/195:0", "/dev/char/195:1"}

    assert units.unrecord(unit, [GPU0]).devices == (GPU0,)
    assert systemd.entries == [*RUNC_LIST, entry_for(GPU1)]
    assert units.unrecord(unit, [GPU1]).devices == (GPU1,)
    assert systemd.entries == list(RUNC_LIST)
    assert note(unit) is None  # nothing of ours left on the cgroup either
    assert systemd.calls[-1] == (RUNC_LIST, True)  # one call: reset and the whole list
    assert systemd.closed == systemd.opened  # every connection is closed


@needs_root
def test_a_device_the_runtime_allows_is_neither_added_nor_removed(
    units: SystemdUnits, unit: Unit, systemd: FakeSystemd
) -> None:
    systemd.entries.append(AllowEntry("/dev/char/195:0", "rwm"))
    before = list(systemd.entries)

    assert not units.record(unit, [GPU0]).changed
    assert not units.unrecord(unit, [GPU0]).changed

    assert systemd.entries == before
    assert systemd.calls == []


@needs_root
def test_an_entry_we_widened_gets_its_access_back(
    units: SystemdUnits, unit: Unit, systemd: FakeSystemd
) -> None:
    systemd.entries.append(AllowEntry("/dev/char/195:0", "m"))
    before = list(systemd.entries)

    units.record(unit, [GPU0])
    assert AllowEntry("/dev/char/195:0", "rwm") in systemd.entries
    units.unrecord(unit, [GPU0])

    assert systemd.entries == before


@needs_root
def test_a_write_systemd_does_not_keep_is_an_error(
    units: SystemdUnits, unit: Unit, systemd: FakeSystemd
) -> None:
    systemd.drop_writes = True
    with pytest.raises(SystemdUnitError, match=r"missing \[/dev/char/195:0 rw\]"):
        units.record(unit, [GPU0])


@needs_root
def test_a_reset_that_leaves_something_else_is_an_error(
    units: SystemdUnits, unit: Unit, systemd: FakeSystemd
) -> None:
    units.record(unit, [GPU0])
    systemd.drop_writes = True
    with pytest.raises(SystemdUnitError, match="after the reset"):
        units.unrecord(unit, [GPU0])
    assert units.ours(unit) == {"/dev/char/195:0"}  # the note still says what is ours


@needs_root
def test_a_grant_waits_until_systemd_rebuilt_its_program(unit: Unit, systemd: FakeSystemd) -> None:
    programs = FakePrograms(systemd, rebuild_after=4)
    units = SystemdUnits(bus=systemd.connect, programs=programs, realize_timeout=30)
    units.record(unit, [GPU0])
    assert programs.seen > 4


@needs_root
def test_a_systemd_that_never_rebuilds_fails_the_grant(unit: Unit, systemd: FakeSystemd) -> None:
    units = SystemdUnits(
        bus=systemd.connect, programs=lambda d: [(7, SYSTEMD_PROGRAM_NAME)], realize_timeout=0.2
    )
    with pytest.raises(SystemdUnitError, match="did not rebuild"):
        units.record(unit, [GPU0])


# ---- which cgroups are units ---------------------------------------------------------------


def _tagged(unit: Unit, tag: str = INVOCATION) -> Unit:
    os.setxattr(unit.directory, INVOCATION_XATTR, tag.encode())
    return unit


@needs_root
def test_a_tagged_cgroup_that_systemd_places_there_is_its_unit(
    units: SystemdUnits, unit: Unit, systemd: FakeSystemd
) -> None:
    _tagged(unit)
    found = units.unit_of(unit.directory, control_group=PurePosixPath(systemd.control_group))
    assert found == unit


def _untagged(u: Unit, s: FakeSystemd) -> None:
    """No invocation-id tag: systemd does not manage the cgroup."""


def _other_invocation(u: Unit, s: FakeSystemd) -> None:
    _tagged(u, "f" * 32)


def _moved(u: Unit, s: FakeSystemd) -> None:
    _tagged(u)
    s.control_group = "/elsewhere.scope"


def _unknown(u: Unit, s: FakeSystemd) -> None:
    _tagged(u)
    s.name = "other.scope"


def _no_policy(u: Unit, s: FakeSystemd) -> None:
    """An entry would *start* restricting such a unit."""
    _tagged(u)
    s.policy = "auto"
    s.entries.clear()


@needs_root
@pytest.mark.parametrize("change", [_untagged, _other_invocation, _moved, _unknown, _no_policy])
def test_what_is_not_a_unit_to_record_in(
    units: SystemdUnits,
    unit: Unit,
    systemd: FakeSystemd,
    change: Callable[[Unit, FakeSystemd], None],
) -> None:
    where = PurePosixPath(systemd.control_group)
    change(unit, systemd)
    assert units.unit_of(unit.directory, control_group=where) is None


def test_names_alone_make_no_unit(units: SystemdUnits, tmp_path: Path) -> None:
    plain = tmp_path / "container-abc"
    plain.mkdir()
    assert units.unit_of(plain, control_group=PurePosixPath("/container-abc")) is None


def test_no_systemd_no_units(tmp_path: Path) -> None:
    assert SystemdUnits.for_host(lambda d: [], run_dir=tmp_path / "absent") is None


# ---- the engine's path: the v2 device controller's unit (root: trusted xattrs) ------------


@pytest.fixture
def controller(units: SystemdUnits, unit: Unit) -> V2Controller:
    """A container scope with no device program of its own: only the unit confines it."""
    return V2Controller(unit.directory, (), ManagedUnit(unit, units))


@needs_root
def test_the_v2_controller_records_a_grant_and_its_journal_undoes_it(
    controller: V2Controller, unit: Unit, systemd: FakeSystemd
) -> None:
    journal = Journal.for_process(4242)

    controller.grant([GPU0, GPU1], journal)

    assert systemd.entries == [*RUNC_LIST, entry_for(GPU0), entry_for(GPU1)]
    assert [type(change) for change in journal.changes] == [RecordChange]
    verdict = controller.granted([GPU0])[GPU0]
    assert (verdict.granted, verdict.unit_allows, verdict.unit_ours) == (None, True, True)
    assert DeviceStatus(GPU0, node=True, v2=verdict).usable

    assert journal.roll_back() == []
    assert systemd.entries == list(RUNC_LIST)
    assert note(unit) is None


@needs_root
def test_the_v2_controller_takes_its_entry_back_and_its_journal_restores_it(
    controller: V2Controller, unit: Unit, systemd: FakeSystemd
) -> None:
    controller.grant([GPU0], Journal.for_process(4242))
    journal = Journal.for_process(4242)

    controller.revoke([GPU0], journal)

    assert systemd.entries == list(RUNC_LIST)
    verdict = controller.granted([GPU0])[GPU0]
    assert (verdict.unit_allows, verdict.unit_ours) == (False, False)
    assert not DeviceStatus(GPU0, node=True, v2=verdict).usable
    assert not DeviceStatus(GPU0, node=False, v2=verdict).exposed  # nothing of ours is left

    assert journal.roll_back() == []
    assert systemd.entries == [*RUNC_LIST, entry_for(GPU0)]


@needs_root
def test_the_v2_controller_leaves_a_unit_that_went_with_its_container(
    controller: V2Controller, unit: Unit, systemd: FakeSystemd
) -> None:
    controller.grant([GPU0], Journal.for_process(4242))
    os.removexattr(unit.directory, RECORD_XATTR)
    unit.directory.rmdir()
    calls = list(systemd.calls)

    controller.revoke([GPU0], Journal("an empty cgroup"))

    assert systemd.calls == calls
