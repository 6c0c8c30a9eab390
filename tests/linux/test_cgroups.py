"""cgroups: finding hierarchies and a process's cgroup directories, refusing escapes."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import pytest

from jupyter_gpu_hotplug.linux import cgroups
from jupyter_gpu_hotplug.linux.cgroups import (
    CgroupHierarchies,
    CgroupMount,
    CgroupNotFoundError,
    CgroupPathError,
)

from ..fixtures.requirements import needs_cgroup_v1_devices
from .probes import move_into, probe, scratch_v1_cgroup

HYBRID_MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:9 - cgroup cgroup rw,cpu,cpuacct
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime shared:13 - cgroup cgroup rw,devices
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:5 - cgroup2 cgroup2 rw,nsdelegate
"""

PURE_V2_MOUNTINFO = """\
24 29 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
30 24 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate
"""

PURE_V1_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
33 31 0:30 / /sys/fs/cgroup/systemd rw,nosuid shared:9 - cgroup cgroup rw,xattr,name=systemd
37 31 0:34 / /sys/fs/cgroup/cpu,devices rw,nosuid shared:13 - cgroup cgroup rw,cpu,devices
"""

# What a container with its own cgroup namespace sees: subtrees of the hierarchies.
CONTAINER_MOUNTINFO = """\
700 690 0:33 /kubepods/pod1/abc /sys/fs/cgroup/devices ro master:13 - cgroup cgroup rw,devices
701 690 0:38 /kubepods/pod1/abc /sys/fs/cgroup/unified ro,nosuid - cgroup2 cgroup2 rw
"""

HYBRID_PROC_CGROUP = """\
9:name=systemd:/system.slice/containerd.service
5:devices:/kubepods/burstable/pod1/abc
4:cpu,cpuacct:/kubepods/burstable/pod1/abc
0::/kubepods/burstable/pod1/abc/container
"""


class TestParseMountinfo:
    def test_hybrid_host(self) -> None:
        found = cgroups.parse_mountinfo(HYBRID_MOUNTINFO)
        assert found.layout == "hybrid"
        assert found.devices_v1 == CgroupMount(Path("/sys/fs/cgroup/devices"), PurePosixPath("/"))
        assert found.unified == CgroupMount(Path("/sys/fs/cgroup/unified"), PurePosixPath("/"))

    def test_pure_v2_host(self) -> None:
        found = cgroups.parse_mountinfo(PURE_V2_MOUNTINFO)
        assert found.layout == "v2"
        assert found.devices_v1 is None
        assert found.unified == CgroupMount(Path("/sys/fs/cgroup"), PurePosixPath("/"))

    def test_pure_v1_host_with_comounted_controllers(self) -> None:
        found = cgroups.parse_mountinfo(PURE_V1_MOUNTINFO)
        assert found.layout == "v1"
        assert found.unified is None
        assert found.devices_v1 is not None
        assert found.devices_v1.mount_point == Path("/sys/fs/cgroup/cpu,devices")

    def test_no_cgroups_at_all(self) -> None:
        assert cgroups.parse_mountinfo("22 27 0:21 / /proc rw - proc proc rw\n").layout == "none"

    def test_subtree_mounts_keep_their_root(self) -> None:
        found = cgroups.parse_mountinfo(CONTAINER_MOUNTINFO)
        assert found.devices_v1 is not None
        assert found.devices_v1.root == PurePosixPath("/kubepods/pod1/abc")

    def test_root_mount_preferred_over_subtree(self) -> None:
        text = CONTAINER_MOUNTINFO + HYBRID_MOUNTINFO.replace("/sys/fs/", "/host/sys/fs/")
        found = cgroups.parse_mountinfo(text)
        assert found.devices_v1 == CgroupMount(
            Path("/host/sys/fs/cgroup/devices"), PurePosixPath("/")
        )

    def test_mount_hidden_by_a_later_one_is_ignored(self) -> None:
        text = PURE_V2_MOUNTINFO + "90 24 0:99 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
        assert cgroups.parse_mountinfo(text).unified is None

    def test_escaped_mount_point(self) -> None:
        text = "41 31 0:38 / /mnt/cgroup\\040two rw - cgroup2 cgroup2 rw\n"
        found = cgroups.parse_mountinfo(text)
        assert found.unified is not None
        assert found.unified.mount_point == Path("/mnt/cgroup two")

    def test_garbage_is_an_error(self) -> None:
        with pytest.raises(ValueError, match="unparseable mountinfo"):
            cgroups.parse_mountinfo("41 31 0:38 / /x rw - cgroup2\n")

    def test_rebased(self) -> None:
        found = cgroups.parse_mountinfo(HYBRID_MOUNTINFO).rebased(Path("/host"))
        assert found.devices_v1 is not None and found.unified is not None
        assert found.devices_v1.mount_point == Path("/host/sys/fs/cgroup/devices")
        assert found.unified.mount_point == Path("/host/sys/fs/cgroup/unified")


class TestParseProcCgroup:
    def test_hybrid(self) -> None:
        paths = cgroups.parse_proc_cgroup(HYBRID_PROC_CGROUP)
        assert paths.devices_v1 == "/kubepods/burstable/pod1/abc"
        assert paths.unified == "/kubepods/burstable/pod1/abc/container"

    def test_pure_v2(self) -> None:
        paths = cgroups.parse_proc_cgroup("0::/user.slice/user-0.slice/session-1.scope\n")
        assert paths.devices_v1 is None
        assert paths.unified == "/user.slice/user-0.slice/session-1.scope"

    def test_comounted_devices(self) -> None:
        assert cgroups.parse_proc_cgroup("3:cpu,devices:/x\n").devices_v1 == "/x"

    def test_garbage_is_an_error(self) -> None:
        with pytest.raises(ValueError, match="unparseable"):
            cgroups.parse_proc_cgroup("devices/x\n")


class TestDirectoryOf:
    MOUNT = CgroupMount(Path("/sys/fs/cgroup/devices"), PurePosixPath("/"))

    def test_joins_the_path_read_from_proc(self) -> None:
        assert self.MOUNT.directory_of("/kubepods/pod1/abc") == Path(
            "/sys/fs/cgroup/devices/kubepods/pod1/abc"
        )
        assert self.MOUNT.directory_of("/") == Path("/sys/fs/cgroup/devices")

    @pytest.mark.parametrize(
        "path",
        [
            pytest.param("/../../etc", id="outside-cgroup-namespace"),
            pytest.param("/a/../../../etc", id="dotdot-inside"),
            pytest.param("/a/./b", id="dot"),
            pytest.param("relative/path", id="relative"),
            pytest.param("/a\0b", id="nul"),
        ],
    )
    def test_refuses_paths_that_are_not_plain(self, path: str) -> None:
        with pytest.raises(CgroupPathError):
            self.MOUNT.directory_of(path)

    def test_subtree_mount(self) -> None:
        mount = CgroupMount(Path("/sys/fs/cgroup/devices"), PurePosixPath("/kubepods/pod1"))
        assert mount.directory_of("/kubepods/pod1/abc") == Path("/sys/fs/cgroup/devices/abc")
        with pytest.raises(CgroupPathError, match="not visible through the mount"):
            mount.directory_of("/kubepods/pod2/abc")

    def test_refuses_a_symlink_out_of_the_mount(self, tmp_path: Path) -> None:
        mount_point = tmp_path / "devices"
        (mount_point / "pod").mkdir(parents=True)
        (tmp_path / "outside").mkdir()
        (mount_point / "pod" / "evil").symlink_to(tmp_path / "outside")
        mount = CgroupMount(mount_point, PurePosixPath("/"))
        assert mount.directory_of("/pod") == mount_point / "pod"
        with pytest.raises(CgroupPathError, match="outside"):
            mount.directory_of("/pod/evil/x")

    def test_a_refusal_is_never_remembered(self, tmp_path: Path) -> None:
        """Accepted paths are remembered (``directory_of``'s docstring says why that is safe on
        a cgroup filesystem); a refused one is checked again at every call."""
        mount_point = tmp_path / "devices"
        (mount_point / "pod").mkdir(parents=True)
        (tmp_path / "outside").mkdir()
        evil = mount_point / "pod" / "evil"
        evil.symlink_to(tmp_path / "outside")
        mount = CgroupMount(mount_point, PurePosixPath("/"))
        for _ in range(2):
            with pytest.raises(CgroupPathError, match="outside"):
                mount.directory_of("/pod/evil/x")
        evil.unlink()
        evil.mkdir()
        assert mount.directory_of("/pod/evil/x") == evil / "x"


class TestProcessCgroups:
    @pytest.fixture
    def host(self, tmp_path: Path) -> tuple[Path, CgroupHierarchies]:
        proc = tmp_path / "proc"
        (proc / "123").mkdir(parents=True)
        (proc / "123" / "cgroup").write_text(HYBRID_PROC_CGROUP)
        (proc / "self").mkdir()
        (proc / "self" / "mountinfo").write_text(HYBRID_MOUNTINFO)
        return proc, cgroups.discover(host_proc=proc, rebase=tmp_path)

    def test_discover_reads_and_rebases(
        self, tmp_path: Path, host: tuple[Path, CgroupHierarchies]
    ) -> None:
        _, hierarchies = host
        assert hierarchies.layout == "hybrid"
        assert hierarchies.devices_v1 is not None
        assert hierarchies.devices_v1.mount_point == tmp_path / "sys/fs/cgroup/devices"

    def test_absolute_directories_under_the_mounts(
        self, tmp_path: Path, host: tuple[Path, CgroupHierarchies]
    ) -> None:
        proc, hierarchies = host
        found = cgroups.process_cgroups(123, hierarchies=hierarchies, host_proc=proc)
        assert found.pid == 123
        assert found.devices_v1 == tmp_path / "sys/fs/cgroup/devices/kubepods/burstable/pod1/abc"
        assert found.unified == (
            tmp_path / "sys/fs/cgroup/unified/kubepods/burstable/pod1/abc/container"
        )

    def test_unmounted_hierarchy_is_none(self, host: tuple[Path, CgroupHierarchies]) -> None:
        proc, hierarchies = host
        v1_only = CgroupHierarchies(devices_v1=hierarchies.devices_v1, unified=None)
        assert cgroups.process_cgroups(123, hierarchies=v1_only, host_proc=proc).unified is None

    def test_missing_entry_for_a_mounted_hierarchy(
        self, host: tuple[Path, CgroupHierarchies]
    ) -> None:
        proc, hierarchies = host
        (proc / "123" / "cgroup").write_text("0::/only-v2\n")
        with pytest.raises(CgroupNotFoundError, match="no devices"):
            cgroups.process_cgroups(123, hierarchies=hierarchies, host_proc=proc)

    def test_escaping_entry(self, host: tuple[Path, CgroupHierarchies]) -> None:
        proc, hierarchies = host
        (proc / "123" / "cgroup").write_text("5:devices:/../../../etc\n0::/\n")
        with pytest.raises(CgroupPathError):
            cgroups.process_cgroups(123, hierarchies=hierarchies, host_proc=proc)

    def test_gone_process(self, host: tuple[Path, CgroupHierarchies]) -> None:
        proc, hierarchies = host
        with pytest.raises(CgroupNotFoundError, match="process 999 is gone"):
            cgroups.process_cgroups(999, hierarchies=hierarchies, host_proc=proc)


class TestDirsToPatchV2:
    def test_leaf_up_to_scope_inclusive(self) -> None:
        scope = Path("/sys/fs/cgroup/kubepods.slice/cri-containerd-abc.scope")
        leaf = scope / "container"
        assert cgroups.cgroup_dirs_to_patch_v2(leaf, scope=scope) == [leaf, scope]

    def test_leaf_is_the_scope(self) -> None:
        leaf = Path("/sys/fs/cgroup/sandbox")
        assert cgroups.cgroup_dirs_to_patch_v2(leaf, scope=leaf) == [leaf]

    @pytest.mark.parametrize(
        ("leaf", "scope"),
        [
            pytest.param("/cg/a/b", "/cg/x", id="not-an-ancestor"),
            pytest.param("/cg/ab/c", "/cg/a", id="name-prefix-is-not-an-ancestor"),
            pytest.param("/cg/a", "/cg/a/b", id="scope-below-leaf"),
            pytest.param("/cg/a/../b", "/cg", id="dotdot"),
            pytest.param("cg/a", "cg", id="relative"),
        ],
    )
    def test_refuses_a_scope_that_does_not_bound_the_leaf(self, leaf: str, scope: str) -> None:
        with pytest.raises(ValueError):
            cgroups.cgroup_dirs_to_patch_v2(Path(leaf), scope=Path(scope))


class TestWalking:
    @pytest.fixture
    def tree(self, tmp_path: Path) -> Path:
        top = tmp_path / "top"
        for directory, pids in (
            (top, "10\n11\n"),
            (top / "a", "12\n"),
            (top / "a" / "deep", "11\n13\n"),
            (top / "b", ""),
        ):
            directory.mkdir()
            (directory / "cgroup.procs").write_text(pids)
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "cgroup.procs").write_text("99\n")
        (top / "link").symlink_to(tmp_path / "elsewhere")
        return top

    def test_descendants_parents_first_without_following_links(self, tree: Path) -> None:
        assert cgroups.descendants(tree) == [tree / "a", tree / "a" / "deep", tree / "b"]

    def test_descendants_walk_is_bounded_and_iterative(self, tree: Path) -> None:
        with pytest.raises(cgroups.CgroupLimitError, match="more than 2 cgroups"):
            cgroups.descendants(tree, limit=2)
        chain = [tree / "b" / ("n/" * level) / "n" for level in range(1100)]  # > recursion limit
        try:
            for directory in chain:
                directory.mkdir()
            assert cgroups.descendants(tree)[-1] == chain[-1]
        finally:
            # Deepest first: pytest's own clean-up (shutil.rmtree) recurses, and must never
            # meet a tree deeper than its recursion limit.
            for directory in reversed(chain):
                directory.rmdir()

    def test_pids_recursive_and_not(self, tree: Path) -> None:
        assert cgroups.pids_in_cgroup(tree) == [10, 11, 12, 13]
        assert cgroups.pids_in_cgroup(tree, recursive=False) == [10, 11]

    def test_missing_directory(self, tmp_path: Path) -> None:
        with pytest.raises(CgroupNotFoundError):
            cgroups.descendants(tmp_path / "nope")
        with pytest.raises(CgroupNotFoundError):
            cgroups.pids_in_cgroup(tmp_path / "nope", recursive=False)


class TestLiveHost:
    def test_our_own_cgroups_hold_us(self) -> None:
        hierarchies = cgroups.discover()
        assert hierarchies.layout != "none", "this host mounts no cgroup hierarchy"
        ours = cgroups.process_cgroups(os.getpid(), hierarchies=hierarchies)
        for directory in (ours.devices_v1, ours.unified):
            if directory is not None:
                assert directory.is_dir()
                assert os.getpid() in cgroups.pids_in_cgroup(directory, recursive=False)

    @needs_cgroup_v1_devices
    def test_process_in_a_child_cgroup(self) -> None:
        with scratch_v1_cgroup() as top, probe() as child:
            leaf = top / "scope" / "container"
            leaf.mkdir(parents=True)
            move_into(leaf, child.pid)
            found = cgroups.process_cgroups(child.pid, hierarchies=cgroups.discover())
            assert found.devices_v1 == leaf
            assert cgroups.pids_in_cgroup(top) == [child.pid]
            assert cgroups.pids_in_cgroup(top, recursive=False) == []
            assert cgroups.descendants(top) == [top / "scope", leaf]
