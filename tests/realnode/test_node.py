"""The node itself, before the product meets it: the versions we built, a Ready node whose
``nvidia.com/gpu`` comes from NVIDIA's device plugin reading the simulated NVML, the real
scheduler's refusal, the kubelet's PodResources, and PodSecurity admission."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest
from kubernetes import client as k8s

from jupyter_gpu_hotplug.nvml.sim import read_config

from ..fixtures.requirements import needs_root
from .cluster import Cluster, eventually
from .node import GPU_RESOURCE, NodeBusy, new_node

pytestmark = [*needs_root, pytest.mark.realnode, pytest.mark.slow]

REPO: Final = Path(__file__).resolve().parents[2]


def test_the_server_is_the_kubernetes_we_built_and_the_node_is_ready_with_gpus(
    cluster: Cluster,
) -> None:
    version = json.loads(cluster.kubectl("version", "-o", "json"))
    built = cluster.node.components.versions["KUBERNETES_VERSION"]
    assert version["serverVersion"]["gitVersion"] == built
    (node,) = json.loads(cluster.kubectl("get", "nodes", "-o", "json"))["items"]
    assert node["metadata"]["name"] == cluster.node_name
    assert node["status"]["nodeInfo"]["kubeletVersion"] == built
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"] == (
        f"containerd://{cluster.node.components.versions['CONTAINERD_VERSION'].lstrip('v')}"
    )
    ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
    assert ready == "True"
    assert node["status"]["allocatable"][GPU_RESOURCE] == str(cluster.node.gpu_count)
    # NVIDIA's plugin announced it, not ours: its own log line names the resource.
    assert "nvidia.com/gpu" in cluster.node.log_tail("nvidia-device-plugin", 100_000)


def test_a_gpu_pod_runs_and_podresources_names_a_simulated_gpu(cluster: Cluster) -> None:
    ns = cluster.namespace("plain")
    pod = cluster.run_notebook_pod(ns, "gpu", resources={"limits": {GPU_RESOURCE: "1"}})
    assert pod["spec"]["nodeName"] == cluster.node_name
    devices = eventually(
        lambda: cluster.assignments(ns).get((ns, "gpu")), "PodResources lists the pod's GPU"
    )
    assert cluster.node.nvml_config_path is not None
    uuids = {str(g.uuid) for g in read_config(cluster.node.nvml_config_path).gpus}
    (device,) = devices
    assert device in uuids
    # NVIDIA's Allocate answered with its envvar strategy: the container sees the UUID.
    env = cluster.exec(ns, "gpu", ["env"]).stdout
    assert f"NVIDIA_VISIBLE_DEVICES={device}" in env
    cluster.delete_pod(ns, "gpu")


def test_the_real_scheduler_refuses_more_gpus_than_the_node_has(cluster: Cluster) -> None:
    ns = cluster.namespace("greedy")
    too_many = str(cluster.node.gpu_count + 1)
    cluster.core.create_namespaced_pod(
        ns,
        {
            "metadata": {"name": "greedy"},
            "spec": {
                "containers": [
                    {
                        "name": "c",
                        "image": "localhost/k8stier/busybox:1",
                        "command": ["sleep", "infinity"],
                        "resources": {"limits": {GPU_RESOURCE: too_many}},
                    }
                ]
            },
        },
    )

    def unschedulable() -> str | None:
        conditions = cluster.pod(ns, "greedy")["status"].get("conditions") or []
        return next(
            (c.get("message") for c in conditions if c.get("reason") == "Unschedulable"), None
        )

    message = eventually(unschedulable, "the scheduler marks the pod Unschedulable")
    assert f"Insufficient {GPU_RESOURCE}" in message


def test_podsecurity_restricted_rejects_a_privileged_pod(cluster: Cluster) -> None:
    ns = cluster.namespace("strict", pod_security="restricted")
    with pytest.raises(k8s.ApiException) as refused:
        cluster.core.create_namespaced_pod(
            ns,
            {
                "metadata": {"name": "root"},
                "spec": {
                    "containers": [
                        {
                            "name": "c",
                            "image": "localhost/k8stier/busybox:1",
                            "securityContext": {"privileged": True},
                        }
                    ]
                },
            },
        )
    assert refused.value.status == 403
    assert "violates PodSecurity" in str(refused.value.body)


def test_a_second_node_on_the_same_machine_is_refused_clearly(cluster: Cluster) -> None:
    """Only one kubelet per machine can own the device-plugin directory: a second node (another
    session's, or one brought up by hand) is refused with the reason, and ``down`` by hand
    leaves a test session's node alone."""
    second = new_node()
    with pytest.raises(NodeBusy, match="another real node is running on this machine"):
        second.start()
    assert cluster.kubectl("get", "nodes", "-o", "name").strip() == f"node/{cluster.node_name}"
    for command, said in (("up", "already up"), ("down", "goes down at the session's end")):
        by_hand = subprocess.run(
            [sys.executable, "-m", "tests.realnode", command],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
            check=False,
        )
        assert by_hand.returncode == 1, by_hand
        assert said in by_hand.stdout + by_hand.stderr
    assert cluster.kubectl("get", "nodes", "-o", "name").strip() == f"node/{cluster.node_name}"
