"""Hot-plugged GPUs survive systemd on the production-default node (runs inside the VM).

The node: systemd as pid 1, pure cgroup v2, containerd (CRI) with runc and podman with crun,
both with the systemd cgroup driver — every container is a systemd scope whose device policy
systemd re-applies on ``daemon-reload``, ``daemon-reexec``, any ``set-property`` and a
runtime's ``update``. A local-mode agent with simulated GPUs attaches one to a running
container; after each of those events the container must still open the GPU (ENXIO: allowed,
no driver), and after detach it must not (EPERM), with the unit's ``DeviceAllow=`` list back
to exactly what the runtime set.

The agent reconciles every few seconds; the trigger test checks that it never had to restore
a grant (the unit record alone kept them — a reconciler could otherwise hide the bug), the
reconcile tests that it restores one taken away behind its back within an interval.
Checks poll for state: after a trigger, for systemd's re-attached program (``bpftool``, not
our own code), then open once.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest

from jupyter_gpu_hotplug._structs import PidRef
from jupyter_gpu_hotplug.client.models import Attachment
from jupyter_gpu_hotplug.linux import cgroup_v2
from jupyter_gpu_hotplug.linux.bpf.syscall import ProgId
from jupyter_gpu_hotplug.linux.devnodes import DeviceNode
from jupyter_gpu_hotplug.linux.devrules import CONTAINER_DEFAULTS, CharDevice
from jupyter_gpu_hotplug.linux.engine import HotplugEngine
from jupyter_gpu_hotplug.nvml.sim import ensure_fake_nvml
from tests.fixtures.agent import LocalAgent, LocalAgentFactory
from tests.k8s import cri

from .workloads import (
    CriPod,
    PodmanContainer,
    Workload,
    open_in,
    prepare_cri,
    prepare_podman,
    sh,
    unit_of,
)

pytestmark = [pytest.mark.vm]

NVIDIA_MAJOR: Final = 195
REATTACH_TIMEOUT: Final = 60.0
"""systemd re-attaches within the trigger's own call on 252 (seconds later on 257)."""
REGRANT_TIMEOUT: Final = 120.0
"""Far above the reconcile interval: a loaded host emulates the VM slowly."""
RECONCILE_INTERVAL: Final = 2.0
AGENT_START_TIMEOUT: Final = 300.0
"""An agent's Python start-up alone takes tens of seconds under emulation on a busy host."""
RUNTIME_DEVICES: Final = "exec 3<>/dev/null 4</dev/zero 5</dev/urandom 6<>/dev/ptmx 7<>/dev/full"
"""Devices every OCI runtime allows a container: they must keep working throughout."""

Trigger = Callable[[str, Workload], object]
TRIGGERS: Final[list[tuple[str, Trigger, bool]]] = [
    # (what, how, once per container (True) or once for the node)
    ("daemon-reload 1", lambda unit, w: sh("systemctl", "daemon-reload"), False),
    ("daemon-reload 2", lambda unit, w: sh("systemctl", "daemon-reload"), False),
    ("daemon-reload 3", lambda unit, w: sh("systemctl", "daemon-reload"), False),
    ("daemon-reexec", lambda unit, w: sh("systemctl", "daemon-reexec"), False),
    (
        "set-property CPUWeight=50",
        lambda unit, w: sh("systemctl", "set-property", "--runtime", unit, "CPUWeight=50"),
        True,
    ),
    ("runtime update --memory", lambda unit, w: w.runtime_update(), True),
]

ENGINES: Final = {
    "containerd-cri-system.slice": "system.slice",
    "containerd-cri-kubepods.slice": "kubepods-besteffort-pod{uid}.slice",
    "podman-crun": None,
}


@dataclass
class Node:
    cri: cri.CriClient

    def start(self, engine: str) -> Workload:
        parent = ENGINES[engine]
        if parent is None:
            return PodmanContainer().start()
        return CriPod(self.cri, parent).start()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    directory = tmp_path_factory.mktemp("images")
    client = prepare_cri(directory)
    prepare_podman(directory)
    yield Node(client)
    client.close()


@pytest.fixture(scope="module", autouse=True)
def fake_nvml() -> Path:
    """The simulated NVML, compiled before any agent starts: under emulation the compiler
    takes longer than an agent may take to answer."""
    return ensure_fake_nvml()


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalAgent]:
    """One agent for the module, reconciling every few seconds: the trigger test checks that
    it never had to (the unit record alone kept the grants), the reconcile tests that it
    did."""
    factory = LocalAgentFactory(tmp_path_factory.mktemp("agent"), start_timeout=AGENT_START_TIMEOUT)
    try:
        yield factory(simulate=len(ENGINES), args=[f"--reconcile-interval={RECONCILE_INTERVAL}"])
    finally:
        factory.stop_all()


@pytest.fixture
def workload(request: pytest.FixtureRequest, node: Node) -> Iterator[Workload]:
    """One container of the engine named by the test's parameter."""
    started = node.start(request.param)
    yield started
    started.remove()


# ---- what the node says, read with its own tools -------------------------------------------


def device_allow(unit: str) -> list[str]:
    """``systemctl show -p DeviceAllow``: one ``PATH ACCESS`` per entry."""
    out = sh("systemctl", "show", "--property=DeviceAllow", unit)
    return [
        line.removeprefix("DeviceAllow=")
        for line in out.splitlines()
        if line.strip() != "DeviceAllow="
    ]


def device_policy(unit: str) -> str:
    return sh("systemctl", "show", "--property=DevicePolicy", "--value", unit).strip()


def programs(scope: Path) -> list[tuple[int, str]]:
    """Device programs at the scope, from ``bpftool cgroup show``."""
    out = json.loads(sh("bpftool", "--json", "cgroup", "show", str(scope)).strip() or "[]")
    return [(p["id"], p.get("name", "")) for p in out if p["attach_type"] == "cgroup_device"]


def wait_for_systemd(scope: Path, before: list[tuple[int, str]], what: str) -> None:
    """Until systemd has re-applied the unit's device policy (its program is new)."""
    old = {pid for pid, name in before if name == "sd_devices"}
    deadline = time.monotonic() + REATTACH_TIMEOUT
    while True:
        now = programs(scope)
        fresh = [pid for pid, name in now if name == "sd_devices" and pid not in old]
        if fresh and not old & {pid for pid, _ in now}:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"systemd did not re-apply its device program after {what}: {now}")
        time.sleep(0.1)


def mknod_inside(workload: Workload, path: str, minor: int) -> None:
    """A node made from outside (the container may lack CAP_MKNOD; mknod is judged by the
    caller's cgroup, so only opening it inside tests the container's)."""
    sh("nsenter", "-t", str(workload.pid), "-m", "--", "/bin/busybox", "mknod", "-m", "666",
       path, "c", str(NVIDIA_MAJOR), str(minor))  # fmt: skip


def runtime_devices_work(workload: Workload) -> bool:
    status, output = workload.exec(["/bin/sh", "-c", RUNTIME_DEVICES])
    assert status == 0, output
    return True


def attach(agent: LocalAgent, pid: int) -> Attachment:
    (attachment,) = agent.client().attach(1, target=PidRef(pid))
    return attachment


def regranted_count(agent: LocalAgent) -> float:
    # /metrics answers only an API caller (issue 31): the agent's token, as the tests hold it.
    scrape = urllib.request.Request(
        f"{agent.tcp_url}/metrics", headers={"Authorization": f"Bearer {agent.token}"}
    )
    with urllib.request.urlopen(scrape, timeout=30) as reply:
        text = reply.read().decode()
    pattern = r'^gpu_hotplug_reconcile_actions_total\{action="regranted"\} (\S+)$'
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


# ---- the acceptance ------------------------------------------------------------------------


@dataclass
class Attached:
    """One engine's container with a GPU, and what its unit held before."""

    engine: str
    workload: Workload
    unit: str
    scope: Path
    runtime_list: list[str]
    restricted: bool
    attachment: Attachment


@pytest.fixture
def every_engine(node: Node) -> Iterator[dict[str, Workload]]:
    started: dict[str, Workload] = {}
    try:
        for engine in ENGINES:
            started[engine] = node.start(engine)
        yield started
    finally:
        for workload in started.values():
            workload.remove()


def test_a_grant_survives_everything_systemd_does(
    every_engine: dict[str, Workload], agent: LocalAgent
) -> None:
    # The three engines' containers go through each trigger together (a reload is slow
    # under emulation); every check names the engine.
    attached = []
    regrants = regranted_count(agent)
    for engine, workload in every_engine.items():
        unit, scope = unit_of(workload.pid)
        runtime_list = device_allow(unit)
        restricted = device_policy(unit) in ("strict", "closed") or bool(runtime_list)
        assert runtime_devices_work(workload), engine
        attachment = attach(agent, workload.pid)
        assert open_in(workload, attachment.device) == "ENXIO", engine
        if restricted:
            entry = f"/dev/char/{NVIDIA_MAJOR}:{attachment.minor} rw"
            assert entry in device_allow(unit), engine
        attached.append(
            Attached(engine, workload, unit, scope, runtime_list, restricted, attachment)
        )

    for what, trigger, each in TRIGGERS:
        before = {a.engine: programs(a.scope) for a in attached}
        for a in attached if each else attached[:1]:
            trigger(a.unit, a.workload)
        for a in attached:
            if a.restricted:
                wait_for_systemd(a.scope, before[a.engine], f"{what} ({a.engine})")
            verdict = open_in(a.workload, a.attachment.device)
            assert verdict == "ENXIO", f"{a.engine}: access lost after {what}: {programs(a.scope)}"
            assert runtime_devices_work(a.workload), a.engine

    assert regranted_count(agent) == regrants, "the reconciler had to restore a grant"
    for a in attached:
        agent.client().detach(a.attachment.uuid)
        assert open_in(a.workload, a.attachment.device) == "ENOENT", a.engine
        mknod_inside(a.workload, a.attachment.device, a.attachment.minor)
        assert open_in(a.workload, a.attachment.device) == "EPERM", a.engine
        # Nothing of ours left, nothing of the runtime's lost.
        assert device_allow(a.unit) == a.runtime_list, a.engine
        assert runtime_devices_work(a.workload), a.engine
    sh("systemctl", "daemon-reload")
    for a in attached:
        assert open_in(a.workload, a.attachment.device) == "EPERM", a.engine
        assert runtime_devices_work(a.workload), a.engine


@pytest.mark.parametrize("workload", ["containerd-cri-system.slice"], indirect=True)
def test_without_the_unit_record_a_reload_takes_the_grant_away(workload: Workload) -> None:
    # The bug itself, with an engine that patches the eBPF program only: what every hot-plug
    # tool that does not tell systemd gets. It shows that the test above can fail.
    _, scope = unit_of(workload.pid)
    engine = HotplugEngine(systemd=None, control_nodes=())
    gpu = DeviceNode("nvidia1", CharDevice(NVIDIA_MAJOR, 1))
    engine.grant(workload.pid, [gpu])
    assert open_in(workload, "/dev/nvidia1") == "ENXIO"
    before = programs(scope)

    sh("systemctl", "daemon-reload")
    wait_for_systemd(scope, before, "daemon-reload")

    assert open_in(workload, "/dev/nvidia1") == "EPERM"
    engine.revoke(workload.pid, [gpu])


@pytest.mark.parametrize("workload", ["containerd-cri-kubepods.slice"], indirect=True)
def test_a_program_replaced_by_hand_is_restored_within_an_interval(
    workload: Workload, agent: LocalAgent
) -> None:
    _, scope = unit_of(workload.pid)
    attachment = attach(agent, workload.pid)
    device = attachment.device
    assert open_in(workload, device) == "ENXIO"
    counted = regranted_count(agent)
    ours = [pid for pid, name in programs(scope) if name != "sd_devices"]

    # The runtime's policy, attached afresh in place of the program that carries our grant.
    # (The reconciler may restore it before a probe could see EPERM: its counter tells.)
    cgroup_v2.attach_device_program(scope, list(CONTAINER_DEFAULTS), name="by_hand")
    for prog_id in ours:
        assert cgroup_v2.detach_program(scope, ProgId(prog_id))

    wait_until(lambda: regranted_count(agent) > counted, "the reconciler restores the grant")
    assert open_in(workload, device) == "ENXIO"
    assert "had lost access" in agent.log()
    agent.client().detach(attachment.uuid)


@pytest.mark.parametrize("workload", ["containerd-cri-system.slice"], indirect=True)
def test_a_unit_list_reset_by_hand_is_restored_within_an_interval(
    workload: Workload, agent: LocalAgent
) -> None:
    # systemd re-attaching a program built from a list without our entry: a lost grant like
    # any other, restored by the reconciler.
    unit, scope = unit_of(workload.pid)
    runtime_list = device_allow(unit)
    attachment = attach(agent, workload.pid)
    device = attachment.device
    counted = regranted_count(agent)
    before = programs(scope)

    sh("systemctl", "set-property", "--runtime", unit, "DeviceAllow=",
       *(f"DeviceAllow={entry}" for entry in runtime_list))  # fmt: skip
    wait_for_systemd(scope, before, "the DeviceAllow reset")

    wait_until(lambda: regranted_count(agent) > counted, "the reconciler restores the grant")
    assert open_in(workload, device) == "ENXIO"
    assert f"/dev/char/{NVIDIA_MAJOR}:{attachment.minor} rw" in device_allow(unit)
    agent.client().detach(attachment.uuid)
    assert device_allow(unit) == runtime_list


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + REGRANT_TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        time.sleep(0.2)


def test_the_node_is_the_production_default() -> None:
    assert Path("/proc/1/comm").read_text().strip() == "systemd"
    assert sh("stat", "-fc", "%T", "/sys/fs/cgroup").strip() == "cgroup2fs"
    assert "SystemdCgroup = true" in Path("/etc/containerd/config.toml").read_text()
    assert subprocess.run(["crun", "--version"], capture_output=True, check=False).returncode == 0
