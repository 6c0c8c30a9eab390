"""The kubelet simulator over the real containerd: pods become real containers, their status
and PodResources tell the truth, and admission, eviction and deletion behave as on a node —
what the tier's remaining tests (MIG, idle, sweeps, the allocator contract, the cases a real
node cannot produce on demand) rely on. Scheduling, container restarts and a kubelet restart
are the real node's (``tests/realnode``) and are not simulated."""

from __future__ import annotations

import os
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


def test_pod_resources_list_and_get(kube: FakeKube, kubelet: KubeletSimulator) -> None:
    p = protos.load("k8stier_podresources")
    names = []
    for count in (2, 1):
        created = kube.create_pod("default", holder(kubelet.node_name, count))
        names.append(created["metadata"]["name"])
        kube.wait_for_pod("default", names[-1], running, "it runs")
    kubelet.run_notebook_pod("team", "nb")

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


def test_eviction_leaves_the_failed_pod_and_frees_its_gpu(
    kube: FakeKube, kubelet: KubeletSimulator
) -> None:
    """Node-pressure eviction leaves the Failed pod for the pod garbage collector."""
    kube.create_namespace("team")
    kept = kube.create_pod("team", holder(kubelet.node_name, 1))["metadata"]["name"]
    kube.wait_for_pod("team", kept, running, "it runs")
    container_id = kubelet.container_id("team", kept, "pause")
    kubelet.evict("team", kept)
    evicted = kube.pod("team", kept)
    assert evicted is not None and evicted["status"]["phase"] == "Failed"
    assert evicted["status"]["reason"] == "Evicted"
    (entry,) = evicted["status"]["containerStatuses"]
    assert entry["state"]["terminated"]["containerID"] == f"containerd://{container_id}"
    assert ("team", kept) not in kubelet.assignments()
    assert container_id not in {c.id for c in kubelet.cri.list_containers()}


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


def test_what_the_kubelet_writes_deserialises(kube: FakeKube, kubelet: KubeletSimulator) -> None:
    """The status the simulator writes — of a runc pod and of a VM-runtime pod — is what the
    official client's models accept."""
    kubelet.run_notebook_pod("team", "nb")
    kube.create_runtime_class("kata", "kata-qemu")
    kubelet.run_notebook_pod("team", "vm", runtime_class="kata")
    with kube.client() as client:
        core: Any = kubernetes.client.CoreV1Api(client)
        for name in ("nb", "vm"):
            pod = core.read_namespaced_pod(name, "team")
            (status,) = pod.status.container_statuses
            assert status.ready and status.state.running.started_at is not None
            container_id = kubelet.container_id("team", name, "notebook")
            assert status.container_id == f"containerd://{container_id}"
            assert {c.type for c in pod.status.conditions} >= {"Ready", "PodScheduled"}
        node = core.read_node(kubelet.node_name)
        assert node.status.allocatable["nvidia.com/gpu"] == str(len(kubelet.gpus))
