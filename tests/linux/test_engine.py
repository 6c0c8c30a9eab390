"""Tier 2: the hot-plug engine on real sandboxes (cgroup v1, v2 and both; mount namespaces).

Every assertion about access is made from *inside* the sandbox by its probe process,
which keeps running across grant and revoke: ENOENT (no node), ENXIO (node present and
allowed — no NVIDIA driver here answers it), EPERM (the device cgroup denies it).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import NVIDIA_MAJOR
from jupyter_gpu_hotplug.linux import cgroup_v1, cgroup_v2, devnodes
from jupyter_gpu_hotplug.linux.bpf import syscall
from jupyter_gpu_hotplug.linux.devnodes import DeviceNode
from jupyter_gpu_hotplug.linux.devrules import (
    CONTAINER_DEFAULTS,
    Access,
    CharDevice,
    DevType,
)
from jupyter_gpu_hotplug.linux.engine import (
    DeviceBusyError,
    HotplugEngine,
    InjectionError,
    ScanTimedOut,
    TargetGoneError,
)
from jupyter_gpu_hotplug.linux.sandbox.runtime import Backend, host_backends
from tests.fixtures.host_state import process_state
from tests.fixtures.requirements import needs_cgroup_v1_devices, needs_root
from tests.fixtures.sandbox import SandboxFactory, SandboxProbe
from tests.linux.conftest import BACKEND_SETS

pytestmark = needs_root


def gpu(minor: int) -> DeviceNode:
    return DeviceNode(f"nvidia{minor}", CharDevice(NVIDIA_MAJOR, minor))


@pytest.fixture
def engine() -> HotplugEngine:
    # No NVIDIA driver here: no control nodes to add (tests that want them pass some).
    return HotplugEngine(control_nodes=(), terminate_grace=2.0)


@pytest.fixture
def box(sandbox_factory: SandboxFactory, backends: frozenset[Backend]) -> SandboxProbe:
    return sandbox_factory(backends=backends)


@dataclass(frozen=True)
class HostState:
    """Everything a grant may change, for "nothing changed" assertions."""

    v1_list: str | None
    v2_programs: tuple[bytes, ...]
    dev: tuple[str, ...]


def host_state(box: SandboxProbe) -> HostState:
    cg = box.sandbox.cgroups
    v1 = (cg.v1 / "devices.list").read_text() if cg.v1 is not None else None
    programs = []
    if cg.v2 is not None:
        for info in cgroup_v2.attached_programs(cg.v2):
            with syscall.prog_get_fd_by_id(syscall.ProgId(info.id)) as fd:
                programs.append(syscall.prog_info(fd).xlated)
    return HostState(v1, tuple(programs), tuple(sorted(box.listdir("/dev"))))


def test_grant_then_revoke_in_the_same_running_process(
    engine: HotplugEngine, box: SandboxProbe
) -> None:
    before = host_state(box)
    assert box.open("/dev/nvidia3") == "ENOENT"

    result = engine.grant(box.pid, [gpu(3)])

    assert result.nodes_created == ("nvidia3",)
    seen = box.stat("/dev/nvidia3")
    assert (seen.kind, seen.rdev, seen.mode) == ("chr", (NVIDIA_MAJOR, 3), 0o666)
    assert box.open("/dev/nvidia3", "rw") == "ENXIO"  # allowed; no driver behind it
    status = engine.status(result.container, [gpu(3)])
    assert [s.usable for s in status] == [True]

    engine.revoke(box.pid, [gpu(3)])

    assert box.open("/dev/nvidia3") == "ENOENT"
    assert box.mknod("/dev/nvidia3", NVIDIA_MAJOR, 3) == "OK"
    assert box.open("/dev/nvidia3") == "EPERM"
    assert box.unlink("/dev/nvidia3") == "OK"
    assert host_state(box) == before  # v2 programs byte for byte, v1 list, /dev


def test_other_gpus_stay_denied(engine: HotplugEngine, box: SandboxProbe) -> None:
    engine.grant(box.pid, [gpu(1)])
    assert box.mknod("/dev/nvidia2", NVIDIA_MAJOR, 2) == "OK"
    assert box.open("/dev/nvidia2") == "EPERM"
    assert box.open("/dev/nvidia1") == "ENXIO"


def test_nodes_present_names_the_nodes_of_that_number_in_that_process(
    engine: HotplugEngine, box: SandboxProbe
) -> None:
    container = engine.inspect(box.pid)
    asked = [gpu(3), gpu(4)]
    assert engine.nodes_present(box.pid, container.start_time, asked) == frozenset()

    engine.grant(container, [gpu(3)])
    assert box.mknod("/dev/nvidia4", NVIDIA_MAJOR, 5) == "OK"  # its name, another number

    assert engine.nodes_present(box.pid, container.start_time, asked) == {"nvidia3"}
    with pytest.raises(TargetGoneError):  # a newcomer with the target's pid is never read
        engine.nodes_present(box.pid, container.start_time + 1, asked)


@pytest.mark.parametrize(
    ("grant_order", "revoke_order"),
    [
        pytest.param([0, 1, 2], [2, 1, 0], id="lifo"),
        pytest.param([0, 1, 2], [0, 1, 2], id="fifo"),
        pytest.param([2, 0, 1], [1], id="partial"),
        pytest.param([5, 6, 7, 0, 1, 2, 3, 4], [3, 6, 0], id="eight"),
    ],
)
def test_several_gpus_any_order(
    engine: HotplugEngine, box: SandboxProbe, grant_order: list[int], revoke_order: list[int]
) -> None:
    for minor in grant_order:
        engine.grant(box.pid, [gpu(minor)])
    engine.revoke(box.pid, [gpu(m) for m in revoke_order])

    expected = set(grant_order) - set(revoke_order)
    for minor in range(8):
        if minor not in expected:
            box.mknod(f"/dev/nvidia{minor}", NVIDIA_MAJOR, minor)
        assert box.open(f"/dev/nvidia{minor}") == ("ENXIO" if minor in expected else "EPERM"), minor


def test_grant_is_idempotent_and_revoke_of_nothing_is_a_no_op(
    engine: HotplugEngine, box: SandboxProbe
) -> None:
    before = host_state(box)
    engine.revoke(box.pid, [gpu(4)])
    assert host_state(box) == before

    engine.grant(box.pid, [gpu(4)])
    granted = host_state(box)
    again = engine.grant(box.pid, [gpu(4)])
    assert again.nodes_created == ()
    assert again.v2_changes == ()
    assert host_state(box) == granted


@pytest.mark.parametrize(
    "plant",
    [
        pytest.param(("symlink", "/etc/hostname"), id="file-link"),
        pytest.param(("symlink", "/"), id="dir-link"),
        pytest.param(("symlink", "nvidia0"), id="relative-link"),
    ],
)
def test_planted_symlink_fails_cleanly(
    engine: HotplugEngine, box: SandboxProbe, tmp_path: Path, plant: tuple[str, str]
) -> None:
    target = plant[1]
    # Written from the host through the sandbox's root: the test is trusted, the
    # engine must not be fooled by what a hostile workload left there.
    os.symlink(target, f"/proc/{box.pid}/root/dev/nvidia3")
    before = host_state(box)
    host_before = {
        p: (Path(p).stat().st_mode, Path(p).stat().st_mtime_ns) for p in ("/etc/hostname",)
    }

    with pytest.raises(InjectionError, match="nvidia3") as caught:
        engine.grant(box.pid, [gpu(3)])

    assert caught.value.rollback_errors == ()
    assert host_state(box) == before
    assert box.stat("/dev/nvidia3").kind == "lnk"
    assert {
        p: (Path(p).stat().st_mode, Path(p).stat().st_mtime_ns) for p in host_before
    } == host_before
    assert not Path("/nvidia3").exists()


# ---- busy --------------------------------------------------------------------------------

STAND_IN = DeviceNode("nvidia7", CharDevice(1, 8))
"""A device that can really be held open here (/dev/random's numbers), under a GPU's name."""

HOLDER_SCRIPT = """
import os, signal, sys, time
if sys.argv[1] == 'stubborn':
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
fd = os.open('/dev/nvidia7', os.O_RDONLY)
while True:
    time.sleep(3600)
"""


@pytest.fixture
def busy_box(sandbox_factory: SandboxFactory) -> SandboxProbe:
    rules = tuple(
        r for r in CONTAINER_DEFAULTS if r.is_wildcard or not r.covers(DevType.CHAR, 1, 8)
    )
    return sandbox_factory(rules=rules)


def holds_stand_in(pid: int) -> bool:
    """Whether ``pid`` has the stand-in open; a process still starting up opens and closes
    fds while we look, so an fd that vanished between listing and stat just does not count."""
    fd_dir = f"/proc/{pid}/fd"
    rdev = os.makedev(STAND_IN.device.major, STAND_IN.device.minor)
    for fd in os.listdir(fd_dir):
        try:
            if os.stat(f"{fd_dir}/{fd}").st_rdev == rdev:
                return True
        except FileNotFoundError:
            continue
    return False


def spawn_holder(box: SandboxProbe, mode: str) -> int:
    """Start a process in the sandbox that opens the stand-in device and keeps it open."""
    pid = box.spawn([sys.executable, "-I", "-S", "-c", HOLDER_SCRIPT, mode])
    deadline = time.monotonic() + 30
    while not holds_stand_in(pid):
        if time.monotonic() > deadline or process_state(pid) in ("Z", None):
            raise AssertionError(f"holder {pid} never opened the device")
        time.sleep(0.01)
    return pid


def test_revoke_refuses_while_a_process_holds_the_device(
    engine: HotplugEngine, busy_box: SandboxProbe
) -> None:
    assert busy_box.open("/dev/random") == "EPERM"  # denied by default in this sandbox
    engine.grant(busy_box.pid, [STAND_IN])
    assert busy_box.open("/dev/nvidia7") == "OK"
    holder = spawn_holder(busy_box, "polite")
    granted = host_state(busy_box)

    with pytest.raises(DeviceBusyError) as caught:
        engine.revoke(busy_box.pid, [STAND_IN])

    (found,) = caught.value.holders
    assert found.pid == holder
    assert found.comm == Path(f"/proc/{holder}/comm").read_text().strip()
    assert str(holder) in str(caught.value)
    assert host_state(busy_box) == granted  # nothing changed
    assert busy_box.open("/dev/nvidia7") == "OK"


PARKER_SCRIPT = """
import os, signal, socket
fd = os.open('/dev/nvidia7', os.O_RDONLY)
mine, theirs = socket.socketpair()
socket.send_fds(mine, [b'x'], [fd])
os.close(fd)
os.kill(os.getpid(), signal.SIGSTOP)  # parked: the test may look now
"""


def test_revoke_refuses_while_a_process_has_the_device_parked_in_a_socket(
    engine: HotplugEngine, busy_box: SandboxProbe
) -> None:
    """Issue 25, item 8, on a real sandbox: the process sent its fd of the device through a
    unix socket of its own and closed it; it can take it back at any time, so the revoke is
    refused as for an open fd, and nothing changes."""
    engine.grant(busy_box.pid, [STAND_IN])
    parker = busy_box.spawn([sys.executable, "-I", "-S", "-c", PARKER_SCRIPT])
    deadline = time.monotonic() + 30
    while process_state(parker) != "T":
        assert time.monotonic() < deadline and process_state(parker) not in ("Z", None)
        time.sleep(0.01)
    assert not holds_stand_in(parker)
    granted = host_state(busy_box)

    with pytest.raises(DeviceBusyError) as caught:
        engine.revoke(busy_box.pid, [STAND_IN])

    assert [(h.pid, h.fds) for h in caught.value.holders] == [(parker, ())]
    assert caught.value.holders[0].queued != ()
    assert host_state(busy_box) == granted
    assert busy_box.open("/dev/nvidia7") == "OK"


@pytest.mark.parametrize("force", [False, True], ids=["plain", "forced"])
def test_a_busy_scan_past_its_deadline_changes_nothing(busy_box: SandboxProbe, force: bool) -> None:
    """Issue 25: the scan has a deadline; past it the revoke stops, having changed nothing and
    ended no process (not even with force)."""
    engine = HotplugEngine(control_nodes=(), terminate_grace=2.0, busy_scan_seconds=0.0)
    engine.grant(busy_box.pid, [STAND_IN])
    granted = host_state(busy_box)

    with pytest.raises(ScanTimedOut, match=r"looked at 0 of \d+ processes"):
        engine.revoke(busy_box.pid, [STAND_IN], force=force)

    assert host_state(busy_box) == granted
    assert busy_box.open("/dev/nvidia7") == "OK"


@pytest.mark.parametrize("mode", ["polite", "stubborn"])
def test_force_terminates_holders_then_revokes(
    engine: HotplugEngine, busy_box: SandboxProbe, mode: str
) -> None:
    engine.grant(busy_box.pid, [STAND_IN])
    holder = spawn_holder(busy_box, mode)

    result = engine.revoke(busy_box.pid, [STAND_IN], force=True)

    (termination,) = result.terminated
    ended = termination.exited if mode == "polite" else termination.killed
    assert ended == (holder,)
    assert not Path(f"/proc/{holder}/fd").exists() or process_state(holder) == "Z"
    assert busy_box.open("/dev/nvidia7") == "ENOENT"
    assert busy_box.mknod("/dev/nvidia7", 1, 8) == "OK"
    assert busy_box.open("/dev/nvidia7") == "EPERM"


def test_leave_open_takes_the_access_and_ends_nobody(
    engine: HotplugEngine, busy_box: SandboxProbe
) -> None:
    """Issue 21's default for a lost holder: the permission and our node go, the process that
    holds the device keeps its descriptor and lives on."""
    engine.grant(busy_box.pid, [STAND_IN])
    holder = spawn_holder(busy_box, "polite")

    result = engine.revoke(busy_box.pid, [STAND_IN], leave_open=True)

    assert result.terminated == ()
    assert process_state(holder) not in ("Z", None) and holds_stand_in(holder)
    assert busy_box.open("/dev/nvidia7") == "ENOENT"
    assert busy_box.mknod("/dev/nvidia7", 1, 8) == "OK"
    assert busy_box.open("/dev/nvidia7") == "EPERM"


@needs_cgroup_v1_devices  # it reads the v1 list (pure v2: the VM tier)
def test_status_tells_our_grant_from_a_runtimes_rule(
    engine: HotplugEngine, busy_box: SandboxProbe
) -> None:
    """The orphan sweep's question: our v1 entry is exactly ``c M:m rw``; a runtime writes
    ``rwm`` for a device it gives (and a wildcard for all of them)."""
    container = engine.inspect(busy_box.pid)
    assert container.v1_scope is not None, "the busy box is confined by v1 devices"
    engine.grant(busy_box.pid, [STAND_IN])
    (ours,) = engine.status(container, [STAND_IN])
    assert ours.v1_allowed and ours.ours
    engine.revoke(busy_box.pid, [STAND_IN])
    cgroup_v1.grant(container.v1_scope, [STAND_IN.device], access=Access.parse("rwm"))
    (runtimes,) = engine.status(container, [STAND_IN])
    assert runtimes.v1_allowed and not runtimes.ours


def test_status_runs_the_runtimes_own_program_on_v2(
    engine: HotplugEngine, sandbox_factory: SandboxFactory, backends: frozenset[Backend]
) -> None:
    """The stray sweep's question on any host: can the container open the device by its own
    policy, whoever wrote it? On v2 that is every attached program run for the device."""
    given = sandbox_factory(backends=backends)  # the runtime's defaults allow c 1:8
    denied = sandbox_factory(
        backends=backends,
        rules=tuple(
            r for r in CONTAINER_DEFAULTS if r.is_wildcard or not r.covers(DevType.CHAR, 1, 8)
        ),
    )
    (runtimes,) = engine.status(engine.inspect(given.pid), [STAND_IN])
    (nothing,) = engine.status(engine.inspect(denied.pid), [STAND_IN])
    assert given.mknod("/dev/probe", 1, 8) == "OK" and given.open("/dev/probe") == "OK"
    assert runtimes.opens and not runtimes.ours
    assert not nothing.opens and not nothing.ours
    if Backend.V2 in backends:
        assert runtimes.v2_allowed is True and nothing.v2_allowed is False
    engine.grant(denied.pid, [STAND_IN])
    (granted,) = engine.status(engine.inspect(denied.pid), [STAND_IN])
    assert granted.opens and granted.ours


def test_force_may_end_the_target_itself(engine: HotplugEngine, busy_box: SandboxProbe) -> None:
    """The container's main process holds the device: force ends it (and with it the
    sandbox, the target), and the permissions still go (other processes could live on in its
    cgroups)."""
    before = host_state(busy_box)
    engine.grant(busy_box.pid, [STAND_IN])
    assert busy_box.hold("/dev/nvidia7") == "OK"
    workload = busy_box.workload_pid

    result = engine.revoke(busy_box.pid, [STAND_IN], force=True)

    assert result.terminated[0].exited + result.terminated[0].killed == (workload,)
    assert busy_box.sandbox.wait(timeout=30) is not None  # the sandbox ended with it
    cg = busy_box.sandbox.cgroups
    if cg.v1 is not None:
        assert (cg.v1 / "devices.list").read_text() == before.v1_list
    if cg.v2 is not None:
        (info,) = cgroup_v2.attached_programs(cg.v2)
        with syscall.prog_get_fd_by_id(syscall.ProgId(info.id)) as fd:
            assert (syscall.prog_info(fd).xlated,) == before.v2_programs


# ---- failure injection -------------------------------------------------------------------


class Boom(OSError):
    pass


@pytest.fixture
def hybrid_box(sandbox_factory: SandboxFactory) -> SandboxProbe:
    if BACKEND_SETS["hybrid"] - host_backends():
        pytest.skip("failure injection walks every step: needs a hybrid host")
    return sandbox_factory(backends=BACKEND_SETS["hybrid"])


def fail_on_call(monkeypatch: pytest.MonkeyPatch, module: object, name: str, nth: int) -> None:
    real = getattr(module, name)
    calls = {"n": 0}

    def wrapper(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == nth:
            raise Boom(5, f"injected failure in {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)


@pytest.mark.parametrize(
    ("module", "name", "nth"),
    [
        pytest.param(cgroup_v1, "grant", 1, id="v1-grant"),
        pytest.param(cgroup_v2, "grant", 1, id="v2-grant"),
        pytest.param(devnodes, "ensure_node", 1, id="first-node"),
        pytest.param(devnodes, "ensure_node", 2, id="second-node"),
    ],
)
def test_grant_failure_at_each_step_leaves_nothing_changed(
    engine: HotplugEngine,
    hybrid_box: SandboxProbe,
    monkeypatch: pytest.MonkeyPatch,
    module: object,
    name: str,
    nth: int,
) -> None:
    before = host_state(hybrid_box)
    fail_on_call(monkeypatch, module, name, nth)

    with pytest.raises(InjectionError, match="injected failure") as caught:
        engine.grant(hybrid_box.pid, [gpu(0), gpu(1)])

    assert caught.value.rollback_errors == ()
    assert host_state(hybrid_box) == before
    monkeypatch.undo()
    for minor in (0, 1):
        hybrid_box.mknod(f"/dev/nvidia{minor}", NVIDIA_MAJOR, minor)
        assert hybrid_box.open(f"/dev/nvidia{minor}") == "EPERM"


def test_read_only_v1_control_file_rolls_back(
    engine: HotplugEngine, hybrid_box: SandboxProbe, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel itself refuses a write (EPERM: a child asking for more than its parent)."""
    before = host_state(hybrid_box)
    v1 = hybrid_box.sandbox.cgroups.v1
    assert v1 is not None
    (v1 / "inner").mkdir()
    try:
        # The inner cgroup's devices.allow refuses the write, as a read-only file would.
        real = cgroup_v1.CgroupFS.write

        def refuse_inner(files: cgroup_v1.CgroupFS, path: Path, data: str) -> None:
            if path.parent.name == "inner":
                raise PermissionError(1, "Operation not permitted")
            real(files, path, data)

        monkeypatch.setattr(cgroup_v1.CgroupFS, "write", refuse_inner)
        with pytest.raises(InjectionError, match="inner"):
            engine.grant(hybrid_box.pid, [gpu(2)])
        monkeypatch.undo()
        assert host_state(hybrid_box) == before
    finally:
        (v1 / "inner").rmdir()


def test_revoke_failure_grants_back(
    engine: HotplugEngine, hybrid_box: SandboxProbe, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.grant(hybrid_box.pid, [gpu(0)])
    granted = host_state(hybrid_box)
    fail_on_call(monkeypatch, cgroup_v1, "revoke", 1)

    with pytest.raises(InjectionError, match="injected failure"):
        engine.revoke(hybrid_box.pid, [gpu(0)])

    assert host_state(hybrid_box) == granted
    assert hybrid_box.open("/dev/nvidia0") == "ENXIO"


def test_vanished_target(engine: HotplugEngine, hybrid_box: SandboxProbe) -> None:
    container = engine.inspect(hybrid_box.pid)
    hybrid_box.sandbox.stop()
    with pytest.raises(TargetGoneError):
        engine.grant(container, [gpu(0)])
    with pytest.raises(TargetGoneError):
        engine.grant(hybrid_box.pid, [gpu(0)])


def test_target_dies_between_cgroups_and_nodes(
    engine: HotplugEngine, hybrid_box: SandboxProbe, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_grant = cgroup_v2.grant
    sandbox = hybrid_box.sandbox

    def grant_then_die(directory: Path, rules: object, **options: object) -> object:
        change = real_grant(directory, rules, **options)  # type: ignore[arg-type]
        sandbox.stop()
        return change

    monkeypatch.setattr(cgroup_v2, "grant", grant_then_die)
    with pytest.raises((TargetGoneError, InjectionError)):
        engine.grant(hybrid_box.pid, [gpu(0)])


# ---- control nodes -----------------------------------------------------------------------


def test_missing_control_nodes_are_added_and_kept(
    sandbox_factory: SandboxFactory,
) -> None:
    control = (DeviceNode("nvidiactl", CharDevice(NVIDIA_MAJOR, 255)),)
    engine = HotplugEngine(control_nodes=control)
    box = sandbox_factory()
    assert box.open("/dev/nvidiactl") == "ENOENT"

    result = engine.grant(box.pid, [gpu(0)])
    assert set(result.nodes_created) == {"nvidia0", "nvidiactl"}
    assert box.open("/dev/nvidiactl") == "ENXIO"

    again = engine.grant(box.pid, [gpu(1)])
    assert "nvidiactl" not in again.nodes_created

    engine.revoke(box.pid, [gpu(0), gpu(1)])
    assert box.open("/dev/nvidia0") == "ENOENT"
    assert box.stat("/dev/nvidiactl").rdev == (NVIDIA_MAJOR, 255)


@pytest.fixture
def unconfined_v1_box(sandbox_factory: SandboxFactory) -> Iterator[SandboxProbe]:
    if Backend.V1 not in host_backends():
        pytest.skip("needs the v1 devices controller")
    yield sandbox_factory(
        backends=frozenset({Backend.V2}) if Backend.V2 in host_backends() else None
    )


def test_root_v1_cgroup_is_never_written(
    engine: HotplugEngine, unconfined_v1_box: SandboxProbe
) -> None:
    """A v2-only sandbox on a hybrid host sits in the v1 root cgroup: a deny written there
    would hit the whole host, so the engine must leave v1 alone."""
    container = engine.inspect(unconfined_v1_box.pid)
    assert container.v1_scope is None
    root_list = Path("/sys/fs/cgroup/devices/devices.list").read_text()
    engine.grant(container, [gpu(0)])
    engine.revoke(container, [gpu(0)])
    assert Path("/sys/fs/cgroup/devices/devices.list").read_text() == root_list
