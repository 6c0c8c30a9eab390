"""Local mode serves containers of real engines: podman and containerd, run by runc (and crun
where it can run).

The DockerSpawner case, end to end on the host: the local-mode agent (a subprocess with
simulated GPUs); containers started by podman or containerd with exactly the socket mount and
environment that ``configure_dockerspawner`` gives a user container; a process *inside* the
container that calls the agent over the mounted socket with no token (its identity: the
kernel's peer credentials). What the container can do is the proof: ``/dev/nvidia<minor>``
opens with ENXIO (allowed, no driver behind the simulated number) or fails with EPERM (the
device cgroup denies). A runtime re-applying the container's device rules behind the agent's
back (what runc does on ``systemctl daemon-reload`` with the systemd driver) is re-enacted on
the real cgroups, and the agent's reconciler must give the GPU back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_hotplug.linux import cgroup_v2
from jupyter_gpu_hotplug.linux.devrules import parse_v1_list
from jupyter_gpu_hotplug.spawner import DockerSettings
from tests.agent.agent_process import AgentProcess
from tests.fixtures.requirements import needs_cgroup2, needs_cgroup_v1_devices, needs_root

from .containerd import Containerd, containerd_missing_reason
from .containers import Container, EngineUnavailable
from .podman import Podman, podman_missing_reason

pytestmark = [*needs_root, pytest.mark.slow]

REPLY_TIMEOUT = 60.0
REGRANT_TIMEOUT = 30.0
"""An upper bound for waiting, far above the interval (CI machines are shared)."""
V1_DEVICES = Path("/sys/fs/cgroup/devices")
UNIX_CLIENT_IN_CONTAINER = "/tests/agent/_unix_client.py"

Engine = Podman | Containerd


@pytest.fixture(scope="module", params=["podman-runc", "podman-crun", "containerd-runc"])
def engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    kind, runtime = request.param.split("-")
    missing = podman_missing_reason() if kind == "podman" else containerd_missing_reason()
    if missing is not None:
        pytest.skip(missing)
    root = tmp_path_factory.mktemp(request.param)
    chosen: Engine = Podman(root, runtime=runtime) if kind == "podman" else Containerd(root)
    try:
        chosen.prepare()
    except EngineUnavailable as e:
        # crun refuses hybrid cgroup hosts ("cgroups in hybrid mode not supported"); every
        # other engine must work wherever the suite runs.
        if runtime != "crun" or "hybrid mode not supported" not in str(e):
            raise
        pytest.skip(f"{request.param} cannot run containers on this host: {e}")
    yield chosen
    if isinstance(chosen, Containerd):
        chosen.close()


@pytest.fixture
def start(engine: Engine, agent: AgentProcess) -> Iterator[Any]:
    """Start a user container configured the way ``configure_dockerspawner`` configures it."""
    settings = DockerSettings(host_socket=str(agent.socket_path), runtime=None)

    def started(*, cap_mknod: bool = True) -> Container:
        volumes = {host: bind["bind"] for host, bind in settings.volumes.items()}
        return engine.start_probe(
            volumes=volumes, environment=settings.environment, cap_mknod=cap_mknod
        )

    yield started
    engine.containers.stop_all()


def ask(container: Container, method: str, path: str, body: object = None) -> dict[str, Any]:
    """One request from inside the container over the mounted socket, without a token."""
    socket = container.probe.read_text("/proc/self/environ")
    url = dict(
        item.split("=", 1) for item in socket.split("\0") if item.startswith("GPU_HOTPLUG_")
    )["GPU_HOTPLUG_AGENT_URL"]
    assert url.startswith("unix:")
    out = f"/tmp/reply-{time.monotonic_ns()}.json"
    payload = "-" if body is None else json.dumps(body)
    argv = ["/usr/bin/python3", "-I", "-S", UNIX_CLIENT_IN_CONTAINER, url[len("unix:") :]]
    container.probe.spawn([*argv, method, path, payload, out])
    deadline = time.monotonic() + REPLY_TIMEOUT
    while container.probe.stat(out).result != "OK":
        assert time.monotonic() < deadline, "no answer from the agent inside the container"
        time.sleep(0.05)
    reply: dict[str, Any] = json.loads(container.probe.read_text(out))
    return reply


def attach_from_inside(container: Container) -> dict[str, Any]:
    reply = ask(container, "POST", "/v1/attachments", {"count": 1})
    assert reply["status"] == 201, reply
    (attachment,) = json.loads(reply["body"])["attachments"]
    assert isinstance(attachment, dict)
    return attachment


def wait_until_usable(container: Container, device: str) -> None:
    deadline = time.monotonic() + REGRANT_TIMEOUT
    while container.probe.open(device) != "ENXIO":
        assert time.monotonic() < deadline, f"{device} was not granted again"
        time.sleep(0.05)


def wait_for_log(agent: AgentProcess, text: str) -> None:
    """The agent logs a repair just after making it: the device opens a moment before the
    line is written, so the line is waited for, not read at once."""
    deadline = time.monotonic() + REGRANT_TIMEOUT
    while text not in agent.log():
        assert time.monotonic() < deadline, f"the agent never logged {text!r}:\n{agent.log()}"
        time.sleep(0.05)


def test_attach_from_inside_then_detach(start: Any, agent: AgentProcess) -> None:
    container = start()
    attachment = attach_from_inside(container)
    device = attachment["device"]
    minor = attachment["minor"]
    # The target is the container itself, named by its oldest process on the host.
    assert attachment["target"] == {"pid": container.pid}
    stat = container.probe.stat(device)
    assert (stat.result, stat.kind, stat.rdev) == ("OK", "chr", (195, minor))
    assert container.probe.open(device) == "ENXIO"
    listed = ask(container, "GET", "/v1/attachments")
    assert [a["uuid"] for a in json.loads(listed["body"])["attachments"]] == [attachment["uuid"]]

    detached = ask(container, "DELETE", f"/v1/attachments/{attachment['uuid']}")

    assert detached["status"] == 204, detached
    assert container.probe.stat(device).result == "ENOENT"
    # A node of its own (the container may mknod) is refused by the device cgroup.
    assert container.probe.mknod(device, 195, minor) == "OK"
    assert container.probe.open(device) == "EPERM"


def test_container_needs_no_extra_capability(start: Any, agent: AgentProcess) -> None:
    # Without CAP_MKNOD (podman's default) the agent makes the node from outside all the same.
    container = start(cap_mknod=False)
    assert container.probe.mknod("/dev/test-null", 1, 3) == "EPERM"
    attachment = attach_from_inside(container)
    assert container.probe.open(attachment["device"]) == "ENXIO"
    assert ask(container, "DELETE", f"/v1/attachments/{attachment['uuid']}")["status"] == 204
    assert container.probe.stat(attachment["device"]).result == "ENOENT"


def test_another_container_cannot_act_on_it(start: Any, agent: AgentProcess) -> None:
    owner = start()
    other = start()
    attachment = attach_from_inside(owner)
    uuid = attachment["uuid"]
    query = f"pid={owner.pid}"

    refused = [
        ask(other, "DELETE", f"/v1/attachments/{uuid}"),
        ask(other, "DELETE", f"/v1/attachments?{query}"),
        ask(other, "GET", f"/v1/attachments?{query}"),
        ask(other, "POST", "/v1/attachments", {"count": 1, "target": {"pid": owner.pid}}),
    ]

    assert [reply["status"] for reply in refused] == [403, 403, 403, 403], refused
    assert all(json.loads(reply["body"])["error"] == "forbidden" for reply in refused)
    assert owner.probe.open(attachment["device"]) == "ENXIO"
    # Its own view: nothing attached, and the owner's GPU is no device it may open.
    mine = ask(other, "GET", "/v1/attachments")
    assert json.loads(mine["body"])["attachments"] == []
    device = attachment["device"]
    assert other.probe.stat(device).result == "ENOENT"
    assert other.probe.mknod(device, 195, attachment["minor"]) == "OK"
    assert other.probe.open(device) == "EPERM"


@needs_cgroup_v1_devices
def test_v1_rules_reapplied_by_the_runtime_are_repaired(start: Any, agent: AgentProcess) -> None:
    container = start()
    devices_dir = container.cgroup_dir("devices", V1_DEVICES)
    original = (devices_dir / "devices.list").read_text()
    attachment = attach_from_inside(container)
    device = attachment["device"]
    assert container.probe.open(device) == "ENXIO"

    # What runc's cgroupfs manager writes when it (re)applies a v1 device list: deny all,
    # then allow the container's configured rules again — the hot-attached GPU is not in them.
    (devices_dir / "devices.deny").write_text("a")
    for rule in original.splitlines():
        (devices_dir / "devices.allow").write_text(rule)
    assert container.probe.open(device) == "EPERM"

    wait_until_usable(container, device)
    wait_for_log(agent, "had lost access")
    assert ask(container, "DELETE", f"/v1/attachments/{attachment['uuid']}")["status"] == 204
    assert container.probe.open(device) in ("EPERM", "ENOENT")


@needs_cgroup2
def test_v2_program_replaced_by_the_runtimes_is_repaired(start: Any, agent: AgentProcess) -> None:
    container = start()
    unified = cgroup_v2_mount()
    cgroup = container.cgroup_dir("", unified)
    # The runtime's own device program for the container's configured list (runc builds it
    # from the same rules it writes to v1; default deny), as on a cgroup v2 host.
    rules = parse_v1_list(
        (container.cgroup_dir("devices", V1_DEVICES) / "devices.list").read_text()
    )
    cgroup_v2.attach_device_program(cgroup, rules, name="runc_dev")
    attachment = attach_from_inside(container)
    device = attachment["device"]
    assert container.probe.open(device) == "ENXIO"
    (patched,) = cgroup_v2.attached_programs(cgroup)

    # A runtime re-applying v2 rules: attach a fresh program of its own, detach the old one.
    cgroup_v2.attach_device_program(cgroup, rules, name="runc_dev")
    assert cgroup_v2.detach_program(cgroup, patched.id)
    assert container.probe.open(device) == "EPERM"

    wait_until_usable(container, device)
    wait_for_log(agent, "had lost access")
    assert ask(container, "DELETE", f"/v1/attachments/{attachment['uuid']}")["status"] == 204
    assert container.probe.open(device) in ("EPERM", "ENOENT")


def cgroup_v2_mount() -> Path:
    from tests.linux.cgroup2_support import cgroup2_mount

    mount = cgroup2_mount()
    assert mount is not None
    return mount
