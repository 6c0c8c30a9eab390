"""The agent deployed as ``k8s/`` ships it: the image built from this repository (no registry),
imported into the node's containerd, and ``kubectl apply -k`` of an overlay over ``k8s/``.

Why a module of its own: the deployment test (``test_deployed.py``), the Helm chart's test and
the JupyterHub tier (``hub.py``) all run the agent as a DaemonSet pod; what this node needs
changed from a cloud's GPU node is written once, here.

The overlay changes only what differs on this node: the image (local, ``imagePullPolicy:
Never``), no ``nvidia`` RuntimeClass (the simulated NVML is mounted from the host instead), where
this kubelet and containerd keep their sockets, the node's own CDI spec directory in place of
the host's ``/etc/cdi`` and ``/var/run/cdi`` (nothing is created on the host), and the test's
pause image as the holder image. Everything else — privileges, ``hostPID``, probes, the
ServiceAccount and its RBAC, the Service's ``internalTrafficPolicy: Local`` — is what ``k8s/``
ships.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from jupyter_gpu_hotplug.nvml.sim import CONFIG_ENV

from ..k8s.image import PAUSE_IMAGE
from ..manifests.support import K8S_DIR, render
from .agent import AGENT_NAMESPACE
from .agent_image import AgentImage, agent_image
from .cluster import Cluster, eventually
from .node import RealNode
from .vm_node import VmNode

GPU_NODE_LABEL: Final = "nvidia.com/gpu.present"
HOST_STATE_DIR: Final = Path("/run/gpu-hotplug")
"""The DaemonSet's state directory on the host (``hostPath``, ``DirectoryOrCreate``)."""
DriverFiles = Literal["off", "cdi"]
"""``off``: the notebook is busybox-static (no loader, no driver to give it); ``cdi``: the
node's CDI spec, as on a GPU Operator >= 25.10 node (``--driver-files`` of the agent)."""


@dataclass(frozen=True)
class FakeNvmlMounts:
    """The node's simulated NVML, mounted into the agent's pod from the host (there is no
    NVIDIA container toolkit here): its environment, volumes and volume mounts."""

    env: list[dict[str, str]]
    volumes: list[dict[str, Any]]
    mounts: list[dict[str, Any]]


def fake_nvml_mounts(node: RealNode) -> FakeNvmlMounts:
    assert node.nvml_library_dir is not None and node.nvml_config_path is not None
    return FakeNvmlMounts(
        env=[
            {"name": "LD_LIBRARY_PATH", "value": str(node.nvml_library_dir)},
            {"name": CONFIG_ENV, "value": str(node.nvml_config_path)},
        ],
        volumes=[
            {"name": "fake-nvml",
             "hostPath": {"path": str(node.nvml_library_dir), "type": "Directory"}},
            {"name": "fake-nvml-config",
             "hostPath": {"path": str(node.nvml_config_path), "type": "File"}},
        ],
        mounts=[
            {"name": "fake-nvml", "mountPath": str(node.nvml_library_dir), "readOnly": True},
            {"name": "fake-nvml-config", "mountPath": str(node.nvml_config_path),
             "readOnly": True},
        ],
    )  # fmt: skip


def _cdi_volumes(node: RealNode) -> list[dict[str, Any]]:
    """The shipped ``cdi-0``/``cdi-1`` volumes (the host's ``/etc/cdi``, ``/var/run/cdi``) on
    this node: its spec directory (``cdi`` mode: where the toolkit's spec is), and an empty
    directory of its own for the other — never directories created on the host."""
    spare = node.directory / "cdi-static"
    spare.mkdir(exist_ok=True)
    specs = node.cdi_spec_dir if node.cdi_spec_dir.is_dir() else spare
    return [
        {"name": "cdi-0", "hostPath": {"path": str(spare), "type": "Directory"}},
        {"name": "cdi-1", "hostPath": {"path": str(specs), "type": "Directory"}},
    ]


def agent_patch(cluster: Cluster, image: AgentImage, driver_files: DriverFiles) -> dict[str, Any]:
    """A strategic-merge patch of the shipped DaemonSet for this node (see the module doc)."""
    (daemonset,) = [o for o in render() if o["kind"] == "DaemonSet"]
    (container,) = [c for c in daemonset["spec"]["template"]["spec"]["containers"]
                    if c["name"] == "agent"]  # fmt: skip
    node = cluster.node
    nvml = fake_nvml_mounts(node)
    replaced = {
        "--pod-resources-socket": str(node.pod_resources_socket),
        "--cri-endpoint": node.cri_endpoint,
        "--holder-image": PAUSE_IMAGE,
        "--driver-files": driver_files,
    }
    args = [
        f"{arg.partition('=')[0]}={replaced[arg.partition('=')[0]]}"
        if arg.partition("=")[0] in replaced
        else arg
        for arg in container["args"]
    ]
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": daemonset["metadata"]["name"], "namespace": AGENT_NAMESPACE},
        "spec": {
            "template": {
                "spec": {
                    "runtimeClassName": None,
                    # The pre-pull of the holder image: here the test's pause image, which is
                    # imported, not pulled (busybox's sleep stands in for `pause -v`).
                    "initContainers": [
                        {"name": "pull-holder-image", "image": PAUSE_IMAGE,
                         "imagePullPolicy": "Never", "command": ["/bin/sleep", "0"]}
                    ],
                    "containers": [
                        {
                            "name": "agent",
                            "image": image.name,
                            "imagePullPolicy": "Never",
                            "args": args,
                            "env": nvml.env,
                            "volumeMounts": [
                                {"name": "pod-resources",
                                 "mountPath": str(node.pod_resources_socket.parent)},
                                {"name": "cri", "mountPath": str(node.containerd_dir)},
                                *nvml.mounts,
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "pod-resources",
                         "hostPath": {"path": str(node.pod_resources_socket.parent)}},
                        {"name": "cri", "hostPath": {"path": str(node.containerd_dir)}},
                        *nvml.volumes,
                        *_cdi_volumes(node),
                    ],
                }
            }
        },
    }  # fmt: skip


def agent_service_when_ready(cluster: Cluster, namespace: str, what: str, nodes: int = 1) -> str:
    """Wait until the agent's DaemonSet pods in ``namespace`` are Ready on ``nodes`` nodes
    (their readiness probes pass, ``what`` says whose); then the ClusterIP of its Service."""

    def ready() -> bool:
        pods = cluster.pods(namespace, "app.kubernetes.io/name=gpu-hotplug-agent")
        return (
            sum(
                all(s.get("ready") for s in (p["status"].get("containerStatuses") or [{}]))
                for p in pods
            )
            >= nodes
        )

    eventually(ready, f"{what} is Ready (its readiness probe passes)", 300)
    service = cluster.core.read_namespaced_service("gpu-hotplug-agent", namespace)
    return str(service.spec.cluster_ip)


def print_agent_log(cluster: Cluster, namespace: str) -> None:
    """The agent's last log lines, for a failed test's output."""
    print(cluster.kubectl("logs", "-n", namespace, "daemonset/gpu-hotplug-agent",
                          "--tail=200", check=False))  # fmt: skip


@contextlib.contextmanager
def deployed_agent(
    cluster: Cluster, driver_files: DriverFiles = "off", workers: Sequence[VmNode] = ()
) -> Iterator[str]:
    """``kubectl apply -k`` of the overlay; yields the Service's ClusterIP once the agent's
    pod is Ready on every GPU node (the host's and ``workers``); deletes everything it
    applied at the end."""
    image = agent_image()
    cluster.node.import_image(image.archive)
    had_state_dir = HOST_STATE_DIR.exists()
    overlay = Path(tempfile.mkdtemp(prefix="jgh-overlay-", dir="/tmp"))
    patch = agent_patch(cluster, image, driver_files)
    for worker in workers:  # the same pod template: its hostPaths must be there too
        worker.import_image(image.archive)
        sources = [v["hostPath"]["path"] for v in patch["spec"]["template"]["spec"]["volumes"]
                   if v.get("hostPath", {}).get("type") == "Directory"]  # fmt: skip
        worker.run(shlex.join(["mkdir", "-p", *sources]))
    nodes = [cluster.node_name, *(worker.name for worker in workers)]
    cluster.kubectl("label", "node", *nodes, f"{GPU_NODE_LABEL}=true", "--overwrite")
    (overlay / "agent-patch.json").write_text(json.dumps(patch))
    # The admission policy admits holders of the holder image only: the test's pause image.
    # (tests/manifests checks that variables[0] is holderImage.)
    policy_patch = [{"op": "replace", "path": "/spec/variables/0/expression",
                     "value": f"'{PAUSE_IMAGE}'"}]  # fmt: skip
    (overlay / "policy-patch.json").write_text(json.dumps(policy_patch))
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {os.path.relpath(K8S_DIR, overlay)}\n"
        "patches:\n  - path: agent-patch.json\n"
        "  - path: policy-patch.json\n"
        "    target: {kind: ValidatingAdmissionPolicy, name: gpu-hotplug-agent-holders-only}\n"
    )
    try:
        # The cluster-wide objects are the session's too (``agent_account``, applied client-side
        # and re-applied after the chart's release): the overlay takes over their fields.
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(overlay))
        yield agent_service_when_ready(
            cluster, AGENT_NAMESPACE, "the agent's DaemonSet pod", len(nodes)
        )
    finally:
        print_agent_log(cluster, AGENT_NAMESPACE)
        # The agent's workload only: its Namespace, ServiceAccount and RBAC are the session's
        # (``agent_account``), which later tests still use.
        cluster.kubectl("delete", "-n", AGENT_NAMESPACE, "daemonset/gpu-hotplug-agent",
                        "service/gpu-hotplug-agent", "--wait=true", "--timeout=120s",
                        check=False)  # fmt: skip
        eventually(
            lambda: not cluster.pods(AGENT_NAMESPACE, "app.kubernetes.io/name=gpu-hotplug-agent"),
            "the agent's pod is gone",
        )
        cluster.kubectl("label", "node", *nodes, f"{GPU_NODE_LABEL}-", check=False)
        shutil.rmtree(overlay, ignore_errors=True)
        if not had_state_dir:  # the DaemonSet's hostPath (DirectoryOrCreate) made it
            shutil.rmtree(HOST_STATE_DIR, ignore_errors=True)
