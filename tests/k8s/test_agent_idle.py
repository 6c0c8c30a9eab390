"""Kubernetes mode's idle release end to end: the platform's per-pod idle period (a pod
annotation, stricter-only), Events on the notebook pod for the warning and the release, and a
release that goes through the ordinary detach (holder pod deleted, node gone from the
container). The real agent runs as a subprocess against the tier's apiserver and kubelet and a
real containerd; the fake NVML reports 0 % utilisation (nothing animates it).

Why simulated: the real-node tier has no idle-release test; the release is an ordinary detach,
which the real node proves (``tests/realnode/test_attach.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from jupyter_gpu_hotplug._structs import IDLE_RELEASE_ANNOTATION
from jupyter_gpu_hotplug.nvml.sim.config import SimulatedProcess
from tests.fixtures.requirements import needs_root

from ..agent.agent_process import AgentProcess
from ..fixtures.nvml import FakeNvmlNode
from .agent import as_pod, event_reasons, eventually, holders, running_k8s_agent
from .containerd import Containerd
from .kube import FakeKube
from .kubelet import KubeletSimulator

pytestmark = [*needs_root, pytest.mark.k8s, pytest.mark.slow]

NS = "team-idle"


@pytest.fixture
def idle_agent(
    kube: FakeKube,
    kubelet: KubeletSimulator,
    kubelet_nvml: FakeNvmlNode,
    containerd: Containerd,
) -> Iterator[AgentProcess]:
    """An agent without an idle period of its own: only the pods' annotations set one."""
    with running_k8s_agent(
        kube,
        kubelet,
        kubelet_nvml,
        containerd,
        extra=("--idle-warning=2", "--AgentApp.idle_check_interval=0.2"),
    ) as process:
        yield process


def hold_in_nvml(nvml: FakeNvmlNode, uuid: str, pid: int) -> None:
    """Make NVML list ``pid`` as running on the GPU (what a CUDA context does)."""
    gpu = next(gpu for gpu in nvml.gpus if gpu.uuid == uuid)
    nvml.update_gpu(uuid, processes=(*gpu.processes, SimulatedProcess(pid, None)))


def node_state(kubelet: KubeletSimulator, pod: str, minor: int) -> str:
    result = kubelet.exec(NS, pod, "notebook", ["cat", f"/dev/nvidia{minor}"])
    return result.stdout + result.stderr


def test_an_annotated_pod_loses_its_unused_gpu_with_events_but_a_held_one_stays(
    kube: FakeKube,
    kubelet: KubeletSimulator,
    kubelet_nvml: FakeNvmlNode,
    idle_agent: AgentProcess,
) -> None:
    annotations = {IDLE_RELEASE_ANNOTATION: "3"}
    kubelet.run_notebook_pod(NS, "busy", annotations=annotations)
    kubelet.run_notebook_pod(NS, "idle", annotations=annotations)
    busy = as_pod(idle_agent, kube, NS, "busy").post("/v1/attachments", {"count": 1})
    assert busy.status == 201
    hold_in_nvml(
        kubelet_nvml,
        busy.json()["attachments"][0]["uuid"],
        kubelet.container_info(NS, "busy", "notebook").pid,
    )
    api = as_pod(idle_agent, kube, NS, "idle")
    attached = api.post("/v1/attachments", {"count": 1})
    assert attached.status == 201
    minor = attached.json()["attachments"][0]["minor"]
    assert "No such device or address" in node_state(kubelet, "idle", minor)
    assert len(holders(kube, NS)) == 2

    eventually(
        lambda: "GpuIdleWarning" in event_reasons(kube, NS, "idle"), "a GpuIdleWarning Event"
    )
    eventually(lambda: not api.get("/v1/attachments").json()["attachments"], "the release")
    eventually(
        lambda: "GpuIdleReleased" in event_reasons(kube, NS, "idle"), "a GpuIdleReleased Event"
    )
    reasons = event_reasons(kube, NS, "idle")
    assert "GpuDetached" in reasons
    assert "No such file" in node_state(kubelet, "idle", minor)
    eventually(lambda: len(holders(kube, NS)) == 1, "the released GPU's holder pod is deleted")
    (left,) = holders(kube, NS)
    assert left["metadata"]["ownerReferences"][0]["name"] == "busy"
    (release,) = api.get("/v1/idle-releases").json()["releases"]
    assert release["reason"] == "idle"

    # Held open by the busy pod's process for the same idle period and longer: it stays.
    (kept,) = as_pod(idle_agent, kube, NS, "busy").get("/v1/attachments").json()["attachments"]
    assert "idle_release" not in kept
    assert "GpuIdleWarning" not in event_reasons(kube, NS, "busy")


def test_a_laxer_or_unreadable_annotation_changes_nothing(
    kube: FakeKube,
    kubelet: KubeletSimulator,
    kubelet_nvml: FakeNvmlNode,
    containerd: Containerd,
) -> None:
    with running_k8s_agent(
        kube,
        kubelet,
        kubelet_nvml,
        containerd,
        extra=(
            "--idle-release=3",
            "--idle-warning=1",
            "--AgentApp.idle_check_interval=0.2",
        ),
    ) as agent:
        kubelet.run_notebook_pod(NS, "lax", annotations={IDLE_RELEASE_ANNOTATION: "86400"})
        kubelet.run_notebook_pod(NS, "bad", annotations={IDLE_RELEASE_ANNOTATION: "soon"})
        apis = [as_pod(agent, kube, NS, pod) for pod in ("lax", "bad")]
        for api in apis:
            assert api.post("/v1/attachments", {"count": 1}).status == 201
        # The agent's 3 s hold: a day asked for does not lengthen it, nonsense is ignored.
        eventually(
            lambda: not any(api.get("/v1/attachments").json()["attachments"] for api in apis),
            "both released",
        )
        assert holders(kube, NS) == []
        assert "not a positive number" in agent.log()
