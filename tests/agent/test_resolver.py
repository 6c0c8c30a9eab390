"""Local mode's resolver over a procfs and cgroup mounts laid out in ``tmp_path``.

The resolver reads ``/proc/<pid>/stat``, ``/proc/<pid>/cgroup`` and ``cgroup.procs``; here they
are files written by the test, so every case — a container, the host, the agent itself, crun's
inner ``container`` leaf, a reused pid — is built exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import pytest

from jupyter_gpu_hotplug._structs import PidRef, PidTarget
from jupyter_gpu_hotplug.agent.core.errors import Forbidden, NotFound
from jupyter_gpu_hotplug.agent.core.seams import ContainerCgroups
from jupyter_gpu_hotplug.agent.local.resolver import ProcResolver
from jupyter_gpu_hotplug.linux.cgroups import CgroupHierarchies, CgroupMount
from jupyter_gpu_hotplug.linux.devnodes import HostDevError

AGENT = 10


@dataclass
class FakeProc:
    root: Path
    devices: Path
    unified: Path
    host_dev: set[int] = field(default_factory=set)
    """Processes whose ``/dev`` is the host's (a mount namespace of their own, nonetheless)."""

    def add(
        self,
        pid: int,
        cgroup: str,
        *,
        start: int = 100,
        comm: str = "python",
        mounts_of: int | None = None,
    ) -> None:
        """``mounts_of``: share that process's mount namespace (default: one of its own)."""
        directory = self.root / str(pid)
        directory.mkdir(exist_ok=True)
        (directory / "ns").mkdir()
        if mounts_of is None:
            (directory / "ns" / "mnt").write_text("")
        else:
            (directory / "ns" / "mnt").hardlink_to(self.root / str(mounts_of) / "ns" / "mnt")
        fields = ["S", *(["0"] * 18), str(start), "0"]
        (directory / "stat").write_text(f"{pid} ({comm}) {' '.join(fields)}\n")
        (directory / "cgroup").write_text(
            f"9:name=systemd:/\n5:devices:{cgroup}\n4:memory:/\n0::{cgroup}\n"
        )
        for mount in (self.devices, self.unified):
            cgroup_dir = mount / cgroup.lstrip("/")
            cgroup_dir.mkdir(parents=True, exist_ok=True)
            procs = cgroup_dir / "cgroup.procs"
            old = procs.read_text() if procs.exists() else ""
            procs.write_text(old + f"{pid}\n")

    def remove(self, pid: int) -> None:
        for name in ("stat", "cgroup", "ns/mnt"):
            (self.root / str(pid) / name).unlink()
        (self.root / str(pid) / "ns").rmdir()
        (self.root / str(pid)).rmdir()

    def resolver(self) -> ProcResolver:
        hierarchies = CgroupHierarchies(
            devices_v1=CgroupMount(self.devices, PurePosixPath("/")),
            unified=CgroupMount(self.unified, PurePosixPath("/")),
        )
        return ProcResolver(
            host_proc=self.root, hierarchies=hierarchies, agent_pid=AGENT, check_dev=self.check_dev
        )

    def check_dev(self, pid: int) -> None:
        """The fake processes' ``/dev``: private, but for those in ``host_dev``."""
        if pid in self.host_dev:
            raise HostDevError(f"the /dev of process {pid} is the host's /dev")


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    fake = FakeProc(tmp_path / "proc", tmp_path / "devices", tmp_path / "unified")
    fake.root.mkdir()
    fake.add(1, "/")
    fake.add(AGENT, "/system.slice/gpu-hotplug.service", mounts_of=1)
    fake.add(11, "/system.slice/gpu-hotplug.service", comm="child-of-agent", mounts_of=1)
    fake.add(20, "/")
    fake.add(30, "/kubepods/pod-a/ctr-1", start=500)
    fake.add(31, "/kubepods/pod-a/ctr-1", start=600)
    fake.add(40, "/machine.slice/libpod-abc.scope/container", start=700)
    fake.add(50, "/system.slice/cron.service", mounts_of=1)
    fake.add(60, "/user.slice/user-1000.slice/session-1.scope")  # unshare -Urm: host's /dev
    fake.host_dev.add(60)
    return fake


def test_container_target_resolves_with_its_start_time(proc: FakeProc) -> None:
    resolved = proc.resolver().resolve(PidRef(31))

    assert resolved.target == PidTarget(31, 600)
    assert (resolved.pid, resolved.start_time) == (31, 600)
    assert resolved.cgroups == ContainerCgroups("/kubepods/pod-a/ctr-1", "/kubepods/pod-a/ctr-1")
    assert resolved.key == proc.resolver().resolve(PidRef(30)).key


def test_crun_inner_cgroup_is_folded_into_the_scope(proc: FakeProc) -> None:
    resolved = proc.resolver().resolve(PidRef(40))

    assert resolved.cgroups.unified == "/machine.slice/libpod-abc.scope"


@pytest.mark.parametrize(
    ("pid", "reason"),
    [
        (AGENT, "agent itself"),
        (11, "agent's own cgroup"),
        (20, "root cgroup"),
        (50, "shares the agent's mount namespace"),
        (60, "not in a container with a /dev of its own.*host's /dev"),
    ],
)
def test_not_containers_are_refused(proc: FakeProc, pid: int, reason: str) -> None:
    with pytest.raises(Forbidden, match=reason):
        proc.resolver().resolve(PidRef(pid))


def test_missing_process_is_not_found(proc: FakeProc) -> None:
    with pytest.raises(NotFound) as caught:
        proc.resolver().resolve(PidRef(99))

    assert (caught.value.resource, caught.value.name) == ("process", "99")


def test_lookup_tells_a_reused_pid_apart(proc: FakeProc) -> None:
    resolver = proc.resolver()
    found = resolver.resolve(PidRef(30))

    assert resolver.lookup(found.target, found.key) == found
    proc.remove(30)
    assert resolver.lookup(found.target, found.key) is None
    proc.add(30, "/kubepods/pod-b/ctr-9", start=900)
    assert resolver.lookup(found.target, found.key) is None


def test_current_finds_the_container_through_another_process(proc: FakeProc) -> None:
    resolver = proc.resolver()
    found = resolver.resolve(PidRef(31))
    proc.remove(31)

    current = resolver.current(found.target, found.key)

    assert current is not None
    assert (current.target, current.key) == (PidTarget(30, 500), found.key)
    proc.remove(30)
    assert resolver.current(found.target, found.key) is None


def test_remains_are_the_cgroups_of_the_same_container_only(proc: FakeProc) -> None:
    resolver = proc.resolver()
    found = resolver.resolve(PidRef(30))

    assert resolver.remains(found.key) == found.cgroups
    for mount in (proc.devices, proc.unified):
        directory = mount / "kubepods/pod-a/ctr-1"
        # Re-created under the same name: another cgroup (kernfs gives it a new id; here the
        # old directory is kept elsewhere so that its inode cannot be handed out again).
        directory.rename(mount / "kubepods/pod-a/old")
        directory.mkdir()
    assert resolver.remains(found.key) is None


def test_oldest_member_is_what_the_caller_itself_means(proc: FakeProc) -> None:
    resolver = proc.resolver()
    cgroups = resolver.container_of(31)

    assert cgroups is not None
    assert resolver.oldest_member(cgroups) == 30


def test_container_of_any_process(proc: FakeProc) -> None:
    resolver = proc.resolver()

    assert resolver.container_of(1) == ContainerCgroups("/", "/")
    assert resolver.container_of(99) is None
    assert resolver.agent_container == ContainerCgroups(
        "/system.slice/gpu-hotplug.service", "/system.slice/gpu-hotplug.service"
    )


def test_running_is_every_container_a_target_could_be_once_through_its_oldest(
    proc: FakeProc,
) -> None:
    """The node sweep's containers (issue 38): not the host's processes, the agent's own
    cgroup or a process with the host's ``/dev``; a container once, through its oldest
    process; crun's inner leaf folded; only below ``within``."""
    resolver = proc.resolver()

    found = {c.pid: c.cgroups.unified for c in resolver.running()}

    assert found == {30: "/kubepods/pod-a/ctr-1", 40: "/machine.slice/libpod-abc.scope"}
    assert [c.pid for c in resolver.running(within="/machine.slice")] == [40]
    assert resolver.running(within="/kubepods/pod-b") == []


def test_running_counts_a_child_cgroup_of_a_reserved_container_as_that_container(
    proc: FakeProc,
) -> None:
    """A process that moved into a child cgroup of its own is in its container: judged as a
    container of its own, the grant of its owner's reservation would look like an orphan."""
    resolver = proc.resolver()
    owner = resolver.resolve(PidRef(30))
    proc.add(32, "/kubepods/pod-a/ctr-1/worker", start=550)

    alone = {c.pid: c.key for c in resolver.running()}
    folded = {c.pid: c.key for c in resolver.running(owners=[owner.key])}

    assert 32 in alone and alone[32] != owner.key
    assert folded == {30: owner.key, 40: resolver.resolve(PidRef(40)).key}
