"""The cgroup v2 device controller against the real kernel.

A child process we control sits in a fresh cgroup2 directory whose device
program allows only ``/dev/null``; whether it can open ``/dev/zero`` (c 1:5),
``/dev/full`` (1:7), ``/dev/random`` (1:8) and ``/dev/urandom`` (1:9) shows what
the kernel enforces. NVIDIA numbers are checked on nodes made with mknod: without
the driver, an allowed open fails with ENXIO and a denied one with EPERM.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import NVIDIA_MAJOR
from jupyter_gpu_hotplug.linux import cgroup_v2
from jupyter_gpu_hotplug.linux.bpf import syscall
from jupyter_gpu_hotplug.linux.bpf.asm import build_device_program
from jupyter_gpu_hotplug.linux.bpf.syscall import AttachFlags, BpfError, Command, Fd, ProgId
from jupyter_gpu_hotplug.linux.cgroup_v2 import GrantChange
from jupyter_gpu_hotplug.linux.devrules import (
    ALL_ACCESS,
    NVIDIACTL_MINOR,
    DeviceRule,
    char_device,
)
from tests.fixtures.requirements import needs_cgroup2
from tests.linux.cgroup2_support import cgroup2_mount, temporary_cgroup
from tests.linux.probes import Probe, make_nodes, move_into, probe

pytestmark = needs_cgroup2

NULL = char_device(1, 3, ALL_ACCESS)
ZERO = char_device(1, 5)
FULL = char_device(1, 7)
RANDOM = char_device(1, 8)
URANDOM = char_device(1, 9)
PATHS = {ZERO: "/dev/zero", FULL: "/dev/full", RANDOM: "/dev/random", URANDOM: "/dev/urandom"}
ONLY_NULL = [NULL]

# Tests below replace syscall.prog_attach; the helpers keep using the real one.
_real_prog_attach = syscall.prog_attach


@pytest.fixture
def cgroup() -> Iterator[Path]:
    mount = cgroup2_mount()
    if mount is None:
        pytest.skip("no cgroup2 hierarchy is mounted")
    with temporary_cgroup(mount) as path:
        yield path


@pytest.fixture
def child() -> Iterator[Probe]:
    with probe() as process:
        yield process


def xlated(prog_id: ProgId) -> bytes:
    with syscall.prog_get_fd_by_id(prog_id) as program:
        return syscall.prog_info(program).xlated


def attached_ids(cgroup: Path) -> tuple[ProgId, ...]:
    return tuple(program.id for program in cgroup_v2.attached_programs(cgroup))


def assert_allowed_exactly(child: Probe, granted: set[DeviceRule]) -> None:
    opened = {device for device, path in PATHS.items() if child.open(path) == "OK"}
    assert opened == granted
    denied = {child.open(path) for device, path in PATHS.items() if device not in granted}
    assert denied <= {"EPERM"}


def confined(cgroup: Path, child: Probe, rules: Sequence[DeviceRule] = ONLY_NULL) -> ProgId:
    prog_id = cgroup_v2.attach_device_program(cgroup, rules)
    move_into(cgroup, child.pid)
    return prog_id


# ---- the basic cycle -------------------------------------------------------------------------


def test_grant_then_revoke_restores_the_original(cgroup: Path, child: Probe) -> None:
    prog_id = confined(cgroup, child)
    original = xlated(prog_id)
    assert original == build_device_program(ONLY_NULL)
    assert child.open("/dev/null") == "OK"
    assert child.open("/dev/zero") == "EPERM"

    granted = cgroup_v2.grant(cgroup, [ZERO])
    assert granted.restricted and granted.changed
    assert granted.old_ids == (prog_id,)
    assert attached_ids(cgroup) == granted.new_ids
    assert child.open("/dev/zero") == "OK"  # the same running process
    assert cgroup_v2.granted_devices(cgroup) == {ZERO}
    [program] = cgroup_v2.attached_programs(cgroup)
    assert program.granted == {ZERO}
    assert program.name == "gpu_hotplug_dev"
    assert program.insn_count > len(original) // 8

    revoked = cgroup_v2.revoke(cgroup, [ZERO])
    assert revoked.old_ids == granted.new_ids
    assert child.open("/dev/zero") == "EPERM"
    assert child.open("/dev/null") == "OK"
    [current] = attached_ids(cgroup)
    assert xlated(current) == original
    assert cgroup_v2.granted_devices(cgroup) == frozenset()


def test_grant_twice_changes_nothing_the_second_time(cgroup: Path, child: Probe) -> None:
    confined(cgroup, child)
    first = cgroup_v2.grant(cgroup, [ZERO])
    second = cgroup_v2.grant(cgroup, [ZERO])
    assert not second.changed and second.restricted
    assert attached_ids(cgroup) == first.new_ids
    assert child.open("/dev/zero") == "OK"


def test_revoking_what_was_never_granted_changes_nothing(cgroup: Path, child: Probe) -> None:
    prog_id = confined(cgroup, child)
    change = cgroup_v2.revoke(cgroup, [ZERO])
    assert not change.changed
    assert attached_ids(cgroup) == (prog_id,)
    cgroup_v2.grant(cgroup, [FULL])
    assert not cgroup_v2.revoke(cgroup, [ZERO]).changed
    assert_allowed_exactly(child, {FULL})


Step = tuple[str, list[DeviceRule]]


@pytest.mark.parametrize(
    "steps",
    [
        pytest.param(
            [
                ("grant", [ZERO]),
                ("grant", [FULL]),
                ("grant", [RANDOM]),
                ("revoke", [FULL]),
                ("revoke", [ZERO]),
                ("revoke", [RANDOM]),
            ],
            id="one-by-one",
        ),
        pytest.param(
            [
                ("grant", [ZERO, FULL, RANDOM]),
                ("revoke", [FULL]),
                ("grant", [URANDOM]),
                ("revoke", [ZERO, RANDOM, URANDOM]),
            ],
            id="batches",
        ),
        pytest.param(
            [("grant", [RANDOM]), ("revoke", [RANDOM, ZERO]), ("grant", [ZERO, RANDOM])],
            id="revoke-superset-then-regrant",
        ),
        pytest.param(
            [("grant", [URANDOM, ZERO]), ("revoke", [ZERO]), ("revoke", [URANDOM])],
            id="reverse-order",
        ),
    ],
)
def test_sequences_leave_exactly_the_expected_set(
    cgroup: Path, child: Probe, steps: list[Step]
) -> None:
    prog_id = confined(cgroup, child)
    original = xlated(prog_id)
    expected: set[DeviceRule] = set()
    for verb, devices in steps:
        if verb == "grant":
            cgroup_v2.grant(cgroup, devices)
            expected |= set(devices)
        else:
            cgroup_v2.revoke(cgroup, devices)
            expected -= set(devices)
        assert cgroup_v2.granted_devices(cgroup) == expected
        assert_allowed_exactly(child, expected)
    if not expected:
        [current] = attached_ids(cgroup)
        assert xlated(current) == original


# ---- several programs, several levels ---------------------------------------------------------


def test_two_programs_at_one_level_are_both_patched(cgroup: Path, child: Probe) -> None:
    first = confined(cgroup, child, [NULL, ZERO, FULL])
    second = cgroup_v2.attach_device_program(cgroup, [NULL, ZERO, RANDOM])
    originals = {first: xlated(first), second: xlated(second)}
    # All programs must allow: each denies what the other one allows.
    assert_allowed_exactly(child, {ZERO})

    change = cgroup_v2.grant(cgroup, [FULL, RANDOM])
    assert change.old_ids == (first, second)
    assert attached_ids(cgroup) == change.new_ids
    assert all(p.granted == {FULL, RANDOM} for p in cgroup_v2.attached_programs(cgroup))
    assert_allowed_exactly(child, {ZERO, FULL, RANDOM})

    cgroup_v2.revoke(cgroup, [FULL])
    assert_allowed_exactly(child, {ZERO, RANDOM})

    restored = cgroup_v2.revoke(cgroup, [RANDOM])
    assert [xlated(prog_id) for prog_id in restored.new_ids] == list(originals.values())
    assert_allowed_exactly(child, {ZERO})


def test_granted_devices_is_what_every_program_grants(cgroup: Path, child: Probe) -> None:
    confined(cgroup, child)
    cgroup_v2.grant(cgroup, [ZERO, FULL])
    cgroup_v2.attach_device_program(cgroup, ONLY_NULL)  # e.g. the runtime added one
    assert cgroup_v2.granted_devices(cgroup) == frozenset()
    assert_allowed_exactly(child, set())
    cgroup_v2.grant(cgroup, [ZERO])  # patches the new one, leaves the first as it is
    assert cgroup_v2.granted_devices(cgroup) == {ZERO}
    assert_allowed_exactly(child, {ZERO})


def test_program_on_the_parent_governs_a_nested_cgroup(cgroup: Path, child: Probe) -> None:
    cgroup_v2.attach_device_program(cgroup, ONLY_NULL)
    leaf = cgroup / "container"
    leaf.mkdir()
    move_into(leaf, child.pid)
    assert_allowed_exactly(child, set())

    nothing_here = cgroup_v2.grant(leaf, [ZERO])
    assert not nothing_here.restricted and not nothing_here.changed
    assert_allowed_exactly(child, set())

    assert cgroup_v2.grant(cgroup, [ZERO]).changed
    assert_allowed_exactly(child, {ZERO})
    cgroup_v2.revoke(cgroup, [ZERO])
    assert_allowed_exactly(child, set())


def test_directory_without_programs(cgroup: Path, child: Probe) -> None:
    move_into(cgroup, child.pid)
    change = cgroup_v2.grant(cgroup, [ZERO])
    assert change == GrantChange(cgroup, frozenset({ZERO}), swaps=(), restricted=False)
    assert cgroup_v2.attached_programs(cgroup) == []
    assert cgroup_v2.granted_devices(cgroup) == frozenset()
    assert_allowed_exactly(child, set(PATHS))


# ---- other writers -------------------------------------------------------------------------------


def replace_behind_our_back(cgroup: Path, prog_id: ProgId) -> ProgId:
    """What systemd or a runtime does when it re-applies its own device program."""
    with (
        Fd(os.open(cgroup, os.O_RDONLY)) as cgroup_fd,
        syscall.prog_get_fd_by_id(prog_id) as current,
        syscall.prog_load(build_device_program(ONLY_NULL), name="sd_devices") as fresh,
    ):
        _real_prog_attach(cgroup_fd, fresh, flags=AttachFlags.ALLOW_MULTI, replace=current)
        return syscall.prog_info(fresh).id


def test_regrant_after_someone_else_replaced_the_program(cgroup: Path, child: Probe) -> None:
    confined(cgroup, child)
    [ours] = cgroup_v2.grant(cgroup, [ZERO]).new_ids
    theirs = replace_behind_our_back(cgroup, ours)
    assert_allowed_exactly(child, set())
    assert cgroup_v2.granted_devices(cgroup) == frozenset()

    change = cgroup_v2.grant(cgroup, [ZERO])
    assert change.old_ids == (theirs,)
    assert_allowed_exactly(child, {ZERO})


def test_losing_a_race_starts_over(
    cgroup: Path, child: Probe, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = confined(cgroup, child)
    raced: list[ProgId] = []

    def attach_after_a_competitor(
        target: Fd, prog: Fd, *, flags: AttachFlags, replace: Fd | None = None
    ) -> None:
        if not raced:
            # Between our read and our swap, someone else swaps the program: our
            # REPLACE then names a program that is no longer attached (ENOENT).
            raced.append(replace_behind_our_back(cgroup, original))
        _real_prog_attach(target, prog, flags=flags, replace=replace)

    monkeypatch.setattr(syscall, "prog_attach", attach_after_a_competitor)
    change = cgroup_v2.grant(cgroup, [ZERO])
    assert change.old_ids == tuple(raced)
    assert_allowed_exactly(child, {ZERO})


def test_exclusive_attachment_is_replaced_in_place(cgroup: Path, child: Probe) -> None:
    # Some runtimes attach without ALLOW_MULTI; such a cgroup holds a single program.
    with (
        Fd(os.open(cgroup, os.O_RDONLY)) as cgroup_fd,
        syscall.prog_load(build_device_program(ONLY_NULL), name="exclusive") as program,
    ):
        syscall.prog_attach(cgroup_fd, program, flags=AttachFlags.NONE)
        move_into(cgroup, child.pid)
        assert cgroup_v2.grant(cgroup, [ZERO]).changed
        assert_allowed_exactly(child, {ZERO})
        assert syscall.prog_query(cgroup_fd).attach_flags == AttachFlags.NONE
        cgroup_v2.revoke(cgroup, [ZERO])
        assert_allowed_exactly(child, set())


# ---- failures ----------------------------------------------------------------------------------


def test_failed_second_swap_is_rolled_back(
    cgroup: Path, child: Probe, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = confined(cgroup, child)
    second = cgroup_v2.attach_device_program(cgroup, ONLY_NULL)
    originals = [xlated(first), xlated(second)]
    calls: list[bool] = []

    def second_swap_fails(
        target: Fd, prog: Fd, *, flags: AttachFlags, replace: Fd | None = None
    ) -> None:
        calls.append(replace is not None)
        if len(calls) == 2:
            raise BpfError(Command.PROG_ATTACH, errno.ENOMEM)
        _real_prog_attach(target, prog, flags=flags, replace=replace)

    monkeypatch.setattr(syscall, "prog_attach", second_swap_fails)
    with pytest.raises(cgroup_v2.CgroupV2Error, match="Cannot allocate memory"):
        cgroup_v2.grant(cgroup, [ZERO])
    assert calls == [True, True, True]  # swap, failed swap, swap back
    assert attached_ids(cgroup) == (first, second)
    assert [xlated(first), xlated(second)] == originals
    assert_allowed_exactly(child, set())


def test_failed_rollback_is_reported(cgroup: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cgroup_v2.attach_device_program(cgroup, ONLY_NULL)
    cgroup_v2.attach_device_program(cgroup, ONLY_NULL)
    calls: list[int] = []

    def only_first_swap_works(
        target: Fd, prog: Fd, *, flags: AttachFlags, replace: Fd | None = None
    ) -> None:
        calls.append(1)
        if len(calls) > 1:
            raise BpfError(Command.PROG_ATTACH, errno.ENOMEM)
        _real_prog_attach(target, prog, flags=flags, replace=replace)

    monkeypatch.setattr(syscall, "prog_attach", only_first_swap_works)
    with pytest.raises(cgroup_v2.RollbackError, match="could not restore") as excinfo:
        cgroup_v2.grant(cgroup, [ZERO])
    assert calls == [1, 1, 1]  # swap, failed swap, failed swap back
    assert str(excinfo.value).count("Cannot allocate memory") == 2  # the failure and the undo


def test_endless_races_give_up(cgroup: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cgroup_v2.attach_device_program(cgroup, ONLY_NULL)
    competitors: list[ProgId] = []

    def always_beaten(
        target: Fd, prog: Fd, *, flags: AttachFlags, replace: Fd | None = None
    ) -> None:
        [current] = attached_ids(cgroup)
        competitors.append(replace_behind_our_back(cgroup, current))
        _real_prog_attach(target, prog, flags=flags, replace=replace)

    monkeypatch.setattr(syscall, "prog_attach", always_beaten)
    with pytest.raises(cgroup_v2.ConcurrentModificationError, match="someone else"):
        cgroup_v2.grant(cgroup, [ZERO])
    assert len(competitors) == cgroup_v2._ATTEMPTS
    assert attached_ids(cgroup) == (competitors[-1],)


def test_refused_program_leaves_the_directory_untouched(
    cgroup: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prog_id = cgroup_v2.attach_device_program(cgroup, ONLY_NULL)

    def refuse(code: bytes, *, name: str) -> Fd:
        raise syscall.ProgramLoadError(errno.EINVAL, "0: (b7) r0 = 2\nR0 out of range")

    monkeypatch.setattr(syscall, "prog_load", refuse)
    with pytest.raises(cgroup_v2.ProgramRejectedError, match="R0 out of range") as excinfo:
        cgroup_v2.grant(cgroup, [ZERO])
    assert "patched program" in str(excinfo.value)
    assert excinfo.value.log.endswith("R0 out of range")
    assert attached_ids(cgroup) == (prog_id,)


def test_unreadable_program_is_named_not_skipped(
    cgroup: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prog_id = cgroup_v2.attach_device_program(cgroup, ONLY_NULL)

    def denied(prog_id: ProgId) -> Fd:
        raise BpfError(Command.PROG_GET_FD_BY_ID, errno.EPERM)

    monkeypatch.setattr(syscall, "prog_get_fd_by_id", denied)
    with pytest.raises(cgroup_v2.UnreadableProgramError, match=f"program {prog_id} ") as excinfo:
        cgroup_v2.grant(cgroup, [ZERO])
    assert excinfo.value.prog_id == prog_id
    assert isinstance(excinfo.value, cgroup_v2.PermissionDeniedError)


def test_verification_catches_an_unexpected_program_list(
    cgroup: Path, child: Probe, monkeypatch: pytest.MonkeyPatch
) -> None:
    prog_id = confined(cgroup, child)
    real_query = syscall.prog_query
    queries: list[int] = []

    def query_sees_a_stranger(target: Fd) -> syscall.QueryResult:
        result = real_query(target)
        queries.append(1)
        if len(queries) == 2:  # the read-back after the swap
            return syscall.QueryResult(result.attach_flags, (*result.prog_ids, ProgId(999_999)))
        return result

    monkeypatch.setattr(syscall, "prog_query", query_sees_a_stranger)
    with pytest.raises(cgroup_v2.VerificationError, match="expected") as excinfo:
        cgroup_v2.grant(cgroup, [ZERO])
    assert excinfo.value.change.old_ids == (prog_id,)
    assert excinfo.value.change.new_ids == attached_ids(cgroup)


def test_invalid_grants_change_nothing(cgroup: Path) -> None:
    prog_id = cgroup_v2.attach_device_program(cgroup, ONLY_NULL)
    with pytest.raises(ValueError, match="deny rule"):
        cgroup_v2.grant(cgroup, [char_device(1, 5, allow=False)])
    assert attached_ids(cgroup) == (prog_id,)


def test_paths_that_are_not_cgroup2_directories(cgroup: Path, tmp_path: Path) -> None:
    with pytest.raises(cgroup_v2.NotCgroup2Error):
        cgroup_v2.grant(tmp_path, [ZERO])
    with pytest.raises(cgroup_v2.NotCgroup2Error):
        cgroup_v2.attach_device_program(tmp_path, ONLY_NULL)
    with pytest.raises(cgroup_v2.NotCgroup2Error):
        cgroup_v2.attached_programs(cgroup / "cgroup.procs")
    with pytest.raises(cgroup_v2.CgroupGoneError):
        cgroup_v2.revoke(cgroup / "exited", [ZERO])


def test_detach_our_program(cgroup: Path, child: Probe) -> None:
    prog_id = confined(cgroup, child)
    assert cgroup_v2.detach_program(cgroup, prog_id)
    assert attached_ids(cgroup) == ()
    assert_allowed_exactly(child, set(PATHS))
    assert not cgroup_v2.detach_program(cgroup, prog_id)


# ---- NVIDIA numbers without a driver ------------------------------------------------------------


@pytest.fixture
def nvidia_nodes(tmp_path: Path) -> dict[int, Path]:
    if os.statvfs(tmp_path).f_flag & os.ST_NODEV:
        pytest.skip(f"{tmp_path} is mounted nodev: device nodes there cannot be opened")
    return make_nodes(tmp_path, (0, 1, NVIDIACTL_MINOR))


def test_nvidia_node_allowed_gives_enxio_denied_gives_eperm(
    cgroup: Path, child: Probe, nvidia_nodes: dict[int, Path]
) -> None:
    confined(cgroup, child)
    assert {child.open(node) for node in nvidia_nodes.values()} == {"EPERM"}

    cgroup_v2.grant(cgroup, [char_device(NVIDIA_MAJOR, 0)])
    assert child.open(nvidia_nodes[0]) == "ENXIO"
    assert child.open(nvidia_nodes[1]) == "EPERM"
    assert child.open(nvidia_nodes[NVIDIACTL_MINOR]) == "EPERM"

    cgroup_v2.revoke(cgroup, [char_device(NVIDIA_MAJOR, 0)])
    assert child.open(nvidia_nodes[0]) == "EPERM"
