"""cgroup v1 devices: policy, grant, revoke, verification — on the real kernel where possible.

The kernel tests watch one *running* child: opening a ``c 195:N`` node gives ENXIO
when its cgroup allows the device (there is no NVIDIA driver here) and EPERM when
the cgroup denies it.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from jupyter_gpu_hotplug.linux import cgroup_v1
from jupyter_gpu_hotplug.linux.cgroup_v1 import (
    CgroupFS,
    ControlFileError,
    VerificationError,
    WildcardAllowError,
    Write,
)
from jupyter_gpu_hotplug.linux.devrules import (
    ALL_ACCESS,
    CONTAINER_DEFAULTS,
    RW,
    Access,
    CharDevice,
    DeviceRule,
    DevType,
    char_device,
    v1_allow_list,
)

from ..fixtures.requirements import needs_cgroup_v1_devices
from .probes import Probe, make_nodes, move_into, probe, scratch_v1_cgroup

GPU3 = CharDevice(195, 3)
GPU2 = CharDevice(195, 2)


def rule(text: str, *, allow: bool = True) -> DeviceRule:
    type_, numbers, access = text.split()
    major, minor = numbers.split(":")
    return DeviceRule(
        DevType(type_),
        None if major == "*" else int(major),
        None if minor == "*" else int(minor),
        Access.parse(access),
        allow,
    )


# --- the pure model additions -------------------------------------------------------


@pytest.mark.parametrize(
    ("rules", "expected"),
    [
        pytest.param([rule("c 1:5 r"), rule("c 1:5 w")], [rule("c 1:5 rw")], id="allow-merges"),
        pytest.param(
            [rule("c 1:5 rw"), rule("c 1:5 w", allow=False)], [rule("c 1:5 r")], id="deny-bits"
        ),
        pytest.param([rule("c 1:5 rw"), rule("c 1:5 rw", allow=False)], [], id="deny-all-bits"),
        pytest.param(
            [rule("c 195:* rwm"), rule("c 195:3 rwm", allow=False)],
            [rule("c 195:* rwm")],
            id="deny-never-punches-a-wildcard",
        ),
        pytest.param([rule("c 1:3 rw", allow=False)], [], id="deny-of-absent"),
    ],
)
def test_v1_allow_list(rules: list[DeviceRule], expected: list[DeviceRule]) -> None:
    assert v1_allow_list(rules) == expected


def test_v1_allow_list_refuses_mode_switches() -> None:
    with pytest.raises(ValueError, match="switches the cgroup's mode"):
        v1_allow_list([DeviceRule(DevType.ALL, None, None, ALL_ACCESS)])


def test_char_device() -> None:
    assert str(GPU3) == "c 195:3"
    assert GPU3.rule() == char_device(195, 3, RW)
    assert GPU3.rule(ALL_ACCESS, allow=False).render_v1() == "c 195:3 rwm"
    with pytest.raises(ValueError, match="out of range"):
        CharDevice(-1, 0)


# --- logic against an injected seam -------------------------------------------------


@dataclass
class FakeFiles:
    """Control files in memory: ``devices.list`` contents are set by the test; writes are
    recorded, and the write numbered ``fail_at`` (0-based) fails with ``error``."""

    lists: dict[Path, str]
    fail_at: int | None = None
    error: int = errno.EPERM
    writes: list[Write] = field(default_factory=list)

    def read(self, path: Path) -> str:
        try:
            return self.lists[path.parent]
        except KeyError:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path)) from None

    def write(self, path: Path, data: str) -> None:
        if len(self.writes) == self.fail_at:
            raise OSError(self.error, os.strerror(self.error), str(path))
        self.writes.append(Write(path, data))


@pytest.fixture
def cg(tmp_path: Path) -> Path:
    directory = tmp_path / "cg"
    directory.mkdir()
    return directory


def test_grant_that_the_kernel_did_not_apply_is_an_error(cg: Path) -> None:
    files = FakeFiles({cg: "c 1:3 rwm\n"})
    with pytest.raises(VerificationError, match="grants nothing") as caught:
        cgroup_v1.grant(cg, [GPU3], files=files)
    assert caught.value.done == (Write(cg / "devices.allow", "c 195:3 rw"),)


def test_failed_write_names_file_data_and_what_was_done(cg: Path) -> None:
    files = FakeFiles({cg: ""}, fail_at=1)
    with pytest.raises(ControlFileError) as caught:
        cgroup_v1.grant(cg, [GPU2, GPU3], files=files)
    message = str(caught.value)
    assert f"'c 195:3 rw' to {cg / 'devices.allow'}" in message
    assert "EPERM" in message
    assert caught.value.done == (Write(cg / "devices.allow", "c 195:2 rw"),)


def test_grant_writes_every_descendant_parents_first(cg: Path) -> None:
    (cg / "scope" / "container").mkdir(parents=True)
    dirs = [cg, cg / "scope", cg / "scope" / "container"]
    files = FakeFiles(dict.fromkeys(dirs, "c 195:3 rw\n"))
    change = cgroup_v1.grant(cg, [GPU3], files=files)
    assert change.writes == tuple(Write(d / "devices.allow", "c 195:3 rw") for d in dirs)
    assert cgroup_v1.grant(cg, [GPU3], recursive=False, files=files).writes == change.writes[:1]


def test_grant_skips_a_child_removed_meanwhile_but_not_the_top(cg: Path) -> None:
    (cg / "gone").mkdir()
    files = FakeFiles({cg: "c 195:3 rw\n"}, fail_at=1, error=errno.ENOENT)
    assert cgroup_v1.grant(cg, [GPU3], files=files).writes == (
        Write(cg / "devices.allow", "c 195:3 rw"),
    )
    with pytest.raises(ControlFileError, match="ENOENT"):
        cgroup_v1.grant(cg, [GPU3], files=FakeFiles({}, fail_at=0, error=errno.ENOENT))


@pytest.mark.parametrize(
    ("listed", "error", "match"),
    [
        pytest.param("c 195:* rwm\n", WildcardAllowError, "'c 195:\\* rwm'", id="major-wildcard"),
        pytest.param("a *:* rwm\n", WildcardAllowError, "not confined", id="unconfined"),
        pytest.param("c *:* rw\n", WildcardAllowError, "no-op", id="char-wildcard"),
        pytest.param("c 195:3 r\n", VerificationError, "still allowed", id="specific-left"),
    ],
)
def test_revoke_that_changed_nothing_is_an_error(
    cg: Path, listed: str, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match) as caught:
        cgroup_v1.revoke(cg, [GPU3], files=FakeFiles({cg: listed}))
    assert type(caught.value) is error


def test_revoke_accepts_the_mknod_wildcard_every_container_has(cg: Path) -> None:
    files = FakeFiles({cg: "c *:* m\nb *:* m\nc 1:3 rwm\n"})
    change = cgroup_v1.revoke(cg, [GPU3], files=files)
    assert change.writes == (Write(cg / "devices.deny", "c 195:3 rwm"),)


def test_set_policy_checks_the_resulting_list(cg: Path) -> None:
    files = FakeFiles({cg: "c 1:3 rwm\n"})
    with pytest.raises(VerificationError, match="after setting the policy"):
        cgroup_v1.set_policy(cg, [rule("c 1:3 rwm"), rule("c 1:5 rwm")], files=files)
    assert files.writes[0] == Write(cg / "devices.deny", "a")


def test_allowed_reads_the_effective_access(cg: Path) -> None:
    files = FakeFiles({cg: "c 195:* r\nc 195:3 w\n"})
    assert cgroup_v1.allowed(cg, GPU3, files=files) == RW
    assert cgroup_v1.allowed(cg, CharDevice(1, 5), files=files) == Access.NONE


def test_real_files_refuse_a_directory_that_is_not_a_cgroup(cg: Path) -> None:
    (cg / "devices.allow").write_text("")
    with pytest.raises(ControlFileError, match="not a cgroup v1 hierarchy"):
        cgroup_v1.grant(cg, [GPU3])
    assert (cg / "devices.allow").read_text() == ""


def test_real_files_never_follow_a_symlinked_control_file(cg: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("")
    (cg / "devices.allow").symlink_to(target)
    (cg / "devices.list").write_text("c 195:3 rw\n")
    with pytest.raises(ControlFileError, match="ELOOP"):
        cgroup_v1.grant(cg, [GPU3], files=CgroupFS(fs_magic=None))
    assert target.read_text() == ""


def test_real_files_on_a_plain_directory_when_told_so(cg: Path) -> None:
    (cg / "devices.allow").write_text("")
    (cg / "devices.list").write_text("c 195:3 rw\n")
    change = cgroup_v1.grant(cg, [GPU3], recursive=False, files=CgroupFS(fs_magic=None))
    assert change.writes == (Write(cg / "devices.allow", "c 195:3 rw"),)
    assert (cg / "devices.allow").read_text() == "c 195:3 rw"


# --- the real kernel ----------------------------------------------------------------


@dataclass
class Setup:
    top: Path
    child: Probe
    nodes: dict[int, Path]


@pytest.fixture
def confined(tmp_path: Path) -> Iterator[Setup]:
    """A child in a fresh v1 cgroup with the container defaults; nodes c 195:0..3."""
    nodes = make_nodes(tmp_path, range(4))
    with scratch_v1_cgroup() as top, probe() as child:
        cgroup_v1.set_policy(top, CONTAINER_DEFAULTS)
        move_into(top, child.pid)
        yield Setup(top, child, nodes)


class TestKernel:
    pytestmark = needs_cgroup_v1_devices

    def test_set_policy_confines_a_running_process(self, confined: Setup) -> None:
        assert confined.child.open(Path("/dev/null"), "rw") == "OK"
        assert confined.child.open(confined.nodes[3], "rw") == "EPERM"
        listed = cgroup_v1.read_allow_list(confined.top)
        assert set(listed) == set(v1_allow_list(CONTAINER_DEFAULTS))

    def test_grant_then_revoke_on_the_same_running_process(self, confined: Setup) -> None:
        change = cgroup_v1.grant(confined.top, [GPU3])
        assert change.writes == (Write(confined.top / "devices.allow", "c 195:3 rw"),)
        assert confined.child.open(confined.nodes[3], "rw") == "ENXIO"
        assert confined.child.open(confined.nodes[2], "rw") == "EPERM"
        assert cgroup_v1.allowed(confined.top, GPU3) & RW == RW

        cgroup_v1.revoke(confined.top, [GPU3])
        assert confined.child.open(confined.nodes[3], "rw") == "EPERM"
        assert cgroup_v1.allowed(confined.top, GPU3) & RW == Access.NONE

    def test_allows_do_not_propagate_denies_do(self, confined: Setup) -> None:
        leaf = confined.top / "scope" / "container"
        leaf.mkdir(parents=True)
        move_into(leaf, confined.child.pid)

        cgroup_v1.grant(confined.top, [GPU3], recursive=False)
        assert confined.child.open(confined.nodes[3], "rw") == "EPERM"

        change = cgroup_v1.grant(confined.top, [GPU3])
        assert [w.path.parent for w in change.writes] == [
            confined.top,
            confined.top / "scope",
            leaf,
        ]
        assert confined.child.open(confined.nodes[3], "rw") == "ENXIO"

        cgroup_v1.revoke(confined.top, [GPU3])
        assert confined.child.open(confined.nodes[3], "rw") == "EPERM"
        assert cgroup_v1.allowed(leaf, GPU3) & RW == Access.NONE

    def test_wildcard_makes_revoke_a_detected_no_op(self, tmp_path: Path) -> None:
        nodes = make_nodes(tmp_path, range(3, 4))
        policy = (*CONTAINER_DEFAULTS, DeviceRule(DevType.CHAR, 195, None, ALL_ACCESS))
        with scratch_v1_cgroup() as top, probe() as child:
            cgroup_v1.set_policy(top, policy)
            move_into(top, child.pid)
            with pytest.raises(WildcardAllowError, match="c 195:\\* rwm") as caught:
                cgroup_v1.revoke(top, [GPU3])
            assert caught.value.done == (Write(top / "devices.deny", "c 195:3 rwm"),)
            assert child.open(nodes[3], "rw") == "ENXIO"  # the kernel really did nothing

    def test_unconfined_cgroup_cannot_be_revoked(self) -> None:
        with scratch_v1_cgroup() as top, pytest.raises(WildcardAllowError, match="a \\*:\\* rwm"):
            cgroup_v1.revoke(top, [GPU3])

    def test_kernel_refusal_names_file_and_data(self, confined: Setup) -> None:
        sub = confined.top / "sub"
        sub.mkdir()
        with pytest.raises(ControlFileError, match="EPERM") as caught:
            cgroup_v1.grant(sub, [GPU3])  # the parent does not have it: a child cannot get it
        assert caught.value.path == sub / "devices.allow"
        assert caught.value.data == "c 195:3 rw"
        assert caught.value.done == ()

    def test_policy_needs_a_cgroup_without_children(self) -> None:
        with scratch_v1_cgroup() as top:
            (top / "child").mkdir()
            with pytest.raises(ControlFileError, match=r"writing 'a' to .*EINVAL"):
                cgroup_v1.set_policy(top, CONTAINER_DEFAULTS)

    def test_missing_cgroup(self) -> None:
        with scratch_v1_cgroup() as top, pytest.raises(ControlFileError, match="ENOENT"):
            cgroup_v1.grant(top / "missing", [GPU3])
