"""The sandbox: what its workload sees, and that stopping it leaves nothing behind.

Device checks use real NVIDIA numbers without a GPU: opening ``c 195:0`` gives ENXIO
where the device cgroup allows it (no driver behind it) and EPERM where it denies it.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import pytest

from jupyter_gpu_hotplug._structs import NVIDIA_MAJOR
from jupyter_gpu_hotplug.linux import cgroups, devnodes
from jupyter_gpu_hotplug.linux.devnodes import DeviceNode, nvidia_control_devices
from jupyter_gpu_hotplug.linux.devrules import (
    CONTAINER_DEFAULTS,
    NVIDIACTL_MINOR,
    RW,
    CharDevice,
    char_device,
)
from jupyter_gpu_hotplug.linux.sandbox import _init as _sandbox_init
from jupyter_gpu_hotplug.linux.sandbox.runtime import (
    Backend,
    Sandbox,
    SandboxSpec,
    SandboxStartError,
    SandboxUnsupportedError,
    cleanup_stale,
    effective_rules,
    host_backends,
)
from tests.fixtures.host_state import (
    bpf_program_loaded,
    changed_mounts,
    mount_namespaces_in_use,
    mount_table,
    process_running,
    process_start_time,
    ticks_now,
)
from tests.fixtures.probe_client import StatResult
from tests.fixtures.requirements import needs_cgroup2, needs_cgroup_v1_devices, needs_root
from tests.fixtures.sandbox import SandboxFactory, SandboxProbe, SandboxSession

V1 = frozenset({Backend.V1})
V2 = frozenset({Backend.V2})
BOTH = frozenset({Backend.V1, Backend.V2})

BACKEND_SETS = [
    pytest.param(V1, id="v1", marks=needs_cgroup_v1_devices),
    pytest.param(V2, id="v2", marks=needs_cgroup2),
    pytest.param(BOTH, id="v1+v2", marks=[*needs_cgroup_v1_devices, *needs_cgroup2]),
]

BASIC_DEV = {
    "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout", "tty",
    "urandom", "zero",
}  # fmt: skip

DEADLINE = 10.0


def _eventually(condition: Callable[[], bool]) -> bool:
    """Poll ``condition`` until true or :data:`DEADLINE` passes (for asynchronous kernel
    clean-up such as releasing a cgroup's BPF programs)."""
    deadline = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _open_result(path: Path) -> str:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    except OSError as e:
        return errno.errorcode[e.errno or 0]
    return "OK"


# ---- pure parts (no root) ----------------------------------------------------------------


class TestSpec:
    def test_defaults_are_container_defaults_with_no_gpu(self) -> None:
        spec = SandboxSpec(("true",))
        assert spec.rules == CONTAINER_DEFAULTS
        assert spec.backends is None
        assert spec.nvidia_control_nodes is True

    @pytest.mark.parametrize(
        ("fields", "message"),
        [
            pytest.param({"argv": ()}, "argv is empty", id="empty-argv"),
            pytest.param({"name_prefix": "a.b"}, "invalid name prefix", id="dot-in-prefix"),
            pytest.param({"name_prefix": ""}, "invalid name prefix", id="empty-prefix"),
            pytest.param({"cgroup_parent": "/abs"}, "relative path", id="absolute-parent"),
            pytest.param({"cgroup_parent": "a/../b"}, "relative path", id="dotdot-parent"),
            pytest.param({"backends": frozenset()}, "at least one", id="no-backends"),
        ],
    )
    def test_rejects_invalid_fields(self, fields: dict[str, object], message: str) -> None:
        arguments: dict[str, object] = {"argv": ("true",), **fields}
        with pytest.raises(ValueError, match=message):
            SandboxSpec(**arguments)  # type: ignore[arg-type]


class TestRules:
    def test_control_nodes_are_allowed_read_write(self) -> None:
        nodes = [DeviceNode("nvidiactl", CharDevice(NVIDIA_MAJOR, NVIDIACTL_MINOR))]
        rules = effective_rules(CONTAINER_DEFAULTS, nodes)
        assert rules == (*CONTAINER_DEFAULTS, char_device(NVIDIA_MAJOR, NVIDIACTL_MINOR, RW))

    def test_no_nodes_no_extra_rules(self) -> None:
        assert effective_rules(CONTAINER_DEFAULTS, []) == CONTAINER_DEFAULTS


class TestHostBackends:
    @pytest.mark.parametrize(
        ("devices", "unified", "expected"),
        [
            pytest.param(True, True, BOTH, id="hybrid"),
            pytest.param(True, False, V1, id="v1"),
            pytest.param(False, True, V2, id="v2"),
            pytest.param(False, False, frozenset(), id="none"),
        ],
    )
    def test_backends_follow_mounted_hierarchies(
        self, devices: bool, unified: bool, expected: frozenset[Backend]
    ) -> None:
        def mount(path: str) -> cgroups.CgroupMount:
            return cgroups.CgroupMount(Path(path), PurePosixPath("/"))

        hierarchies = cgroups.CgroupHierarchies(
            devices_v1=mount("/sys/fs/cgroup/devices") if devices else None,
            unified=mount("/sys/fs/cgroup/unified") if unified else None,
        )
        assert host_backends(hierarchies) == expected

    def test_missing_hierarchy_is_a_clear_error(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(
            cgroups, "discover", lambda: cgroups.CgroupHierarchies(devices_v1=None, unified=None)
        )
        with pytest.raises(SandboxUnsupportedError, match="no v2 hierarchy mounted"):
            Sandbox.start(SandboxSpec(("true",), backends=V2))


# ---- real sandboxes (root) ---------------------------------------------------------------


@pytest.mark.parametrize("backends", BACKEND_SETS)
class TestConfinement:
    def test_gpu_node_denied_inside_but_allowed_outside(
        self, sandbox_factory: SandboxFactory, backends: frozenset[Backend], tmp_path: Path
    ) -> None:
        probe = sandbox_factory(backends=backends)
        assert probe.mknod("/dev/nvidia0", NVIDIA_MAJOR, 0) == "OK"
        assert probe.stat("/dev/nvidia0").rdev == (NVIDIA_MAJOR, 0)
        assert probe.open("/dev/nvidia0", "rw") == "EPERM"
        assert probe.open("/dev/nvidia0", "r") == "EPERM"

        outside = tmp_path / "nvidia0"
        os.mknod(outside, stat.S_IFCHR | 0o666, os.makedev(NVIDIA_MAJOR, 0))
        assert _open_result(outside) == "ENXIO"

    def test_control_nodes_are_created_and_allowed(
        self,
        sandbox_factory: SandboxFactory,
        backends: frozenset[Backend],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        # Pretend the host has the driver's control node: the sandbox must get it, usable.
        ctl = DeviceNode("nvidiactl", CharDevice(NVIDIA_MAJOR, NVIDIACTL_MINOR))
        monkeypatch.setattr(devnodes, "nvidia_control_devices", lambda: [ctl])
        probe = sandbox_factory(backends=backends)
        assert probe.stat("/dev/nvidiactl") == StatResult(
            "OK", kind="chr", rdev=(NVIDIA_MAJOR, NVIDIACTL_MINOR), mode=0o666
        )
        assert probe.open("/dev/nvidiactl", "rw") == "ENXIO"  # allowed; no driver here
        assert probe.mknod("/dev/nvidia0", NVIDIA_MAJOR, 0) == "OK"
        assert probe.open("/dev/nvidia0", "rw") == "EPERM"  # the GPU itself stays denied

    def test_basic_devices_work(
        self, sandbox_factory: SandboxFactory, backends: frozenset[Backend]
    ) -> None:
        probe = sandbox_factory(backends=backends)
        for node in ("/dev/zero", "/dev/null", "/dev/full", "/dev/random", "/dev/urandom"):
            assert probe.open(node, "rw") == "OK", node
        assert probe.open("/dev/ptmx", "rw") == "OK"
        # Allowed by the cgroup, but the sandbox's new session has no controlling tty.
        assert probe.open("/dev/tty", "rw") == "ENXIO"

    def test_workload_is_in_the_cgroups_from_its_first_instruction(
        self, sandbox_factory: SandboxFactory, backends: frozenset[Backend]
    ) -> None:
        sandbox = sandbox_factory.raw(
            ("cat", "/proc/self/cgroup"), stdout=subprocess.PIPE, backends=backends
        )
        assert sandbox.stdout is not None
        text = sandbox.stdout.read().decode()
        assert sandbox.wait() == 0
        seen = cgroups.parse_proc_cgroup(text)
        hierarchies = cgroups.discover()
        if Backend.V1 in backends:
            assert hierarchies.devices_v1 is not None and seen.devices_v1 is not None
            assert hierarchies.devices_v1.directory_of(seen.devices_v1) == sandbox.cgroups.v1
        if Backend.V2 in backends:
            assert hierarchies.unified is not None and seen.unified is not None
            assert hierarchies.unified.directory_of(seen.unified) == sandbox.cgroups.v2

    def test_stop_leaves_nothing_behind(
        self, sandbox_factory: SandboxFactory, backends: frozenset[Backend]
    ) -> None:
        mounts_before = mount_table()
        probe = sandbox_factory(backends=backends)
        child = probe.spawn(["sleep", "1000"])
        sandbox = probe.sandbox
        # The outer process, the sandbox's init (pid 1 inside), the probe and its child.
        everyone = {sandbox.pid, probe.host_pid(1), probe.workload_pid, child}
        assert set(sandbox.processes()) == everyone
        dirs = sandbox.cgroups.dirs()
        program = sandbox.cgroups.v2_program
        assert (program is not None) == (Backend.V2 in backends)
        start_times = {pid: process_start_time(pid) for pid in everyone}
        recorded_at = ticks_now()

        assert sandbox.stop() == -signal.SIGTERM
        assert sandbox.stopped
        assert None not in start_times.values()
        assert not any(
            process_running(pid, start) for pid, start in start_times.items() if start is not None
        )
        assert not any(directory.exists() for directory in dirs)
        if program is not None:
            assert _eventually(lambda: not bpf_program_loaded(program))
        assert changed_mounts(mounts_before) == []
        assert _eventually(
            lambda: sandbox.mount_ns not in mount_namespaces_in_use(started_by=recorded_at)
        )


@needs_root
class TestMountNamespace:
    def test_has_its_own_mount_namespace(self, sandbox: SandboxProbe) -> None:
        ours = os.stat("/proc/self/ns/mnt").st_ino
        assert sandbox.sandbox.mount_ns != ours
        assert sandbox.sandbox.mount_ns == os.stat(f"/proc/{sandbox.pid}/ns/mnt").st_ino

    def test_dev_holds_only_the_basic_nodes(self, sandbox: SandboxProbe) -> None:
        control = {node.name for node in nvidia_control_devices()}
        assert set(sandbox.listdir("/dev")) == BASIC_DEV | control
        assert sandbox.listdir("/dev/pts") == ["ptmx"]
        assert sandbox.listdir("/dev/shm") == []
        zero = sandbox.stat("/dev/zero")
        assert (zero.kind, zero.rdev, zero.mode) == ("chr", (1, 5), 0o666)
        assert sandbox.stat("/dev/ptmx").kind == "lnk"
        assert sandbox.stat("/dev/vda").result == "ENOENT"

    def test_without_control_nodes_dev_is_basic(self, sandbox_factory: SandboxFactory) -> None:
        probe = sandbox_factory(nvidia_control_nodes=False)
        assert set(probe.listdir("/dev")) == BASIC_DEV

    def test_the_host_does_not_see_the_sandbox_dev(self, sandbox: SandboxProbe) -> None:
        mounts_before = mount_table()
        assert sandbox.mknod("/dev/gpu-hotplug-test-node", 1, 5) == "OK"
        assert sandbox.stat("/dev/gpu-hotplug-test-node").rdev == (1, 5)
        assert not Path("/dev/gpu-hotplug-test-node").exists()
        assert changed_mounts(mounts_before) == []

    def test_the_rest_of_the_filesystem_is_shared(
        self, sandbox: SandboxProbe, tmp_path: Path
    ) -> None:
        (tmp_path / "note").write_text("from the host")
        assert sandbox.read_text(str(tmp_path / "note")) == "from the host"


@needs_root
class TestLifecycle:
    def test_command_gets_env_and_cwd_inside_the_sandbox(
        self, sandbox_factory: SandboxFactory
    ) -> None:
        sandbox = sandbox_factory.raw(
            ("/bin/sh", "-c", 'echo "$GREETING $(pwd)"'),
            stdout=subprocess.PIPE,
            env={"GREETING": "hello", "PATH": os.environ["PATH"]},
            cwd="/dev/shm",  # only exists as the sandbox's own tmpfs
        )
        assert sandbox.stdout is not None
        assert sandbox.stdout.read() == b"hello /dev/shm\n"
        assert sandbox.wait() == 0

    def test_runs_as_the_given_user(self, sandbox_factory: SandboxFactory) -> None:
        sandbox = sandbox_factory.raw(
            ("/bin/sh", "-c", "id -u; id -g; id -G"), stdout=subprocess.PIPE, uid=65534, gid=65534
        )
        assert sandbox.stdout is not None
        out = sandbox.stdout.read().decode()
        assert sandbox.wait() == 0
        assert out.split() == ["65534", "65534", "65534"]

    def test_nonexistent_command_fails_clearly_and_cleans_up(
        self, sandbox_factory: SandboxFactory, sandbox_session: SandboxSession
    ) -> None:
        before = sandbox_session.leftover_cgroups()
        with pytest.raises(SandboxStartError, match="cannot execute '/nonexistent/kernel'") as e:
            sandbox_factory.raw(
                ("/nonexistent/kernel",),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        assert e.value.step == "exec"
        assert e.value.errno == errno.ENOENT
        assert sandbox_session.leftover_cgroups() == before

    def test_bad_cwd_fails_at_chdir(
        self, sandbox_factory: SandboxFactory, sandbox_session: SandboxSession
    ) -> None:
        with pytest.raises(SandboxStartError, match="/nonexistent") as e:
            sandbox_factory.raw(("true",), cwd="/nonexistent")
        assert e.value.step == "chdir"
        assert sandbox_session.leftover_cgroups() == []

    def test_stop_after_the_command_exited(self, sandbox_factory: SandboxFactory) -> None:
        sandbox = sandbox_factory.raw(("true",))
        assert sandbox.wait() == 0
        assert sandbox.stop() == 0
        assert not any(directory.exists() for directory in sandbox.cgroups.dirs())
        assert sandbox.stop() == 0  # idempotent

    def test_stop_kills_what_ignores_sigterm(self, sandbox_factory: SandboxFactory) -> None:
        sandbox = sandbox_factory.raw(
            ("/bin/sh", "-c", "trap '' TERM; echo ready; while :; do sleep 1; done"),
            stdout=subprocess.PIPE,
        )
        assert sandbox.stdout is not None
        assert sandbox.stdout.readline() == b"ready\n"
        assert sandbox.stop(timeout=0.2) == -signal.SIGKILL
        assert sandbox.processes() == []

    def test_context_manager_stops(self, sandbox_session: SandboxSession) -> None:
        spec = sandbox_session.spec(("sleep", "1000"))
        with Sandbox.start(spec) as sandbox:
            sandbox_session.track(sandbox.pid)
            dirs = sandbox.cgroups.dirs()
            assert sandbox.poll() is None
        assert sandbox.stopped
        assert sandbox.returncode == -signal.SIGTERM
        assert not any(directory.exists() for directory in dirs)


_ORPHANING_OWNER = """
import subprocess, sys
from jupyter_gpu_hotplug.linux.sandbox.runtime import Sandbox, SandboxSpec
spec = SandboxSpec(("sleep", "1000"), cgroup_parent=sys.argv[1], name_prefix=sys.argv[2])
sandbox = Sandbox.start(spec, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
print(sandbox.pid, sandbox.name, flush=True)
"""


@needs_root
class TestCleanupStale:
    def test_removes_sandboxes_of_a_dead_owner_only(
        self, sandbox_factory: SandboxFactory, sandbox_session: SandboxSession
    ) -> None:
        mine = sandbox_factory.raw(("sleep", "1000"))
        # A short-lived owner starts a sandbox and exits without stopping it (a crash).
        owner = subprocess.run(
            [sys.executable, "-c", _ORPHANING_OWNER, sandbox_session.cgroup_parent,
             sandbox_session.name_prefix],
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        pid_text, name = owner.stdout.split()
        orphan = int(pid_text)
        sandbox_session.track(orphan)
        orphan_start = process_start_time(orphan)
        assert orphan_start is not None

        removed = cleanup_stale(
            sandbox_session.name_prefix, cgroup_parent=sandbox_session.cgroup_parent
        )

        assert removed == (name,)
        assert not process_running(orphan, orphan_start)
        assert [d.name for d in sandbox_session.leftover_cgroups()] == [mine.name] * len(
            mine.cgroups.dirs()
        )
        assert mine.poll() is None

    def test_nothing_to_do_without_a_parent(self) -> None:
        assert cleanup_stale("never-used-prefix", cgroup_parent="gpu-hotplug-no-such-parent") == ()

    def test_rejects_a_bad_prefix(self) -> None:
        with pytest.raises(ValueError, match="invalid name prefix"):
            cleanup_stale("../x")


@pytest.mark.parametrize("machine", sorted(_sandbox_init.SYSCALL_TABLES))
def test_the_seccomp_filter_refuses_every_listed_call_on_each_architecture(machine: str) -> None:
    """Every refused call has a number on every architecture the filter knows, and the
    program is well formed: the architecture checked first, every jump inside the program,
    every path ending in a return (the kernel refuses anything else at install time)."""
    arch, numbers = _sandbox_init.SYSCALL_TABLES[machine]
    program = _sandbox_init.seccomp_program(machine)

    assert set(_sandbox_init.REFUSED_SYSCALLS) <= set(numbers)
    assert program[:2] == [(0x20, 0, 0, 4), (0x15, 1, 0, arch)]
    assert program[-1] == (0x06, 0, 0, 0x7FFF0000)  # allow what is not refused
    for index, (code, jt, jf, _) in enumerate(program):
        if code & 0x07 == 0x05:  # a conditional jump
            assert index + 1 + max(jt, jf) < len(program)
    refused = {k for code, _, _, k in program if code == 0x15}
    assert {numbers[name] for name in _sandbox_init.REFUSED_SYSCALLS} <= refused


def test_no_seccomp_filter_for_an_unknown_architecture() -> None:
    with pytest.raises(_sandbox_init.SetupError, match="no system call table"):
        _sandbox_init.seccomp_program("sparc64")
