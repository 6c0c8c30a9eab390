"""The kubelet simulator over the real containerd: pods become real containers, their status
and PodResources tell the truth, and eviction, restart and deletion behave as on a node."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path
from typing import Any

import grpc
import kubernetes.client
import pytest

from jupyter_gpu_hotplug.nvml.sim import read_config
from tests.fixtures.nvml import FakeNvmlNode
from tests.fixtures.requirements import needs_root

from . import protos
from .containerd import cgroup_mount_points
from .fixtures import KubeletFactory, nvml_node_for
from .inventory import mig_devices, whole_gpus
from .kube import FakeKube
from .kubelet import KubeletSimulator

pytestmark = [*needs_root, pytest.mark.k8s]

GPU = "nvidia.com/gpu"


def holder(node: str, gpus: int = 1, resource: str = GPU, **spec: Any) -> dict[str, Any]:
    """A holder-like pod: pause image, Guaranteed, ``gpus`` of ``resource``."""
    limits = {"cpu": "10m", "memory": "16Mi", resource: str(gpus)}
    return {
        "metadata": {"generateName": "holder-"},
        "spec": {
            "nodeName": node,
            "containers": [
                {
                    "name": "pause",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"limits": limits},
                }
            ],
            **spec,
        },
    }


def running(pod: dict[str, Any] | None) -> bool:
    return pod is not None and pod["status"].get("phase") == "Running"


def pod_resources(kubelet: KubeletSimulator, method: str, request: Any) -> Any:
    p = protos.load("k8stier_podresources")
    response = {"List": p.ListPodResourcesResponse, "Get": p.GetPodResourcesResponse}[method]
    with grpc.insecure_channel(f"unix://{kubelet.pod_resources_socket}") as channel:
        call = channel.unary_unary(
            f"/v1.PodResourcesLister/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=response.FromString,
        )
        return call(request, timeout=10)


def test_holder_pod_runs_as_a_real_container(kube: FakeKube, kubelet: KubeletSimulator) -> None:
    created = kube.create_pod("default", holder(kubelet.node_name))
    name = created["metadata"]["name"]
    pod = kube.wait_for_pod("default", name, running, "it runs")
    assert pod is not None
    (status,) = pod["status"]["containerStatuses"]
    assert status["ready"] and status["restartCount"] == 0
    assert status["containerID"].startswith("containerd://")
    container_id = status["containerID"].removeprefix("containerd://")

    info = kubelet.cri.container_status(container_id)
    assert info.state == "CONTAINER_RUNNING"
    cgroups = dict(
        line.split(":", 2)[1:] for line in Path(f"/proc/{info.pid}/cgroup").read_text().splitlines()
    )
    # containerd's answer and the kernel's agree in every hierarchy (the v1 devices one and
    # cgroup2 here, whichever exist elsewhere), and the path is kubelet-shaped.
    assert set(cgroups.values()) == {info.cgroups_path}
    assert "devices" in cgroups or "" in cgroups
    assert info.cgroups_path == (
        f"{kubelet.containerd.cgroup_top}/pod{pod['metadata']['uid']}/{container_id}"
    )
    assert pod["status"]["qosClass"] == "Guaranteed"
    assert any((mount / info.cgroups_path.lstrip("/")).is_dir() for mount in cgroup_mount_points())

    assignments = kubelet.assignments()[("default", name)]
    assert assignments == {"pause": [kubelet.gpus[0].id]}


def test_inventory_and_fake_nvml_agree(
    kubelet: KubeletSimulator,
    kubelet_nvml: FakeNvmlNode,
    kubelet_factory: KubeletFactory,
    fake_nvml_library: Path,
    tmp_path: Path,
) -> None:
    written = read_config(kubelet_nvml.config_path)
    assert [(g.uuid, g.minor) for g in written.gpus] == [(g.id, g.minor) for g in kubelet.gpus]
    assert kubelet.cri.version().runtime_name == "containerd"

    other = kubelet_factory(gpus=whole_gpus(2, "node-b"), node_name="node-b")
    node_b = nvml_node_for(other, fake_nvml_library, tmp_path)
    assert [g.uuid for g in read_config(node_b.config_path).gpus] == [g.id for g in other.gpus]
    assert not {g.id for g in other.gpus} & {g.id for g in kubelet.gpus}


def test_exhausted_inventory(kube: FakeKube, kubelet_factory: KubeletFactory) -> None:
    kubelet = kubelet_factory(gpus=mig_devices(1, "n", "nvidia.com/mig-1g.10gb"))
    resource = "nvidia.com/mig-1g.10gb"
    first = kube.create_pod("default", holder(kubelet.node_name, resource=resource))
    kube.wait_for_pod("default", first["metadata"]["name"], running, "it runs")

    # Pinned with nodeName, the pod skips the scheduler: the kubelet's admission rejects it.
    pinned = kube.create_pod("default", holder(kubelet.node_name, resource=resource))
    rejected = kube.wait_for_pod(
        "default",
        pinned["metadata"]["name"],
        lambda p: p is not None and p["status"]["phase"] == "Failed",
        "it is rejected",
    )
    assert rejected is not None
    assert rejected["status"]["reason"] == f"OutOf{resource}"
    assert "requested: 1, used: 1, capacity: 1" in rejected["status"]["message"]

    # Selecting the node by label goes through the scheduler: Unschedulable, Pending...
    selected = holder(
        "", resource=resource, nodeSelector={"kubernetes.io/hostname": kubelet.node_name}
    )
    del selected["spec"]["nodeName"]
    waiting = kube.create_pod("default", selected)["metadata"]["name"]

    def unschedulable(pod: dict[str, Any] | None) -> bool:
        conditions = (pod or {}).get("status", {}).get("conditions") or []
        return any(
            c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions
        )

    pending = kube.wait_for_pod("default", waiting, unschedulable, "it is unschedulable")
    assert pending is not None and pending["status"]["phase"] == "Pending"
    assert f"Insufficient {resource}" in pending["status"]["conditions"][0]["message"]

    # ... until the GPU is free again: then it is bound and runs.
    kube.delete_pod("default", first["metadata"]["name"])
    placed = kube.wait_for_pod("default", waiting, running, "it runs after the GPU is freed")
    assert placed is not None and placed["spec"]["nodeName"] == kubelet.node_name


def test_pod_resources_list_and_get(kube: FakeKube, kubelet: KubeletSimulator) -> None:
    p = protos.load("k8stier_podresources")
    names = []
    for count in (2, 1):
        created = kube.create_pod("default", holder(kubelet.node_name, count))
        names.append(created["metadata"]["name"])
        kube.wait_for_pod("default", names[-1], running, "it runs")
    notebook = kubelet.run_notebook_pod("team", "nb")

    listed = pod_resources(kubelet, "List", p.ListPodResourcesRequest())
    by_pod = {(r.namespace, r.name): r for r in listed.pod_resources}
    assert set(by_pod) == {("default", names[0]), ("default", names[1]), ("team", "nb")}
    ids = [
        list(d.device_ids)
        for r in listed.pod_resources
        if r.namespace == "default"
        for c in r.containers
        for d in c.devices
    ]
    assert sorted(i for group in ids for i in group) == sorted(g.id for g in kubelet.gpus[:3])
    assert [c.devices for c in by_pod[("team", "nb")].containers] == [[]]

    got = pod_resources(
        kubelet, "Get", p.GetPodResourcesRequest(pod_name=names[0], pod_namespace="default")
    )
    (container,) = got.pod_resources.containers
    assert container.name == "pause"
    assert container.devices[0].resource_name == GPU
    assert len(container.devices[0].device_ids) == 2
    with pytest.raises(grpc.RpcError) as missing:
        pod_resources(
            kubelet, "Get", p.GetPodResourcesRequest(pod_name="nope", pod_namespace="default")
        )
    assert "pod nope in namespace default not found" in str(missing.value.details())
    assert missing.value.code() == grpc.StatusCode.UNKNOWN

    # A kubelet restart replaces the socket; a client's channel reconnects to the new one.
    with grpc.insecure_channel(f"unix://{kubelet.pod_resources_socket}") as channel:
        list_pods = channel.unary_unary(
            "/v1.PodResourcesLister/List",
            request_serializer=p.ListPodResourcesRequest.SerializeToString,
            response_deserializer=p.ListPodResourcesResponse.FromString,
        )
        before = list_pods(p.ListPodResourcesRequest(), timeout=10)
        kubelet.restart_pod_resources()
        after = list_pods(p.ListPodResourcesRequest(), timeout=30, wait_for_ready=True)
    assert after == before
    assert notebook["status"]["containerStatuses"][0]["containerID"].startswith("containerd://")


def test_delete_stops_the_container_and_frees_the_gpu(
    kube: FakeKube, kubelet: KubeletSimulator
) -> None:
    name = kube.create_pod("default", holder(kubelet.node_name, 4))["metadata"]["name"]
    pod = kube.wait_for_pod("default", name, running, "it runs")
    assert pod is not None
    container_id = pod["status"]["containerStatuses"][0]["containerID"].removeprefix(
        "containerd://"
    )
    marked = kube.delete_pod("default", name)
    assert marked["metadata"]["deletionTimestamp"]  # graceful: the kubelet finishes it
    kube.wait_for_pod("default", name, lambda p: p is None, "it is gone")
    assert container_id not in {c.id for c in kubelet.cri.list_containers()}
    assert kubelet.assignments() == {}
    pod_cgroup = f"{kubelet.containerd.cgroup_top}/pod{pod['metadata']['uid']}".lstrip("/")
    assert not [m for m in cgroup_mount_points() if (m / pod_cgroup).exists()]


def test_evict_and_restart(kube: FakeKube, kubelet: KubeletSimulator) -> None:
    pod = kubelet.run_notebook_pod("team", "nb")
    old = kubelet.container_id("team", "nb", "notebook")
    new = kubelet.restart_container("team", "nb", "notebook")
    assert new != old
    status = kube.pod("team", "nb")
    assert status is not None
    (entry,) = status["status"]["containerStatuses"]
    assert entry["containerID"] == f"containerd://{new}"
    assert entry["restartCount"] == 1
    assert entry["lastState"]["terminated"]["containerID"] == f"containerd://{old}"
    assert kubelet.cri.container_status(new).state == "CONTAINER_RUNNING"
    assert status["metadata"]["uid"] == pod["metadata"]["uid"]

    held = kube.create_pod("team", holder(kubelet.node_name, 1))["metadata"]["name"]
    kube.wait_for_pod("team", held, running, "it runs")
    kubelet.evict("team", held)
    kube.wait_for_pod("team", held, lambda p: p is None, "the evicted holder is deleted")
    assert ("team", held) not in kubelet.assignments()

    # Node-pressure eviction proper leaves the Failed pod for the pod garbage collector.
    kept = kube.create_pod("team", holder(kubelet.node_name, 1))["metadata"]["name"]
    kube.wait_for_pod("team", kept, running, "it runs")
    kubelet.evict("team", kept, delete=False)
    evicted = kube.pod("team", kept)
    assert evicted is not None and evicted["status"]["phase"] == "Failed"
    assert evicted["status"]["reason"] == "Evicted"
    assert ("team", kept) not in kubelet.assignments()


def test_vm_runtime_pods_never_reach_runc(kube: FakeKube, kubelet: KubeletSimulator) -> None:
    kube.create_runtime_class("kata", "kata-qemu")
    pod = kubelet.run_notebook_pod("team", "vm", runtime_class="kata")
    (status,) = pod["status"]["containerStatuses"]
    container_id = status["containerID"].removeprefix("containerd://")
    assert status["ready"] and len(container_id) == 64
    assert container_id not in {c.id for c in kubelet.cri.list_containers()}
    with pytest.raises(grpc.RpcError) as unknown:
        kubelet.cri.container_status(container_id)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def test_exec_sees_what_the_workload_sees(kubelet: KubeletSimulator) -> None:
    kubelet.run_notebook_pod("team", "nb")
    absent = kubelet.exec("team", "nb", "notebook", ["cat", "/dev/nvidia0"])
    assert absent.exit_code != 0 and "No such file or directory" in absent.stderr
    # A node made from outside (as the agent does) exists inside, and runc's device rules
    # (no c 195:*) refuse to open it.
    pid = kubelet.container_info("team", "nb", "notebook").pid
    node = Path(f"/proc/{pid}/root/dev/nvidia0")
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(195, 0))
    denied = kubelet.exec("team", "nb", "notebook", ["cat", "/dev/nvidia0"])
    assert denied.exit_code != 0 and "Operation not permitted" in denied.stderr


def test_a_crashed_container_is_replaced_or_ends_the_pod(
    kube: FakeKube, kubelet: KubeletSimulator
) -> None:
    kubelet.run_notebook_pod("team", "nb")
    old = kubelet.container_info("team", "nb", "notebook")
    os.kill(old.pid, signal.SIGKILL)

    def restarted(pod: dict[str, Any] | None) -> bool:
        return pod is not None and pod["status"]["containerStatuses"][0]["restartCount"] == 1

    pod = kube.wait_for_pod("team", "nb", restarted, "the crashed container is replaced")
    assert pod is not None
    (entry,) = pod["status"]["containerStatuses"]
    assert entry["lastState"]["terminated"]["containerID"] == f"containerd://{old.id}"
    assert entry["lastState"]["terminated"]["exitCode"] == 137
    assert entry["containerID"] != f"containerd://{old.id}" and entry["ready"]

    job = holder(kubelet.node_name, 1, restartPolicy="Never")
    job["spec"]["containers"][0]["command"] = ["true"]
    name = kube.create_pod("team", job)["metadata"]["name"]
    done = kube.wait_for_pod(
        "team", name, lambda p: p is not None and p["status"]["phase"] == "Succeeded", "it ends"
    )
    assert done is not None
    assert done["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    assert ("team", name) not in kubelet.assignments()


def test_the_scheduler_never_binds_more_than_is_free(
    kube: FakeKube, kubelet_factory: KubeletFactory
) -> None:
    kubelet = kubelet_factory(gpus=whole_gpus(1, "small"))
    names = []
    for _ in range(3):
        body = holder("", nodeSelector={"kubernetes.io/hostname": kubelet.node_name})
        del body["spec"]["nodeName"]
        names.append(kube.create_pod("default", body)["metadata"]["name"])

    def settled(pods: list[dict[str, Any]]) -> bool:
        phases = sorted(p["status"].get("phase", "") for p in pods)
        waiting = [
            p
            for p in pods
            if (p["status"].get("conditions") or [{}])[0].get("reason") == "Unschedulable"
        ]
        return phases.count("Running") == 1 and len(waiting) == 2

    kube.wait_for_pod("default", names[0], lambda _: settled(kube.pods("default")), "one runs")
    assert not [p for p in kube.pods("default") if p["status"].get("phase") == "Failed"]


def test_what_the_kubelet_writes_deserialises(kube: FakeKube, kubelet: KubeletSimulator) -> None:
    kubelet.run_notebook_pod("team", "nb")
    kubelet.restart_container("team", "nb", "notebook")
    with kube.client() as client:
        core: Any = kubernetes.client.CoreV1Api(client)
        pod = core.read_namespaced_pod("nb", "team")
        assert pod.status.container_statuses[0].last_state.terminated.exit_code == 137
        assert {c.type for c in pod.status.conditions} >= {"Ready", "PodScheduled"}
        node = core.read_node(kubelet.node_name)
        assert node.status.allocatable["nvidia.com/gpu"] == str(len(kubelet.gpus))
