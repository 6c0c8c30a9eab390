"""The real agent in Kubernetes mode as a subprocess, against the tier's fake apiserver, the
kubelet simulator's PodResources socket and the real containerd's CRI socket."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_hotplug.linux import cgroups

from ..agent.agent_process import AgentProcess
from ..agent.api_harness import ApiClient
from ..fixtures.agent import kubernetes_agent_argv
from ..fixtures.nvml import FakeNvmlNode
from .apiserver.resources import EVENTS, PRIORITY_CLASSES
from .containerd import Containerd
from .kube import FakeKube
from .kubelet import KubeletSimulator

RECONCILE_INTERVAL = 1.0
"""Seconds between the agent's timed reconciliations in these tests."""

HOLDER_LABEL = "gpu-hotplug.jupyter.org/holder"
HOLDER_PRIORITY_CLASS = "gpu-hotplug-holder"
HOLDER_PRIORITY = 1_000_000
"""Above notebooks (0 unless their own class says otherwise), below system-*-critical."""

WAIT = 60.0
"""Upper bound, in seconds, of the tier's waits for the agent to act (never asserted)."""


def eventually(check: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    """Wait until ``check()`` holds; fail after ``timeout`` seconds saying ``what``."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)


def kubernetes_argv(
    *,
    kube: FakeKube,
    kubelet: KubeletSimulator,
    containerd: Containerd,
    state_dir: Path,
    socket_path: Path,
    reconcile_interval: float = RECONCILE_INTERVAL,
    extra: tuple[str, ...] = (),
) -> list[str]:
    # A lost holder's GPU is revoked at once unless a test gives a grace period. The tenant
    # policy is proven on the real node (tests/realnode/test_limits.py): here every namespace
    # is allowed and a pod without the max-gpus annotation may take every simulated GPU.
    grace = () if any(arg.startswith("--lost-grace") for arg in extra) else ("--lost-grace=0",)
    tenancy = ("--allowed-namespaces=*", "--default-max-gpus=8")
    return kubernetes_agent_argv(
        node_name=kubelet.node_name,
        kubeconfig=kube.kubeconfig_path,
        pod_resources_socket=kubelet.pod_resources_socket,
        cri_endpoint=containerd.endpoint,
        state_dir=state_dir,
        socket_path=socket_path,
        reconcile_interval=reconcile_interval,
        extra=(*grace, *tenancy, *extra),
    )


def ensure_holder_priority_class(kube: FakeKube) -> None:
    """The holders' PriorityClass, as the agent's manifests ship it beside the DaemonSet (the
    API server refuses holders that name a missing class)."""
    if not any(
        item["metadata"]["name"] == HOLDER_PRIORITY_CLASS
        for item in kube.call(kube.server.cluster.store.list, PRIORITY_CLASSES, "")
    ):
        kube.create_priority_class(HOLDER_PRIORITY_CLASS, HOLDER_PRIORITY)


@contextlib.contextmanager
def running_k8s_agent(
    kube: FakeKube,
    kubelet: KubeletSimulator,
    kubelet_nvml: FakeNvmlNode | None,
    containerd: Containerd,
    *,
    extra: tuple[str, ...] = (),
    reconcile_interval: float = RECONCILE_INTERVAL,
) -> Iterator[AgentProcess]:
    """The agent for ``kubelet``'s node with ``extra`` flags, running (stopped on exit, its
    log shown, its directory removed). ``kubelet_nvml``: the fake NVML it reads (``None``: the
    agent simulates its own, e.g. with ``--simulate-mig``)."""
    ensure_holder_priority_class(kube)
    directory = Path(tempfile.mkdtemp(prefix="k8sagent-", dir="/tmp"))
    state_dir = directory / "state"
    env = {} if kubelet_nvml is None else dict(kubelet_nvml.environ())
    process = AgentProcess(state_dir=state_dir, simulate=0, env=env)
    process.argv = kubernetes_argv(
        kube=kube,
        kubelet=kubelet,
        containerd=containerd,
        state_dir=state_dir,
        socket_path=process.socket_path,
        reconcile_interval=reconcile_interval,
        extra=extra,
    )
    process.start()
    try:
        yield process
    finally:
        process.stop()
        print(process.log()[-6000:])
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def k8s_agent(
    kube: FakeKube,
    kubelet: KubeletSimulator,
    kubelet_nvml: FakeNvmlNode,
    containerd: Containerd,
) -> Iterator[AgentProcess]:
    """The agent for ``kubelet``'s node, running (stopped at teardown, its log shown on
    failure)."""
    with running_k8s_agent(kube, kubelet, kubelet_nvml, containerd) as process:
        yield process


def as_pod(agent: AgentProcess, kube: FakeKube, namespace: str, name: str) -> ApiClient:
    """The agent's API as the pod's own bound token (audience gpu-hotplug) calls it."""
    assert agent.tcp is not None
    return agent.tcp.with_token(kube.pod_token(namespace, name))


def notebook_with_one_gpu(
    agent: AgentProcess, kube: FakeKube, kubelet: KubeletSimulator, namespace: str, name: str
) -> dict[str, Any]:
    """Run a notebook pod and attach one GPU with its own token; the attachment."""
    kubelet.run_notebook_pod(namespace, name)
    answer = as_pod(agent, kube, namespace, name).post("/v1/attachments", {"count": 1})
    assert answer.status == 201, answer.body
    (attachment,) = answer.json()["attachments"]
    return dict(attachment)


def holders(kube: FakeKube, namespace: str) -> list[dict[str, Any]]:
    return [
        pod
        for pod in kube.pods(namespace)
        if (pod["metadata"].get("labels") or {}).get(HOLDER_LABEL) == "true"
    ]


def pod_events(kube: FakeKube, namespace: str, pod: str) -> list[dict[str, Any]]:
    """The Events recorded on the pod, oldest first."""
    events = kube.call(kube.server.cluster.store.list, EVENTS, namespace)
    return [event for event in events if event.get("involvedObject", {}).get("name") == pod]


def event_reasons(kube: FakeKube, namespace: str, pod: str) -> list[str]:
    """The reasons of the Events recorded on the pod, oldest first."""
    return [event["reason"] for event in pod_events(kube, namespace, pod)]


def devices_of(kubelet: KubeletSimulator, namespace: str) -> set[str]:
    """The devices the kubelet has assigned to the pods of ``namespace`` (the holders')."""
    return {
        device
        for (ns, _), containers in kubelet.assignments().items()
        if ns == namespace
        for devices in containers.values()
        for device in devices
    }


def allow_in_cgroup(kubelet: KubeletSimulator, namespace: str, pod: str, rule: str) -> None:
    """Add ``rule`` to the notebook container's v1 device cgroup, as a runtime would at
    creation (the NVIDIA runtime, for what the device plugin assigned)."""
    pid = kubelet.container_info(namespace, pod, "notebook").pid
    paths = cgroups.parse_proc_cgroup(Path(f"/proc/{pid}/cgroup").read_text())
    assert paths.devices_v1 is not None, "the tier's host has the v1 devices controller"
    (Path("/sys/fs/cgroup/devices") / paths.devices_v1.lstrip("/") / "devices.allow").write_text(
        rule
    )
