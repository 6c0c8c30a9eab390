"""MIG access: the driver's capability tables (tier 1) and granting slices to sandboxes (tier 2).

The tables are test files: a ``/proc/devices`` that registers ``nvidia-caps`` at a major no
driver of this host owns, and a ``mig-minors`` file written by the simulator for a GPU with
two 1g slices. Opening a node of that major gives ENXIO where the device cgroup allows it and
EPERM where it denies it, exactly like the GPU's own ``c 195:N`` — so each sandbox's view of
its slice is proven from inside it, with no GPU and no NVIDIA driver.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import NVIDIA_MAJOR
from jupyter_gpu_hotplug.linux import devnodes
from jupyter_gpu_hotplug.linux.devnodes import DeviceNode
from jupyter_gpu_hotplug.linux.devrules import CharDevice
from jupyter_gpu_hotplug.linux.engine import HotplugEngine
from jupyter_gpu_hotplug.linux.mig import (
    CAPS_NODE_MODE,
    MigAccess,
    MigCaps,
    MigCapsError,
    caps_major,
    parse_mig_minors,
    read_mig_minors,
    revoke_nodes,
)
from jupyter_gpu_hotplug.linux.sandbox.runtime import Backend
from jupyter_gpu_hotplug.nvml.sim import (
    FakeNvmlConfig,
    default_gpus,
    render_mig_minors,
    with_mig_devices,
)
from tests.fixtures.requirements import needs_root
from tests.fixtures.sandbox import SandboxFactory, SandboxProbe

LOCAL_MAJORS = range(240, 255)
"""Char majors Linux reserves for local and experimental use: no driver here registers one."""
NVIDIACTL = DeviceNode("nvidiactl", CharDevice(NVIDIA_MAJOR, 255))


def free_major() -> int:
    """A char major that this host's ``/proc/devices`` does not list (the simulated
    ``nvidia-caps`` major: opening such a node can only give ENXIO or EPERM)."""
    taken = set(devnodes.parse_proc_devices(Path("/proc/devices").read_text()).values())
    return next(major for major in LOCAL_MAJORS if major not in taken)


def node_config() -> FakeNvmlConfig:
    """GPU 0 (minor 0) in MIG mode with two 1g.10gb slices (GPU instances 1 and 2)."""
    first, second = default_gpus(2)
    return FakeNvmlConfig(gpus=(with_mig_devices(first, ["1g.10gb", "1g.10gb"]), second))


@pytest.fixture
def host_tables(tmp_path: Path) -> tuple[Path, Path]:
    """A simulated ``/proc/devices`` and ``mig-minors`` (paths, as the agent would get them)."""
    proc_devices = tmp_path / "devices"
    proc_devices.write_text(
        "Character devices:\n  1 mem\n195 nvidia-frontend\n"
        f"{free_major()} nvidia-caps\n\nBlock devices:\n  8 sd\n"
    )
    mig_minors = tmp_path / "mig-minors"
    mig_minors.write_text(render_mig_minors(node_config()))
    return proc_devices, mig_minors


@pytest.fixture
def caps(host_tables: tuple[Path, Path]) -> MigCaps:
    proc_devices, mig_minors = host_tables
    return MigCaps.read(proc_devices=proc_devices, mig_minors=mig_minors)


GPU0 = DeviceNode("nvidia0", CharDevice(NVIDIA_MAJOR, 0))


def slice_access(caps: MigCaps, gpu_instance_id: int) -> MigAccess:
    return caps.access(GPU0, gpu_instance_id=gpu_instance_id, compute_instance_id=0)


# ---- tier 1: the tables ---------------------------------------------------------------------


class TestTables:
    def test_minors_file(self) -> None:
        minors = parse_mig_minors(
            "config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\n"
            "gpu3/gi12/ci7/access 4711\n\nfabric-mgmt 9\n"
        )
        assert (minors.config, minors.monitor) == (1, 2)
        assert minors.gpu_instances == {(0, 0): 3}
        assert minors.compute_instances == {(0, 0, 0): 4, (3, 12, 7): 4711}

    @pytest.mark.parametrize(
        "line", ["config", "config one", "gpu0/gi0/access 3 4", "monitor -2", "config 1048576"]
    )
    def test_malformed_line_is_an_error(self, line: str) -> None:
        with pytest.raises(MigCapsError, match=r"mig-minors:2: expected '<capability> <minor>'"):
            parse_mig_minors(f"config 1\n{line}\n")

    def test_simulated_node_tables(self, caps: MigCaps, host_tables: tuple[Path, Path]) -> None:
        first, second = node_config().gpus[0].mig_devices
        assert caps.major == free_major()
        access = slice_access(caps, 2)
        assert access.nodes == (
            DeviceNode("nvidia0", CharDevice(NVIDIA_MAJOR, 0)),
            DeviceNode(
                f"nvidia-caps/nvidia-cap{second.gi_access_minor}",
                CharDevice(caps.major, second.gi_access_minor),
                mode=CAPS_NODE_MODE,
            ),
            DeviceNode(
                f"nvidia-caps/nvidia-cap{second.ci_access_minor}",
                CharDevice(caps.major, second.ci_access_minor),
                mode=CAPS_NODE_MODE,
            ),
        )
        for node in access.nodes:
            devnodes.validate_name(node.name)  # names the node module accepts
        assert slice_access(caps, 1).gpu_instance.device.minor == first.gi_access_minor

    def test_unknown_instance(self, caps: MigCaps) -> None:
        with pytest.raises(MigCapsError, match="no capability for gpu1/gi1/ci0"):
            caps.access(
                DeviceNode("nvidia1", CharDevice(NVIDIA_MAJOR, 1)),
                gpu_instance_id=1,
                compute_instance_id=0,
            )

    def test_missing_tables(self, tmp_path: Path) -> None:
        (tmp_path / "devices").write_text("Character devices:\n195 nvidia-frontend\n")
        with pytest.raises(MigCapsError, match="no nvidia-caps driver"):
            caps_major(tmp_path / "devices")
        with pytest.raises(MigCapsError, match="cannot read"):
            caps_major(tmp_path / "absent")
        with pytest.raises(MigCapsError, match=r"cannot read .*mig-minors"):
            read_mig_minors(tmp_path / "mig-minors")

    def test_revoke_keeps_what_other_slices_need(self, caps: MigCaps) -> None:
        one, two = slice_access(caps, 1), slice_access(caps, 2)
        assert revoke_nodes(one.nodes, keeping=()) == one.nodes
        assert revoke_nodes(one.nodes, keeping=two.nodes) == (
            one.gpu_instance,
            one.compute_instance,
        )


# ---- tier 2: real sandboxes -----------------------------------------------------------------


@pytest.fixture
def engine() -> HotplugEngine:
    # nvidiactl comes with the first grant, as the agent's engine adds the host's control nodes.
    return HotplugEngine(control_nodes=(NVIDIACTL,), terminate_grace=2.0)


def box_for(factory: SandboxFactory, backends: frozenset[Backend]) -> SandboxProbe:
    # No control nodes from the host (it has no NVIDIA driver): the engine brings nvidiactl.
    return factory(backends=backends, nvidia_control_nodes=False)


def sees(box: SandboxProbe, node: DeviceNode) -> str:
    """What opening ``node`` gives inside ``box`` — made first if absent, so that the answer
    is the device cgroup's (ENXIO: allowed, EPERM: denied), not a missing file's."""
    path = f"/dev/{node.name}"
    if box.open(path) == "ENOENT":
        assert box.mknod(path, node.device.major, node.device.minor) == "OK"
        answer = box.open(path)
        assert box.unlink(path) == "OK"
        return answer
    return box.open(path)


@needs_root
def test_two_sandboxes_each_see_only_their_own_slice(
    engine: HotplugEngine,
    sandbox_factory: SandboxFactory,
    backends: frozenset[Backend],
    caps: MigCaps,
) -> None:
    first_box, second_box = box_for(sandbox_factory, backends), box_for(sandbox_factory, backends)
    first, second = slice_access(caps, 1), slice_access(caps, 2)

    first_grant = engine.grant(first_box.pid, first.nodes)
    engine.grant(second_box.pid, second.nodes)

    assert first_grant.nodes_created == (
        "nvidia0",
        first.gpu_instance.name,
        first.compute_instance.name,
        "nvidiactl",
    )
    for box, own, other in ((first_box, first, second), (second_box, second, first)):
        for node in (NVIDIACTL, *own.nodes):
            assert box.open(f"/dev/{node.name}", "r") == "ENXIO", node  # there and allowed
        caps_node = box.stat(f"/dev/{own.gpu_instance.name}")
        assert (caps_node.kind, caps_node.rdev, caps_node.mode) == (
            "chr",
            (caps.major, own.gpu_instance.device.minor),
            CAPS_NODE_MODE,
        )
        assert box.stat("/dev/nvidia-caps").mode == 0o755
        listed = sorted(box.listdir("/dev/nvidia-caps"))
        assert listed == sorted(n.name.split("/")[1] for n in own.nodes[1:])
        for node in (other.gpu_instance, other.compute_instance):
            assert sees(box, node) == "EPERM", node  # the other slice: denied, not just absent

    engine.revoke(first_box.pid, revoke_nodes(first.nodes, keeping=()))

    for node in first.nodes:
        assert first_box.open(f"/dev/{node.name}") == "ENOENT"
        assert sees(first_box, node) == "EPERM", node
    for node in (NVIDIACTL, *second.nodes):
        assert second_box.open(f"/dev/{node.name}") == "ENXIO", node  # untouched


@needs_root
def test_detaching_one_of_two_slices_of_a_gpu_keeps_the_other(
    engine: HotplugEngine, sandbox: SandboxProbe, caps: MigCaps
) -> None:
    one, two = slice_access(caps, 1), slice_access(caps, 2)
    engine.grant(sandbox.pid, one.nodes)
    engine.grant(sandbox.pid, two.nodes)

    result = engine.revoke(sandbox.pid, revoke_nodes(one.nodes, keeping=two.nodes))

    assert result.nodes_removed == (one.gpu_instance.name, one.compute_instance.name)
    for node in two.nodes:
        assert sandbox.open(f"/dev/{node.name}") == "ENXIO", node
    for node in (one.gpu_instance, one.compute_instance):
        assert sees(sandbox, node) == "EPERM", node

    engine.revoke(sandbox.pid, revoke_nodes(two.nodes, keeping=()))

    for node in two.nodes:
        assert sees(sandbox, node) == "EPERM", node
