"""devnodes: nodes made inside a fake container's private /dev, and traps not to fall into."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jupyter_gpu_hotplug.linux import devnodes
from jupyter_gpu_hotplug.linux.devnodes import (
    ContainerGoneError,
    DeviceNode,
    DevNodeError,
    HostDevError,
    InvalidNodeNameError,
    UnsafeNodeError,
)
from jupyter_gpu_hotplug.linux.devrules import CharDevice

from ..fixtures.requirements import needs_root
from .fake_container import FakeContainer, fake_container

GPU3 = CharDevice(195, 3)
CTL = CharDevice(195, 255)

GPU_HOST_PROC_DEVICES = """\
Character devices:
  1 mem
  5 /dev/tty
195 nvidia-frontend
236 nvidia-nvlink
508 nvidia-uvm
509 nvidia-caps

Block devices:
  7 loop
195 nvidia-uvm
"""


# --- pure --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["nvidia0", "nvidia17", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools",
             "nvidia-caps/nvidia-cap1", "nvidia-caps/nvidia-cap402"],
)  # fmt: skip
def test_valid_names(name: str) -> None:
    assert devnodes.validate_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "nvidia",
        "nvidia01",
        "nvidia0/x",
        "../nvidia0",
        "/nvidia0",
        "nvidia-caps/../nvidia0",
        "nvidia-caps/nvidia-cap1/..",
        "nvidia-caps/nvidia0",
        "null",
        "nvidia3\n",
        "",
    ],
)
def test_invalid_names(name: str) -> None:
    with pytest.raises(InvalidNodeNameError):
        devnodes.validate_name(name)


def test_bad_input_is_refused_before_touching_anything() -> None:
    with pytest.raises(InvalidNodeNameError):
        devnodes.ensure_node(1, "../etc/passwd", GPU3)
    with pytest.raises(InvalidNodeNameError):
        devnodes.remove_node(1, "nvidia3/..", expect=GPU3)
    with pytest.raises(ValueError, match="permission mode"):
        devnodes.ensure_node(1, "nvidia3", GPU3, mode=0o4755)


def test_parse_proc_devices_reads_only_character_devices() -> None:
    majors = devnodes.parse_proc_devices(GPU_HOST_PROC_DEVICES)
    assert majors["nvidia-uvm"] == 508
    assert majors["nvidia-frontend"] == 195
    assert "loop" not in majors


def test_control_devices_from_proc_devices(tmp_path: Path) -> None:
    proc_devices = tmp_path / "devices"
    proc_devices.write_text(GPU_HOST_PROC_DEVICES)
    assert devnodes.nvidia_control_devices(tmp_path, proc_devices) == [
        DeviceNode("nvidiactl", CTL),
        DeviceNode("nvidia-uvm", CharDevice(508, 0)),
        DeviceNode("nvidia-uvm-tools", CharDevice(508, 1)),
    ]


def test_control_devices_without_the_driver(tmp_path: Path) -> None:
    proc_devices = tmp_path / "devices"
    proc_devices.write_text("Character devices:\n  1 mem\n\nBlock devices:\n  7 loop\n")
    assert devnodes.nvidia_control_devices(tmp_path, proc_devices) == []


def test_control_devices_on_this_host() -> None:
    if "nvidia" in Path("/proc/devices").read_text():
        pytest.skip("this host has the NVIDIA driver loaded")
    assert devnodes.nvidia_control_devices() == []


@needs_root
def test_host_node_numbers_win_over_proc_devices(tmp_path: Path) -> None:
    proc_devices = tmp_path / "devices"
    proc_devices.write_text(GPU_HOST_PROC_DEVICES)
    dev = tmp_path / "dev"
    dev.mkdir()
    os.mknod(dev / "nvidia-uvm", stat.S_IFCHR | 0o666, os.makedev(511, 0))
    found = devnodes.nvidia_control_devices(dev, proc_devices)
    assert DeviceNode("nvidia-uvm", CharDevice(511, 0)) in found
    (dev / "nvidiactl").write_text("not a device")
    with pytest.raises(UnsafeNodeError, match="not a character device"):
        devnodes.nvidia_control_devices(dev, proc_devices)


# --- inside a fake container ---------------------------------------------------------


@pytest.fixture
def umask_022() -> Iterator[None]:
    """Sets the umask to 022 (tests may change it further); the old one is restored."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


@pytest.fixture
def container(tmp_path: Path) -> Iterator[FakeContainer]:
    with fake_container(tmp_path) as running:
        yield running


@pytest.fixture
def host_target(tmp_path: Path) -> Path:
    """A host directory with one file: what a hostile container's links point at."""
    target = tmp_path / "host"
    target.mkdir()
    (target / "precious").write_text("host data")
    os.chmod(target / "precious", 0o600)
    return target


def assert_untouched(host_target: Path) -> None:
    assert sorted(os.listdir(host_target)) == ["precious"]
    assert (host_target / "precious").read_text() == "host data"
    info = os.lstat(host_target / "precious")
    assert stat.S_ISREG(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o600


def _wait_for_own_mount_namespace(pid: int) -> bool:
    """Poll until ``pid`` (just started by ``unshare``) has left our mount namespace."""
    deadline = time.monotonic() + 30
    ours = os.stat("/proc/self/ns/mnt").st_ino
    while time.monotonic() < deadline:
        if os.stat(f"/proc/{pid}/ns/mnt").st_ino != ours:
            return True
        time.sleep(0.01)
    return False


class TestInContainer:
    pytestmark = needs_root

    def test_node_appears_inside_with_mode_despite_umask(
        self, container: FakeContainer, umask_022: None
    ) -> None:
        assert devnodes.ensure_node(container.pid, "nvidia3", GPU3) is True
        assert container.stat("/dev/nvidia3") == "chr 195:3 666 0:0"
        assert os.listdir(container.rootfs) == []  # only the container's namespace has it

    def test_ensure_is_idempotent_and_never_changes_a_node_it_did_not_create(
        self, container: FakeContainer
    ) -> None:
        """A node already there is someone else's (the runtime's, the host's): its mode and
        owner are never changed, or a node on the host could be made world-writable."""
        assert devnodes.ensure_node(container.pid, "nvidia3", GPU3) is True
        assert container.ask("chmod /dev/nvidia3 600") == "OK done"
        assert container.ask("chown /dev/nvidia3 1000:1000") == "OK done"
        assert devnodes.ensure_node(container.pid, "nvidia3", GPU3) is False
        assert container.stat("/dev/nvidia3") == "chr 195:3 600 1000:1000"

    def test_a_node_made_before_a_failure_is_removed_again(
        self, container: FakeContainer, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        def refuse(path: str, uid: int, gid: int) -> None:
            raise PermissionError(errno.EPERM, "Operation not permitted", path)

        monkeypatch.setattr(os, "chown", refuse)
        with pytest.raises(DevNodeError, match=r"making /dev/nvidia3 .* Operation not permitted"):
            devnodes.ensure_node(container.pid, "nvidia3", GPU3)
        assert container.stat("/dev/nvidia3") == "ENOENT"

    def test_never_in_the_hosts_dev(self, tmp_path: Path) -> None:
        """A process with a mount namespace of its own but the host's /dev mounted in it
        (``unshare -m``): the host's /dev is never written, whatever the namespace."""
        with subprocess.Popen(["unshare", "-m", "--propagation", "private", "sleep", "60"]) as p:
            try:
                assert _wait_for_own_mount_namespace(p.pid)
                with pytest.raises(HostDevError, match="is the host's /dev"):
                    devnodes.ensure_node(p.pid, "nvidia7", CharDevice(195, 7))
                with pytest.raises(HostDevError):
                    devnodes.remove_node(p.pid, "nvidia7", expect=CharDevice(195, 7))
                with pytest.raises(HostDevError):
                    devnodes.check_private_dev(p.pid)
            finally:
                p.kill()
        assert not Path("/dev/nvidia7").exists()

    def test_other_mode(self, container: FakeContainer) -> None:
        devnodes.ensure_node(container.pid, "nvidiactl", CTL, mode=0o660)
        assert container.stat("/dev/nvidiactl") == "chr 195:255 660 0:0"

    def test_caps_subdirectory_is_made(self, container: FakeContainer, umask_022: None) -> None:
        os.umask(0o077)  # would make the directory 700 and the node 600 if not corrected
        devnodes.ensure_node(container.pid, "nvidia-caps/nvidia-cap1", CharDevice(509, 1))
        assert container.stat("/dev/nvidia-caps") == "dir 755"
        assert container.stat("/dev/nvidia-caps/nvidia-cap1") == "chr 509:1 666 0:0"

    def test_remove_only_what_we_expect(self, container: FakeContainer) -> None:
        devnodes.ensure_node(container.pid, "nvidia3", GPU3)
        with pytest.raises(UnsafeNodeError, match="is the device c 195:3, not c 195:4"):
            devnodes.remove_node(container.pid, "nvidia3", expect=CharDevice(195, 4))
        assert container.stat("/dev/nvidia3").startswith("chr 195:3")
        assert devnodes.remove_node(container.pid, "nvidia3", expect=GPU3) is True
        assert container.stat("/dev/nvidia3") == "ENOENT"
        assert devnodes.remove_node(container.pid, "nvidia3", expect=GPU3) is False
        assert devnodes.remove_node(container.pid, "nvidia-caps/nvidia-cap1", expect=GPU3) is False

    def test_list_nodes(self, container: FakeContainer) -> None:
        devnodes.ensure_node(container.pid, "nvidia3", GPU3)
        devnodes.ensure_node(container.pid, "nvidiactl", CTL)
        devnodes.ensure_node(container.pid, "nvidia-caps/nvidia-cap1", CharDevice(509, 1))
        assert devnodes.list_nodes(container.pid) == [
            DeviceNode("nvidia-caps/nvidia-cap1", CharDevice(509, 1)),
            DeviceNode("nvidia3", GPU3),
            DeviceNode("nvidiactl", CTL),
        ]
        assert devnodes.list_nodes(container.pid, prefix="nvidiactl") == [
            DeviceNode("nvidiactl", CTL)
        ]

    def test_gone_process(self) -> None:
        process = subprocess.Popen([sys.executable, "-c", ""])
        process.wait()
        with pytest.raises(ContainerGoneError):
            devnodes.ensure_node(process.pid, "nvidia3", GPU3)


class TestHostileContainer:
    """Links and impostors planted by the workload: refused, and nothing outside changes."""

    pytestmark = needs_root

    def test_absolute_symlink_at_the_node_name(self, tmp_path: Path, host_target: Path) -> None:
        trap = str(host_target / "precious")
        with fake_container(tmp_path, plant=[("symlink", "dev/nvidia3", trap)]) as box:
            with pytest.raises(UnsafeNodeError, match="a symlink"):
                devnodes.ensure_node(box.pid, "nvidia3", GPU3)
            with pytest.raises(UnsafeNodeError, match="a symlink"):
                devnodes.remove_node(box.pid, "nvidia3", expect=GPU3)
            assert box.stat("/dev/nvidia3") == f"lnk {trap}"
            assert devnodes.list_nodes(box.pid) == []
        assert_untouched(host_target)

    def test_symlinked_caps_directory(self, tmp_path: Path, host_target: Path) -> None:
        plant = [("symlink", "dev/nvidia-caps", str(host_target))]
        with fake_container(tmp_path, plant=plant) as box:
            with pytest.raises(UnsafeNodeError, match="not a plain directory"):
                devnodes.ensure_node(box.pid, "nvidia-caps/nvidia-cap1", CharDevice(509, 1))
            assert devnodes.list_nodes(box.pid) == []
        assert_untouched(host_target)

    @pytest.mark.parametrize("link", ["/", "HOST"], ids=["to-container-root", "to-host-path"])
    def test_dev_itself_is_a_symlink(self, tmp_path: Path, host_target: Path, link: str) -> None:
        target = str(host_target) if link == "HOST" else link
        with fake_container(tmp_path, dev_link=target) as box:
            with pytest.raises(UnsafeNodeError, match="is a symlink"):
                devnodes.ensure_node(box.pid, "nvidia3", GPU3)
            with pytest.raises(UnsafeNodeError, match="is a symlink"):
                devnodes.list_nodes(box.pid)
            assert box.ask("ls /") == "OK dev"  # nothing was made at the container's root
        assert_untouched(host_target)

    @pytest.mark.parametrize(
        ("kind", "arg", "what"),
        [
            pytest.param("file", None, "a file", id="regular-file"),
            pytest.param("dir", None, "a directory", id="directory"),
            pytest.param("node", [1, 5], "the device c 1:5", id="other-device"),
        ],
    )
    def test_impostor_at_the_node_name(
        self, tmp_path: Path, kind: str, arg: object, what: str
    ) -> None:
        with fake_container(tmp_path, plant=[(kind, "dev/nvidia3", arg)]) as box:
            before = box.stat("/dev/nvidia3")
            with pytest.raises(UnsafeNodeError, match=what):
                devnodes.ensure_node(box.pid, "nvidia3", GPU3)
            with pytest.raises(UnsafeNodeError, match=what):
                devnodes.remove_node(box.pid, "nvidia3", expect=GPU3)
            assert box.stat("/dev/nvidia3") == before
