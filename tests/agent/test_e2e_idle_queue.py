"""Issue 11 end to end in local mode: GPUs that come back by themselves, a fair queue, MIG slices.

The agent runs as a real process (``--simulate 4``), the kernels are sandboxes (fresh device
cgroups, private ``/dev``), and the API is spoken over TCP with the agent's token, its answers
checked against ``openapi.json``. Whether a sandbox can use a GPU is asked from inside it:
ENXIO (allowed; no driver behind the number), EPERM (denied).

"Holds the device open" is what NVML reports: a process listed as running on the GPU, which is
how the real driver shows a CUDA context (the fake NVML's config lists the kernel's pid there;
a ``c 195:N`` node cannot really be opened on a machine without the driver). Simulated readings
do not move (``--AgentApp.simulation_interval=0``), so a GPU nobody uses shows 0 % utilisation.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_hotplug.agent.local.simulate import CONFIG_NAME
from jupyter_gpu_hotplug.nvml.sim import SimulatedProcess, read_config, write_config
from tests.fixtures.mig import caps_nodes
from tests.fixtures.requirements import needs_root
from tests.fixtures.sandbox import SandboxFactory, SandboxProbe

from .agent_process import AgentProcess
from .api_harness import ApiClient, Response

pytestmark = [*needs_root, pytest.mark.slow]

DEADLINE = 60.0
"""Seconds a background effect may take on a loaded machine; an upper bound, never asserted."""


def poll(check: Callable[[], Any], what: str, agent: AgentProcess) -> Any:
    """``check()`` until it returns something truthy; fail after ``DEADLINE``."""
    deadline = time.monotonic() + DEADLINE
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting until {what}:\n{agent.log()}"
        time.sleep(0.05)
    return found


def tcp(agent: AgentProcess) -> ApiClient:
    assert agent.tcp is not None
    return agent.tcp


def opens(probe: SandboxProbe, minor: int) -> str:
    """What opening ``/dev/nvidia<minor>`` gives inside ``probe`` (see ``opens_node``)."""
    return opens_node(probe, f"/dev/nvidia{minor}", 195, minor)


def opens_node(probe: SandboxProbe, path: str, major: int, minor: int) -> str:
    """What opening ``path`` gives inside ``probe``: the cgroup's answer, with a node made
    first if the agent made none (and removed again: it is not the agent's)."""
    made = probe.stat(path).result == "ENOENT"
    if made:
        assert probe.mknod(path, major, minor) == "OK"
    result = probe.open(path)
    if made:
        assert probe.unlink(path) == "OK"
    return result


def attachments(agent: AgentProcess, probe: SandboxProbe) -> list[dict[str, Any]]:
    listed = tcp(agent).get(f"/v1/attachments?pid={probe.pid}")
    assert listed.status == 200, listed.body
    result: list[dict[str, Any]] = listed.json()["attachments"]
    return result


def metric(agent: AgentProcess, line_start: str) -> float:
    text = tcp(agent).get("/metrics").body.decode()
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    return 0.0


# --- GPUs that come back by themselves -----------------------------------------------------------


@pytest.fixture
def idle_agent(tmp_path: Path) -> Iterator[AgentProcess]:
    process = AgentProcess(
        tmp_path / "state",
        simulate=4,
        extra_args=[
            "--reconcile-interval=0",
            "--idle-release=3",
            "--idle-warning=2",
            "--AgentApp.idle_check_interval=0.2",
            "--AgentApp.simulation_interval=0",
        ],
    )
    process.start()
    try:
        yield process
    finally:
        process.kill9()


def hold_in_nvml(agent: AgentProcess, minor: int, pid: int) -> None:
    """Make NVML list ``pid`` as running on the GPU with ``minor`` (what a CUDA context does)."""
    path = agent.state_dir / "simulation" / CONFIG_NAME
    config = read_config(path)
    write_config(
        path,
        dataclasses.replace(
            config,
            gpus=tuple(
                dataclasses.replace(gpu, processes=(SimulatedProcess(pid, None),))
                if gpu.minor == minor
                else gpu
                for gpu in config.gpus
            ),
        ),
    )


def test_idle_gpu_is_announced_released_and_free_again_but_a_held_one_stays(
    idle_agent: AgentProcess, sandbox_factory: SandboxFactory
) -> None:
    idle_kernel, busy_kernel = sandbox_factory(), sandbox_factory()
    busy = tcp(idle_agent).post("/v1/attachments", {"count": 1, "target": {"pid": busy_kernel.pid}})
    assert busy.status == 201, busy.body
    busy_minor = busy.json()["attachments"][0]["minor"]
    hold_in_nvml(idle_agent, busy_minor, busy_kernel.pid)
    attached = tcp(idle_agent).post(
        "/v1/attachments", {"count": 1, "target": {"pid": idle_kernel.pid}}
    )
    assert attached.status == 201, attached.body
    (attachment,) = attached.json()["attachments"]
    minor, uuid = attachment["minor"], attachment["uuid"]
    assert opens(idle_kernel, minor) == "ENXIO"

    warned = poll(
        lambda: [a for a in attachments(idle_agent, idle_kernel) if "idle_release" in a],
        "the idle release is announced",
        idle_agent,
    )
    assert warned[0]["idle_release"]["reason"] == "idle"
    poll(lambda: not attachments(idle_agent, idle_kernel), "the GPU is released", idle_agent)

    assert opens(idle_kernel, minor) == "EPERM"
    assert idle_kernel.stat(f"/dev/nvidia{minor}").result == "ENOENT"
    releases = tcp(idle_agent).get(f"/v1/idle-releases?pid={idle_kernel.pid}")
    assert releases.status == 200
    (record,) = releases.json()["releases"]
    assert (record["uuid"], record["reason"], record["target"]) == (
        uuid,
        "idle",
        {"pid": idle_kernel.pid},
    )
    gpus = {g["uuid"]: g for g in tcp(idle_agent).get("/v1/gpus").json()["gpus"]}
    assert gpus[uuid]["state"] == "free"
    assert metric(idle_agent, 'gpu_hotplug_idle_releases_total{reason="idle"}') == 1
    assert metric(idle_agent, 'gpu_hotplug_idle_warnings_total{reason="idle"}') >= 1

    # The held GPU was idle (0 %) all along, for longer than the idle period: it stays.
    (kept,) = attachments(idle_agent, busy_kernel)
    assert kept["minor"] == busy_minor and "idle_release" not in kept
    assert opens(busy_kernel, busy_minor) == "ENXIO"


def test_a_request_asks_for_a_stricter_idle_period(tmp_path: Path, sandbox: SandboxProbe) -> None:
    agent = AgentProcess(
        tmp_path / "state",
        simulate=2,
        extra_args=[
            "--reconcile-interval=0",
            "--AgentApp.idle_check_interval=0.2",
            "--AgentApp.simulation_interval=0",
        ],
    )
    agent.start()
    try:
        attached = tcp(agent).post(
            "/v1/attachments",
            {"count": 1, "target": {"pid": sandbox.pid}, "idle_release_seconds": 1},
        )
        assert attached.status == 201, attached.body
        poll(lambda: not attachments(agent, sandbox), "the GPU is released", agent)
        assert opens(sandbox, attached.json()["attachments"][0]["minor"]) == "EPERM"
    finally:
        agent.kill9()


# --- a fair queue ------------------------------------------------------------------------------


@pytest.fixture
def queue_agent(tmp_path: Path) -> Iterator[AgentProcess]:
    process = AgentProcess(tmp_path / "state", simulate=1, extra_args=["--reconcile-interval=0"])
    process.start()
    try:
        yield process
    finally:
        process.kill9()


class Waiting:
    """An attach that waits, sent from a thread (the POST answers when it is served)."""

    def __init__(self, agent: AgentProcess, probe: SandboxProbe, wait: float = 60.0) -> None:
        self.response: Response | None = None
        self.error: BaseException | None = None
        self.probe = probe
        body = {
            "count": 1,
            "target": {"pid": probe.pid},
            "wait_seconds": wait,
            "request_id": f"kernel-{probe.pid}",
        }
        plain = tcp(agent)
        client = ApiClient(plain.address, plain.token, timeout=wait + DEADLINE)
        self.thread = threading.Thread(target=self._send, args=(client, body), daemon=True)
        self.thread.start()

    def _send(self, client: ApiClient, body: dict[str, Any]) -> None:
        try:
            self.response = client.post("/v1/attachments", body)
        except BaseException as e:  # handed to the test's thread by answer()
            self.error = e

    def answer(self) -> Response:
        self.thread.join(DEADLINE)
        if self.error is not None:
            raise self.error
        assert self.response is not None, "no answer"
        return self.response


def positions(agent: AgentProcess, probe: SandboxProbe) -> tuple[list[int], int]:
    view = tcp(agent).get(f"/v1/queue?pid={probe.pid}")
    assert view.status == 200, view.body
    body = view.json()
    return [r["position"] for r in body["requests"]], body["length"]


def test_three_kernels_one_gpu_served_in_order(
    queue_agent: AgentProcess, sandbox_factory: SandboxFactory
) -> None:
    first, second, third, late = (sandbox_factory() for _ in range(4))
    served = Waiting(queue_agent, first).answer()
    assert served.status == 201, served.body
    uuid = served.json()["attachments"][0]["uuid"]

    waiting_second = Waiting(queue_agent, second)
    poll(lambda: positions(queue_agent, second)[0] == [1], "the second waits", queue_agent)
    waiting_third = Waiting(queue_agent, third)
    poll(lambda: positions(queue_agent, third)[0] == [2], "the third waits", queue_agent)
    assert positions(queue_agent, second) == ([1], 2)
    assert metric(queue_agent, "gpu_hotplug_queue_length") == 2

    detached = tcp(queue_agent).delete(f"/v1/attachments/{uuid}")
    assert detached.status == 204, detached.body
    got = waiting_second.answer()
    assert got.status == 201, got.body
    assert opens(second, got.json()["attachments"][0]["minor"]) == "ENXIO"
    assert opens(first, 0) == "EPERM"
    poll(lambda: positions(queue_agent, third) == ([1], 1), "the third moves up", queue_agent)

    cancelled = tcp(queue_agent).delete(f"/v1/queue/kernel-{third.pid}?pid={third.pid}")
    assert cancelled.status == 204, cancelled.body
    answer = waiting_third.answer()
    assert answer.status == 409 and answer.json()["error"] == "insufficient_gpus"
    assert "cancelled" in answer.json()["message"]
    assert positions(queue_agent, third) == ([], 0)
    assert attachments(queue_agent, third) == []

    timed_out = Waiting(queue_agent, late, wait=0.5).answer()
    assert timed_out.status == 504 and timed_out.json()["error"] == "timeout"
    assert positions(queue_agent, late) == ([], 0)
    assert attachments(queue_agent, late) == []
    assert opens(late, 0) == "EPERM" and opens(third, 0) == "EPERM"
    assert [a["target"] for a in tcp(queue_agent).get("/v1/gpus").json()["gpus"]] == [
        {"pid": second.pid}
    ]


# --- MIG slices --------------------------------------------------------------------------------


@pytest.fixture
def mig_agent(tmp_path: Path) -> Iterator[AgentProcess]:
    process = AgentProcess(
        tmp_path / "state",
        simulate=2,
        extra_args=["--reconcile-interval=0", "--simulate-mig=1g.10gb,1g.10gb"],
    )
    process.start()
    try:
        yield process
    finally:
        process.kill9()


def test_two_kernels_each_attach_one_slice_and_see_only_their_own(
    mig_agent: AgentProcess, sandbox_factory: SandboxFactory
) -> None:
    first, second = sandbox_factory(), sandbox_factory()
    answers = [
        tcp(mig_agent).post(
            "/v1/attachments", {"count": 1, "target": {"pid": box.pid}, "mig": "1g.10gb"}
        )
        for box in (first, second)
    ]
    assert [a.status for a in answers] == [201, 201], [a.body for a in answers]
    (one,), (two,) = (a.json()["attachments"] for a in answers)
    assert one["uuid"].startswith("MIG-") and two["uuid"].startswith("MIG-")
    assert one["uuid"] != two["uuid"] and one["minor"] == two["minor"] == 0
    own = {
        first.pid: caps_nodes(mig_agent.state_dir / "simulation", one["uuid"]),
        second.pid: caps_nodes(mig_agent.state_dir / "simulation", two["uuid"]),
    }

    for box, other in ((first, second), (second, first)):
        assert box.open("/dev/nvidia0") == "ENXIO"
        assert sorted(box.listdir("/dev/nvidia-caps")) == sorted(
            path.rsplit("/", 1)[1] for path, _, _ in own[box.pid]
        ), "each sees only its own caps nodes"
        for node in own[box.pid]:
            assert box.open(node[0]) == "ENXIO", node
        for node in own[other.pid]:
            assert opens_node(box, *node) == "EPERM", node
    refused = tcp(mig_agent).post(
        "/v1/attachments", {"count": 1, "target": {"pid": first.pid}, "mig": "1g.10gb"}
    )
    assert refused.status == 409, refused.body
    whole = tcp(mig_agent).post("/v1/attachments", {"count": 1, "target": {"pid": first.pid}})
    assert whole.status == 201 and whole.json()["attachments"][0]["minor"] == 1, whole.body

    detached = tcp(mig_agent).delete(f"/v1/attachments/{one['uuid']}")

    assert detached.status == 204, detached.body
    for node in own[first.pid]:
        assert opens_node(first, *node) == "EPERM", node
    assert opens_node(first, "/dev/nvidia0", 195, 0) == "EPERM"
    assert first.open("/dev/nvidia1") == "ENXIO", "the whole GPU stays"
    assert second.open("/dev/nvidia0") == "ENXIO"
    for node in own[second.pid]:
        assert second.open(node[0]) == "ENXIO", node
